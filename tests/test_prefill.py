"""The prefill stage: the tiled attention against numpy's softmax (grouped heads, chunks, a page
table), a row alone and in a tile the same bits; the pair kernel and the tile kernel (AVX2)
against repack's kernel, bit for bit, for every type each takes; the stage within int8's
tolerance of the reference, decode rows = prompt rows, 1 thread = N, a prompt in pieces = whole, a
batch's rows = alone (with a planted tile that crosses sequences caught); the scratch a prompt
needs bounded by one piece's rows.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

from common import reference
from common.gguf import GGMLType, GGUFFile
from stages import load
from stages.kernels import layer_stack as L
from stages.kernels import pair_gemm, prefill_steps, repack_steps, repacked, tile_gemm, tiled_attention
from stages.kernels.layer_ops import CHUNK, chunks_of
from stages.kernels.pair_gemm import new_pairs
from stages.kernels.prefill_steps import Prefill, block_rows, head_record
from stages.kernels.q8 import new_packs, quantize_row
from stages.kernels.repack_steps import REPACKED, Repacked
from tests.test_fused import _weights
from tests.test_int8 import activations
from tests.test_quantized import MIXED_TYPES, stage_logits, write_tiny_llama
from tests.test_repack import crowd_differences
from tests.util import attention_numpy, expected_isa, lacks, thread_counts

F32 = np.float32
# skipped by LLVM's view of the CPU numba compiles for (tests/util.py), not by vector_ir.ISA / ZMM:
# a probe that lost an instruction would otherwise turn these tests into expected skips
needs_isa = pytest.mark.skipif(expected_isa() is None,
                               reason=str(lacks("avx2", "f16c", then="the prefill stage's kernels need them")))
NO_ZMM = lacks("avx2", "f16c", "avx512vnni", "avx512bw", "avx512vl", then="the pair kernels run on 512-bit registers")
needs_zmm = pytest.mark.skipif(NO_ZMM is not None, reason=str(NO_ZMM))


# ---- the tiled attention ---------------------------------------------------------------------------

def _case(rng, H, Hkv, hd, T, page_size):
    """Queries for positions 0..T-1, K and V in float16 through a shuffled page table."""
    kv = Hkv * hd
    pages = -(-T // page_size)
    order = rng.permutation(pages)
    k = np.zeros((pages * page_size, kv), np.float16)
    v = np.zeros_like(k)
    kt = rng.standard_normal((T, kv)).astype(np.float16)
    vt = rng.standard_normal((T, kv)).astype(np.float16)
    for t in range(T):
        slot = order[t // page_size] * page_size + t % page_size
        k[slot], v[slot] = kt[t], vt[t]
    cache = L.Cache(k.view(np.uint16)[None], v.view(np.uint16)[None], order[None].astype(np.int64), page_size)
    pos = np.arange(T, dtype=np.int64)
    rows = L.Rows(pos, pos, np.zeros(T, np.int64))
    dims = L.Dims(H, Hkv, 1, 1e-5, F32(1 / np.sqrt(hd)), np.zeros((1, 1), F32), np.zeros((1, 1), F32))
    y = rng.standard_normal((T, H * hd)).astype(F32)
    return y, kt.astype(F32), vt.astype(F32), cache, rows, dims


@numba.njit
def _alone(y, m, kvh, cache, rows, dims, w, pm, pl, po, G, hd, out):
    """Row m by itself: each chunk attended on its own (as decode's threads do), merged in order."""
    n = chunks_of(rows.positions[m])
    groups = (G + tiled_attention.LANES - 1) // tiled_attention.LANES
    for c in range(n):
        tiled_attention.attend_rows(y, m, 1, kvh, c, c + 1, 0, cache, rows, dims, w)
        pm[c], pl[c], po[c] = w.m[:groups], w.l[:groups], w.o[:groups]
    tiled_attention.merge_parts(w, pm, pl, po, n, groups, hd)
    tiled_attention.finish_rows(w, m, 1, kvh, G, hd, out)


@pytest.mark.isa_paths
@needs_isa
@pytest.mark.parametrize("H,Hkv,hd,T,tile", [(8, 2, 64, CHUNK + 37, 16), (9, 3, 32, 70, 5), (2, 2, 16, 40, 40),
                                             (4, 2, 40, 50, 7)],
                         ids=["GQA 4, two chunks", "GQA 3, tiles mixing rows", "MHA, one tile",
                              "head size not a multiple of 16"])
def test_tiles_against_numpy_and_a_row_alone(H, Hkv, hd, T, tile):
    """Causal attention of every row through the page table, in tiles: within float32 rounding of
    numpy's (scores, softmax, weighted sum, in float64 of the same float16 K/V); each row computed
    alone, its chunks merged afterwards, gives the tile's bits exactly."""
    rng = np.random.default_rng(T)
    y, k, v, cache, rows, dims = _case(rng, H, Hkv, hd, T, page_size=24)
    G = H // Hkv
    w1 = tiled_attention.Workspace(*(a[0] for a in tiled_attention.workspace(1, -(-tile * G // 8), hd)))
    tiled = np.zeros_like(y)
    for m0 in range(0, T, tile):
        n = min(tile, T - m0)
        for kvh in range(Hkv):
            tiled_attention.attend_rows(y, m0, n, kvh, 0, chunks_of(m0 + n - 1), 0, cache, rows, dims, w1)
            tiled_attention.finish_rows(w1, m0, n, kvh, G, hd, tiled)
    want = np.concatenate([attention_numpy(y[m:m + 1].astype(np.float64), k[:m + 1], v[:m + 1], H, Hkv, m)
                           for m in range(T)])
    # float32 sums of hd products and of T weighted values, exp within a few ulp: a few ulp per term
    assert np.abs(tiled - want).max() < 8 * (hd + T) * 2.0 ** -24 * np.abs(v).max()
    groups = -(-G // 8)
    n_chunks = chunks_of(T - 1)
    parts = (np.zeros((n_chunks, groups, 8), F32), np.zeros((n_chunks, groups, 8), F32),
             np.zeros((n_chunks, groups, 8, hd), F32))
    alone = np.zeros_like(y)
    for m in range(T):
        for kvh in range(Hkv):
            _alone(y, m, kvh, cache, rows, dims, w1, *parts, G, hd, alone)
    assert np.array_equal(alone, tiled)


@pytest.mark.isa_paths
@needs_isa
def test_a_float32_cache_of_the_same_values_gives_the_same_bits():
    """LLM_KV_TYPE=f32: K and V read as float32 rows (copied, not converted), the same values as
    the float16 cache's (converted exactly): every row's result has the same bits."""
    H, Hkv, hd, T = 9, 3, 64, 90
    y, _, _, cache, rows, dims = _case(np.random.default_rng(1), H, Hkv, hd, T, page_size=16)
    wide = L.Cache(*(c.view(np.float16).astype(F32) for c in (cache.k, cache.v)), cache.tables, cache.page_size)
    G = H // Hkv
    w = tiled_attention.Workspace(*(a[0] for a in tiled_attention.workspace(1, -(-5 * G // 8), hd)))
    out = {}
    for name, c in (("f16", cache), ("f32", wide)):
        out[name] = np.zeros_like(y)
        for m0 in range(0, T, 5):
            for kvh in range(Hkv):
                tiled_attention.attend_rows(y, m0, 5, kvh, 0, chunks_of(m0 + 4), 0, c, rows, dims, w)
                tiled_attention.finish_rows(w, m0, 5, kvh, G, hd, out[name])
    assert np.abs(out["f16"]).max() > 0
    assert np.array_equal(out["f16"], out["f32"])


# ---- the pair kernel -------------------------------------------------------------------------------

@numba.njit
def _packs(x, K, with_k):
    M = x.shape[0]
    p32, pk = new_packs(M, K)
    x32, xk = pair_gemm.new_pairs(M, K)
    for m in range(M):
        quantize_row(x[m], m, K, True, with_k, p32, pk)
        pair_gemm.pair_row(m, K, True, with_k, p32, pk, x32, xk)
    return p32, pk, x32, xk


@numba.njit
def _pair(kind, w, rb, x32, xk, m0, m1, out, r1):
    pair_gemm.pair_gemm(kind, w, 0, rb, x32, xk, m0, m1, out, 0, (0, r1))


@numba.njit
def _group(kind, w, rb, p32, pk, out, r1):
    repacked.group_gemm(kind, w, 0, rb, p32, pk, out.shape[0], out, 0, 0, r1)


@needs_zmm
@pytest.mark.parametrize("ggml_type", [GGMLType(t) for t in pair_gemm.PAIR_TYPES], ids=lambda t: t.name)
def test_pairs_are_repacks_bits(ggml_type):
    """19 weight rows (two groups and part of one) times activation rows m0..m1 of 12: whole
    tiles, every narrower tile of the pairs left over, and an odd last row, give repack's kernel's
    bits, row by row, and write no row outside m0..m1."""
    _against_repack(ggml_type, 500, 12, [(2, 10), (0, 12), (2, 11), (0, 3), (4, 9), (0, 2), (2, 7), (0, 1), (0, 7),
                                         (0, 11)],
                    lambda kind, w, rb, p32, pk, x32, xk, m0, m1, got: _pair(kind, w, rb, x32, xk, m0, m1, got, 19))


def _against_repack(ggml_type, seed, M, cases, kernel):
    """19 weight rows of ggml_type times M activation rows: for each (m0, m1) of cases,
    kernel(kind, w, row_bytes, p32, pk, x32, xk, m0, m1, got) writes rows m0..m1 of got (the 8-bit
    packs and the pair packs of all M rows given); they must be repack's kernel's bits, row by row,
    and no row outside m0..m1 may be written."""
    raw, K, rng = _weights(ggml_type, 19, seed + int(ggml_type))
    p32, pk, x32, xk = _packs(activations(rng, M, K), K, K % 256 == 0)
    w = repacked.repack(raw, int(ggml_type))
    want = np.zeros((M, 19), F32)
    _group(int(ggml_type), w, raw.shape[1], p32, pk, want, 19)
    for m0, m1 in cases:
        got = np.full((M, 19), np.nan, F32)
        kernel(int(ggml_type), w, raw.shape[1], p32, pk, x32, xk, m0, m1, got)
        outside = [m for m in range(M) if not m0 <= m < m1]
        assert np.isnan(got[outside]).all(), (m0, m1)
        assert np.array_equal(got[m0:m1], want[m0:m1]), (m0, m1)


@needs_zmm
@pytest.mark.parametrize("ggml_type", [GGMLType(t) for t in pair_gemm.PAIR_TYPES], ids=lambda t: t.name)
def test_the_head_in_pairs_is_repacks_bits(ggml_type):
    """The output head's rows through the pair kernel (matmul_rows with the prefill stage's
    record for the head, head_record): 2, 5 and 12 rows of 19 weight rows (two work items, the last
    group part of one) give repack's kernel's bits, and so does one row (which stays on repack's
    kernel). Both stacks as their stages call them: float16 K/V (uint16 bits)."""
    raw, K, rng = _weights(ggml_type, 19, 700 + int(ggml_type))
    mat = L.matrix_table([(0, 19, raw.shape[1], int(ggml_type), REPACKED)])
    blob = L.read_only(repacked.repack(raw, int(ggml_type)))
    nt = numba.get_num_threads()
    for M in (1, 2, 5, 12):
        x = np.ascontiguousarray(activations(rng, M, K))
        want = repack_steps.STACK.matmul_rows(x, blob, mat, nt, Repacked(), np.uint16)
        got = prefill_steps.STACK.matmul_rows(x, blob, mat, nt, head_record(Prefill, M, K), np.uint16)
        assert np.array_equal(got, want), M


# ---- the tile kernel (AVX2 without VNNI) -----------------------------------------------------------

NO_YMM_TILES = None if expected_isa() == "avx2" else (
    lacks("avx2", "f16c", then="the tile kernel needs them") or
    "numba compiles for a CPU with VNNI, where the stage keeps repack's kernel (vpdpbusd is one instruction): "
    "`make test-avx2` runs this compiled for haswell")


@numba.njit
def _tiles(kind, w, rb, p32, pk, m0, m1, out, r1):
    x32, xk = L.rows_of(p32, pk, m0, m1)
    tile_gemm.tile_gemm(kind, w, 0, rb, x32, xk, m1 - m0, out[m0:m1], 0, 0, r1)


@pytest.mark.isa_paths
@pytest.mark.skipif(NO_YMM_TILES is not None, reason=str(NO_YMM_TILES))
@pytest.mark.parametrize("ggml_type", [GGMLType(t) for t in tile_gemm.TILE_TYPES], ids=lambda t: t.name)
def test_tiles_are_repacks_bits(ggml_type):
    """19 weight rows (two groups and part of one) times activation rows m0..m1 of 14: two whole
    tiles and every narrower tile left over give repack's kernel's bits, row by row, and write no
    row outside m0..m1."""
    assert tile_gemm.ROWS_PER_TILE == 6                 # the cases below: 2 tiles and 1, 6 tiles, 5 .. 1 left
    _against_repack(ggml_type, 900, 14, [(0, 14), (1, 14), (2, 13), (3, 12), (4, 11), (5, 10), (3, 4), (0, 6), (6, 8)],
                    lambda kind, w, rb, p32, pk, x32, xk, m0, m1, got: _tiles(kind, w, rb, p32, pk, m0, m1, got, 19))


def test_the_prefill_stage_asks_for_the_head_in_pairs(monkeypatch):
    """The prefill stage's head passes its pair packs, for its rows, to matmul_rows; repack's does
    not (its lesson is the one-row kernel)."""
    import stages.fused as fused_stage
    from stages.prefill import PrefillBackend
    from stages.repack import RepackBackend
    seen = []
    for stack in (prefill_steps.STACK, repack_steps.STACK):
        monkeypatch.setattr(stack, "matmul_rows", lambda x, blob, mat, nt, ops, kv, dims: seen.append(ops) or x)
    monkeypatch.setattr(fused_stage.FusedBackend, "_head", lambda self, w: (None, None))
    for backend in (PrefillBackend(threads=1), RepackBackend(threads=1)):
        backend.matmul_blocks(np.zeros((3, 64), np.float32), None)
    assert [type(ops) for ops in seen] == [Prefill, Repacked]
    assert seen[0].q32.shape == new_pairs(3, 64)[0].q.shape            # 3 rows of 64: two pairs


# ---- the stage -------------------------------------------------------------------------------------

def test_a_few_rows_are_one_block_and_blocks_start_on_pairs():
    """A call of a few rows (odd counts too) is one work block, so the weights are read once for
    all of them; rows past what act_bytes holds go in blocks of whole pairs, the last alone odd."""
    K, act = 2048, 2048 * 100
    for M in (2, 3, 5, 9, 100):
        assert block_rows(act, K, M) == M
    for M in (101, 512, 513):
        mb = block_rows(act, K, M)
        assert mb == 100 and mb % 2 == 0
    assert block_rows(2048 * 3, K, 513) == 2 and block_rows(100, K, 7) == 2


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("prefill") / "tiny-mixed.gguf",
                            {**MIXED_TYPES, "attn_k": GGMLType.Q4_1, "attn_v": GGMLType.F16,
                             "attn_output": GGMLType.Q4_0, "ffn_up": GGMLType.Q8_0, "ffn_down": GGMLType.Q6_K,
                             "output": GGMLType.Q6_K})


@needs_isa
def test_tiny_model_against_the_reference(tiny_path):
    """Prefill then decode within the relative size int8 is held to, 1 thread and N the same bits,
    and decode rows the bits of prompt rows."""
    tokens = [3, 17, 42, 5, 63, 0, 8, 21, 9, 30, 11, 12, 50]
    want = reference.forward(GGUFFile(tiny_path), tokens)
    engines = [load("prefill", tiny_path, threads=n) for n in thread_counts()]
    runs = [stage_logits(e, tokens, split=9) for e in engines]
    got = runs[0]
    assert np.isfinite(got).all() and all(np.array_equal(r, got) for r in runs)
    assert np.sqrt(((got - want) ** 2).mean() / (want ** 2).mean()) < 0.05
    assert np.array_equal(stage_logits(engines[0], tokens, split=1), stage_logits(engines[0], tokens, split=13))


@needs_isa
def test_a_prompt_in_pieces_is_the_whole(tiny_path, monkeypatch):
    """A prompt longer than max_batch goes through the stack in pieces of at most that many rows
    (never more), and its logits are the bits of the prompt in one call."""
    e = load("prefill", tiny_path)
    tokens = list(range(3, 40))
    e.reset()
    whole = e.forward(tokens, 0, all_logits=True)
    calls = []
    run = e.backend.stack.run_layers

    def spy(h, *a):
        calls.append(h.shape[0])
        return run(h, *a)
    monkeypatch.setattr(e.backend.stack, "run_layers", spy)
    monkeypatch.setattr(e.backend, "max_batch", 8)
    e.reset()
    pieces = e.forward(tokens, 0, all_logits=True)
    assert calls == [8, 8, 8, 8, 5] and np.array_equal(pieces, whole)


@needs_isa
def test_a_batch_is_each_sequence_alone_with_a_tile_across_sequences_caught(tiny_path, monkeypatch):
    """A sequence's logits in a batched step (prompt chunks beside single decoding rows) are its bits
    alone; tiles built across sequences' boundaries (planted) are caught by the same check."""
    from stages import prefill
    prompts = [[3, 17, 42], [5, 63, 0, 8, 21, 9, 30, 2, 7], [11], [40, 41, 42, 43, 44]]
    crowds = [[0, 1], [2, 0, 3], [1, 2, 3, 0]]
    e = load("prefill", tiny_path)
    assert crowd_differences(e, prompts, crowds) == []

    def across(positions, slots, seq, tile_rows):                       # one tile per batch: boundaries ignored
        real = np.flatnonzero(slots >= 0)
        return np.array([[real[0], len(real)]], np.int64), np.zeros(0, np.int64)
    monkeypatch.setattr(prefill, "query_tiles", across)
    assert crowd_differences(e, prompts, crowds) != []


def test_query_tiles_follow_the_sequences():
    """Runs of one sequence at consecutive positions, cut into tiles; a run of one row alone; padding
    rows in neither."""
    from stages.prefill import query_tiles
    positions = np.array([0, 1, 2, 3, 4, 7, 5, 6, 0, 0], np.int64)
    slots = np.array([0, 1, 2, 3, 4, 9, 20, 21, -1, -1], np.int64)
    seq = np.array([0, 0, 0, 0, 0, 1, 2, 2, -1, -1], np.int64)
    tiles, alone = query_tiles(positions, slots, seq, 3)
    assert tiles.tolist() == [[0, 3], [3, 2], [6, 2]] and alone.tolist() == [5]


# ---- a long prompt's memory ------------------------------------------------------------------------

_PEAK = """
import sys, numpy as np
from pathlib import Path
import app; app.configure_numba()
from stages import load
e = load("prefill", sys.argv[1], n_ctx=int(sys.argv[2]))
if sys.argv[3] == "whole":
    e.backend.max_batch = None
e.warmup()
lines = lambda: Path("/proc/self/status").read_text().splitlines()
status = lambda key: int(next(line for line in lines() if line.startswith(key)).split()[1])
Path("/proc/self/clear_refs").write_text("5")           # the peak (VmHWM) starts again from now
before = status("VmRSS:")
e.forward(list(np.arange(int(sys.argv[2])) % 60 + 1), 0, all_logits=False)
print((status("VmHWM:") - before) * 1024)
"""


def _peak_growth(path, n, pieces) -> int:
    """Bytes the peak resident memory grew by during one prompt of n tokens (a fresh process)."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    p = subprocess.run([sys.executable, "-c", _PEAK, str(path), str(n), pieces], cwd=root,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return int(p.stdout.split()[-1])


@needs_isa
def test_a_long_prompt_needs_one_pieces_scratch(tmp_path):
    """A 4000-token prompt on a made-up model grows the process's peak memory by at most what one
    piece of the stage's PIECE_ROWS rows allocates (scratch_bytes, plus its embedding rows and a few
    MiB of the allocator's and numpy's own), the KV cache being made at load; the whole prompt in
    one call (planted: no pieces) allocates the scratch of every row, which the same bound catches."""
    from common.cpu import cache_sizes, physical_cores
    from common.model import LlamaConfig
    from stages.prefill import PIECE_ROWS, scratch_bytes, tile_rows_for
    n = 4000
    path = write_tiny_llama(tmp_path / "long.gguf", {**MIXED_TYPES, "ffn_down": GGMLType.Q6_K}, n_ctx=n)
    cfg = LlamaConfig.from_gguf(GGUFFile(path))
    tile = tile_rows_for(cfg.n_head, cfg.n_head_kv, cfg.head_dim, cache_sizes()["L2"])
    bound = scratch_bytes(cfg, PIECE_ROWS, physical_cores(), n, tile) + PIECE_ROWS * cfg.n_embd * 4 + (8 << 20)
    assert _peak_growth(path, n, "stage") <= bound
    assert _peak_growth(path, n, "whole") > bound
