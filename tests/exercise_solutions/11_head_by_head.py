"""A correct rank's share written head by head: each local query head's scores, mask and softmax in
numpy, its KV head counted from the rank's first, and its output multiplied at once by its own hd
columns of attn_output (the partial sum grows head by head); the feed-forward over the rank's units
in one piece."""
import numpy as np


def layer_partial(x, w, share):
    hd = share.head_dim
    G = share.n_heads // share.n_kv_heads
    q0, q1 = share.q_rows
    k0, k1 = share.kv_rows
    f0, f1 = share.ff
    q = x @ w["attn_q"][q0:q1].T
    k = x @ w["attn_k"][k0:k1].T
    v = x @ w["attn_v"][k0:k1].T
    M = x.shape[0]
    future = np.arange(M)[None, :] > np.arange(M)[:, None]
    attn = np.zeros((M, w["attn_output"].shape[0]), np.float32)
    for j in range(share.n_heads):
        kv = j // G                                   # this rank's KV head j // G, not the model's
        s = q[:, j * hd:(j + 1) * hd] @ k[:, kv * hd:(kv + 1) * hd].T / np.float32(np.sqrt(hd))
        s = np.where(future, -np.inf, s)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        out = p @ v[:, kv * hd:(kv + 1) * hd]
        attn += out @ w["attn_output"][:, q0 + j * hd:q0 + (j + 1) * hd].T
    gate = x @ w["ffn_gate"][f0:f1].T
    up = x @ w["ffn_up"][f0:f1].T
    hidden = gate / (1 + np.exp(-gate)) * up
    ffn = hidden @ w["ffn_down"][:, f0:f1].T
    return attn.astype(np.float32), ffn.astype(np.float32)
