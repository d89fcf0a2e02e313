"""Planted bug: the qs pieces laid out row after row (each row's 16 bytes together), not piece
after piece across the 8 rows."""
import numpy as np


def repack_q4_1(raw):
    N, rb = raw.shape
    nb = rb // 20
    G = -(-N // 8)
    rows = np.zeros((G * 8, rb), np.uint8)
    rows[:N] = raw
    blocks = rows.reshape(G, 8, nb, 20).transpose(0, 2, 1, 3)
    d = blocks[..., 0:2].reshape(G, nb, 16)
    m = blocks[..., 2:4].reshape(G, nb, 16)
    qs = blocks[..., 4:20].reshape(G, nb, 128)
    return np.concatenate([d, m, qs], axis=2).reshape(-1)
