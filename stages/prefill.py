"""Stage 12, prefill: the compute-bound half; multiply-adds per loaded byte.

The lesson: a prompt is not decode. Decode reads every weight for one row, so the bytes set its
pace (the repack stage reaches the memory's); a prompt of M rows reads each weight once for M
rows and has work to spare for every byte, so what sets its pace is how many multiply-adds the
core does per byte it loads into a register, and how far that is from the core's peak (the
roofline's integer ceiling, app/measure/roofline.py, measured for the instruction used here).
The article's CUDA stage won decode and lost the time to first token: two problems. Here the
repack stage's prompt is taken apart in two:

* Attention in tiles (stages/kernels/tiled_attention.py). Repack attends one query row and one
  head at a time, so in a prompt each of M rows reads and converts K and V again for each of the
  G query heads that share them: attention grows as the prompt squared, at one multiply-add per
  loaded value. Here the G heads of R consecutive rows (a tile, R from the L2 cache's size) read
  each block of keys once, in float32, 8 query vectors to a register; an online softmax per lane;
  blocks after every row of a group skipped (the causal triangle). A row alone (decode) is a tile
  of one row whose chunks of positions go to different threads (flash-decoding), merged in the
  same order: the same bits as in a tile. Long contexts in decode gain too: the G heads of a KV
  head now read its keys once.
* The prompt's matmuls two rows to a register (stages/kernels/pair_gemm.py). Where the CPU has
  AVX512-VNNI a 512-bit vpdpbusd issues as often as a 256-bit one: the other 8 lanes take a second
  prompt row, and the rows' 8-bit blocks are laid out side by side once, as they are rounded. Work
  items are a chunk of weight rows times a block of prompt rows whose 8-bit values fill a quarter
  of the L2 cache (read from sysfs: common/cpu.py), so every loaded weight block serves the whole block
  of rows from the cache. A call of a few rows (a batch of decode rows, a verify pass of guesses)
  is one block, an odd row included, so its weights stream from memory once, not once per pair;
  the output head's rows of such a call go through the same kernel.
  Each (weight row, prompt row) gets the repack kernel's integer sums and the same float steps: a
  prompt row's result is repack's bits, and decode stays repack's kernel.
* A prompt goes through the stack in pieces of PIECE_ROWS rows: the scratch of a call is sized
  by its rows, so a long prompt needs the KV cache and one piece's scratch (scratch_bytes), not
  scratch for every row at once; the weights are read again per piece, which at a thousand
  multiply-adds per byte costs nothing the chapter can see.
* On AVX2 alone (a Zen 3) the same row blocks go through stages/kernels/tile_gemm.py: repack's
  lanes, a tile of prompt rows per unpacked 256-bit piece, each row's products summed in int16 in
  the order written (Q4_0, Q4_1, Q8_0, Q4_K; other types, and AVX-VNNI, keep repack's kernel).
Numerics: int8's (LOGIT_TOLERANCE); the matmuls are repack's bits on every path; attention sums
in another order than repack's (a tile's softmax is online).
What limits it: the integer sums of a K-quant block are scaled per sub-block (one vpmulld per 8
vpdpbusd), and attention, whose multiply-adds are float, grows with the prompt's square.
"""

from __future__ import annotations

import numpy as np

from common.cpu import cache_sizes
from stages.kernels import prefill_steps, tiled_attention
from stages.kernels.layer_ops import chunks_of
from stages.kernels.pair_gemm import new_pairs
from stages.kernels.prefill_steps import Prefill, head_record
from stages.kernels.tiled_attention import LANES
from stages.repack import LOGIT_TOLERANCE, RepackBackend

__all__ = ["PrefillBackend", "LOGIT_TOLERANCE", "PIECE_ROWS", "query_tiles", "scratch_bytes"]

PIECE_ROWS = 512         # prompt rows per call of the layer stack (common/model.py pieces)
MAX_TILE_ROWS = 64       # query rows per tile, at most
# A matmul work item's block of prompt rows: their 8-bit values in a quarter of L2, so that the
# block, the rows' pair copy and the weights streaming past stay in it (timed on the machine first
# measured: blocks of a quarter were faster than of a half, for TinyLlama's 2048- and 5632-wide rows).
ACT_SHARE = 4


def query_tiles(positions, slots, seq, tile_rows: int):
    """(tiles int64 [n, 2] of (first row, rows), decode rows int64 [k]): runs of consecutive rows
    of one sequence at consecutive positions, cut into tiles of at most tile_rows; a run of one row
    is attended alone (its chunks split between threads); padding rows (slot -1) neither."""
    tiles, alone = [], []
    M, m = len(positions), 0
    while m < M:
        if slots[m] < 0:
            m += 1
            continue
        e = m + 1
        while e < M and slots[e] >= 0 and seq[e] == seq[m] and positions[e] == positions[e - 1] + 1:
            e += 1
        if e - m == 1:
            alone.append(m)
        tiles += [(a, min(tile_rows, e - a)) for a in range(m, e, tile_rows)] if e - m > 1 else []
        m = e
    return np.array(tiles, np.int64).reshape(-1, 2), np.array(alone, np.int64)


def tile_rows_for(n_head: int, n_head_kv: int, head_dim: int, l2: int) -> int:
    """Query rows per tile: a tile's queries and its two results (3 x R G hd float32) in a quarter
    of L2, at most MAX_TILE_ROWS."""
    G = n_head // n_head_kv
    return int(max(1, min(MAX_TILE_ROWS, l2 // 4 // (3 * G * head_dim * 4))))


def scratch_bytes(cfg, rows: int, threads: int, n_ctx: int, tile_rows: int, alone: int = 1) -> int:
    """Bytes one call of the layer stack allocates for `rows` rows, `alone` of them attended alone
    (decode rows; a prompt's rows are in tiles): the layer stack's scratch and 8-bit packs,
    and this stage's Prefill arrays. What a prompt needs besides the weights and the KV cache, per
    piece."""
    D, q, kv, ff = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.kv_dim, cfg.n_ff
    K = max(D, ff, q)
    floats = rows * (max(D, q) + ff + max(q + 2 * kv, 2 * ff, D))              # xin, fbuf, y
    packs = 2 * rows * (K + 3 * 4 * (K // 32) + 2 * (K // 16 + 1))           # both 8-bit packs
    pairs = 2 * (rows + 1) // 2 * 2 * (K + 3 * 4 * (K // 32) + 4 * (K // 16))   # and their pair copies
    groups = -(-tile_rows * (cfg.n_head // cfg.n_head_kv) // LANES)
    work = threads * 4 * (groups * LANES * (3 * cfg.head_dim + 5) + 2 * tiled_attention.BK * cfg.head_dim
                          + tiled_attention.BK * LANES + K)
    decode = alone * cfg.n_head_kv * chunks_of(n_ctx - 1) * -(-cfg.n_head // cfg.n_head_kv // LANES) * LANES \
        * (cfg.head_dim + 2) * 4
    return int(4 * floats + packs + pairs + work + decode)


class PrefillBackend(RepackBackend):
    name = "prefill"
    max_batch = PIECE_ROWS
    stack = prefill_steps.STACK          # repack's, with this stage's matmuls and attention
    records = (Prefill,)                 # its ops record (a call of the layers, or of the output head)

    def __init__(self, threads: int | None = None, kv_type: str | None = None):
        super().__init__(threads, kv_type)
        self.caches = cache_sizes()
        self._work = None               # (threads, tile rows) -> the attention's per-thread arrays
        self._head_records = {}         # (rows, K) -> the output head's ops record

    def _workspace(self, nt: int, model, tile_rows: int):
        cfg = model.config
        if self._work is None or self._work[0] != (nt, tile_rows):
            groups = -(-tile_rows * (cfg.n_head // cfg.n_head_kv) // LANES)
            self._work = ((nt, tile_rows), tiled_attention.workspace(nt, groups, cfg.head_dim))
        return self._work[1]

    def _ops(self, model, rows, cache):
        """This stage's steps in the layer stack (stages/kernels/prefill_steps.py): the tiles of this
        call's rows, the row blocks of its matmuls, and their arrays."""
        cfg = model.config
        tile_rows = tile_rows_for(cfg.n_head, cfg.n_head_kv, cfg.head_dim, self.caches["L2"])
        tiles, alone = query_tiles(rows.positions, rows.slots, rows.seq, tile_rows)
        decode_of = np.full(len(rows.positions), -1, np.int64)
        decode_of[alone] = np.arange(len(alone))
        chunks = max([chunks_of(int(p)) for p in rows.positions[alone]], default=1)
        groups = -(-(cfg.n_head // cfg.n_head_kv) // LANES)
        part = (len(alone), cfg.n_head_kv, chunks, groups, LANES)
        K = max(cfg.n_embd, cfg.n_ff, cfg.n_head * cfg.head_dim)
        x32, xk = new_pairs(len(rows.positions), K)
        return self.records[0](self.caches["L2"] // ACT_SHARE, tiles, alone, decode_of,
                       *self._workspace(self._threads(), model, tile_rows),
                       np.empty(part, np.float32), np.empty(part, np.float32),
                       np.empty((*part, cfg.head_dim), np.float32), *x32, *xk)

    def _head_ops(self, M, K):
        """The output head's record for M rows: its pair packs (two rows or more go two to a register)."""
        ops = self._head_records.get((M, K))
        if ops is None:
            ops = self._head_records[(M, K)] = head_record(self.records[0], M, K)
        return ops
