"""The llama forward pass in float64 numpy, spelled out: the in-project oracle.

No stage code, no caching, no cleverness: every formula as the model defines it, in double
precision, so that each stage's float32 logits can be checked against it. Weights are
dequantized one at a time as they are used, so even a 1.1B model fits in memory.
(The reference itself is checked against llama.cpp's logits in tests/test_reference.py.)

forward(..., activations="q8") is the same pass with llama.cpp's one departure from it: before
each product with a quantized weight, the activation row is rounded to the 8-bit blocks ggml
pairs with that weight type (its vec_dot_type: Q8_0 for Q4_0/Q5_0/Q8_0, Q8_1 for Q4_1/Q5_1,
Q8_K for the K-quants), as quantize_row_q8_0/_q8_1/_q8_K_ref round it, and the values those
blocks stand for are multiplied in float64; for Q4_1/Q5_1 the weight blocks' offsets are
multiplied by Q8_1's s (float16 of d * sum q), as ggml's dot product does. Everything else
stays float64, so what is left between it and a stage that rounds the same way (int8) is that
stage's float32 arithmetic, and the few values float32 puts on the other side of a rounding
step (tests/test_int8.py measures how much that is).
"""

from __future__ import annotations

import numpy as np

from common.gguf import GGMLType, GGUFFile
from common.model import LlamaConfig, rope_angles
from common.quants import blocks_of, dequantize_rows, dequantize_tensor, nearest_int, round_half_away

f32 = np.float32
ACTIVATIONS = ("float", "q8")
# ggml's vec_dot_type of each quantized weight type: the activation blocks it is multiplied with
Q8_ACTIVATIONS = {GGMLType.Q4_0: "q8_0", GGMLType.Q5_0: "q8_0", GGMLType.Q8_0: "q8_0",
                  GGMLType.Q4_1: "q8_1", GGMLType.Q5_1: "q8_1",
                  GGMLType.Q2_K: "q8_k", GGMLType.Q3_K: "q8_k", GGMLType.Q4_K: "q8_k", GGMLType.Q5_K: "q8_k",
                  GGMLType.Q6_K: "q8_k"}


def _w(g: GGUFFile, name: str) -> np.ndarray:
    return dequantize_tensor(g.tensors[name]).astype(np.float64)


def round_q8(x: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray | None]:
    """Activation rows [M, K] -> (the values ggml's 8-bit blocks of that kind stand for, float64
    [M, K]; for q8_1 also s - d * sum q per block [M, K/32], else None).

    q8_0, q8_1 (32 values): d = amax / 127 in float32, q = roundf(x * (1/d)), stored d = float16(d);
    q8_1 adds s = float16(d * sum q) with the float32 d. q8_k (256 values): max = the value of
    largest |x| (the first on ties), iscale = -127 / max, q = min(127, nearest_int(iscale * x)),
    d = 1 / iscale in float32."""
    x = np.ascontiguousarray(x, dtype=f32)
    m, k = x.shape
    qk = 256 if kind == "q8_k" else 32
    b = x.reshape(m, k // qk, qk)
    if kind == "q8_k":
        big = np.take_along_axis(b, np.abs(b).argmax(axis=2)[..., None], axis=2)      # signed, first on ties
        with np.errstate(divide="ignore"):
            iscale = np.where(big == 0, f32(0), f32(-127) / big).astype(f32)
            d = np.where(big == 0, f32(0), f32(1) / iscale).astype(f32)
        q = np.minimum(127, nearest_int(iscale * b))
        return (d.astype(np.float64) * q).reshape(m, k), None
    d = (np.abs(b).max(axis=2, keepdims=True) / f32(127)).astype(f32)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, f32(0), f32(1) / d).astype(f32)
    q = round_half_away((b * inv).astype(f32)).astype(np.int64)
    d16 = d.astype(np.float16).astype(np.float64)
    values = (d16 * q).reshape(m, k)
    if kind == "q8_0":
        return values, None
    total = q.sum(axis=2, keepdims=True)
    s = (total.astype(f32) * d).astype(np.float16).astype(np.float64)
    return values, (s - d16 * total)[..., 0]


def matmul(g: GGUFFile, x: np.ndarray, name: str, activations: str = "float") -> np.ndarray:
    """x [M, K] @ weight `name`^T in float64; activations="q8" rounds x as llama.cpp does first."""
    w = _w(g, name)
    t = g.tensors[name]
    kind = Q8_ACTIVATIONS.get(t.ggml_type) if activations == "q8" else None
    if kind is None:
        return x @ w.T
    xq, s_fix = round_q8(x, kind)
    y = xq @ w.T
    if s_fix is not None:                            # the offset term: m * s instead of m * sum(d q)
        mins = blocks_of(t.data, t.ggml_type)["m"].astype(np.float64).reshape(t.shape[0], -1)     # [N, K/32]
        y += s_fix @ mins.T
    return y


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, angles, n_heads):
    """Rotate adjacent pairs of each head: x [M, n_heads*hd], angles [M, hd/2]."""
    m = x.shape[0]
    x = x.reshape(m, n_heads, -1, 2)                   # [M, heads, hd/2, (even, odd)]
    cos = np.cos(angles)[:, None, :]
    sin = np.sin(angles)[:, None, :]
    x0, x1 = x[..., 0], x[..., 1]
    out = np.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
    return out.reshape(m, -1)


def forward(g: GGUFFile, tokens, activations: str = "float") -> np.ndarray:
    """float64 logits [len(tokens), n_vocab] for tokens at positions 0..len-1. activations:
    "float" (every product in float64) or "q8" (rounded as llama.cpp rounds them: see above)."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations '{activations}': one of {', '.join(ACTIVATIONS)}")
    cfg = LlamaConfig.from_gguf(g)
    tokens = np.asarray(tokens)
    m, hd = len(tokens), cfg.head_dim
    angles = rope_angles(cfg, np.arange(m),
                         _w(g, "rope_freqs.weight") if "rope_freqs.weight" in g.tensors else None)
    emb = g.tensors["token_embd.weight"]
    h = dequantize_rows(emb, tokens).astype(np.float64)                  # [M, D]
    causal = np.triu(np.full((m, m), -np.inf), k=1)                      # row i sees 0..i
    group = cfg.n_head // cfg.n_head_kv
    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        x = rms_norm(h, _w(g, p + "attn_norm.weight"), cfg.eps)
        q = rope(matmul(g, x, p + "attn_q.weight", activations), angles, cfg.n_head)
        k = rope(matmul(g, x, p + "attn_k.weight", activations), angles, cfg.n_head_kv)
        v = matmul(g, x, p + "attn_v.weight", activations)
        att = np.empty_like(q)
        for hh in range(cfg.n_head):
            kv = hh // group
            qh, kh, vh = (a[:, s * hd:(s + 1) * hd] for a, s in ((q, hh), (k, kv), (v, kv)))
            scores = qh @ kh.T / np.sqrt(hd) + causal
            scores = np.exp(scores - scores.max(axis=1, keepdims=True))
            att[:, hh * hd:(hh + 1) * hd] = (scores / scores.sum(axis=1, keepdims=True)) @ vh
        h = h + matmul(g, att, p + "attn_output.weight", activations)
        x = rms_norm(h, _w(g, p + "ffn_norm.weight"), cfg.eps)
        gate = matmul(g, x, p + "ffn_gate.weight", activations)
        up = matmul(g, x, p + "ffn_up.weight", activations)
        h = h + matmul(g, gate / (1.0 + np.exp(-gate)) * up, p + "ffn_down.weight", activations)
    h = rms_norm(h, _w(g, "output_norm.weight"), cfg.eps)
    out = "output.weight" if "output.weight" in g.tensors else "token_embd.weight"
    return matmul(g, h, out, activations)
