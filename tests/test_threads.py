"""The threads stage: the same numbers on 1 thread and on N, the thread count respected, the
parallel kernels against the quantized stage's serial ones and the fused attention against
numpy.

Splitting work between threads changes which core computes a value, never the order of the
additions inside one value (a matrix row, a panel of rows, one (query row, head) pair), so
the results on 1 and on N threads are compared for equality, bit for bit.
(The default model against the float64 reference and greedy tokens are checked for every
stage in tests/test_stages.py, primitives in tests/test_ops.py.)
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

from common.gguf import GGMLType
from stages import load
from stages.kernels.dequant_dot import CPU_KERNEL_TYPES, MATVEC, matvec_rows
from stages.kernels.threaded import attention_parallel, matvec_parallel, prefill_parallel
from stages.kernels.toolkit import F16_TO_F32
from stages.quantized import PANEL_ROWS, QuantizedBackend
from stages.threads import ThreadsBackend, default_threads
from tests.test_quantized import n_cols_for, random_blocks
from tests.util import attention_numpy, tensor_from_raw, thread_counts

POOL = numba.config.NUMBA_NUM_THREADS
TYPES = list(CPU_KERNEL_TYPES)


def close(got, want, x, w64):
    """Equal up to the order of float additions: relative to sum |x||w| (as test_quantized)."""
    scale = np.abs(x).astype(np.float64) @ np.abs(w64).T
    return (np.abs(got.astype(np.float64) - want) <= 2e-6 * np.maximum(scale, 1e-30)).all()


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_parallel_kernels_against_the_serial_ones(ggml_type):
    """Decode (rows split in 1, 2 and 3 chunks) and prefill (panels split): every split gives
    the same bits, and they agree with the quantized stage's kernels. (Not bit for bit with
    those: compiled into another function, LLVM may order a row's fastmath additions
    differently, so the comparison allows float rounding.)"""
    from common import quants as Q
    rng = np.random.default_rng(int(ggml_type))
    K = n_cols_for(ggml_type)
    raw = random_blocks(rng, ggml_type, 2 * PANEL_ROWS + 5, K)
    w = QuantizedBackend().prepare_matrix(tensor_from_raw(raw, ggml_type, raw.shape[:1] + (K,)))
    w64 = Q.dequantize(raw, ggml_type, w.shape).astype(np.float64)
    x = rng.standard_normal((1, K)).astype(np.float32)
    serial = MATVEC.get(w.kind, None)
    want = serial(x[0], w.data, F16_TO_F32) if serial else matvec_rows(x[0], w.data, w.kind, F16_TO_F32)
    got = [matvec_parallel(x[0], w.data, w.kind, F16_TO_F32, chunks) for chunks in (1, 2, 3)]
    assert all(np.array_equal(g, got[0]) for g in got)
    assert close(got[0][None], want[None], x, w64)
    xs = rng.standard_normal((7, K)).astype(np.float32)
    want = QuantizedBackend().matmul(xs, w)
    got = [prefill_parallel(xs, w.data, w.kind, F16_TO_F32, chunks, PANEL_ROWS, 4) for chunks in (1, 2, 3)]
    assert all(np.array_equal(g, got[0]) for g in got)
    assert close(got[0], want, xs, w64)


@pytest.mark.parametrize("n_head,n_kv,hd,m,start", [(9, 3, 64, 1, 40), (9, 3, 64, 17, 0), (4, 4, 16, 5, 3),
                                                    (32, 4, 64, 3, 100)])
def test_fused_attention_against_numpy(n_head, n_kv, hd, m, start):
    """Decode (one row, a long cache), prefill (many rows from position 0), no grouping, and
    TinyLlama's 32 heads on 4 KV heads; 1 thread and all."""
    rng = np.random.default_rng(n_head * 1000 + m)
    t = start + m
    q = rng.standard_normal((m, n_head * hd)).astype(np.float32)
    k = rng.standard_normal((t, n_kv * hd)).astype(np.float32)
    v = rng.standard_normal((t, n_kv * hd)).astype(np.float32)
    want = attention_numpy(q, k, v, n_head, n_kv, start)
    scale = np.float32(1.0 / np.sqrt(hd))
    results = []
    for threads in thread_counts():
        numba.set_num_threads(threads)
        results.append(attention_parallel(q, k, v, n_head, n_kv, start, scale))
        np.testing.assert_allclose(results[-1], want, rtol=1e-4, atol=1e-5)
    assert len(results) == 2 and np.array_equal(results[0], results[1])


def default_problems(default, monkeypatch, tmp_path) -> list[str]:
    """The default on a machine of 2 cores with 2 hyperthreads each (its topology as data,
    tests/test_machine.py's): 2 threads, one per core; with numba's pool of 1, 1."""
    from common.cpu import physical_cores
    from stages import threads
    from tests.test_machine import topology
    smt = topology(tmp_path / "smt", {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1)})
    monkeypatch.setattr(threads, "physical_cores", lambda: physical_cores({0, 1, 2, 3}, smt))
    problems = [] if (got := default()) == 2 else [f"2 cores, 4 hyperthreads: {got} threads"]
    monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", 1)
    if (got := default()) != 1:
        problems.append(f"numba's pool of 1: {got} threads")
    return problems


def test_the_default_is_one_thread_per_physical_core_within_numbas_pool(monkeypatch, tmp_path):
    from stages import threads
    assert default_problems(default_threads, monkeypatch, tmp_path / "right") == []
    monkeypatch.undo()                                          # planted: the pool not looked at
    assert default_problems(lambda: max(1, threads.physical_cores()), monkeypatch, tmp_path / "wrong") != []


def test_thread_count_is_the_backends():
    """--threads N reaches the backend, numba's pool follows it, the run record states it."""
    assert ThreadsBackend().threads == default_threads()
    assert ThreadsBackend(threads=1).threads == 1
    assert ThreadsBackend(threads=10 * POOL).threads == POOL          # no more than numba's pool
    for n in thread_counts():
        b = ThreadsBackend(threads=n)
        numba.set_num_threads(1 if n > 1 else POOL)                     # someone else's setting
        b.attention(np.ones((1, 8), np.float32), np.ones((2, 8), np.float32), np.ones((2, 8), np.float32),
                    2, 2, 1)
        assert numba.get_num_threads() == n


@pytest.fixture(scope="module")
def engines(default_model_path):
    return {n: load("threads", default_model_path, threads=n) for n in thread_counts()}


def test_one_thread_and_all_give_the_same_logits(engines):
    """Prefill, then decode steps: bit-identical logits on 1 thread and on all of them (and each
    run really had its thread count: the backend sets numba's, which is read back after it)."""
    tokens = [1, 504, 3287, 282, 1790, 314, 253, 2730, 30]
    runs = []
    for n, engine in engines.items():
        engine.reset()
        rows = [engine.forward(tokens[:6], 0)] + [engine.forward(tokens[i:i + 1], i) for i in range(6, len(tokens))]
        assert numba.get_num_threads() == n
        engine.reset()
        runs.append(np.concatenate(rows))
    assert np.isfinite(runs[0]).all()
    assert len(runs) == 2 and np.array_equal(runs[0], runs[1])


def test_run_record_states_the_threads(engines):
    from app.measure.bench import run_record
    from common.generate import generate
    assert sorted(engines) == thread_counts()
    for n, engine in engines.items():
        gen = generate(engine, [1, 504, 3287], 2, ignore_eos=True)
        assert run_record(engine, "threads", gen, "", 0.0)["threads"] == n


def test_types_are_the_quantized_stages():
    """The stage adds no format of its own: the kernel table is the quantized stage's."""
    assert set(TYPES) >= {GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K}
