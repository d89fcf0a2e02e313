"""Chapter 01's experiments (run: make try-it ch=01; the notebook chapter says what each shows)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from numba import njit

from exercises.harness import best_seconds
from exercises.try_it import engine, experiment
from stages.naive import matmul_textbook


@njit(cache=True)
def matmul_ikj(A, B):
    """The textbook's sum with the j and k loops swapped: the inner loop runs along a row of B."""
    M, K = A.shape
    N = B.shape[1]
    C = np.zeros((M, N), dtype=np.float32)
    for i in range(M):
        for k in range(K):
            a = A[i, k]
            for j in range(N):
                C[i, j] += a * B[k, j]
    return C


@experiment("the order of the loops in matmul_textbook (stages/naive.py): i-j-k against i-k-j")
def loop_order(quick):
    """i-k-j reads B along its rows (every byte of a 64-byte line used), and its inner loop's adds go
    to different C[i, j], so none waits for another and LLVM can do 8 or 16 at once in a vector
    register: tens of times faster, with no other change (chapters 02 and 03 get there by other
    roads)"""
    M, K, N = (4, 128, 512) if quick else (16, 576, 1536)
    rng = np.random.default_rng(0)
    A = rng.standard_normal((M, K)).astype(np.float32)
    B = rng.standard_normal((K, N)).astype(np.float32)
    ijk = best_seconds(lambda: matmul_textbook(A, B), 2 if quick else 5)
    ikj = best_seconds(lambda: matmul_ikj(A, B), 2 if quick else 5)
    return {"rows": [(f"i-j-k (the stage), [{M} x {K}] @ [{K} x {N}]", ijk * 1e3, "ms"),
                     ("i-k-j (rows of B, independent sums)", ikj * 1e3, "ms"),
                     ("i-k-j speed over i-j-k", ijk / ikj, "x")],
            "note": "the loop order alone changes what memory is read and which adds wait for which"}


@experiment("the text's length L, with no KV cache (a step's matmul has L rows)")
def text_length(quick):
    """a step multiplies L rows by every weight: 2 L flops per weight, so the time grows in proportion
    to L (64 tokens: about 64 times one)"""
    lengths = (1, 2, 4) if quick else (1, 4, 16, 64)
    K, N = (128, 512) if quick else (576, 1536)
    rng = np.random.default_rng(0)
    B = rng.standard_normal((K, N)).astype(np.float32)
    rows = []
    for L in lengths:
        A = rng.standard_normal((L, K)).astype(np.float32)
        s = best_seconds(lambda: matmul_textbook(A, B), 2 if quick else 5)
        rows.append((f"a text of {L} token(s): one matmul, {L} row(s)", s * 1e3, "ms"))
    rows.append((f"{lengths[-1]} tokens against 1", rows[-1][1] / rows[0][1], "x"))
    return {"rows": rows, "note": "without a KV cache every step pushes the whole text through every matmul"}


@experiment("the bits per weight the stage holds: float32 against the file's blocks", model=True)
def balloon(quick):
    """SmolLM2's Q4_1 blocks hold 5 bits per weight (20 bytes per 32) and its embedding Q8_0 8.5: as
    float32 (32 bits) the weights take about 4 to 6 times the file, plus the output matrix the stage
    holds twice (once per layout)"""
    model = engine("naive", n_ctx=64)
    held = model.backend.held_bytes(model._weights())
    size = Path(model.gguf.path).stat().st_size
    return {"rows": [("the model file", size / 2**20, "MiB"),
                     ("weights as the naive stage holds them (float32)", held / 2**20, "MiB"),
                     ("ratio", held / size, "x")],
            "note": "compare with 32 bits over the file's bits per weight"}
