"""Chapter 12 · prefill: write a prompt tile of attention with the online softmax.

Run the check:   make exercise ch=12
(or: .venv/bin/python -m exercises.check 12)

Decode attends one query row and one head at a time. In a prompt of M rows that reads every key
and value again for every row, and again for each of the G query heads that share a KV head. The
prefill stage takes the queries that read the same keys together (the G heads of a KV head, for
R consecutive rows: a tile) and walks the keys once, in blocks, keeping for every query a running
softmax: its largest score so far, the sum of exps, and the weighted sum of values, rescaled
whenever a larger score arrives. Your tile is compared with the stage's (stages/kernels/
tiled_attention.py) on tiles that straddle key blocks and the causal diagonal, then a whole
prompt's attention is timed beside the stage's and the repack stage's row-at-a-time attention.
"""

import numpy as np  # noqa: F401  (for your code)
from numba import njit

from stages.kernels.toolkit import FASTMATH

BK = 32                 # keys per block: K and V of one block stay in L1 while every query uses them


@njit(cache=True, fastmath=FASTMATH)
def attend_tile(q, k, v, p0, scale, out):
    """Causal attention of a tile of queries over one KV head, keys in blocks, online softmax.

    q:     float32 [R, G, hd]  the queries of R consecutive prompt rows at positions p0 .. p0 + R - 1,
                               for the G query heads that read this KV head (hd a multiple of 8)
    k, v:  float32 [T, hd]     the KV head's keys and values at positions 0 .. T - 1, T >= p0 + R
    p0:    int                 the tile's first position
    scale: float32             1 / sqrt(hd)
    out:   float32 [R, G, hd]  write softmax_t(q . k_t * scale) weighted sum of v_t, over t <= p0 + r
                               for row r (keys after a row's own position are masked)

    What to write: for every query (r, j) keep a running max m (start -inf), a running sum l
    (start 0) and a running output o[hd] (start 0). Walk the keys in blocks of BK, t0 = 0, BK, ...,
    up to the tile's last position p0 + R - 1 (a block wholly after it is never read). For each
    block and each query that can see any of it:
        scores s_t = q . k_t * scale for the block's keys t <= p0 + r
        m_new = max(m, max_t s_t);  c = exp(m - m_new)   (0 when m is still -inf)
        l = l * c + sum_t exp(s_t - m_new);   o = o * c + sum_t exp(s_t - m_new) v_t;   m = m_new
    At the end out[r, j] = o / l. Any loop order within a block is yours.

    The edges: the last block is partial (T, p0 + R not multiples of BK); rows of one tile see
    different numbers of keys (the causal diagonal runs through the tile); a tile whose rows
    start mid-block (p0 not a multiple of BK); G = 1 and hd = 8.

    Why: the block's K and V are read once for all R * G queries of the tile, where a row at a time
    reads them R * G times; and the softmax never needs all scores at once, so the block stays
    small enough for L1 whatever the prompt's length.

    Hint: notebooks/12_prefill.ipynb, "Where the prompt's time goes". Try it
    before you read stages/kernels/tiled_attention.py (its module docstring states the update).
    """
    raise NotImplementedError("write the tile: keys in blocks, a running softmax per query: see the docstring")
