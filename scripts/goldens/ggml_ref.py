"""ggml's reference quantizer, called through the ggml library inside llama-cpp-python.

ggml_quantize_chunk(type, src, dst, start, nrows, n_per_row, imatrix) with imatrix = NULL
runs quantize_row_<type>_ref, the quantizer llama-quantize uses without an importance matrix.
llama-cpp-python is optional (requirements-llama.txt), so callers handle GGMLUnavailable.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from common.gguf import GGMLType, type_nbytes


class GGMLUnavailable(RuntimeError):
    pass


def ggml_quantizer():
    """A function (x float32 [rows, n], GGMLType) -> uint8 [rows, bytes per row]."""
    try:
        import llama_cpp
    except ImportError:
        raise GGMLUnavailable("llama-cpp-python is not installed (optional: requirements-llama.txt); "
                              "it carries ggml's reference K-quant quantizers") from None
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll", "libggml.so", "libllama.so"):
        if (lib_dir / name).exists():
            lib = ctypes.CDLL(str(lib_dir / name))
            if hasattr(lib, "ggml_quantize_chunk"):
                break
    else:
        raise GGMLUnavailable(f"no ggml library exporting ggml_quantize_chunk in {lib_dir}")
    fn = lib.ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]

    def quantize(x: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
        x = np.ascontiguousarray(x, np.float32)
        nrows, n_per_row = x.shape
        out = np.zeros((nrows, type_nbytes(ggml_type, (n_per_row,))), np.uint8)
        written = fn(int(ggml_type), x.ctypes.data, out.ctypes.data, 0, nrows, n_per_row, None)
        assert written == out.nbytes
        return out
    return quantize
