"""The llama forward pass in float64 numpy, spelled out: the in-project oracle.

No stage code, no caching, no cleverness: every formula as the model defines it, in double
precision, so that each stage's float32 logits can be checked against it. Weights are
dequantized one at a time as they are used, so even a 1.1B model fits in memory.
(The reference itself is checked against llama.cpp's logits in tests/test_reference.py.)
"""

from __future__ import annotations

import numpy as np

from common.gguf import GGUFFile
from common.model import LlamaConfig, rope_angles
from common.quants import dequantize_rows, dequantize_tensor


def _w(g: GGUFFile, name: str) -> np.ndarray:
    return dequantize_tensor(g.tensors[name]).astype(np.float64)


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


def forward(g: GGUFFile, tokens) -> np.ndarray:
    """float64 logits [len(tokens), n_vocab] for tokens at positions 0..len-1."""
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
        q = rope(x @ _w(g, p + "attn_q.weight").T, angles, cfg.n_head)
        k = rope(x @ _w(g, p + "attn_k.weight").T, angles, cfg.n_head_kv)
        v = x @ _w(g, p + "attn_v.weight").T
        att = np.empty_like(q)
        for hh in range(cfg.n_head):
            kv = hh // group
            qh, kh, vh = (a[:, s * hd:(s + 1) * hd] for a, s in ((q, hh), (k, kv), (v, kv)))
            scores = qh @ kh.T / np.sqrt(hd) + causal
            scores = np.exp(scores - scores.max(axis=1, keepdims=True))
            att[:, hh * hd:(hh + 1) * hd] = (scores / scores.sum(axis=1, keepdims=True)) @ vh
        h = h + att @ _w(g, p + "attn_output.weight").T
        x = rms_norm(h, _w(g, p + "ffn_norm.weight"), cfg.eps)
        gate = x @ _w(g, p + "ffn_gate.weight").T
        up = x @ _w(g, p + "ffn_up.weight").T
        h = h + (gate / (1.0 + np.exp(-gate)) * up) @ _w(g, p + "ffn_down.weight").T
    h = rms_norm(h, _w(g, "output_norm.weight"), cfg.eps)
    out = "output.weight" if "output.weight" in g.tensors else "token_embd.weight"
    return h @ _w(g, out).T
