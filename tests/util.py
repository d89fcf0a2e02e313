"""Helpers shared by the stage tests."""

from __future__ import annotations

import numpy as np

from common.gguf import BLOCK_SIZES, GGMLType, TensorInfo


def tensor_from_raw(raw: np.ndarray, ggml_type: GGMLType, shape, name: str = "w") -> TensorInfo:
    """A TensorInfo over bytes in memory, as if it had been read from a GGUF file."""
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    block, size = BLOCK_SIZES[GGMLType(ggml_type)]
    assert raw.nbytes == int(np.prod(shape)) // block * size
    return TensorInfo(name, tuple(shape), GGMLType(ggml_type), 0, raw.nbytes, raw)


def tensor_from_f32(a: np.ndarray, name: str = "w") -> TensorInfo:
    a = np.ascontiguousarray(a, dtype=np.float32)
    return tensor_from_raw(a, GGMLType.F32, a.shape, name)


def cpu_stages() -> list[str]:
    """The stages whose ops run on this machine's CPU (the cuda stage has its own tests)."""
    from stages import STAGES, unavailable_reason
    return [s for s in STAGES if s != "cuda" and unavailable_reason(s) is None]


def attention_numpy(q, k, v, n_head, n_kv, start):
    """Causal grouped-query attention in float64 numpy: the ops tests' oracle."""
    m, t = q.shape[0], k.shape[0]
    hd = q.shape[1] // n_head
    out = np.empty((m, n_head * hd))
    for h in range(n_head):
        kh = h // (n_head // n_kv)
        sc = q[:, h * hd:(h + 1) * hd].astype(np.float64) @ k[:, kh * hd:(kh + 1) * hd].T / np.sqrt(hd)
        sc += np.triu(np.full((m, t), -np.inf), k=start + 1)
        p = np.exp(sc - sc.max(axis=1, keepdims=True))
        out[:, h * hd:(h + 1) * hd] = (p / p.sum(axis=1, keepdims=True)) @ v[:, kh * hd:(kh + 1) * hd]
    return out
