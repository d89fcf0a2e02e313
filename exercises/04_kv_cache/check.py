"""Chapter 04's check: your store and attention against the stage's own (stages/kv_cache.py's
KVCache.store, then the attention the stage inherits: common/backend.py's composite over the simd
stage's ops), fed the same sequences in pieces: the outputs within the bound two float32
attentions may differ by, the arena equal value for value after every piece. Then one layer's
decode step, timed with your cache and without any (the simd stage: the whole text again)."""

from __future__ import annotations

import numpy as np

from exercises.harness import Case, Exercise, Timing, attention_bound, best_seconds, close, exact
from stages.kv_cache import KVCache, KVCacheBackend
from stages.simd import matmul_panels

BACKEND = KVCacheBackend()


def stage_store_and_attend(cache, layer, start_pos, q, k, v, n_head, n_head_kv):
    """The stage's two steps, as common/model.py calls them."""
    k_all, v_all = cache.store(layer, start_pos, k, v)
    return BACKEND.attention(q, k_all, v_all, n_head, n_head_kv, start_pos)


class KVCacheExercise(Exercise):
    chapter = "04"
    title = "kv_cache: store K and V once, attend over the arena"
    folder = "exercises/04_kv_cache"
    file = "kv_attention.py"
    reference = {"store_and_attend": stage_store_and_attend}
    reference_code = "stages/kv_cache.py: KVCache.store + common/backend.py: Backend.attention"

    def cases(self, rng, quick):
        # (heads, KV heads, head size, pieces [(start, rows)], layers, layer, n_ctx), why
        plans = [
            ((9, 3, 64, [(0, 7), (7, 1), (8, 1), (9, 1), (10, 1), (11, 1)], 1, 0, 32),
             "SmolLM2's heads (9 query, 3 KV, 64 wide): a 7-token prompt, then 5 decode steps"),
            ((9, 3, 64, [(0, 5), (5, 4), (9, 1)], 1, 0, 16),
             "a prompt in two chunks (5 rows, then 4 at position 5): the causal mask follows start_pos"),
            ((4, 4, 8, [(0, 1), (1, 1), (2, 1), (3, 1)], 2, 1, 8),
             "one head per KV head, a 1-token prompt; layer 1 of 2 (layer 0's arena stays untouched)"),
            ((8, 1, 16, [(0, 3), (3, 6), (9, 1), (10, 1), (11, 1)], 3, 2, 12),
             "8 query heads on 1 KV head; the arena filled to its last position (n_ctx 12)"),
        ]
        out = []
        for (H, Hkv, hd, pieces, n_layer, layer, n_ctx), why in plans:
            steps = []
            for start, M in pieces:
                q = rng.standard_normal((M, H * hd)).astype(np.float32)
                k = rng.standard_normal((M, Hkv * hd)).astype(np.float32)
                v = rng.standard_normal((M, Hkv * hd)).astype(np.float32)
                steps.append((start, q, k, v))
            out.append(Case(why, dict(H=H, Hkv=Hkv, hd=hd, steps=steps, n_layer=n_layer, layer=layer, n_ctx=n_ctx)))
        return out

    def judge(self, sol, case):
        c = case.inputs
        H, Hkv, hd = c["H"], c["Hkv"], c["hd"]
        mine = KVCache(c["n_layer"], c["n_ctx"], Hkv * hd)
        theirs = KVCache(c["n_layer"], c["n_ctx"], Hkv * hd)
        worst = ""
        for i, (start, q, k, v) in enumerate(c["steps"]):
            step = f"piece {i + 1} ({q.shape[0]} rows at position {start})"
            got = sol.store_and_attend(mine, c["layer"], start, q.copy(), k.copy(), v.copy(), H, Hkv)
            want = stage_store_and_attend(theirs, c["layer"], start, q, k, v, H, Hkv)
            for name in ("k", "v"):
                wrong = exact(f"{step}: the arena's {name}", getattr(mine, name), getattr(theirs, name))
                if wrong:
                    return wrong + " (index: layer, position, column)", ""
            end = start + q.shape[0]
            bound = max(attention_bound(q[:, h * hd:(h + 1) * hd], theirs.k[c["layer"], :end, kv * hd:(kv + 1) * hd],
                                        theirs.v[c["layer"], :end, kv * hd:(kv + 1) * hd], 1 / np.sqrt(hd))
                        for h in range(H) for kv in [h // (H // Hkv)])
            wrong = close(f"{step}: output", got, want, bound)
            if wrong:
                return wrong + " (index: row, column = head * hd + d)", ""
            most = np.abs(np.asarray(got) - want).max()
            worst = f"{len(c['steps'])} pieces; max |diff| {most:.2g} (bound {bound:.2g})"
        return None, worst

    def timings(self, sol, quick):
        D, H, Hkv, hd = 576, 9, 3, 64                            # SmolLM2's attention
        T = 32 if quick else 256
        self.timing_note = (f"one layer's decode step at position {T - 1}: the q, k, v matmuls and attention, "
                            f"SmolLM2's shapes; without a cache every step pushes all {T} rows through them")
        rng = np.random.default_rng(0)
        W = [(rng.standard_normal((n, D)) * 0.05).astype(np.float32) for n in (H * hd, Hkv * hd, Hkv * hd)]
        X = rng.standard_normal((T, D)).astype(np.float32)
        caches = {}
        for name, fn in (("yours", sol.store_and_attend), ("stage", stage_store_and_attend)):
            cache = KVCache(1, T, Hkv * hd)
            q, k, v = (matmul_panels(X[:T - 1], w) for w in W)
            fn(cache, 0, 0, q, k, v, H, Hkv)                     # the prompt: positions 0 .. T-2
            caches[name] = cache

        def step(fn, cache):
            x = X[T - 1:T]
            q, k, v = (matmul_panels(x, w) for w in W)
            return fn(cache, 0, T - 1, q, k, v, H, Hkv)

        def no_cache():
            q, k, v = (matmul_panels(X, w) for w in W)
            return BACKEND.attention(q, k, v, H, Hkv, 0)[-1:]

        reps = 3 if quick else 7
        return [Timing("yours", best_seconds(lambda: step(sol.store_and_attend, caches["yours"]), reps), "yours"),
                Timing("the stage's (kv_cache)", best_seconds(lambda: step(stage_store_and_attend, caches["stage"]),
                                                              reps), "stage"),
                Timing("the previous stage's (simd: no cache)", best_seconds(no_cache, reps), "previous")]


EXERCISE = KVCacheExercise()
