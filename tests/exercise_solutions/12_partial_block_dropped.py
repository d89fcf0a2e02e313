"""Planted bug: only whole blocks of 32 keys are walked: the keys of a partial last block never
count (right only when the tile ends on a block's edge)."""
import numpy as np
from numba import njit

BK = 32


@njit(cache=True)
def attend_tile(q, k, v, p0, scale, out):
    R, G, hd = q.shape
    n_keys = p0 + R
    for r in range(R):
        for j in range(G):
            m, l = -np.inf, 0.0
            o = np.zeros(hd)
            for t0 in range(0, n_keys - n_keys % BK, BK):
                for t in range(t0, min(t0 + BK, p0 + r + 1)):
                    s = 0.0
                    for d in range(hd):
                        s += q[r, j, d] * k[t, d]
                    s *= scale
                    top = max(m, s)
                    c = np.exp(m - top) if m > -np.inf else 0.0
                    e = np.exp(s - top)
                    l = l * c + e
                    for d in range(hd):
                        o[d] = o[d] * c + e * v[t, d]
                    m = top
            for d in range(hd):
                out[r, j, d] = o[d] / l if l > 0 else 0.0
