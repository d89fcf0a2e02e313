"""The fused stage: the integer tiles against the int8 stage's loops for every type and shape,
the activation blocks against int8's, the flash-decoding split against numpy, the barrier that
gives up instead of hanging and whose spin bound adapts (doubling back to its most, halving to
its floor), one compiled call per token, one compile shared with repack, and the model: 1 thread
and N bit for bit, within int8's tolerance of the float64 reference, int8's greedy tokens but at
near-ties; CoreShare's choice of one thread or all when the cores are shared (its spells, the
calls it tries on, a median per row count).
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

from common import reference
from common.gguf import GGMLType, GGUFFile
from stages import load
from stages.fused import CoreShare
from stages.int8 import LOGIT_TOLERANCE as INT8_TOLERANCE
from stages.kernels import int_tiles, repack_steps, repacked, vector_ir
from stages.kernels import layer_stack as F
from stages.kernels.int_dot import matvec_int8_auto
from stages.kernels.layer_ops import CHUNK, attend_chunk, chunks_of, fast_exp, merge_chunks
from stages.kernels.q8 import ACTIVATION_BLOCK, dequantize_q8, new_packs, quantize_q8, quantize_row
from stages.kernels.repack_steps import Repacked
from stages.kernels.sync import ABORT, ARRIVALS, SPIN, SPIN_MOST, SPIN_NS, barrier, new_sync, ticks_per_ns
from stages.kernels.toolkit import BLOCK_BYTES, F16_TO_F32
from tests.test_int8 import activations
from tests.test_quantized import MIXED_TYPES, n_cols_for, random_blocks, stage_logits, write_tiny_llama
from tests.util import attention_numpy, expected_isa, greedy_at_clear_choices, lacks, lacks_vnni, some, thread_counts

F32 = np.float32
POOL = numba.config.NUMBA_NUM_THREADS
INT_TYPES = [GGMLType(t) for t in ACTIVATION_BLOCK]
NO_TILES = lacks("avx2", "f16c", then="the fused stage runs the int8 stage's loops, which the tiles are compared with")


def packs_of(x, K):
    """The fused kernels' activation packs for rows x [M, K]: both formats."""
    p32, pk = new_packs(x.shape[0], K)
    _quantize_all(x, p32, pk, K % 256 == 0)
    return p32, pk


@numba.njit
def _quantize_all(x, p32, pk, with_k):
    for m in range(x.shape[0]):
        quantize_row(x[m], m, x.shape[1], True, with_k, p32, pk)


def test_activation_blocks_are_int8s():
    """Q8_0/Q8_1 and Q8_K blocks written row by row into the packs are quantize_q8's, bit for bit
    (which tests/test_int8.py holds to ggml's), and the 32-value sums are pairs of 16-value ones."""
    x = activations(np.random.default_rng(0), 3, 512)
    x[1, :256] = 0.0
    p32, pk = packs_of(x, 512)
    q, d, s, sums = quantize_q8(x, 32)
    for got, want in zip(p32, (q, d, s, sums)):
        assert np.array_equal(got, want)
    q, d, _, sums = quantize_q8(x, 256)
    assert np.array_equal(pk.q, q) and np.array_equal(pk.d, d)
    assert np.array_equal(pk.b16[:, :32], sums) and np.array_equal(pk.b32, sums.reshape(3, 16, 2).sum(axis=2))


def _weights(ggml_type, n_rows, seed):
    rng = np.random.default_rng(seed)
    K = 2 * n_cols_for(ggml_type)
    raw = random_blocks(rng, ggml_type, n_rows, K)
    raw.flags.writeable = False
    return raw, K, rng


def _int8_rows(x, raw, ggml_type):
    """The int8 stage's integer loops, row by row of x, and the size of each sum (|x| @ |w|)."""
    from common import quants as Q
    q, d, s, sums = quantize_q8(x, ACTIVATION_BLOCK[int(ggml_type)])
    want = np.stack([matvec_int8_auto(q[m], d[m], s[m], sums[m], raw, int(ggml_type), F16_TO_F32, 1)
                     for m in range(len(x))])
    xq = dequantize_q8(q, d, ACTIVATION_BLOCK[int(ggml_type)]).astype(np.float64)
    w64 = Q.dequantize(raw, ggml_type, (raw.shape[0], x.shape[1])).astype(np.float64)
    return want, np.abs(xq) @ np.abs(w64).T


def _matmul(x, raw, ggml_type, threads, layout=F.ROWS):
    """x times the matrix through a stack's output head (the fused stage's, or repack's for a
    repacked one), as the stage calls it: the K/V dtype its layers' calls take, so that the head
    runs their compiled code."""
    mat = F.matrix_table([(0, raw.shape[0], raw.shape[1], int(ggml_type), layout)])
    numba.set_num_threads(threads)
    blob = raw.reshape(-1) if layout == F.ROWS else repacked.repack(raw, int(ggml_type))
    stack, ops, kv = (F.STACK, None, F32) if layout == F.ROWS else (repack_steps.STACK, Repacked(), np.uint16)
    return stack.matmul_rows(np.ascontiguousarray(x), F.read_only(blob), mat, threads, ops, kv)


def kernel_rows(x, raw, ggml_type, layout=F.ROWS):
    """x times every row of the matrix through the kernel a matmul work item calls (the fused
    stage's tiles, or repack's group kernel for a repacked one) alone: the vector kernels' checks
    (isa_paths), which `make test-avx2` compiles again for another CPU without the layer stack."""
    K = x.shape[1]
    p32, pk = packs_of(np.ascontiguousarray(x), K)
    blob = raw.reshape(-1) if layout == F.ROWS else repacked.repack(raw, int(ggml_type))
    out = np.zeros((x.shape[0], raw.shape[0]), F32)
    _kernel(int(ggml_type), blob, raw.shape[1], p32, pk, out, layout)
    return out


@numba.njit
def _kernel(kind, w, row_bytes, p32, pk, out, layout):
    M, N = out.shape
    if layout == F.ROWS:
        F._chunk_ints(kind, w, 0, row_bytes, 0, N, M, p32, pk, out, 0)
    else:
        repacked.group_gemm(kind, w, 0, row_bytes, p32, pk, M, out, 0, 0, N)


@pytest.mark.isa_paths
@pytest.mark.parametrize("ggml_type", INT_TYPES, ids=lambda t: t.name)
def test_tiles_against_the_int8_loops(ggml_type):
    """Decode (1 row) and prefill (5 and 11 rows: whole tiles and the rows left over) against
    the int8 stage's plain integer loops: the same integer sums, scaled in another order, so
    float32 rounding is all that differs. (1 thread and N: the model's tests below.)"""
    raw, K, rng = _weights(ggml_type, 13, 40 + int(ggml_type))        # 13 rows: 4 x 4 tiles and leftovers
    for M in (1, 5, 11):
        x = activations(rng, M, K)
        want, scale = _int8_rows(x, raw, ggml_type)
        got = kernel_rows(x, raw, ggml_type)
        err = np.abs(got - want) / np.maximum(scale, 1e-30)
        assert np.isfinite(got).all() and err.max() < 2e-6, f"{ggml_type.name} M={M}: {err.max():.2e}"


def test_float_weights_are_multiplied_in_float():
    from common import quants as Q
    rng = np.random.default_rng(5)
    for ggml_type in (GGMLType.F16, GGMLType.BF16, GGMLType.F32):
        w = rng.standard_normal((9, 64)).astype(F32)
        raw = Q.quantize(w, ggml_type) if ggml_type != GGMLType.F32 else w.view(np.uint8)
        raw = np.ascontiguousarray(raw).reshape(9, -1)
        raw.flags.writeable = False
        x = rng.standard_normal((3, 64)).astype(F32)
        want = x.astype(np.float64) @ Q.dequantize(raw, ggml_type, (9, 64)).astype(np.float64).T
        np.testing.assert_allclose(_matmul(x, raw, ggml_type, 1), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(expected_isa() is None, reason=str(NO_TILES))
def test_the_loops_fallback_equals_the_tiles():
    """Where a CPU has no AVX2 the stage runs the int8 stage's loops instead of the tiles
    (_chunk_loops): the same products."""
    for ggml_type in INT_TYPES:
        raw, K, rng = _weights(ggml_type, 6, 60 + int(ggml_type))
        x = activations(rng, 3, K)
        p32, pk = packs_of(x, K)
        out = np.zeros((3, 6), F32)
        F._chunk_loops(int(ggml_type), raw.reshape(-1), 0, raw.shape[1], 0, 6, 3, p32, pk, out, 0)
        want, scale = _int8_rows(x, raw, ggml_type)
        assert (np.abs(out - want) / np.maximum(scale, 1e-30)).max() < 2e-6, ggml_type.name


def _tile_runner():
    """The two kernels compiled now (with the ISA vector_ir holds now), in one jitted function:
    one tile of the type's shape at the top, the rows below one by one."""
    @numba.njit
    def run(kind, w, rb, nb, p32, pk, out, R):
        int_tiles.prefill_tile(kind, w, 0, rb, nb, p32, pk, 0, out, 0)
        int_tiles.decode_rows(kind, w, R * rb, rb, nb, p32, pk, 0, out, R, out.shape[1] - R)
    return run


@pytest.mark.skipif(expected_isa() != "vnni", reason=str(lacks_vnni(
    then="the AVX2 form is compared with the VNNI one here, and this CPU runs the AVX2 form itself")))
def test_the_avx2_form_on_a_vnni_cpu(monkeypatch):
    """CPUs with AVX2 but no VNNI take vpmaddubsw + vpmaddwd for the byte products: compiled here
    in that form too, the same integer sums (the same bits) and no vpdpbusd in the code."""
    results, asm = {}, {}
    for isa in ("vnni", "avx2"):
        monkeypatch.setattr(vector_ir, "ISA", isa)
        run = _tile_runner()
        for ggml_type in INT_TYPES:
            R, C = int_tiles.TILE[int(ggml_type)]
            raw, K, rng = _weights(ggml_type, R + 3, 80 + int(ggml_type))
            x = activations(rng, C, K)
            p32, pk = packs_of(x, K)
            out = np.zeros((C, R + 3), F32)
            nb = raw.shape[1] // BLOCK_BYTES[int(ggml_type)]
            run(int(ggml_type), raw.reshape(-1), raw.shape[1], nb, p32, pk, out, R)
            results[isa, ggml_type] = out
        asm[isa] = "\n".join(run.inspect_asm().values())
    assert "vpdpbusd" in asm["vnni"] and "vpdpbusd" not in asm["avx2"]
    for ggml_type in INT_TYPES:
        assert np.array_equal(results["vnni", ggml_type], results["avx2", ggml_type]), ggml_type.name


def test_fast_exp_is_close_to_exp():
    """The vectorizable exp: within a few float32 ulp of exp over softmax's and silu's range."""
    x = np.concatenate([np.linspace(-87, 88, 200001), [0.0, -1e-30, -86.99, 87.9]]).astype(F32)
    got = _exp_all(x).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    assert (np.abs(got - want) / want).max() < 4e-7


@numba.njit
def _exp_all(x):
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        out[i] = fast_exp(x[i])
    return out


@numba.njit
def _attend(items, H, n_chunks, positions, y, kc, vc, table, page_size, group, hd, scale, part, out):
    scores = np.zeros(CHUNK, np.float32)
    for item in items:
        m = item // (H * n_chunks)
        hh, c = (item % (H * n_chunks)) // n_chunks, item % n_chunks
        t0, t1 = c * CHUNK, min(positions[m] + 1, (c + 1) * CHUNK)
        if t0 < t1:
            attend_chunk(y[m, hh * hd:(hh + 1) * hd], kc, vc, table, page_size, hh // group, hd, t0, t1, scale,
                         scores, part[m, hh, c])
    for m in range(y.shape[0]):
        for hh in range(H):
            merge_chunks(part[m, hh], chunks_of(positions[m]), hd, out[m, hh * hd:(hh + 1) * hd])


@pytest.mark.parametrize("p0,M", [(700, 1), (CHUNK - 1, 1), (CHUNK, 1), (0, 9), (250, 12)])
@pytest.mark.parametrize("page_size", [16, None])
def test_attention_split_by_positions_against_numpy(p0, M, page_size):
    """Each row's positions in chunks of CHUNK (flash-decoding), merged; K and V read through a
    page table (pages of 16 positions taken in a shuffled order; or the arena: one page). Against
    float64 numpy, and the items taken in any order give the same bits (whichever thread takes
    which)."""
    rng = np.random.default_rng(p0 + M)
    H, Hkv, hd = 9, 3, 64
    T = p0 + M
    positions = np.arange(p0, T)
    n_chunks = max(chunks_of(p) for p in positions)
    q = rng.standard_normal((M, H * hd)).astype(F32)
    k = rng.standard_normal((T, Hkv * hd)).astype(F32)
    v = rng.standard_normal((T, Hkv * hd)).astype(F32)
    want = attention_numpy(q, k, v, H, Hkv, p0)
    P = page_size or T
    n_pages = -(-T // P)
    table = rng.permutation(n_pages + 3)[:n_pages].astype(np.int64)      # pages anywhere in the pool
    kc, vc = np.zeros(((n_pages + 3) * P, Hkv * hd), F32), np.zeros(((n_pages + 3) * P, Hkv * hd), F32)
    slots = table[np.arange(T) // P] * P + np.arange(T) % P
    kc[slots], vc[slots] = k, v
    runs = []
    for order in (1, -1):
        items = np.arange(M * H * n_chunks)[::order].copy()
        part = np.zeros((M, H, n_chunks, hd + 2), F32)
        out = np.zeros((M, H * hd), F32)
        _attend(items, H, n_chunks, positions, q, kc, vc, table, P, H // Hkv, hd, F32(1 / np.sqrt(hd)), part, out)
        runs.append(out)
    np.testing.assert_allclose(runs[0], want, rtol=1e-4, atol=1e-5)
    assert np.array_equal(runs[0], runs[1])


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("fused") / "tiny-mixed.gguf",
                            {**MIXED_TYPES, "attn_k": GGMLType.Q5_1, "attn_v": GGMLType.F16,
                             "attn_output": GGMLType.Q4_0, "ffn_up": GGMLType.Q4_1})


def test_tiny_model_of_every_type_against_the_reference(tiny_path):
    """Every integer type and float weights inside the layers (attn_v F16) and around them (F16
    embedding, BF16 output), prefill then decode, 1 thread and all: against float64 within the
    relative size int8 is held to, the same bits on any thread count, and the threads stage's
    greedy choices wherever its own top two are apart."""
    tokens = [3, 17, 42, 5, 63, 0, 8, 21, 9, 30]
    want = reference.forward(GGUFFile(tiny_path), tokens)
    runs = [stage_logits(load("fused", tiny_path, threads=n), tokens, split=6) for n in thread_counts()]
    got = runs[0]
    assert np.isfinite(got).all() and all(np.array_equal(r, got) for r in runs)
    rel = np.sqrt(((got - want) ** 2).mean() / (want ** 2).mean())
    assert rel < 0.05, f"relative RMS difference {rel:.4f}"
    floats = stage_logits(load("threads", tiny_path), tokens, split=6)
    top2 = np.sort(floats, axis=1)[:, -2:]
    apart = some(top2[:, 1] - top2[:, 0] > 0.1 * np.abs(floats).max(), what="positions whose top two are apart")
    assert (got.argmax(axis=1)[apart] == floats.argmax(axis=1)[apart]).all()


def test_a_barrier_gives_up_instead_of_hanging(tiny_path, monkeypatch):
    """Two iterations of the region on one thread (numba's pool at 1): the first waits at a
    barrier for the second, which cannot start. The barrier gives up, every thread leaves, and
    the stage says why instead of hanging."""
    import stages.fused as fused_stage
    engine = load("fused", tiny_path, threads=1)
    monkeypatch.setattr(fused_stage, "new_sync", lambda **kw: new_sync(give_up=1000, **kw))
    monkeypatch.setattr(type(engine.backend), "_threads", lambda self: 2)
    numba.set_num_threads(1)
    with pytest.raises(RuntimeError, match="barrier gave up"):
        engine.forward([1, 2, 3], 0)


@numba.njit
def _lone_barrier(sync):
    return barrier(sync, 2, 1)


def test_a_barrier_spins_for_a_time_not_a_count_of_pauses():
    """A thread alone at a barrier of two spins for SPIN_NS of the time-stamp counter before it
    sleeps, whatever one `pause` costs on this CPU (a few ns on some, over a hundred cycles on
    others): with the abort flag already up it leaves right after its spin, so the call lasts
    about SPIN_NS. Each failed spin halves the next one."""
    import time
    warm = new_sync()
    warm[ABORT] = 1                 # without it the lone thread sleeps until GIVE_UP: two minutes
    _lone_barrier(warm)                                          # compiled
    took = []
    for _ in range(5):
        sync = new_sync()
        sync[ABORT] = 1
        t0 = time.perf_counter_ns()
        assert not _lone_barrier(sync)
        took.append(time.perf_counter_ns() - t0)
        assert sync[SPIN] == sync[SPIN_MOST] // 2
    assert SPIN_NS / 2 < min(took) < 20 * SPIN_NS, took
    assert abs(ticks_per_ns() * SPIN_NS - new_sync()[SPIN_MOST]) <= 1


def test_one_compiled_call_per_token_for_the_layers(tiny_path, monkeypatch):
    """A decode step is one call of the layer stack and one of the output head, each one parallel
    region; the layers are OPS_PER_LAYER ops with a barrier after each."""
    engine = load("fused", tiny_path, threads=POOL)
    calls = {"run_layers": 0, "matmul_rows": 0}
    for name in calls:
        real = getattr(engine.backend.stack, name)

        def counted(*args, _real=real, _name=name):
            calls[_name] += 1
            return _real(*args)
        monkeypatch.setattr(engine.backend.stack, name, counted)
    engine.reset()
    engine.greedy_next([1, 2, 3], 0)
    calls.update(run_layers=0, matmul_rows=0)
    before = engine.backend.kernel_seconds
    engine.greedy_next([4], 3)
    assert calls == {"run_layers": 1, "matmul_rows": 1}
    assert engine.backend.kernel_seconds > before
    # the threads count the barriers they cross: one after every phase but the last
    assert engine.backend.barriers == engine.config.n_layer * F.OPS_PER_LAYER - 1
    assert F.OPS_PER_LAYER == len(F.PHASES)


def test_each_stage_compiles_its_own_stack(default_model_path):
    """The fused stage's layer stack (its head's phases too) is compiled for its ops record (None) alone, the
    repack stage's copies for Repacked alone: a later stage's steps never reach the fused stage's
    compiled code, nor the other way round (numba's cache tells the copies apart by the record's
    type); and a stack refuses another stage's record."""
    load("fused", default_model_path, n_ctx=64).greedy_next([1, 2, 3], 0)
    load("repack", default_model_path, n_ctx=64).greedy_next([1, 2, 3], 0)
    fused, repack = F.STACK.functions["run_phases"], repack_steps.STACK.functions["run_phases"]    # the head's too
    assert fused is not repack
    assert {type(sig[8]).__name__ for sig in fused.signatures} == {"NoneType"}
    assert {str(sig[8]) for sig in repack.signatures} == {"Repacked()"}
    with pytest.raises(TypeError, match="takes Repacked as its ops record, not NoneType"):
        repack_steps.STACK.matmul_rows(np.zeros((1, 32), np.float32), None, None, 1, None)


@pytest.fixture(scope="module")
def default_engines(default_model_path):
    return {n: load("fused", default_model_path, threads=n, n_ctx=512) for n in thread_counts()}


def test_one_thread_and_all_give_the_same_logits(default_engines):
    """Prefill, then decode steps past CHUNK positions (the attention split in chunks): the same
    bits on 1 thread and on all of them."""
    tokens = [int(t) for t in np.random.default_rng(1).integers(100, 40000, CHUNK + 40)]
    runs = []
    for engine in default_engines.values():
        runs.append(stage_logits(engine, tokens, split=CHUNK - 2))
    assert np.isfinite(runs[0]).all()
    assert all(np.array_equal(r, runs[0]) for r in runs[1:])


def test_greedy_tokens_are_int8s_but_at_near_ties(default_model_path, default_engines):
    """Teacher-forced on the int8 stage's 16 greedy tokens: the fused stage's argmax is int8's
    pick wherever int8's own top two are more than NEAR_TIE apart; and its logits stay within
    int8's tolerance of the float64 reference (tests/test_stages.py: at every position)."""
    from common.generate import generate
    from tests.test_stages import NEAR_TIE, PROMPT
    int8 = load("int8", default_model_path)
    prompt = int8.tokenizer.encode(PROMPT)
    cont = generate(int8, prompt, 16, ignore_eos=True).tokens
    ids = prompt + cont
    ours = stage_logits(default_engines[1], ids, split=len(prompt))[len(prompt) - 1:-1]
    theirs = stage_logits(int8, ids, split=len(prompt))[len(prompt) - 1:-1]
    greedy_at_clear_choices(ours, theirs, cont, NEAR_TIE)
    want = reference.forward(GGUFFile(default_model_path), ids)[len(prompt) - 1:-1]
    assert np.abs(ours - want).max() <= INT8_TOLERANCE


def shared_core_run(rule, slow_at: range, calls: int = 120, base: float = 1.0, shared_factor: float = 12.0,
                    single_factor: float = 1.7, grows_at: int | None = None, rows=(1,), work=None):
    """The threads a CoreShare chose for each of `calls` calls, with made-up times: a call on both
    threads takes `base`, one on one thread `single_factor` times that; while the cores are shared
    (the calls in slow_at) two threads take `shared_factor` times `base` and one thread still
    `single_factor` (it has the core the other process left). From call grows_at on, every call's
    work is three times larger (a longer context, no other process). Call i has rows[i % len(rows)]
    rows, whose work is work[rows] times a one-row call's (default 1)."""
    chosen = []
    for i in range(calls):
        nt = rule.threads(2)
        if i == grows_at:
            base *= 3.0
        m = rows[i % len(rows)]
        seconds = base * (work or {}).get(m, 1.0) * (single_factor if nt == 1 else
                                                      (shared_factor if i in slow_at else 1.0))
        rule.ran(nt, 2, m, seconds)
        chosen.append(nt)
    return chosen


def spells(chosen) -> list[int]:
    """The lengths of the runs of calls on one thread."""
    runs, n = [], 0
    for nt in chosen + [2]:
        if nt == 1:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


def test_shared_cores_send_the_call_to_one_thread_and_back():
    E = CoreShare.EXPLORE
    idle = shared_core_run(CoreShare(), slow_at=range(0), calls=2 * E)
    assert idle.count(1) == 2 and idle[:3] == [2] * 3       # an idle machine: a try now and then, lost
    shared = shared_core_run(CoreShare(), slow_at=range(40, 100), calls=100 + CoreShare.MAX_HOLD + 20)
    assert shared[4:41] == [2] * 37                         # after the first try: all threads while idle
    assert shared[42] == 1                                  # two slow calls, then a try on one thread
    assert shared[42:100].count(1) >= 50                    # the spell: one thread, a few retries on two
    back = shared[100:]                                     # the other process gone: both threads again,
    assert back[CoreShare.MAX_HOLD:] == [2] * 20            # at the latest after the longest spell
    assert 2 in back[:CoreShare.MAX_HOLD // 2]
    always = shared_core_run(CoreShare(), slow_at=range(0, 200), calls=200)
    assert always[3] == 1 and always[3:].count(1) >= 180    # shared from the start: the first try wins
    noise = shared_core_run(CoreShare(), slow_at=range(30, 31))
    assert noise.count(1) == 1                              # one slow call alone: only the first try
    grown = shared_core_run(CoreShare(), slow_at=range(0), grows_at=40)
    assert grown.count(1) == 2                              # more work, not shared cores: one try, lost

    class Never(CoreShare):                                 # planted: all threads whatever happens
        def threads(self, nt):
            return nt
    assert shared_core_run(Never(), slow_at=range(40, 100))[42:100].count(1) < 50

    class OnlyChanges(CoreShare):                           # planted: reacts to a change only, no tries
        def __init__(self):
            super().__init__()
            self.calls = 1
    assert shared_core_run(OnlyChanges(), slow_at=range(0, 200), calls=200)[3:].count(1) < 180


class NoDoubling(CoreShare):
    """Planted: every spell on one thread HOLD calls long, however often a retry lost."""
    MAX_HOLD = CoreShare.HOLD


class NoLongestSpell(CoreShare):
    """Planted: the spells double without end."""
    MAX_HOLD = 1 << 30


class TriesLongCalls(CoreShare):
    """Planted: tries of one thread on calls of any number of rows."""
    EXPLORE_ROWS = 1 << 30


class OneMedian(CoreShare):
    """Planted: one median over calls of every row count."""

    def ran(self, used, nt, rows, seconds):
        super().ran(used, nt, 0, seconds)


def spell_problems(make) -> list[str]:
    """Shared cores from the start to the end: the first try wins a spell of HOLD calls on one
    thread (after the try itself), and each retry on all threads that loses doubles the next
    spell, up to MAX_HOLD. Idle cores and calls of EXPLORE_ROWS + 1 rows: never a try (a
    prompt's pieces are few); of EXPLORE_ROWS rows: the tries. Idle cores and calls of 1 and 32
    rows (20 times the work) mixed: a 32-row call is slow only against the 32-row calls before
    it, so nothing but the tries of one thread."""
    H, M, E = CoreShare.HOLD, CoreShare.MAX_HOLD, CoreShare.EXPLORE
    want = [1 + H] + [H * 2 ** i for i in range(1, M.bit_length() - H.bit_length() + 1)] + [M, M]
    problems = []
    got = spells(shared_core_run(make(), slow_at=range(0, 4000), calls=4000))[:len(want)]
    if got != want:
        problems.append(f"spells on one thread while the cores are shared: {got}, want {want}")
    for rows, tries in ((CoreShare.EXPLORE_ROWS + 1, 0), (CoreShare.EXPLORE_ROWS, 2)):
        got = shared_core_run(make(), slow_at=range(0), calls=2 * E, rows=(rows,)).count(1)
        if got != tries:
            problems.append(f"idle, calls of {rows} rows: {got} tries of one thread, want {tries}")
    mixed = shared_core_run(make(), slow_at=range(0), calls=2 * E, rows=(1, 32, 32), work={32: 20.0})
    if mixed.count(1) > 2:
        problems.append(f"idle, calls of 1 and 32 rows: {mixed.count(1)} calls on one thread")
    return problems


@pytest.mark.parametrize("make", [CoreShare, NoDoubling, NoLongestSpell, TriesLongCalls, OneMedian],
                         ids=lambda c: c.__name__)
def test_spells_on_one_thread_double_to_the_longest_and_tries_are_on_short_calls_of_their_own_kind(make):
    assert (spell_problems(make) == []) == (make is CoreShare)


@numba.njit
def _barrier_of_two(sync, k):
    return barrier(sync, 2, k)


def twin_barrier(**changed):
    """A planted twin of the barrier: its own code compiled with some of the names it reads
    changed (a wrong rule where the real one reads min or max)."""
    import types
    f = barrier.py_func
    twin = numba.njit(_nrt=False)(types.FunctionType(f.__code__, {**f.__globals__, **changed}, f.__name__))

    @numba.njit
    def of_two(sync, k):
        return twin(sync, 2, k)
    return of_two


def spin_problems(of_two) -> list[str]:
    """The spin bound after one barrier of two threads, the other there already (its arrival
    counted: it came within the spin) or never coming (the abort flag up: this one leaves after
    its spin): within the spin doubles the bound back towards SPIN_MOST, never past it; a spin
    that ran out halves it, never below SPIN_MOST // SPIN_FLOOR."""
    from stages.kernels.sync import SPIN_FLOOR
    most = int(new_sync()[SPIN_MOST])
    floor = most // SPIN_FLOOR
    cases = [("came", most // 8, 2 * (most // 8)), ("came", most - 1, most), ("came", most, most),
             ("ran out", most, most // 2), ("ran out", 2 * floor, floor), ("ran out", floor + 1, floor),
             ("ran out", floor, floor)]
    problems = []
    for how, before, want in cases:
        sync = new_sync()
        sync[SPIN] = before
        if how == "came":
            sync[ARRIVALS] = 2                       # barrier 1 of two threads: the other has arrived
        else:
            sync[ABORT] = 1
        passed = of_two(sync, 1)
        if (sync[SPIN], passed) != (want, how == "came"):
            problems.append(f"{how}, a bound of {before}: {sync[SPIN]} after (passed: {passed}), want {want}")
    return problems


def test_the_spin_bound_doubles_back_to_its_most_and_halves_to_its_floor():
    assert spin_problems(_barrier_of_two) == []
    at_most = numba.njit(lambda a, b: a)              # planted: back to the most at once
    no_floor = numba.njit(lambda a, b: b)             # planted: halved without a floor
    assert spin_problems(twin_barrier(min=at_most)) != []
    assert spin_problems(twin_barrier(max=no_floor)) != []
