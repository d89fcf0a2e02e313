"""Chapter 12's check: your tile against stages/kernels/tiled_attention.py's attend_rows and
finish_rows (the prefill stage's tiled attention, called with a float32 cache of one page), within
the bound two float32 attentions may differ by (harness.attention_bound). Then one KV head's
attention over a whole prompt, in tiles, timed beside the stage's and beside the repack stage's
attention (stages/kernels/layer_ops.py: one row and one head at a time, as decode does)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from numba import njit
from numba.core.registry import CPUDispatcher

from exercises.harness import Case, Exercise, Timing, as_kernel, attention_bound, best_seconds, close
from stages.kernels import tiled_attention
from stages.kernels.layer_ops import attend_chunk, chunks_of, merge_chunks
from stages.kernels.layer_stack import Cache, Dims, Rows
from stages.kernels.toolkit import FASTMATH

# attend_rows reads the layer stack's own records (Cache, Rows, Dims): the stage's types, so that
# what the check compiles of the stage's kernels is what the stage compiles (a record type of this
# file, loaded under a made-up module name, would be a type no other process can find again)


def rows_at(positions):
    """Rows of one sequence at these positions (each in its own cache slot)."""
    return Rows(positions, positions, np.zeros(len(positions), np.int64))
TILE = 16                                        # rows per tile in the timed prompt


def _layout(q, k, v, p0, scale):
    R, G, hd = q.shape
    T = k.shape[0]
    cache = Cache(np.ascontiguousarray(k)[None], np.ascontiguousarray(v)[None], np.zeros((1, 1), np.int64), T)
    rows = rows_at(np.arange(p0, p0 + R, dtype=np.int64))
    dims = Dims(G, 1, 0, np.float32(0.0), np.float32(scale), np.zeros((1, 1), np.float32), np.zeros((1, 1), np.float32))
    groups = -(-R * G // tiled_attention.LANES)
    w = tiled_attention.Workspace(*(a[0] for a in tiled_attention.workspace(1, groups, hd)))
    return cache, rows, dims, w


@njit
def _stage_tiles(y, R, cache, rows, dims, w, out, G, hd):
    """The prompt's rows in tiles of R, through the stage's two calls."""
    M = y.shape[0]
    for m0 in range(0, M, R):
        n = min(R, M - m0)
        tiled_attention.attend_rows(y, m0, n, 0, 0, chunks_of(rows.positions[m0 + n - 1]), 0, cache, rows, dims, w)
        tiled_attention.finish_rows(w, m0, n, 0, G, hd, out)


def stage_attend_tile(q, k, v, p0, scale, out):
    """The exercise's signature over the stage's kernels: the tile's rows are rows 0..R-1 of y."""
    R, G, hd = q.shape
    cache, rows, dims, w = _layout(q, k, v, p0, scale)
    flat = np.zeros((R, G * hd), np.float32)
    _stage_tiles(np.ascontiguousarray(q.reshape(R, G * hd)), R, cache, rows, dims, w, flat, G, hd)
    out[:] = flat.reshape(R, G, hd)


@njit
def _jitted_tiles(fn, q, k, v, scale, out, R):
    for m0 in range(0, q.shape[0], R):
        m1 = min(m0 + R, q.shape[0])
        fn(q[m0:m1], k[:m1], v[:m1], m0, scale, out[m0:m1])


def _your_tiles(fn, q, k, v, scale, out, R):
    """The prompt in tiles through `fn`: in one compiled loop when fn is compiled (no Python
    between the tiles, as the stage has none)."""
    if isinstance(fn, CPUDispatcher):
        return _jitted_tiles(fn, q, k, v, scale, out, R)
    for m0 in range(0, q.shape[0], R):
        m1 = min(m0 + R, q.shape[0])
        fn(q[m0:m1], k[:m1], v[:m1], m0, scale, out[m0:m1])


@njit(fastmath=FASTMATH)
def _row_at_a_time(q, kc, vc, scale, out):
    """The repack stage's way (layer_ops): every (row, head) on its own, chunk by chunk, merged."""
    M, G, hd = q.shape
    table = np.zeros(1, np.int64)
    T = kc.shape[0]
    n_chunks = chunks_of(M - 1)
    parts = np.zeros((n_chunks, 2 + hd), np.float32)
    scores = np.zeros(256, np.float32)
    for m in range(M):
        for j in range(G):
            n = chunks_of(m)
            for c in range(n):
                attend_chunk(q[m, j], kc, vc, table, T, 0, hd, c * 256, min((c + 1) * 256, m + 1), scale, scores,
                             parts[c])
            merge_chunks(parts, n, hd, out[m, j])


class Prefill(Exercise):
    chapter = "12"
    title = "prefill: a prompt tile of attention, online softmax"
    folder = "exercises/12_prefill"
    file = "attention_tile.py"
    reference = {"attend_tile": stage_attend_tile}
    reference_code = "stages/kernels/tiled_attention.py: attend_rows, finish_rows (attend_block, merge_state)"

    def cases(self, rng, quick):
        plans = [((1, 1, 8, 0), "one query, one key, hd 8"),
                 ((5, 3, 64, 0), "SmolLM2's heads (G 3, hd 64): the first 5 rows of a prompt"),
                 ((16, 3, 64, 40), "16 rows from position 40: the tile starts mid-block, the diagonal crosses it"),
                 ((7, 1, 16, 29), "G 1: rows 29..35 straddle the first block's end"),
                 ((9, 4, 40, 64), "hd 40 (not a multiple of 16), rows start exactly on a block"),
                 ((3, 2, 32, 300), "past a 256-position chunk (the stage merges chunks)"),
                 ((4, 3, 64, 10), "large scores: queries x 30 (the running max moves a lot)")]
        out = []
        for (R, G, hd, p0), why in plans:
            T = p0 + R + int(rng.integers(0, 5))               # keys past the tile exist and must not count
            q = rng.standard_normal((R, G, hd)).astype(np.float32)
            if "large" in why:
                q *= np.float32(30.0)
            k = rng.standard_normal((T, hd)).astype(np.float32)
            v = rng.standard_normal((T, hd)).astype(np.float32)
            out.append(Case(f"R={R} G={G} hd={hd} p0={p0}: {why}", dict(q=q, k=k, v=v, p0=p0)))
        return out

    def prepare(self, sol):
        return SimpleNamespace(attend_tile=as_kernel(sol.attend_tile, fastmath=FASTMATH))

    def judge(self, sol, case):
        q, k, v, p0 = (case.inputs[n] for n in ("q", "k", "v", "p0"))
        R, G, hd = q.shape
        scale = np.float32(1.0 / np.sqrt(hd))
        got = np.full_like(q, np.nan)
        want = np.zeros_like(q)
        sol.attend_tile(q.copy(), k.copy(), v.copy(), p0, scale, got)
        stage_attend_tile(q, k, v, p0, scale, want)
        bound = attention_bound(q.reshape(R * G, hd), k[:p0 + R], v[:p0 + R], scale)
        wrong = close("out", got, want, bound)
        return (wrong + " (index: row, head, d)" if wrong else None), \
            f"max |diff| {np.nanmax(np.abs(got - want)):.2g} (bound {bound:.2g})"

    def timings(self, sol, quick):
        M, G, hd = (64 if quick else 512), 3, 64
        self.timing_note = (f"one KV head's attention over a {M}-token prompt, G {G}, hd {hd} (SmolLM2's), "
                            f"in tiles of {TILE} rows, 1 thread")
        rng = np.random.default_rng(0)
        q = rng.standard_normal((M, G, hd)).astype(np.float32)
        k = rng.standard_normal((M, hd)).astype(np.float32)
        v = rng.standard_normal((M, hd)).astype(np.float32)
        scale = np.float32(1.0 / np.sqrt(hd))
        out = np.zeros_like(q)
        cache, rows, dims, w = _layout(q[:TILE], k, v, 0, scale)
        rows = rows_at(np.arange(M, dtype=np.int64))
        y = np.ascontiguousarray(q.reshape(M, G * hd))
        flat = np.zeros((M, G * hd), np.float32)
        reps = 3 if quick else 7
        return [Timing("yours", best_seconds(lambda: _your_tiles(sol.attend_tile, q, k, v, scale, out, TILE), reps),
                       "yours"),
                Timing("the stage's (prefill)", best_seconds(
                    lambda: _stage_tiles(y, TILE, cache, rows, dims, w, flat, G, hd), reps), "stage"),
                Timing("the previous stage's, a row and a head at a time (repack)",
                       best_seconds(lambda: _row_at_a_time(q, k, v, scale, out), reps), "previous")]


EXERCISE = Prefill()
