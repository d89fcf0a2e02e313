"""Chapter 04's experiments (run: make try-it ch=04)."""

from __future__ import annotations

from exercises.try_it import engine, experiment, step_ms


@experiment("the KV cache: the kv_cache stage against simd, which has none (the same matmul)", model=True)
def cache_off(quick):
    """at 512 tokens a step without the cache pushes 512 rows through every matmul where the cache
    pushes 1: the matmul work falls 512 times. The step time falls less, since the simd kernel does
    a row 2 to 4 times faster in a block of 4 than alone (chapter 03's one_row): some 130 to 250
    times (quick, 16 tokens: a few times)"""
    L = 16 if quick else 512
    with_cache = step_ms(engine("kv_cache", n_ctx=L + 8), L, 2 if quick else 3)
    without = step_ms(engine("simd", n_ctx=L + 8), L, 1 if quick else 2)
    return {"rows": [(f"kv_cache: a decode step at {L} tokens", with_cache, "ms"),
                     (f"simd (no cache): the same step, all {L} tokens again", without, "ms"),
                     ("without over with", without / with_cache, "x")],
            "note": "the article measured 10.6x at 512 tokens (its model, its machine)"}


@experiment("the context length with the cache: 8 to 1024 positions", model=True)
def context_growth(quick):
    """a step's matmuls cost the same at every length; attention adds one 64-wide dot product and one
    weighted row per stored position, per head and layer (30 x 9 x 1024 x 2 x 64 x 2 = 70 MFLOP at
    1024, against 270 MFLOP of matmuls): the step grows by a fraction, not a multiple"""
    model = engine("kv_cache", n_ctx=1100)
    lengths = (8, 64) if quick else (8, 128, 512, 1024)
    rows = [(f"decode step at {L} tokens", step_ms(model, L, 2 if quick else 5), "ms") for L in lengths]
    rows.append((f"{lengths[-1]} against {lengths[0]}", rows[-1][1] / rows[0][1], "x"))
    return {"rows": rows, "note": "what rises is attention: one dot product per stored position and head"}
