"""ggml block formats: what the bytes of a quantized tensor mean, and how to make them.

A quantized row is cut into blocks of QK values (32 for the "legacy" formats Q4_0..Q8_0,
QK_K = 256 for the K-quants Q2_K..Q6_K). Each block stores a few float16 scale fields and
then small integers, one per value, packed as tightly as their bit width allows:

    value  ~  d * q            (symmetric formats: Q4_0, Q5_0, Q8_0, Q3_K, Q6_K)
    value  ~  d * q + m        (formats with an offset: Q4_1, Q5_1; Q2_K, Q4_K and Q5_K write
                                it as d*sc*q - dmin*m with small integer sc, m per sub-block)

Blocks always run along the row (the last numpy axis), never across rows, so a row's
bytes can be decoded on their own (dequantize_rows picks out embedding rows that way).

Reading order of this file:
    BLOCK_DTYPES           one numpy structured dtype per format: the block's fields by name
    dequantize             raw bytes -> float32, one small function per format
    quantize               float32 -> raw bytes for F32/F16/BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K

Oracles: dequantize is bit-exact with gguf-py (PyPI `gguf`); quantize is byte-exact with
gguf-py for Q8_0/Q4_0/Q4_1 and with ggml's reference quantizers quantize_row_q4_K_ref /
quantize_row_q6_K_ref (what `llama-quantize` runs without an importance matrix) for Q4_K/Q6_K.
"Bit-exact" is a statement about float32 arithmetic: every product and sum below is done in
float32, in the same order as the reference, because (a*b)*c and a*(b*c) can round
differently. That is why some lines look more careful than the maths needs.
"""

from __future__ import annotations

import numpy as np

from common.gguf import BLOCK_SIZES, GGMLType, GGUFError, TensorInfo, type_nbytes

QK = 32        # values per block in Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
QK_K = 256     # values per super-block in the K-quants

f32 = np.float32


class UnsupportedTypeError(GGUFError):
    """A ggml type this module cannot (de)quantize. GGUFError, hence also a ValueError."""


# ---------------------------------------------------------------------------------------------
# Block layouts
#
# Viewing a tensor's raw bytes with one of these dtypes gives an array of blocks whose fields
# can be read by name: `np.frombuffer(raw, BLOCK_DTYPES[GGMLType.Q4_K])["d"]` is every block's
# super-scale. Fields are packed back to back (no padding), in the byte order of ggml's
# block_* structs; all multi-byte fields are little-endian. Shapes below are per block.
# ---------------------------------------------------------------------------------------------

BLOCK_DTYPES: dict[GGMLType, np.dtype] = {
    GGMLType.F32: np.dtype("<f4"),
    GGMLType.F16: np.dtype("<f2"),
    GGMLType.BF16: np.dtype("<u2"),     # the top 16 bits of a float32; numpy has no bfloat16

    # Q4_0: 32 values, 4 bits each, value = d * (q - 8).
    # qs[j] holds value j in its low nibble and value j+16 in its high nibble: the low nibbles
    # are the first half of the block, the high nibbles the second half. (Not neighbours:
    # splitting halves lets a SIMD kernel unpack 16 values with one AND and 16 with one SHIFT.)
    GGMLType.Q4_0: np.dtype([("d", "<f2"), ("qs", "u1", (16,))]),
    # Q4_1: as Q4_0 but unsigned with an offset: value = d * q + m (m is the block's minimum).
    GGMLType.Q4_1: np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (16,))]),
    # Q5_0: Q4_0's nibbles plus a fifth bit per value: bit j of the little-endian u32 qh is the
    # high bit of value j. value = d * (q - 16). (qh is 4 bytes, not a u32 field, because it
    # sits at byte offset 2 and would be unaligned.)
    GGMLType.Q5_0: np.dtype([("d", "<f2"), ("qh", "u1", (4,)), ("qs", "u1", (16,))]),
    # Q5_1: Q5_0's bits, unsigned with an offset: value = d * q + m.
    GGMLType.Q5_1: np.dtype([("d", "<f2"), ("m", "<f2"), ("qh", "u1", (4,)), ("qs", "u1", (16,))]),
    # Q8_0: 32 signed bytes, value = d * q.
    GGMLType.Q8_0: np.dtype([("d", "<f2"), ("qs", "i1", (32,))]),

    # K-quants: a 256-value super-block split into sub-blocks (16 of 16 values, or 8 of 32),
    # each with its own small integer scale, itself scaled by the float16 d (and dmin).

    # Q2_K: 16 sub-blocks of 16. scales[s] = sc | m << 4 (4 bits each);
    # value = d * sc * q - dmin * m with 2-bit q. qs packs 4 values per byte: for the 128-value
    # half n and l < 32, byte qs[32n + l] holds values 128n + 32j + l in bits 2j..2j+1, j = 0..3.
    GGMLType.Q2_K: np.dtype([("scales", "u1", (16,)), ("qs", "u1", (64,)),
                             ("d", "<f2"), ("dmin", "<f2")]),
    # Q3_K: 16 sub-blocks of 16, 6-bit signed scales (stored +32) packed into 12 bytes:
    # the low 4 bits of scale s are in nibble s//8 of scales[s % 8], its top 2 bits in bits
    # 2*(s//4).. of scales[8 + s % 4]. q = 2 low bits (packed as Q2_K) + 1 high bit from hmask
    # (bit k of hmask[l] belongs to value 32k + l); value = d * (sc - 32) * (q - 4 if the high
    # bit is clear else q).
    GGMLType.Q3_K: np.dtype([("hmask", "u1", (32,)), ("qs", "u1", (64,)),
                             ("scales", "u1", (12,)), ("d", "<f2")]),
    # Q4_K: 8 sub-blocks of 32, each with a 6-bit scale sc and a 6-bit min m (see
    # k4_scale_min for the 12-byte packing). value = d * sc * q - dmin * m with 4-bit q.
    # qs: 64-value chunk c uses qs[32c:32c+32]; low nibbles are values 64c..64c+31 (sub-block
    # 2c), high nibbles are values 64c+32..64c+63 (sub-block 2c+1).
    GGMLType.Q4_K: np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", (12,)),
                             ("qs", "u1", (128,))]),
    # Q5_K: Q4_K plus a fifth bit: bit s of qh[l] is the high bit of value l of sub-block s.
    GGMLType.Q5_K: np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", (12,)),
                             ("qh", "u1", (32,)), ("qs", "u1", (128,))]),
    # Q6_K: 16 sub-blocks of 16 with int8 scales; value = d * scale * (q - 32), q 6 bits =
    # 4 low bits in ql + 2 high bits in qh. For each 128-value half n (ql[64n:], qh[32n:]) and
    # l < 32 the four values 128n + 32k + l, k = 0..3, take
    #     low 4 bits:  k=0: ql[l] & 15   k=1: ql[l+32] & 15   k=2: ql[l] >> 4   k=3: ql[l+32] >> 4
    #     high 2 bits: bits 2k..2k+1 of qh[l]
    GGMLType.Q6_K: np.dtype([("ql", "u1", (128,)), ("qh", "u1", (64,)), ("scales", "i1", (16,)),
                             ("d", "<f2")]),
    # Q8_K: only an intermediate (activations quantized for dot products with K-quant weights);
    # d is a float32 and bsums[k] is the sum of qs[16k:16k+16]. Never stored in model files.
    GGMLType.Q8_K: np.dtype([("d", "<f4"), ("qs", "i1", (256,)), ("bsums", "<i2", (16,))]),
}

for _t, _dt in BLOCK_DTYPES.items():   # the layouts above must add up to ggml's block sizes
    assert _dt.itemsize == BLOCK_SIZES[_t][1], (_t, _dt.itemsize)
del _t, _dt

# Types whose values are plain numbers, not blocks.
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)


def _ggml_type(ggml_type, doing: str) -> GGMLType:
    """An int or GGMLType to a GGMLType, with an error naming the id if it is not one."""
    try:
        return GGMLType(ggml_type)
    except ValueError:
        raise UnsupportedTypeError(f"cannot {doing} ggml type id {ggml_type!r}: not a known ggml type") from None


def blocks_of(raw: np.ndarray, ggml_type) -> np.ndarray:
    """Raw bytes as a 1-D array of blocks (structured dtype): a view when raw is contiguous."""
    t = GGMLType(ggml_type)
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    return raw.view(BLOCK_DTYPES[t])


def k4_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 12 scale bytes [..., 12] -> (sc, m), each [..., 8] uint8 in 0..63.

    Eight 6-bit scales and eight 6-bit mins fit in 12 bytes:
        bytes 0-3   low 6 bits: sc0..sc3     top 2 bits: the high 2 bits of sc4..sc7
        bytes 4-7   low 6 bits: m0..m3       top 2 bits: the high 2 bits of m4..m7
        bytes 8-11  low nibble: sc4..sc7's low 4 bits,  high nibble: m4..m7's low 4 bits
    """
    lo_sc, lo_m, hi = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([lo_sc & 63, (hi & 0xF) | ((lo_sc >> 6) << 4)], axis=-1)
    m = np.concatenate([lo_m & 63, (hi >> 4) | ((lo_m >> 6) << 4)], axis=-1)
    return sc, m


def q3_k_scales(scales: np.ndarray) -> np.ndarray:
    """Q3_K: the 12 scale bytes [..., 12] -> 16 signed scales [..., 16] int8 in -32..31."""
    low = np.concatenate([scales[..., 0:8] & 0xF, scales[..., 0:8] >> 4], axis=-1)      # s = 0..15
    shifts = np.repeat(np.arange(0, 8, 2, dtype=np.uint8), 4)                           # 2*(s//4)
    high = (np.tile(scales[..., 8:12], 4) >> shifts) & 3                                # scales[8 + s%4]
    return ((low | (high << 4)).astype(np.int8) - np.int8(32))


# ---------------------------------------------------------------------------------------------
# Dequantization: one function per format. Each takes a chunk of blocks (1-D structured array,
# n blocks) and writes their values into out [n, values per block] float32, in place.
# Products are exact or rounded in the same order as gguf-py and ggml: (d * sc) * q - dmin * m.
# ---------------------------------------------------------------------------------------------

def _f16(field: np.ndarray) -> np.ndarray:
    return field.astype(f32)


def _split_nibbles(qs: np.ndarray, out: np.ndarray):
    """qs [n, k] bytes -> out [n, 2, k]: low nibbles first, then high nibbles."""
    out[:, 0, :] = qs & 0xF
    out[:, 1, :] = qs >> 4


def _dequantize_q4_0(b, out):
    o = out.reshape(len(b), 2, 16)
    _split_nibbles(b["qs"], o)
    o -= 8
    o *= _f16(b["d"])[:, None, None]


def _dequantize_q4_1(b, out):
    o = out.reshape(len(b), 2, 16)
    _split_nibbles(b["qs"], o)
    o *= _f16(b["d"])[:, None, None]
    o += _f16(b["m"])[:, None, None]


def _q5_high_bits(qh: np.ndarray) -> np.ndarray:
    """[n, 4] bytes of a little-endian u32 -> [n, 32] bits, bit j = value j's fifth bit."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _dequantize_q5_0(b, out):
    q = np.empty((len(b), 2, 16), np.uint8)
    _split_nibbles(b["qs"], q)
    out[:] = q.reshape(len(b), 32) | (_q5_high_bits(b["qh"]) << 4)
    out -= 16
    out *= _f16(b["d"])[:, None]


def _dequantize_q5_1(b, out):
    q = np.empty((len(b), 2, 16), np.uint8)
    _split_nibbles(b["qs"], q)
    out[:] = q.reshape(len(b), 32) | (_q5_high_bits(b["qh"]) << 4)
    out *= _f16(b["d"])[:, None]
    out += _f16(b["m"])[:, None]


def _dequantize_q8_0(b, out):
    out[:] = b["qs"]
    out *= _f16(b["d"])[:, None]


# 2-bit fields: value 32j + l of a 128-value half sits in bits 2j..2j+1 of byte l.
_SHIFT_2BIT = np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]


def _unpack_2bit(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K qs [n, 64] -> [n, 256] uint8 in 0..3, in value order."""
    n = len(qs)
    return ((qs.reshape(n, 2, 1, 32) >> _SHIFT_2BIT) & 3).reshape(n, QK_K)


def _dequantize_q2_k(b, out):
    n = len(b)
    o = out.reshape(n, 16, 16)                              # [block, sub-block, value]
    o[:] = _unpack_2bit(b["qs"]).reshape(n, 16, 16)
    sc = b["scales"]
    o *= (_f16(b["d"])[:, None] * (sc & 0xF))[:, :, None]   # d * sc, then * q
    o -= (_f16(b["dmin"])[:, None] * (sc >> 4))[:, :, None]


def _dequantize_q3_k(b, out):
    n = len(b)
    q = _unpack_2bit(b["qs"]).astype(np.int8)
    # bit k of hmask[l] is the high bit of value 32k + l; a CLEAR bit means q - 4
    high = (b["hmask"][:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    q -= ((high ^ 1) << 2).reshape(n, QK_K).astype(np.int8)
    o = out.reshape(n, 16, 16)
    o[:] = q.reshape(n, 16, 16)
    o *= (_f16(b["d"])[:, None] * q3_k_scales(b["scales"]))[:, :, None]


def _k4_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K qs [n, 128] -> [n, 8, 32] uint8: chunk c's low nibbles are sub-block 2c,
    its high nibbles sub-block 2c + 1."""
    n = len(qs)
    q = np.empty((n, 4, 2, 32), np.uint8)
    qs = qs.reshape(n, 4, 32)
    q[:, :, 0, :] = qs & 0xF
    q[:, :, 1, :] = qs >> 4
    return q.reshape(n, 8, 32)


def _apply_k4_scales(b, o):
    """o [n, 8, 32] holds q; turn it into d * sc * q - dmin * m."""
    sc, m = k4_scale_min(b["scales"])
    o *= (_f16(b["d"])[:, None] * sc)[:, :, None]
    o -= (_f16(b["dmin"])[:, None] * m)[:, :, None]


def _dequantize_q4_k(b, out):
    o = out.reshape(len(b), 8, 32)
    o[:] = _k4_nibbles(b["qs"])
    _apply_k4_scales(b, o)


def _dequantize_q5_k(b, out):
    o = out.reshape(len(b), 8, 32)
    high = (b["qh"][:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [n, 8, 32]
    o[:] = _k4_nibbles(b["qs"]) | (high << 4)
    _apply_k4_scales(b, o)


def _dequantize_q6_k(b, out):
    n = len(b)
    ql = b["ql"].reshape(n, 2, 64)                          # [block, half, byte]
    qh = b["qh"].reshape(n, 2, 1, 32)
    low = np.empty((n, 2, 2, 64), np.uint8)                 # [block, half, nibble, byte]
    low[:, :, 0, :] = ql & 0xF                              # values 0..63 of the half
    low[:, :, 1, :] = ql >> 4                               # values 64..127
    high = (qh >> _SHIFT_2BIT) & 3                          # [block, half, k, l]: value 32k + l
    q = (low.reshape(n, QK_K) | (high.reshape(n, QK_K) << 4)).astype(np.int8) - np.int8(32)
    o = out.reshape(n, 16, 16)
    o[:] = q.reshape(n, 16, 16)
    o *= (_f16(b["d"])[:, None] * b["scales"])[:, :, None]


_DEQUANTIZERS = {
    GGMLType.Q4_0: _dequantize_q4_0, GGMLType.Q4_1: _dequantize_q4_1,
    GGMLType.Q5_0: _dequantize_q5_0, GGMLType.Q5_1: _dequantize_q5_1,
    GGMLType.Q8_0: _dequantize_q8_0,
    GGMLType.Q2_K: _dequantize_q2_k, GGMLType.Q3_K: _dequantize_q3_k,
    GGMLType.Q4_K: _dequantize_q4_k, GGMLType.Q5_K: _dequantize_q5_k,
    GGMLType.Q6_K: _dequantize_q6_k,
}
DEQUANTIZE_TYPES = FLOAT_TYPES + tuple(_DEQUANTIZERS)

# Blocks are decoded a chunk at a time (about a million values, 4 MB of float32) so that the
# temporaries stay in cache and a 260 MB embedding does not need 260 MB of scratch on top.
_CHUNK_VALUES = 1 << 20


def dequantize(raw: np.ndarray, ggml_type, shape) -> np.ndarray:
    """Raw ggml bytes -> a new float32 array of `shape` (numpy order, last axis = row).

    raw: uint8 array of any shape holding exactly the tensor's bytes (TensorInfo.data, a slice
    of rows, ...). ggml_type: GGMLType or its id.
    """
    t = _ggml_type(ggml_type, "dequantize")
    if t not in DEQUANTIZE_TYPES:
        raise UnsupportedTypeError(f"dequantize: ggml type {t.name} is not supported "
                                   f"(supported: {', '.join(x.name for x in DEQUANTIZE_TYPES)})")
    shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(s) for s in shape)
    nbytes = type_nbytes(t, shape)
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if raw.nbytes != nbytes:
        raise GGUFError(f"dequantize: {raw.nbytes} bytes given, {t.name} {shape} needs {nbytes}")

    if t == GGMLType.F32:
        return raw.view(f32).reshape(shape).copy()
    if t == GGMLType.F16:
        return raw.view("<f2").astype(f32).reshape(shape)
    if t == GGMLType.BF16:
        return (raw.view("<u2").astype(np.uint32) << 16).view(f32).reshape(shape)

    block = BLOCK_SIZES[t][0]
    blocks = raw.view(BLOCK_DTYPES[t])
    out = np.empty((len(blocks), block), f32)
    step = max(1, _CHUNK_VALUES // block)
    decode = _DEQUANTIZERS[t]
    for start in range(0, len(blocks), step):
        decode(blocks[start:start + step], out[start:start + step])
    return out.reshape(shape)


def dequantize_tensor(tensor: TensorInfo) -> np.ndarray:
    """A whole tensor from a GGUF file as float32 of tensor.shape."""
    return dequantize(tensor.data, tensor.ggml_type, tensor.shape)


def dequantize_rows(tensor: TensorInfo, row_ids) -> np.ndarray:
    """Only the rows `row_ids` of a tensor (an embedding lookup), as float32.

    row_ids: an int or an integer array; the result has shape (*shape(row_ids), row_length).
    Only the bytes of those rows are read from the mapped file.
    """
    ids = np.asarray(row_ids, dtype=np.int64)
    rows = tensor.rows()                                    # [n_rows, bytes per row], a view
    if ids.size and (ids.min() < -len(rows) or ids.max() >= len(rows)):
        raise IndexError(f"{tensor.name}: row ids must be in 0..{len(rows) - 1}")
    row_len = tensor.shape[-1]
    return dequantize(rows[ids.reshape(-1)], tensor.ggml_type, (ids.size, row_len)).reshape(
        ids.shape + (row_len,))


# ---------------------------------------------------------------------------------------------
# Quantization helpers: ggml's rounding, written so that numpy does exactly what C does.
# ---------------------------------------------------------------------------------------------

def nearest_int(f: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: float32 -> int32, rounding halves to even.

    Adding 1.5 * 2**23 pushes the value into the range where a float32's spacing is exactly 1,
    so the FPU's own round-to-nearest-even does the rounding; the integer then sits in the low
    23 mantissa bits. Valid for |f| <= 4194303, like the C (outside it, the same garbage).
    """
    v = (np.asarray(f, f32) + f32(12582912.0)).view(np.int32)
    return (v & 0x007FFFFF) - 0x00400000


def round_half_away(f: np.ndarray) -> np.ndarray:
    """C's roundf (halves away from zero), exactly, for float32 (f + 0.5 would round twice)."""
    whole = np.trunc(f)
    frac = np.abs(f - whole)                                # exact: no bits are lost
    return whole + np.where(frac >= 0.5, np.sign(f), f32(0)).astype(f.dtype)


def sum_in_order(terms: np.ndarray, start_at_zero: bool = True) -> np.ndarray:
    """Sum over the last axis left to right in float32, like `float s = 0; for (...) s += t;`.

    np.sum adds pairwise (more accurate, differently rounded); a running sum is strictly left
    to right. The final + 0 reproduces C's +0.0 start when every term is -0.0.
    """
    s = np.add.accumulate(terms, axis=-1, dtype=f32)[..., -1]
    return s + f32(0) if start_at_zero else s


def _to_f16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> the 2 bytes of its float16 (round to nearest even, like GGML_FP32_TO_FP16)."""
    with np.errstate(over="ignore"):
        return np.asarray(x, f32).astype("<f2")


def _pack_blocks(ggml_type: GGMLType, **fields) -> np.ndarray:
    """Fill a structured block array from named fields -> raw bytes [n, bytes per block]."""
    n = len(next(iter(fields.values())))
    blocks = np.zeros(n, BLOCK_DTYPES[ggml_type])
    for name, value in fields.items():
        blocks[name] = value
    return blocks.view(np.uint8).reshape(n, -1)


def _abs_max_signed(x: np.ndarray) -> np.ndarray:
    """Per row [n, k] -> [n]: the value with the largest |x|, keeping its sign (first on ties)."""
    i = np.abs(x).argmax(axis=-1)
    return np.take_along_axis(x, i[:, None], axis=-1)[:, 0]


def _pack_nibbles_halves(q: np.ndarray) -> np.ndarray:
    """[n, 32] values 0..15 -> [n, 16] bytes: value j in the low nibble, value j+16 in the high."""
    return (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)


# ---------------------------------------------------------------------------------------------
# Legacy formats (gguf-py's quantizers, which follow ggml's quantize_row_*_ref)
# ---------------------------------------------------------------------------------------------

def _quantize_q8_0(x):                                      # x [n, 32] float32
    d = np.abs(x).max(axis=-1) / f32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, f32(0), f32(1) / d)
    qs = round_half_away(x * inv[:, None]).astype(np.int8)
    return _pack_blocks(GGMLType.Q8_0, d=_to_f16_bits(d), qs=qs)


def _quantize_q4_0(x):
    # The value of largest magnitude maps to -8 (so d may be negative); everything else
    # lands in -8..7, shifted to 0..15. +8.5 then truncation = round half up.
    # (One corner where gguf-py, followed here, and ggml differ: a block of only -0.0 gets
    # d = +0.0 here and -0.0 from ggml, whose running maximum starts at +0.0.)
    d = _abs_max_signed(x) / f32(-8)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, f32(0), f32(1) / d)
    q = np.minimum(np.trunc(x * inv[:, None] + f32(8.5)).astype(np.uint8), 15)
    return _pack_blocks(GGMLType.Q4_0, d=_to_f16_bits(d), qs=_pack_nibbles_halves(q))


def _quantize_q4_1(x):
    lo, hi = x.min(axis=-1), x.max(axis=-1)
    d = (hi - lo) / f32(15)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, f32(0), f32(1) / d)
    q = np.minimum(np.trunc((x - lo[:, None]) * inv[:, None] + f32(0.5)).astype(np.uint8), 15)
    return _pack_blocks(GGMLType.Q4_1, d=_to_f16_bits(d), m=_to_f16_bits(lo),
                        qs=_pack_nibbles_halves(q))


# ---------------------------------------------------------------------------------------------
# K-quants (ggml's quantize_row_q4_K_ref / quantize_row_q6_K_ref, vectorized over sub-blocks)
# ---------------------------------------------------------------------------------------------

def make_qkx2_quants(x, w, nmax: int, rmin: float, rdelta: float, nstep: int):
    """Fit each row of x [S, n] as scale * L + min, L integers in 0..nmax, min <= 0.

    Minimizes the weighted squared error sum(w * (scale*L + min - x)**2): start from the grid
    spanning [min(x, 0), max(x)], then try nstep+1 slightly different grid spacings, refit scale
    and min for each by weighted least squares (closed form), keep the best.
    As in ggml, an accepted fit's min becomes the origin of the grids tried after it.
    Returns (scale [S], the_min = -min [S], L [S, n] uint8).
    """
    lo = np.minimum(x.min(axis=1), f32(0))                  # "if (min > 0) min = 0"
    hi = x.max(axis=1)
    flat = hi == lo                                         # all values equal (and <= 0)
    sum_w = sum_in_order(w, start_at_zero=False)            # the C starts these at term 0
    sum_x = sum_in_order(w * x, start_at_zero=False)

    def grid(iscale, mn):                                   # [S], [S] -> L [S, n] as float32
        return np.clip(nearest_int(iscale[:, None] * (x - mn[:, None])), 0, nmax).astype(f32)

    def error(scale, mn, L):                                # sum w * (scale*L + min - x)^2
        diff = (scale[:, None] * L + mn[:, None]) - x
        return sum_in_order(w * (diff * diff))

    def span(mn):                                           # max - min; 1 on flat rows (unused)
        return np.where(flat, f32(1), hi - mn)

    mn = lo
    iscale = f32(nmax) / span(mn)
    scale = f32(1) / iscale
    L = grid(iscale, mn)
    best = error(scale, mn, L)
    for step in range(nstep + 1):
        iscale = (f32(rmin) + f32(rdelta) * f32(step) + f32(nmax)) / span(mn)
        La = grid(iscale, mn)
        wl = w * La
        sum_l = sum_in_order(wl)
        sum_l2 = sum_in_order(wl * La)
        sum_xl = sum_in_order(wl * x)
        D = sum_w * sum_l2 - sum_l * sum_l
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            positive = this_min > 0                         # a min above 0 is not allowed:
            this_scale = np.where(positive, sum_xl / sum_l2, this_scale)   # refit scale alone
            this_min = np.where(positive, f32(0), this_min)
            cur = error(this_scale, this_min, La)
        better = (D > 0) & (cur < best) & ~flat
        L = np.where(better[:, None], La, L)
        best = np.where(better, cur, best)
        scale = np.where(better, this_scale, scale)
        mn = np.where(better, this_min, mn)
    scale = np.where(flat, f32(0), scale)                   # flat rows: L = 0, scale 0
    L = np.where(flat[:, None], f32(0), L)
    return scale, -mn, L.astype(np.uint8)


def _quantize_q4_k(x):                                      # x [n, 256] float32
    nb = len(x)
    xs = x.reshape(nb * 8, 32)                              # sub-blocks of 32
    av_x = np.sqrt(sum_in_order(xs * xs) / f32(32))
    w = av_x[:, None] + np.abs(xs)                          # weights: favour large values
    scales, mins, L = make_qkx2_quants(xs, w, 15, rmin=-1.0, rdelta=0.1, nstep=20)
    scales, mins, L = scales.reshape(nb, 8), mins.reshape(nb, 8), L.reshape(nb, 8, 32)

    # The eight sub-block scales and mins become 6-bit integers relative to the largest.
    max_scale = np.maximum(scales.max(axis=1), f32(0))
    max_min = np.maximum(mins.max(axis=1), f32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, f32(63) / max_scale, f32(0))
        inv_min = np.where(max_min > 0, f32(63) / max_min, f32(0))
    ls = np.minimum(nearest_int(inv_scale[:, None] * scales) & 0xFF, 63).astype(np.uint8)  # C: uint8_t
    lm = np.minimum(nearest_int(inv_min[:, None] * mins) & 0xFF, 63).astype(np.uint8)
    packed = np.concatenate([ls[:, :4] | ((ls[:, 4:] >> 4) << 6),       # see k4_scale_min
                             lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
                             (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)], axis=1)
    d16 = _to_f16_bits(max_scale / f32(63))
    dmin16 = _to_f16_bits(max_min / f32(63))

    # Second pass: requantize every value against the scales as they were actually stored.
    d = d16.astype(f32)[:, None] * ls                       # [nb, 8]: d * sc
    dm = dmin16.astype(f32)[:, None] * lm
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(nearest_int((x.reshape(nb, 8, 32) + dm[:, :, None]) / d[:, :, None]), 0, 15)
    L = np.where((d != 0)[:, :, None], requant, L).astype(np.uint8)      # d == 0: keep the fit

    L = L.reshape(nb, 4, 2, 32)                             # [chunk c, low/high nibble, l]
    qs = (L[:, :, 0, :] | (L[:, :, 1, :] << 4)).reshape(nb, 128)
    return _pack_blocks(GGMLType.Q4_K, d=d16, dmin=dmin16, scales=packed, qs=qs)


GROUP_MAX_EPS = f32(1e-15)


def make_qx_quants(x, nmax: int):
    """Fit each row of x [S, n] as scale * l, l integers in -nmax..nmax-1 (symmetric grid).

    Weights w = x**2 (ggml's rmse_type 1). Starts from the grid that maps the value of largest
    magnitude to -nmax, then tries 18 nearby grid spacings and keeps the one maximizing
    (sum w*x*l)**2 / sum w*l*l, i.e. the smallest weighted error with the best scale.
    Returns (scale [S], L = l + nmax [S, n] uint8); rows of (near-)zeros give scale 0, L 0.
    """
    amax_signed = _abs_max_signed(x)
    zero = np.abs(amax_signed) < GROUP_MAX_EPS
    top = np.where(zero, f32(1), amax_signed)
    w = x * x

    def fit(iscale):                                        # -> l [S, n] float32, sum w x l, sum w l l
        l = np.clip(nearest_int(iscale[:, None] * x), -nmax, nmax - 1).astype(f32)
        return l, sum_in_order((w * x) * l), sum_in_order((w * l) * l)

    l, sumlx, suml2 = fit(f32(-nmax) / top)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, sumlx / suml2, f32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        lt, sumlx, suml2 = fit(-(f32(nmax) + f32(0.1) * f32(step)) / top)
        with np.errstate(over="ignore"):
            take = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        with np.errstate(divide="ignore", invalid="ignore"):
            new_scale = sumlx / suml2
        l = np.where(take[:, None], lt, l)
        scale = np.where(take, new_scale, scale)
        best = np.where(take, scale * sumlx, best)
    L = np.where(zero[:, None], 0, l.astype(np.int32) + nmax).astype(np.uint8)
    return np.where(zero, f32(0), scale), L


def _quantize_q6_k(x):                                      # x [n, 256] float32
    nb = len(x)
    scales, L = make_qx_quants(x.reshape(nb * 16, 16), 32)
    scales, L = scales.reshape(nb, 16), L.reshape(nb, 16, 16)

    # The sub-block scale of largest magnitude maps to -128; d = 1/iscale keeps its sign.
    max_scale = _abs_max_signed(scales)
    zero_block = np.abs(max_scale) < GROUP_MAX_EPS          # -> an all-zero block
    iscale = f32(-128) / np.where(zero_block, f32(1), max_scale)
    d16 = _to_f16_bits(f32(1) / iscale)
    sc = np.minimum(nearest_int(iscale[:, None] * scales), 127).astype(np.int8)

    # Second pass against the stored scales.
    d = d16.astype(f32)[:, None] * sc                       # [nb, 16]
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(nearest_int(x.reshape(nb, 16, 16) / d[:, :, None]), -32, 31) + 32
    L = np.where((d != 0)[:, :, None], requant, L).astype(np.uint8).reshape(nb, 2, 4, 32)

    ql = np.concatenate([(L[:, :, 0] & 0xF) | ((L[:, :, 2] & 0xF) << 4),   # ql[l]: k=0 | k=2
                         (L[:, :, 1] & 0xF) | ((L[:, :, 3] & 0xF) << 4)],  # ql[l+32]: k=1 | k=3
                        axis=2).reshape(nb, 128)
    qh = ((L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4)
          | ((L[:, :, 3] >> 4) << 6)).reshape(nb, 64)
    raw = _pack_blocks(GGMLType.Q6_K, ql=ql, qh=qh, scales=sc, d=d16)
    raw[zero_block] = 0
    return raw


_QUANTIZERS = {
    GGMLType.Q8_0: _quantize_q8_0, GGMLType.Q4_0: _quantize_q4_0, GGMLType.Q4_1: _quantize_q4_1,
    GGMLType.Q4_K: _quantize_q4_k, GGMLType.Q6_K: _quantize_q6_k,
}
QUANTIZE_TYPES = FLOAT_TYPES + tuple(_QUANTIZERS)


def _float_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounding to nearest even; NaN stays a (quiet) NaN."""
    bits = x.view(np.uint32)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = ((bits.astype(np.uint64) + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(nan, ((bits >> 16) | 64).astype(np.uint16), rounded)


# Quantize this many blocks at a time: the K-quant search keeps ~20 arrays of the chunk's size.
_QUANT_CHUNK_VALUES = 1 << 19


def quantize(x: np.ndarray, ggml_type) -> np.ndarray:
    """Float values -> raw ggml bytes, uint8 of shape (*x.shape[:-1], bytes per row).

    The last axis is the row; its length must be a multiple of the type's block size.
    The result can go straight to GGUFWriter.add_tensor(name, raw, ggml_type, shape=x.shape).
    """
    t = _ggml_type(ggml_type, "quantize")
    if t not in QUANTIZE_TYPES:
        raise UnsupportedTypeError(f"quantize: ggml type {t.name} is not supported "
                                   f"(supported: {', '.join(x.name for x in QUANTIZE_TYPES)})")
    x = np.ascontiguousarray(x, dtype=f32)
    if x.ndim == 0:
        raise ValueError("quantize: need at least one axis (the row)")
    block, size = BLOCK_SIZES[t]
    if x.shape[-1] % block:
        raise ValueError(f"quantize: row length {x.shape[-1]} is not a multiple of "
                         f"{t.name}'s block of {block}")
    out_shape = x.shape[:-1] + (x.shape[-1] // block * size,)
    if t == GGMLType.F32:
        return x.view(np.uint8).reshape(out_shape).copy()
    if t == GGMLType.F16:
        return _to_f16_bits(x).view(np.uint8).reshape(out_shape)
    if t == GGMLType.BF16:
        return _float_to_bf16(x).view(np.uint8).reshape(out_shape)
    blocks = x.reshape(-1, block)
    out = np.empty((len(blocks), size), np.uint8)
    step = max(1, _QUANT_CHUNK_VALUES // block)
    for start in range(0, len(blocks), step):
        out[start:start + step] = _QUANTIZERS[t](blocks[start:start + step])
    return out.reshape(out_shape)
