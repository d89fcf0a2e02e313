"""Stage 1, naive: the textbook, everything spelled out as plain loops.

The lesson: the simplest correct engine, and what it costs.

* Every weight matrix is dequantized to float32 when the model loads and stored the way a
  textbook writes y = x B: B is [in, out], row-major. SmolLM2's 94 MB Q4_1 file becomes
  135M weights x 4 bytes of float32 (the RAM balloon; `python -m app run` prints it).
* matmul is the triple loop C[i][j] = sum_k A[i][k] * B[k][j]. The inner loop walks down a
  column of B: consecutive k are `out` floats apart in memory, so almost every load touches a
  new cache line and only 4 of its 64 bytes are used before the line is needed again.
* There is no KV cache: each new token re-runs the whole sequence through the model, so the
  cost of a token grows with the length of the text.

Every other primitive (norms, RoPE, softmax, ...) is written here once as a simple numba
loop; the later CPU stages inherit them and change only what their lesson is about.
Single-threaded, as in the article. What it costs on your machine: `make report`'s table.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from common.backend import Backend
from common.quants import dequantize_tensor

# ---- the lesson: the textbook matmul --------------------------------------------------------

@njit(cache=True)
def matmul_textbook(A, B):
    """A [M, K] @ B [K, N] -> C [M, N], the i-j-k loop with a strided walk down B's columns."""
    M, K = A.shape
    N = B.shape[1]
    C = np.empty((M, N), dtype=np.float32)
    for i in range(M):
        for j in range(N):
            acc = np.float32(0.0)
            for k in range(K):
                acc += A[i, k] * B[k, j]
            C[i, j] = acc
    return C


# ---- the other primitives, as plain loops ---------------------------------------------------

@njit(cache=True)
def add(a, b):
    out = np.empty_like(a)
    for ij in np.ndindex(a.shape):          # every (i, j), row by row
        out[ij] = a[ij] + b[ij]
    return out


@njit(cache=True)
def mul(a, b):
    out = np.empty_like(a)
    for ij in np.ndindex(a.shape):
        out[ij] = a[ij] * b[ij]
    return out


@njit(cache=True)
def rms_norm(x, w, eps):
    M, D = x.shape
    out = np.empty((M, D), dtype=np.float32)
    for i in range(M):
        ss = 0.0                                   # float64 sum of squares, as ggml does
        for j in range(D):
            ss += np.float64(x[i, j]) * x[i, j]
        r = np.float32(1.0 / np.sqrt(ss / D + eps))
        for j in range(D):
            out[i, j] = x[i, j] * r * w[j]
    return out


@njit(cache=True)
def silu(x):
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            v = x[i, j]
            out[i, j] = v / (np.float32(1.0) + np.exp(-v))
    return out


@njit(cache=True)
def rope(x, cos, sin, start_pos, n_heads):
    """x [M, n_heads*hd]; pairs (2i, 2i+1) of each head of row m rotated by angle i of
    position start_pos + m (cos, sin: [n_ctx, hd/2])."""
    M = x.shape[0]
    hd = x.shape[1] // n_heads
    out = np.empty((M, x.shape[1]), dtype=np.float32)
    for m in range(M):
        for h in range(n_heads):
            base = h * hd
            for i in range(hd // 2):
                x0 = x[m, base + 2 * i]
                x1 = x[m, base + 2 * i + 1]
                c = cos[start_pos + m, i]
                s = sin[start_pos + m, i]
                out[m, base + 2 * i] = x0 * c - x1 * s
                out[m, base + 2 * i + 1] = x0 * s + x1 * c
    return out


@njit(cache=True)
def scale(x, s):
    out = np.empty_like(x)
    s32 = np.float32(s)
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            out[i, j] = x[i, j] * s32
    return out


@njit(cache=True)
def dot(a, b):
    """a [M, d], b [T, d] -> [M, T]: the textbook matmul against b's transpose, a view (no copy)
    whose columns are b's rows, so here the inner loop walks memory in order."""
    return matmul_textbook(a, b.T)


@njit(cache=True)
def softmax(x, causal_offset):
    """Row-wise softmax; causal_offset >= 0 keeps columns 0..causal_offset+i of row i."""
    M, T = x.shape
    out = np.zeros((M, T), dtype=np.float32)
    for i in range(M):
        n = T if causal_offset < 0 else min(T, causal_offset + i + 1)
        mx = x[i, 0]
        for t in range(1, n):
            mx = max(mx, x[i, t])
        total = np.float32(0.0)
        for t in range(n):
            e = np.exp(x[i, t] - mx)              # minus the max: exp never overflows
            out[i, t] = e
            total += e
        for t in range(n):
            out[i, t] /= total
    return out


@njit(cache=True)
def argmax(x):
    best = 0
    for i in range(1, x.shape[0]):
        if x[i] > x[best]:
            best = i
    return best


@njit(cache=True)
def embed(table, ids):
    out = np.empty((ids.shape[0], table.shape[1]), dtype=np.float32)
    for m in range(ids.shape[0]):
        for j in range(table.shape[1]):
            out[m, j] = table[ids[m], j]
    return out


class NaiveBackend(Backend):
    name = "naive"

    # Weights: dequantized eagerly, matrices stored as the textbook's B = W^T [in, out].
    def prepare_matrix(self, tensor):
        return np.ascontiguousarray(dequantize_tensor(tensor).T)

    def prepare_embedding(self, tensor):
        return dequantize_tensor(tensor)                       # [n_vocab, D]

    def prepare_vector(self, tensor):
        return dequantize_tensor(tensor)

    def matmul(self, x, w):
        return matmul_textbook(x, w)

    def add(self, a, b):
        return add(a, b)

    def mul(self, a, b):
        return mul(a, b)

    def rms_norm(self, x, weight, eps):
        return rms_norm(x, weight, eps)

    def silu(self, x):
        return silu(x)

    def rope(self, x, cos, sin, start_pos, n_heads):
        return rope(x, cos, sin, start_pos, n_heads)

    def scale(self, x, s):
        return scale(x, s)

    def dot(self, a, b):
        return dot(a, b)

    def softmax(self, x, causal_offset=None):
        return softmax(x, -1 if causal_offset is None else causal_offset)

    def argmax(self, x):
        return int(argmax(np.ascontiguousarray(x).reshape(-1)))

    def embed(self, table, ids):
        return embed(table, np.asarray(ids, dtype=np.int64))
