"""Every primitive of every CPU stage against numpy, on shapes that are not multiples of any
tile, panel or vector width (odd sizes expose the edge loops)."""

from __future__ import annotations

import numpy as np
import pytest

from stages import backend_class
from tests.util import attention_numpy, cpu_stages, tensor_from_f32

STAGES = cpu_stages()
rng = np.random.default_rng(1234)


def rand(*shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.fixture(scope="module", params=STAGES)
def backend(request):
    return backend_class(request.param)()


@pytest.mark.parametrize("m,k,n", [(1, 7, 5), (3, 33, 17), (5, 70, 9), (9, 65, 131), (1, 257, 3)])
def test_matmul(backend, m, k, n):
    x, w = rand(m, k), rand(n, k)                       # w is [out, in] as stored in GGUF
    y = backend.to_host(backend.matmul(x, backend.prepare_matrix(tensor_from_f32(w))))
    np.testing.assert_allclose(y, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-4)


def test_matmul_reads_each_new_weight_not_one_let_go_before_it(backend):
    """Weights made and dropped one after another: Python hands a new object the id of one let
    go, so a stage that keyed what it built for a weight by id() alone would read the old one."""
    for n in range(3, 23):
        x, w = rand(2, 16), rand(n, 16)
        y = backend.to_host(backend.matmul(x, backend.prepare_matrix(tensor_from_f32(w))))
        np.testing.assert_allclose(y, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", [(1, 7), (5, 33)])
def test_elementwise(backend, shape):
    a, b = rand(*shape), rand(*shape)
    np.testing.assert_allclose(backend.add(a, b), a + b, rtol=1e-6)
    np.testing.assert_allclose(backend.mul(a, b), a * b, rtol=1e-6)
    np.testing.assert_allclose(backend.scale(a, 0.37), a * np.float32(0.37), rtol=1e-6)
    np.testing.assert_allclose(backend.silu(a), a / (1 + np.exp(-a.astype(np.float64))), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(backend.swiglu(a, b), a / (1 + np.exp(-a.astype(np.float64))) * b,
                               rtol=1e-5, atol=1e-6)


def test_rms_norm(backend):
    x, w = rand(3, 37) * 5, rand(37)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(backend.rms_norm(x, backend.prepare_vector(tensor_from_f32(w)), 1e-5),
                               want, rtol=1e-5, atol=1e-5)


def test_rope(backend):
    n_heads, hd, m = 3, 10, 4
    x = rand(m, n_heads * hd)
    start = 3                                            # rows are positions 3..6 of the tables
    table = rng.uniform(0, 6, size=(start + m + 2, hd // 2))
    ang = table[start:start + m]
    got = backend.rope(x, backend.prepare_table(np.cos(table).astype(np.float32)),
                       backend.prepare_table(np.sin(table).astype(np.float32)), start, n_heads)
    want = x.astype(np.float64).copy()
    for h in range(n_heads):
        for i in range(hd // 2):
            a, b = x[:, h * hd + 2 * i], x[:, h * hd + 2 * i + 1]
            want[:, h * hd + 2 * i] = a * np.cos(ang[:, i]) - b * np.sin(ang[:, i])
            want[:, h * hd + 2 * i + 1] = a * np.sin(ang[:, i]) + b * np.cos(ang[:, i])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_dot_softmax_argmax(backend):
    a, b = rand(3, 13), rand(7, 13)
    np.testing.assert_allclose(backend.dot(a, b), a.astype(np.float64) @ b.T, rtol=1e-5, atol=1e-5)
    s = rand(3, 7) * 4
    e = np.exp(s - s.max(axis=1, keepdims=True))
    np.testing.assert_allclose(backend.softmax(s), e / e.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-7)
    # causal: row i sits at position offset+i and sees columns 0..offset+i only
    got = backend.softmax(s, causal_offset=2)
    for i in range(3):
        v = s[i, :3 + i]
        e = np.exp(v - v.max())
        np.testing.assert_allclose(got[i, :3 + i], e / e.sum(), rtol=1e-5, atol=1e-7)
        assert np.all(got[i, 3 + i:] == 0)
    v = rand(1001)
    v[[17, 600]] = 50.0                                 # a tie: the first index wins
    assert backend.argmax(v) == 17


def test_embed(backend):
    table = rand(11, 6)
    ids = np.array([3, 0, 10, 3])
    got = backend.to_host(backend.embed(backend.prepare_embedding(tensor_from_f32(table)), ids))
    np.testing.assert_array_equal(got, table[ids])


def test_attention_matches_numpy(backend):
    """The attention op (composite or fused) against a plain causal GQA attention."""
    n_head, n_kv, hd, m, start = 6, 2, 8, 3, 4
    t = start + m
    q, k, v = rand(m, n_head * hd), rand(t, n_kv * hd), rand(t, n_kv * hd)
    got = backend.attention(q, k, v, n_head, n_kv, start)
    want = attention_numpy(q, k, v, n_head, n_kv, start)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
