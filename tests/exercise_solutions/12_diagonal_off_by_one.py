"""Planted bug: row r sees keys t < p0 + r, not t <= p0 + r (its own position left out)."""
import numpy as np
from numba import njit


@njit(cache=True)
def attend_tile(q, k, v, p0, scale, out):
    R, G, hd = q.shape
    for r in range(R):
        for j in range(G):
            n = max(1, p0 + r)
            s = np.empty(n)
            for t in range(n):
                acc = 0.0
                for d in range(hd):
                    acc += q[r, j, d] * k[t, d]
                s[t] = acc * scale
            p = np.exp(s - s.max())
            p /= p.sum()
            for d in range(hd):
                acc = 0.0
                for t in range(n):
                    acc += p[t] * v[t, d]
                out[r, j, d] = acc
