"""GGUF v2/v3 reader and writer.

A GGUF file is three things back to back (all little-endian):

    header      magic "GGUF", version u32, tensor_count u64, kv_count u64
    metadata    kv_count x (key: string, value_type: u32, value)
    tensor info tensor_count x (name: string, n_dims: u32, dims: u64[n_dims], type: u32, offset: u64)
    padding     zeros up to a multiple of general.alignment (default 32)
    data        the tensors' raw bytes; each tensor's offset is relative to here

The reader maps the whole file once and hands every tensor out as a zero-copy
``numpy.uint8`` view into that mapping: opening a 600 MB model costs a few page
faults, not 600 MB of reads. Nothing is allocated before it is checked against the
bytes that remain, so a hostile file can neither hang the reader nor make it allocate
more than its own bytes can back (every element it claims must be there; as Python
objects, the densest metadata costs a few times its size in the file); every failure
is a ``GGUFError`` naming what and where.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_NAME_BYTES = 64          # the spec's limit on a tensor name
MAX_DIMS = 4
MAX_ARRAY_NESTING = 8        # arrays of arrays are legal but rare; deeper is surely hostile


class GGUFError(ValueError):
    """A malformed or unsupported GGUF file. The message says what and where."""


class ValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# Little-endian numpy dtype of each scalar value type.
SCALAR_DTYPES = {
    ValueType.UINT8: np.dtype("<u1"), ValueType.INT8: np.dtype("<i1"),
    ValueType.UINT16: np.dtype("<u2"), ValueType.INT16: np.dtype("<i2"),
    ValueType.UINT32: np.dtype("<u4"), ValueType.INT32: np.dtype("<i4"),
    ValueType.FLOAT32: np.dtype("<f4"), ValueType.BOOL: np.dtype("<u1"),
    ValueType.UINT64: np.dtype("<u8"), ValueType.INT64: np.dtype("<i8"),
    ValueType.FLOAT64: np.dtype("<f8"),
}


class GGMLType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39


# (elements per block, bytes per block) from ggml's type traits.
# Ids 4, 5 (Q4_2/Q4_3) and 31-33, 36-38 (repacked layouts) were removed from ggml.
BLOCK_SIZES = {
    GGMLType.F32: (1, 4), GGMLType.F16: (1, 2), GGMLType.BF16: (1, 2),
    GGMLType.Q4_0: (32, 18), GGMLType.Q4_1: (32, 20),
    GGMLType.Q5_0: (32, 22), GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34), GGMLType.Q8_1: (32, 36),
    GGMLType.Q2_K: (256, 84), GGMLType.Q3_K: (256, 110), GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_K: (256, 176), GGMLType.Q6_K: (256, 210), GGMLType.Q8_K: (256, 292),
    GGMLType.IQ2_XXS: (256, 66), GGMLType.IQ2_XS: (256, 74), GGMLType.IQ3_XXS: (256, 98),
    GGMLType.IQ1_S: (256, 50), GGMLType.IQ4_NL: (32, 18), GGMLType.IQ3_S: (256, 110),
    GGMLType.IQ2_S: (256, 82), GGMLType.IQ4_XS: (256, 136), GGMLType.IQ1_M: (256, 56),
    GGMLType.I8: (1, 1), GGMLType.I16: (1, 2), GGMLType.I32: (1, 4), GGMLType.I64: (1, 8),
    GGMLType.F64: (1, 8), GGMLType.TQ1_0: (256, 54), GGMLType.TQ2_0: (256, 66),
    GGMLType.MXFP4: (32, 17),
}


def type_nbytes(ggml_type: GGMLType, shape) -> int:
    """Bytes of a tensor of this type and numpy-order shape (last axis = row)."""
    block, size = BLOCK_SIZES[GGMLType(ggml_type)]
    n = 1
    for d in shape:
        n *= int(d)
    if shape and int(shape[-1]) % block:
        raise GGUFError(f"row length {shape[-1]} is not a multiple of {GGMLType(ggml_type).name}'s block of {block}")
    return n // block * size


def align_up(offset: int, alignment: int) -> int:
    return offset + (-offset) % alignment


@dataclass
class TensorInfo:
    """One entry of the tensor table.

    shape is in numpy order (the reverse of GGUF's dims): a [out, in] weight has
    shape (out, in) and each of its `out` rows is `in` contiguous values.
    data is the tensor's raw bytes, a read-only uint8 view into the mapped file.
    """
    name: str
    shape: tuple
    ggml_type: GGMLType
    offset: int          # absolute byte offset in the file
    nbytes: int
    data: np.ndarray

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def dims(self) -> tuple:
        """GGUF's order: dims[0] is the row length."""
        return tuple(reversed(self.shape))

    @property
    def type_name(self) -> str:
        return self.ggml_type.name

    def rows(self) -> np.ndarray:
        """The raw bytes as [n_rows, bytes_per_row] (a view, no copy)."""
        n_rows = self.n_elements // self.shape[-1]
        return self.data.reshape(n_rows, self.nbytes // n_rows)


class _Cursor:
    """Bounds-checked little-endian reads over a memoryview."""

    def __init__(self, buf, pos: int = 0):
        self.buf = buf
        self.pos = pos
        self.end = len(buf)

    @property
    def remaining(self) -> int:
        return self.end - self.pos

    def need(self, n: int, what: str):
        if n < 0 or n > self.remaining:
            raise GGUFError(f"truncated file: {what} at byte {self.pos} needs {n} bytes, "
                            f"only {self.remaining} remain")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = struct.unpack_from("<I", self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = struct.unpack_from("<Q", self.buf, self.pos)
        self.pos += 8
        return v

    def raw(self, n: int, what: str) -> bytes:
        self.need(n, what)
        b = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return b

    def string(self, what: str) -> str:
        start = self.pos
        n = self.u64(f"length of {what}")
        if n > self.remaining:
            raise GGUFError(f"{what} at byte {start} claims {n} bytes, only {self.remaining} remain")
        # surrogateescape keeps any invalid UTF-8 byte recoverable (some vocabularies hold raw bytes);
        # decoding straight from the mapping skips an intermediate bytes copy
        s = str(self.buf[self.pos:self.pos + n], "utf-8", "surrogateescape")
        self.pos += n
        return s

    def array(self, dtype: np.dtype, count: int, what: str, copy: bool = True) -> np.ndarray:
        nbytes = count * dtype.itemsize
        if nbytes > self.remaining:
            raise GGUFError(f"{what} at byte {self.pos}: {count} elements of {dtype.itemsize} bytes "
                            f"need {nbytes}, only {self.remaining} remain")
        a = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
        if copy:        # metadata must not pin the mapping
            a = a.copy()
        self.pos += nbytes
        return a


# The fewest bytes one value of each type can occupy, for checking counts before allocating.
_MIN_VALUE_BYTES = {t: d.itemsize for t, d in SCALAR_DTYPES.items()}
_MIN_VALUE_BYTES[ValueType.STRING] = 8
_MIN_VALUE_BYTES[ValueType.ARRAY] = 12


def _value_type(code: int, where: str) -> ValueType:
    try:
        return ValueType(code)
    except ValueError:
        raise GGUFError(f"{where}: unknown value type {code} (known: 0..12)") from None


def _read_string_array(cur: _Cursor, count: int, key: str) -> list:
    """cur.string() in a tight loop: vocabularies hold ~50k-150k strings each."""
    buf, pos, end, out = cur.buf, cur.pos, cur.end, []
    unpack = struct.Struct("<Q").unpack_from
    for i in range(count):
        if pos + 8 > end:
            cur.pos = pos
            raise GGUFError(f"truncated file: length of element {i} of '{key}' at byte {pos}")
        (n,) = unpack(buf, pos)
        pos += 8
        if n > end - pos:
            raise GGUFError(f"element {i} of '{key}' at byte {pos - 8} claims {n} bytes, "
                            f"only {end - pos} remain")
        out.append(str(buf[pos:pos + n], "utf-8", "surrogateescape"))
        pos += n
    cur.pos = pos
    return out


def _read_value(cur: _Cursor, vtype: ValueType, key: str, depth: int = 0):
    """One metadata value. Numeric arrays become numpy arrays, string arrays lists of str."""
    if vtype == ValueType.STRING:
        return cur.string(f"string value of '{key}'")
    if vtype == ValueType.ARRAY:
        at = cur.pos
        etype = _value_type(cur.u32(f"element type of '{key}'"), f"array '{key}' at byte {at}")
        count = cur.u64(f"element count of '{key}'")
        if count * _MIN_VALUE_BYTES[etype] > cur.remaining:
            raise GGUFError(f"array '{key}' at byte {at} claims {count} {etype.name} elements; "
                            f"only {cur.remaining} bytes remain")
        if etype == ValueType.STRING:
            return _read_string_array(cur, count, key)
        if etype == ValueType.ARRAY:
            if depth + 1 >= MAX_ARRAY_NESTING:
                raise GGUFError(f"array '{key}' at byte {at} nests deeper than {MAX_ARRAY_NESTING} levels")
            return [_read_value(cur, etype, key, depth + 1) for _ in range(count)]
        if etype == ValueType.BOOL:     # any nonzero byte is true, as in gguf.cpp
            return cur.array(SCALAR_DTYPES[etype], count, f"array '{key}'", copy=False) != 0
        return cur.array(SCALAR_DTYPES[etype], count, f"array '{key}'")
    dtype = SCALAR_DTYPES[vtype]
    cur.need(dtype.itemsize, f"value of '{key}'")
    (v,) = np.frombuffer(cur.buf, dtype=dtype, count=1, offset=cur.pos)
    cur.pos += dtype.itemsize
    if vtype == ValueType.BOOL:
        return bool(v)
    return float(v) if vtype in (ValueType.FLOAT32, ValueType.FLOAT64) else int(v)


class GGUFFile:
    """A GGUF file, mapped read-only.

    .version, .alignment, .data_offset
    .metadata       dict key -> value (int, float, bool, str, list[str], numpy array, nested list)
    .metadata_types dict key -> ValueType (and, for arrays, .array_types key -> element ValueType)
    .tensors        dict name -> TensorInfo, in file order
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        try:
            with open(self.path, "rb") as f:
                self.file_size = os.fstat(f.fileno()).st_size
                if self.file_size == 0:
                    raise GGUFError(f"{self.path}: empty file, not a GGUF model")
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot open: {e.strerror or e}") from None
        try:
            self._buf = np.frombuffer(self._mmap, dtype=np.uint8)
            self._parse(memoryview(self._mmap))
        except GGUFError as e:
            self.close()
            raise GGUFError(f"{self.path}: {e}") from None

    # ---- parsing -------------------------------------------------------------------------
    def _parse(self, buf):
        """The file in its order: header, metadata, tensor infos, then each tensor checked."""
        cur = _Cursor(buf)
        n_tensors, n_kv = self._header(cur, buf)
        self._metadata(cur, buf, n_kv)
        infos = self._tensor_infos(cur, n_tensors)
        self.data_offset = align_up(cur.pos, self.alignment) if n_tensors else cur.pos
        if n_tensors and self.data_offset > self.file_size:
            raise GGUFError(f"data section would start at byte {self.data_offset}, past the end of the "
                            f"{self.file_size}-byte file")

        self.tensors = {}
        for name, dims, gtype, offset, at in infos:
            self.tensors[name] = self._check_tensor(name, dims, gtype, offset, at)
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.tensors.values())
        for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
            if s1 < e0:
                raise GGUFError(f"tensors '{n0}' (bytes {s0}..{e0}) and '{n1}' (bytes {s1}..{e1}) overlap")

    def _header(self, cur, buf) -> tuple[int, int]:
        """Magic and version checked (self.version); (tensor count, metadata count)."""
        magic = cur.raw(4, "magic") if len(buf) >= 4 else b""
        if magic != GGUF_MAGIC:
            raise GGUFError(f"bad magic {magic!r} at byte 0: not a GGUF file (expected b'GGUF')")
        version = cur.u32("version")
        if version == 0:
            raise GGUFError("version 0 at byte 4 is invalid")
        if version & 0xFFFF == 0:
            raise GGUFError(f"version field at byte 4 reads {version:#x}: the file is big-endian "
                            "(byte-swapped); only little-endian GGUF is supported")
        if version == 1:
            raise GGUFError("GGUF version 1 (32-bit counts and lengths) is no longer supported; "
                            "re-convert the model with a current llama.cpp")
        if version > 3:
            raise GGUFError(f"GGUF version {version} at byte 4 is newer than this reader (2 and 3)")
        self.version = version
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        # smallest possible kv: key length (8) + type (4) + 1-byte value; tensor info: 8+4+4+8
        if n_kv * 13 > cur.remaining:
            raise GGUFError(f"metadata count {n_kv} at byte 16 cannot fit in the {cur.remaining} bytes that remain")
        if n_tensors * 24 > cur.remaining:
            raise GGUFError(f"tensor count {n_tensors} at byte 8 cannot fit in the {cur.remaining} bytes that remain")
        return n_tensors, n_kv

    def _metadata(self, cur, buf, n_kv: int):
        """The n_kv key/value pairs (self.metadata, their types, arrays' element types) and the
        alignment they set."""
        self.metadata, self.metadata_types, self.array_types = {}, {}, {}
        for i in range(n_kv):
            at = cur.pos
            key = cur.string(f"key of metadata entry {i}")
            if not key:
                raise GGUFError(f"metadata entry {i} at byte {at} has an empty key")
            if key in self.metadata:
                raise GGUFError(f"duplicate metadata key '{key}' at byte {at}")
            vtype = _value_type(cur.u32(f"type of '{key}'"), f"metadata '{key}' at byte {at}")
            vat = cur.pos
            self.metadata[key] = _read_value(cur, vtype, key)
            self.metadata_types[key] = vtype
            if vtype == ValueType.ARRAY:
                self.array_types[key] = ValueType(struct.unpack_from("<I", buf, vat)[0])

        self.alignment = DEFAULT_ALIGNMENT
        if "general.alignment" in self.metadata:
            a = self.metadata["general.alignment"]
            if self.metadata_types["general.alignment"] != ValueType.UINT32:
                raise GGUFError("general.alignment must be a UINT32, found "
                                f"{self.metadata_types['general.alignment'].name}")
            if a == 0 or a & (a - 1):
                raise GGUFError(f"general.alignment = {a} is not a power of two")
            self.alignment = a

    def _tensor_infos(self, cur, n_tensors: int) -> list:
        """[(name, dims, ggml type, offset, byte of the info)] of the n_tensors infos, names unique."""
        infos = []
        names = set()
        for i in range(n_tensors):
            at = cur.pos
            name = cur.string(f"name of tensor {i}")
            if len(name.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
                raise GGUFError(f"tensor {i} at byte {at}: name longer than {MAX_NAME_BYTES} bytes")
            if name in names:
                raise GGUFError(f"duplicate tensor name '{name}' at byte {at}")
            names.add(name)
            n_dims = cur.u32(f"n_dims of tensor '{name}'")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFError(f"tensor '{name}' at byte {at}: n_dims = {n_dims}, must be 1..{MAX_DIMS}")
            dims = [cur.u64(f"dim {d} of tensor '{name}'") for d in range(n_dims)]
            code = cur.u32(f"type of tensor '{name}'")
            try:
                gtype = GGMLType(code)
            except ValueError:
                raise GGUFError(f"tensor '{name}' at byte {at}: unknown ggml type id {code}") from None
            offset = cur.u64(f"offset of tensor '{name}'")
            infos.append((name, dims, gtype, offset, at))
        return infos

    def _check_tensor(self, name, dims, gtype, offset, at) -> TensorInfo:
        where = f"tensor '{name}' (info at byte {at})"
        if any(d == 0 for d in dims):
            raise GGUFError(f"{where}: dims {dims} must all be positive")
        if any(d >= 2**62 for d in dims):
            raise GGUFError(f"{where}: dims {dims} are impossibly large")
        n = 1
        for d in dims:
            n *= d
            if n >= 2**62:
                raise GGUFError(f"{where}: element count of dims {dims} overflows")
        if gtype not in BLOCK_SIZES:
            raise GGUFError(f"{where}: ggml type {gtype.name} has no known block size")
        block, size = BLOCK_SIZES[gtype]
        if dims[0] % block:
            raise GGUFError(f"{where}: row length {dims[0]} is not a multiple of {gtype.name}'s "
                            f"block size {block}")
        nbytes = n // block * size
        if offset % self.alignment:
            raise GGUFError(f"{where}: offset {offset} is not a multiple of the alignment {self.alignment}")
        start = self.data_offset + offset
        if start + nbytes > self.file_size:
            raise GGUFError(f"{where}: {gtype.name} {list(dims)} needs bytes {start}..{start + nbytes}, "
                            f"past the end of the {self.file_size}-byte file")
        shape = tuple(int(d) for d in reversed(dims))
        return TensorInfo(name, shape, gtype, start, nbytes, self._buf[start:start + nbytes])

    # ---- conveniences -------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "")

    def get(self, key, default=None):
        return self.metadata.get(key, default)

    def release(self, tensor: TensorInfo):
        """Tell the OS this process is done with a tensor's mapped pages (madvise DONTNEED on the
        whole pages inside it): they leave its resident set and stay in the page cache, and are
        read back if the tensor is read again. For a stage that copied the tensor elsewhere."""
        page = mmap.PAGESIZE
        start = -(-tensor.offset // page) * page
        end = (tensor.offset + tensor.nbytes) // page * page
        if self._mmap is not None and end > start and hasattr(self._mmap, "madvise"):
            self._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self):
        """Drop the mapping. Tensor views handed out earlier keep it alive until they go."""
        self._buf = None
        self._mmap = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"GGUFFile({self.path!r}, v{self.version}, {len(self.metadata)} keys, "
                f"{len(self.tensors)} tensors)")


# ---- writing ---------------------------------------------------------------------------------

def _infer_type(value) -> ValueType:
    if isinstance(value, np.generic) and value.dtype in _NUMPY_TO_VALUE:
        return _NUMPY_TO_VALUE[value.dtype]     # a numpy scalar states its own width
    if isinstance(value, bool):
        return ValueType.BOOL
    if isinstance(value, int):
        if 0 <= value < 2**32:
            return ValueType.UINT32
        return ValueType.UINT64 if value >= 2**63 else ValueType.INT64
    if isinstance(value, float):
        return ValueType.FLOAT32
    if isinstance(value, str):
        return ValueType.STRING
    if isinstance(value, (list, tuple, np.ndarray)):
        return ValueType.ARRAY
    raise GGUFError(f"cannot store a {type(value).__name__} in GGUF metadata")


_NUMPY_TO_VALUE = {np.dtype(d): t for t, d in SCALAR_DTYPES.items() if t != ValueType.BOOL}
_NUMPY_TO_VALUE[np.dtype(bool)] = ValueType.BOOL


def _encode_numbers(value, vtype: ValueType) -> bytes:
    """A number or a sequence of numbers as vtype, refusing any that would not survive the trip."""
    dtype = SCALAR_DTYPES[vtype]
    try:
        enc = value.astype(dtype) if isinstance(value, np.ndarray) else np.array(value, dtype=dtype)
    except (OverflowError, ValueError, TypeError) as e:
        raise GGUFError(f"cannot store {_brief(value)} as {vtype.name}: {e}") from None
    # numpy's casts wrap integers and truncate floats without a word; compare exactly, as Python ints
    if dtype.kind in "iu":
        given = value.tolist() if isinstance(value, np.ndarray) else value
        if enc.tolist() != (list(given) if isinstance(given, tuple) else given):
            raise GGUFError(f"cannot store {_brief(value)} as {vtype.name}: out of range or not whole")
    return enc.tobytes()


def _brief(value) -> str:
    r = repr(value)
    return r if len(r) <= 60 else r[:57] + "..."


def _encode_string(s: str) -> bytes:
    if not isinstance(s, str):
        raise GGUFError(f"expected a str, got {_brief(s)}")
    b = s.encode("utf-8", errors="surrogateescape")
    return struct.pack("<Q", len(b)) + b


def _encode_value(value, vtype: ValueType, elem_type: ValueType | None = None) -> bytes:
    if vtype == ValueType.STRING:
        return _encode_string(value)
    if vtype == ValueType.ARRAY:
        if isinstance(value, np.ndarray) and value.ndim != 1:
            raise GGUFError(f"a metadata array must be 1-D (nest lists for more), not shape {value.shape}")
        if elem_type is None:
            if isinstance(value, np.ndarray):
                elem_type = _NUMPY_TO_VALUE.get(value.dtype.newbyteorder("<") if value.dtype.byteorder == ">"
                                                else value.dtype)
                if elem_type is None:
                    raise GGUFError(f"cannot store a numpy {value.dtype} array in GGUF metadata")
            elif len(value) == 0:
                elem_type = ValueType.UINT32
            else:
                elem_type = _infer_type(value[0])
                if elem_type == ValueType.UINT32 and any(int(v) < 0 for v in value):
                    elem_type = ValueType.INT32
        head = struct.pack("<IQ", elem_type, len(value))
        if elem_type == ValueType.STRING:
            return head + b"".join(_encode_string(s) for s in value)
        if elem_type == ValueType.ARRAY:
            return head + b"".join(_encode_value(v, ValueType.ARRAY) for v in value)
        if elem_type == ValueType.BOOL:
            return head + np.asarray(value).astype(bool).astype(SCALAR_DTYPES[elem_type]).tobytes()
        return head + _encode_numbers(value, elem_type)
    if vtype == ValueType.BOOL:
        return struct.pack("<B", 1 if value else 0)
    return _encode_numbers(value, vtype)


class GGUFWriter:
    """Writes a GGUF v3 file: metadata, then tensors at aligned offsets.

        w = GGUFWriter(path)
        w.add("general.architecture", "llama")                      # type inferred
        w.add("llama.rope.freq_base", 10000.0, ValueType.FLOAT32)   # or stated
        w.add_tensor("blk.0.attn_norm.weight", np.ones(576, np.float32))
        w.add_tensor("token_embd.weight", raw_uint8_blocks, GGMLType.Q4_1, shape=(49152, 576))
        w.write()

    Tensor data may also be a callable returning bytes, so a large file can be generated
    one tensor at a time without holding it all in memory.
    """

    def __init__(self, path, alignment: int = DEFAULT_ALIGNMENT):
        if not (isinstance(alignment, int) and 0 < alignment < 2**32 and alignment & (alignment - 1) == 0):
            raise GGUFError(f"alignment {alignment!r} must be a power of two that fits a UINT32")
        self.path = os.fspath(path)
        self.alignment = alignment
        self.kv = {}       # key -> (value, ValueType, element ValueType or None)
        self.tensors = []  # (name, shape, GGMLType, data or callable)
        if alignment != DEFAULT_ALIGNMENT:
            self.add("general.alignment", alignment, ValueType.UINT32)

    def add(self, key: str, value, vtype: ValueType | None = None, elem_type: ValueType | None = None):
        if key in self.kv:
            raise GGUFError(f"metadata key '{key}' added twice")
        if not key:
            raise GGUFError("metadata key must not be empty")
        vtype = _infer_type(value) if vtype is None else ValueType(vtype)
        try:    # encode once now, so a bad value fails here, naming its key, not later in write()
            _encode_value(value, vtype, elem_type)
        except GGUFError as e:
            raise GGUFError(f"metadata '{key}': {e}") from None
        self.kv[key] = (value, vtype, elem_type)

    def add_tensor(self, name: str, data, ggml_type: GGMLType | None = None, shape=None):
        """data: a float32/float16 array (type inferred), raw uint8 blocks with ggml_type and
        shape (numpy order), or a callable producing those raw bytes."""
        if ggml_type is None:
            arr = np.ascontiguousarray(data)
            ggml_type = {np.dtype(np.float32): GGMLType.F32, np.dtype(np.float16): GGMLType.F16}.get(arr.dtype)
            if ggml_type is None:
                raise GGUFError(f"tensor '{name}': give ggml_type for dtype {arr.dtype}")
            data, shape = arr, arr.shape
        if shape is None:
            raise GGUFError(f"tensor '{name}': raw data needs its shape")
        if any(t[0] == name for t in self.tensors):
            raise GGUFError(f"tensor '{name}' added twice")
        if len(name.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
            raise GGUFError(f"tensor name '{name}' is longer than {MAX_NAME_BYTES} bytes")
        if not 1 <= len(shape) <= MAX_DIMS:
            raise GGUFError(f"tensor '{name}': shape {tuple(shape)} must have 1..{MAX_DIMS} dimensions")
        if any(int(d) <= 0 for d in shape):
            raise GGUFError(f"tensor '{name}': shape {tuple(shape)} must be all positive")
        nbytes = type_nbytes(ggml_type, shape)
        if not callable(data) and np.asarray(data).nbytes != nbytes:
            raise GGUFError(f"tensor '{name}': {np.asarray(data).nbytes} bytes given, "
                            f"{GGMLType(ggml_type).name} {tuple(shape)} needs {nbytes}")
        self.tensors.append((name, tuple(int(s) for s in shape), GGMLType(ggml_type), data, nbytes))

    def write(self, progress=None):
        """progress: optional callable(n_bytes_written) called after each tensor."""
        header = [GGUF_MAGIC, struct.pack("<IQQ", 3, len(self.tensors), len(self.kv))]
        for key, (value, vtype, etype) in self.kv.items():
            header += [_encode_string(key), struct.pack("<I", vtype), _encode_value(value, vtype, etype)]
        offset = 0
        for name, shape, gtype, _, nbytes in self.tensors:
            dims = list(reversed(shape))
            header += [_encode_string(name), struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, gtype, offset)]
            offset = align_up(offset + nbytes, self.alignment)
        head = b"".join(header)
        tmp = self.path + ".part"
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(b"\0" * ((-len(head)) % self.alignment))
                for name, shape, gtype, data, nbytes in self.tensors:
                    raw = data() if callable(data) else data
                    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
                    if raw.nbytes != nbytes:
                        raise GGUFError(f"tensor '{name}': generator gave {raw.nbytes} bytes, expected {nbytes}")
                    f.write(raw.data)
                    f.write(b"\0" * ((-nbytes) % self.alignment))
                    if progress:
                        progress(nbytes)
        except BaseException:   # a half-written file must not be mistaken for a model later
            os.unlink(tmp)
            raise
        os.replace(tmp, self.path)
