"""Stage 4, kv_cache: remember K and V, so each new token costs one token's work.

The lesson: the stages before this one recompute the whole text for every token they add.
Yet a token's key and value vectors depend only on the tokens up to it, so once computed
they never change. Keep them, and each decode step feeds only the newest token through the
model: one row instead of the whole sequence through every matmul, and attention reads the
stored keys and values of all earlier positions.

Prefill (the prompt) still processes all its rows at once and writes every position into
the cache; decode then costs the same whatever the length of the text, apart from attention,
which grows with it (one dot product per stored position).

The cache is one arena allocated when the model loads: for every layer and every position up
to the context length, K and V of all KV heads, float32:

    2 (K, V) x n_layer x n_ctx x n_head_kv * head_dim x 4 bytes
    SmolLM2-135M, 2048 positions: 2 x 30 x 2048 x 192 x 4 = 90 MiB

Nothing is allocated per token. np.zeros asks the OS for zeroed memory that becomes resident
as it is first written; where the OS backs large arrays with 2 MiB huge pages (Linux's
transparent huge pages, as on the machine measured here) the whole arena is resident after
the first token, which is what the peak-RSS figures show.
Everything else (the vectorized matmul included) is the simd stage's.
"""

from __future__ import annotations

import numpy as np

from stages.simd import SimdBackend


class KVCache:
    """K and V for every layer and position: two [n_layer, n_ctx, kv_dim] arrays (float32, or the
    backend's kv_dtype)."""

    def __init__(self, n_layer: int, n_ctx: int, kv_dim: int, dtype=np.float32):
        self.k = np.zeros((n_layer, n_ctx, kv_dim), dtype=dtype)
        self.v = np.zeros((n_layer, n_ctx, kv_dim), dtype=dtype)
        self.n_ctx = n_ctx
        self.nbytes = self.k.nbytes + self.v.nbytes

    def store(self, layer: int, start_pos: int, k, v):
        """Write the new rows k, v [M, kv_dim] at positions start_pos.., return views of all
        positions so far: [start_pos + M, kv_dim] each."""
        end = start_pos + k.shape[0]
        self.k[layer, start_pos:end] = k
        self.v[layer, start_pos:end] = v
        return self.k[layer, :end], self.v[layer, :end]

    def reset(self):
        """Nothing to clear: positions past the current length are never read."""


class KVCacheBackend(SimdBackend):
    name = "kv_cache"

    def new_kv_cache(self, n_layer, n_ctx, kv_dim):
        return KVCache(n_layer, n_ctx, kv_dim, self.kv_dtype)
