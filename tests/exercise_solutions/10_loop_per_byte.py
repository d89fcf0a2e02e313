"""A correct repack written as plain loops over groups, blocks, fields and rows, with a row past N
read as a block of zeros."""
import numpy as np


def repack_q4_1(raw):
    N, rb = raw.shape
    nb = rb // 20
    G = -(-N // 8)
    out = np.zeros(G * 8 * rb, np.uint8)
    o = 0
    for g in range(G):
        for b in range(nb):
            def block(r):
                n = 8 * g + r
                return raw[n, 20 * b:20 * b + 20] if n < N else np.zeros(20, np.uint8)
            for r in range(8):
                out[o:o + 2] = block(r)[0:2]
                o += 2
            for r in range(8):
                out[o:o + 2] = block(r)[2:4]
                o += 2
            for i in range(32):                     # 4 bytes of qs at a time: piece p of all 8 rows, then p + 1
                r, p = i % 8, i // 8
                out[o:o + 4] = block(r)[4 + 4 * p:8 + 4 * p]
                o += 4
    return out
