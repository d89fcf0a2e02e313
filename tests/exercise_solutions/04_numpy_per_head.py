"""A correct store and attention in numpy: all rows of a head at once, the causal mask as -inf."""
import numpy as np


def store_and_attend(cache, layer, start_pos, q, k, v, n_head, n_head_kv):
    M = q.shape[0]
    end = start_pos + M
    cache.k[layer, start_pos:end] = k
    cache.v[layer, start_pos:end] = v
    K, V = cache.k[layer, :end], cache.v[layer, :end]
    hd = q.shape[1] // n_head
    group = n_head // n_head_kv
    visible = np.arange(end)[None, :] <= (start_pos + np.arange(M))[:, None]        # [M, end]
    out = np.empty_like(q)
    for h in range(n_head):
        kv = h // group
        s = (q[:, h * hd:(h + 1) * hd] @ K[:, kv * hd:(kv + 1) * hd].T) * np.float32(1 / np.sqrt(hd))
        s = np.where(visible, s, -np.inf)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, h * hd:(h + 1) * hd] = (p / p.sum(axis=1, keepdims=True)) @ V[:, kv * hd:(kv + 1) * hd]
    return out
