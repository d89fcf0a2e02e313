"""Chapter 05's check: your Q4_1 product against stages/kernels/dequant_dot.py's matvec_q4_1 (the
quantized stage's decode kernel for SmolLM2's layers); then timed beside it and beside the simd
stage's float32 product of the same weights (the stage this one builds on holds them so)."""

from __future__ import annotations

import functools

import numpy as np

from common.gguf import GGMLType
from common.quants import BLOCK_DTYPES, dequantize, quantize
from exercises.harness import Case, Exercise, Timing, best_seconds, close, sum_bound, worst_ratio
from stages.kernels.dequant_dot import matvec_q4_1
from stages.kernels.toolkit import F16_TO_F32
from stages.simd import matmul_panels

Q4_1 = GGMLType.Q4_1


def q4_1_weight(rng, N, K, scale=0.05, zero_blocks=0) -> np.ndarray:
    """uint8 [N, K/32 * 20]: random values quantized by common/quants.py (gguf-py's Q4_1, byte
    for byte); `zero_blocks` blocks of all zeros (d = m = 0) at the front of row 0. Read-only."""
    raw = quantize((rng.standard_normal((N, K)) * scale).astype(np.float32), Q4_1)
    for b in range(zero_blocks):
        raw[0, 20 * b:20 * b + 20] = 0
    return read_only(raw)


def read_only(raw: np.ndarray) -> np.ndarray:
    """Weights as the stages hold them, mapped read-only from the file. numba types a read-only
    array apart from a writable one and compiles a kernel once for each: given read-only
    weights, the stages' kernels this chapter and the later ones run (threads, int8, repack)
    are the ones `make compile` cached, not compiled again (seconds each; the int8 kernels tens)."""
    raw.flags.writeable = False
    return raw


@functools.cache
def decode_weight(quick: bool) -> tuple[np.ndarray, str]:
    """The matrix the decode kernels are timed on (uint8 [N, 360] Q4_1) and what it stands for:
    as many weights as SmolLM2's feed-forward layers (gate, up and down of its 30 layers), rows
    576 wide, about 50 MB of blocks: more than the last-level caches hold, as a decode step's
    weights are. --quick: 4096 rows (1.5 MB, in cache)."""
    N = 4096 if quick else 3 * 30 * 1536
    what = "a small stand-in, in cache (--quick)" if quick else (
        "as many weights as SmolLM2's feed-forward layers, more than the caches hold")
    return q4_1_weight(np.random.default_rng(0), N, 576), f"y = W x, W [{N} x 576] Q4_1: {what}"


def magnitudes(x, raw) -> np.ndarray:
    """sum_k |x_k| (|d| q_k + |m|) per row: the magnitudes a Q4_1 dot's rounding scales with
    (the products x_k * d q_k and x_k * m, however a kernel groups them)."""
    N, K = raw.shape[0], x.shape[0]
    blocks = raw.reshape(-1).view(BLOCK_DTYPES[Q4_1]).reshape(N, K // 32)
    d = np.abs(blocks["d"].astype(np.float64))[:, :, None]
    m = np.abs(blocks["m"].astype(np.float64))[:, :, None]
    qs = blocks["qs"].astype(np.int64)
    q = np.concatenate([qs & 15, qs >> 4], axis=2)                  # [N, blocks, 32]: values j, j + 16
    return ((d * q + m).reshape(N, K) * np.abs(x.astype(np.float64))).sum(axis=1)


class Quantized(Exercise):
    chapter = "05"
    title = "quantized: a Q4_1 matrix-vector product from the blocks' bytes"
    folder = "exercises/05_quantized"
    file = "q4_dot.py"
    reference = {"matvec_q4_1": matvec_q4_1}
    reference_code = "stages/kernels/dequant_dot.py: matvec_q4_1 (_row_q4_1, _dot)"

    def cases(self, rng, quick):
        plans = [((1, 32), {}, "one row of one block"),
                 ((7, 64), {}, "7 rows of 2 blocks"),
                 ((37, 576), {}, "37 rows of 18 blocks (SmolLM2's rows are 576 wide)"),
                 ((1, 1536), {}, "one row of 48 blocks (ffn_down's width)"),
                 ((5, 96), {"zero_blocks": 2}, "blocks of zeros (d = m = 0) beside ordinary ones"),
                 ((9, 160), {"scale": 40.0}, "large weights and activations"),
                 ((3, 128), {"offset": True}, "all weights far from zero (m large, d small)")]
        out = []
        for (N, K), opt, why in plans:
            if opt.get("offset"):
                raw = read_only(quantize((rng.uniform(3.0, 3.5, (N, K))).astype(np.float32), Q4_1))
            else:
                raw = q4_1_weight(rng, N, K, opt.get("scale", 0.05), opt.get("zero_blocks", 0))
            x = rng.standard_normal(K).astype(np.float32) * np.float32(opt.get("scale", 1.0))
            out.append(Case(f"N={N} K={K}: {why}", {"x": x, "w": raw}))
        return out

    def judge(self, sol, case):
        x, w = case.inputs["x"], case.inputs["w"]
        got = sol.matvec_q4_1(x, w, F16_TO_F32)
        want = matvec_q4_1(x, w, F16_TO_F32)
        # a decoded value d q + m rounds once too: K + 2 roundings per product chain
        bound = sum_bound(magnitudes(x, w), x.shape[0] + 2)
        return close("y", got, want, bound), worst_ratio(got, want, bound)

    def timings(self, sol, quick):
        raw, what = decode_weight(quick)
        N, K = raw.shape[0], raw.shape[1] // 20 * 32
        self.timing_note = f"{what}; its Q4_1 bytes against float32's"
        floats = dequantize(raw, Q4_1, (N, K))                   # the simd stage's copy: [N, K], N % 4 == 0
        x = np.random.default_rng(1).standard_normal(K).astype(np.float32)
        xs = x[None, :]
        reps = 3 if quick else 10
        q_bytes, f_bytes = (raw.nbytes, "GB/s of blocks"), (floats.nbytes, "GB/s of float32")
        return [Timing("yours", best_seconds(lambda: sol.matvec_q4_1(x, raw, F16_TO_F32), reps), "yours", q_bytes),
                Timing("the stage's (quantized)", best_seconds(lambda: matvec_q4_1(x, raw, F16_TO_F32), reps), "stage",
                       q_bytes),
                Timing("the previous stage's (simd on float32)", best_seconds(lambda: matmul_panels(xs, floats), reps),
                       "previous", f_bytes)]


EXERCISE = Quantized()
