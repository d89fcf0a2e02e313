"""A correct tile for chapter 12's exercise written differently from the stage: key blocks of 48
(not 32), each block's scores for one query computed and exponentiated in two passes over the
block, queries outer within a block. Written from the exercise's docstring and the online-softmax
update alone."""

import numpy as np
from numba import njit

BLOCK = 48


@njit(cache=True)
def attend_tile(q, k, v, p0, scale, out):
    R, G, hd = q.shape
    last = p0 + R - 1
    m = np.full((R, G), -np.inf, dtype=np.float32)
    lsum = np.zeros((R, G), dtype=np.float32)
    acc = np.zeros((R, G, hd), dtype=np.float32)
    s = np.empty(BLOCK, dtype=np.float32)
    for t0 in range(0, last + 1, BLOCK):
        t1 = min(t0 + BLOCK, last + 1)
        for r in range(R):
            see = min(t1, p0 + r + 1)              # keys t0 .. see - 1 are visible to row r
            if see <= t0:
                continue
            for j in range(G):
                top = m[r, j]
                for t in range(t0, see):
                    dot = np.float32(0.0)
                    for d in range(hd):
                        dot += q[r, j, d] * k[t, d]
                    s[t - t0] = dot * scale
                    if s[t - t0] > top:
                        top = s[t - t0]
                c = np.float32(0.0) if m[r, j] == -np.inf else np.float32(np.exp(m[r, j] - top))
                lsum[r, j] *= c
                for d in range(hd):
                    acc[r, j, d] *= c
                for t in range(t0, see):
                    e = np.float32(np.exp(s[t - t0] - top))
                    lsum[r, j] += e
                    for d in range(hd):
                        acc[r, j, d] += e * v[t, d]
                m[r, j] = top
    for r in range(R):
        for j in range(G):
            for d in range(hd):
                out[r, j, d] = acc[r, j, d] / lsum[r, j]
