"""Planted bug: a last group of fewer than 8 rows is left out instead of padded with zero rows."""
import numpy as np


def repack_q4_1(raw):
    N, rb = raw.shape
    nb = rb // 20
    G = N // 8
    blocks = raw[:G * 8].reshape(G, 8, nb, 20).transpose(0, 2, 1, 3)
    d = blocks[..., 0:2].reshape(G, nb, 16)
    m = blocks[..., 2:4].reshape(G, nb, 16)
    qs = blocks[..., 4:20].reshape(G, nb, 8, 4, 4).transpose(0, 1, 3, 2, 4).reshape(G, nb, 128)
    return np.concatenate([d, m, qs], axis=2).reshape(-1)
