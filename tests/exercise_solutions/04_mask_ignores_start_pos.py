"""Planted bug: the store is right, but row i of a chunk sees positions 0 .. i (its index in the
chunk), not 0 .. start_pos + i: right for a prompt from position 0 and for one-row decode steps
only if... not even those (a decode row sees only position 0)."""
import numpy as np


def store_and_attend(cache, layer, start_pos, q, k, v, n_head, n_head_kv):
    M = q.shape[0]
    cache.k[layer, start_pos:start_pos + M] = k
    cache.v[layer, start_pos:start_pos + M] = v
    K, V = cache.k[layer, :start_pos + M], cache.v[layer, :start_pos + M]
    hd = q.shape[1] // n_head
    group = n_head // n_head_kv
    out = np.zeros_like(q)
    for i in range(M):
        for h in range(n_head):
            kv = h // group
            s = K[:i + 1, kv * hd:(kv + 1) * hd] @ q[i, h * hd:(h + 1) * hd] / np.float32(np.sqrt(hd))
            p = np.exp(s - s.max())
            out[i, h * hd:(h + 1) * hd] = (p / p.sum()) @ V[:i + 1, kv * hd:(kv + 1) * hd]
    return out
