"""common/gguf.py: right on real models, round-trips through the writer, and safe on hostile files.

Oracle: gguf-py's GGUFReader (PyPI gguf 0.19.0), written by llama.cpp's authors. Every metadata
field and every tensor (name, shape, type, offset, size, bytes) must agree with it.
Hostile files: every validation rule gets a handcrafted file that breaks just that rule, and a
seeded mutation run (LLM_FUZZ_CASES adds random cases) checks that any damage to a small valid
file ends in a GGUFError, never another exception, a hang, or an allocation the file cannot back.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import gguf as gguf_py  # the oracle; pinned in requirements-test.txt, so missing it is an error, not a skip
import numpy as np
import pytest

from common.gguf import (
    BLOCK_SIZES,
    MAX_ARRAY_NESTING,
    SCALAR_DTYPES,
    GGMLType,
    GGUFError,
    GGUFFile,
    GGUFWriter,
    ValueType,
    align_up,
    type_nbytes,
)

ROOT = Path(__file__).resolve().parent.parent
# Allocation slack for one open beyond the file's own size: the parser's dicts, a few numpy
# views, an exception and its message. Hostile counts must never get past this.
ALLOC_SLACK = 64 * 1024


# ---- comparing with gguf-py ------------------------------------------------------------------

def _as_bytes(s: str) -> bytes:
    """Our strings back to the file's bytes (invalid UTF-8 survives as surrogate escapes)."""
    return s.encode("utf-8", "surrogateescape")


def _flatten(value) -> list:
    """Our (possibly nested) array value as a flat list of leaves, as gguf-py presents it."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list):
        return [leaf for v in value for leaf in (_flatten(v) if isinstance(v, (list, np.ndarray)) else [v])]
    return [value]


def _theirs_value(field):
    """A gguf-py ReaderField's value: bytes for strings, a flat list for arrays, else a scalar."""
    if field.types[0] == gguf_py.GGUFValueType.ARRAY:
        parts = [field.parts[i] for i in field.data]
        if field.types[-1] == gguf_py.GGUFValueType.STRING:
            return [bytes(p) for p in parts]
        return [x for p in parts for x in p.tolist()]
    if field.types[0] == gguf_py.GGUFValueType.STRING:
        return bytes(field.parts[-1])
    return field.parts[-1][0].item()


def _same_values(a: list, b: list) -> bool:
    """Element-wise ==, except that NaN equals NaN (a mutated float can be one)."""
    return len(a) == len(b) and all(x == y or (x != x and y != y) for x, y in zip(a, b))


def assert_metadata_matches(ours: GGUFFile, theirs):
    their_keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert list(ours.metadata) == their_keys
    assert ours.version == int(theirs.fields["GGUF.version"].parts[0][0])
    assert ours.alignment == theirs.alignment
    for key, value in ours.metadata.items():
        field = theirs.fields[key]
        vtype = ours.metadata_types[key]
        assert vtype.value == field.types[0].value, key
        expected = _theirs_value(field)
        if vtype == ValueType.STRING:
            assert _as_bytes(value) == expected, key
        elif vtype == ValueType.ARRAY:
            if len(field.types) > 1:       # gguf-py records no element type for an empty array
                assert ours.array_types[key].value == field.types[1].value, key
            leaves = _flatten(value)
            if field.types[-1] == gguf_py.GGUFValueType.STRING:
                leaves = [_as_bytes(s) for s in leaves]
            assert _same_values(leaves, expected), key
            if isinstance(value, np.ndarray):
                want = np.dtype(bool) if ours.array_types[key] == ValueType.BOOL else \
                    SCALAR_DTYPES[ours.array_types[key]]
                assert value.dtype == want, key
        else:
            assert type(value) is {ValueType.BOOL: bool, ValueType.FLOAT32: float,
                                   ValueType.FLOAT64: float}.get(vtype, int), key
            assert _same_values([value], [expected]), key


def assert_tensors_match(ours: GGUFFile, theirs):
    assert [t.name for t in ours.tensors.values()] == [t.name for t in theirs.tensors]
    if ours.tensors:    # with no tensors gguf.cpp (and we) skip the padding, gguf-py pads anyway
        assert ours.data_offset == theirs.data_offset
    for t, r in zip(ours.tensors.values(), theirs.tensors):
        assert t.shape == tuple(reversed(r.shape.tolist())), t.name
        assert t.dims == tuple(r.shape.tolist()), t.name
        assert t.ggml_type.value == r.tensor_type.value, t.name
        assert t.offset == r.data_offset, t.name
        if t.ggml_type == GGMLType.Q8_1:
            continue    # gguf-py's Q8_1 block size is stale (see test_block_sizes_agree_with_gguf_py)
        assert t.nbytes == r.n_bytes == t.data.nbytes, t.name
        assert t.n_elements == r.n_elements, t.name
        assert np.array_equal(t.data, np.ascontiguousarray(r.data).reshape(-1).view(np.uint8)), t.name


# ---- the real models ------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["smollm2", "tinyllama-synthetic"])
def model_pair(request):
    """(our GGUFFile, gguf-py's GGUFReader) on one model, opened once per module (gguf-py takes seconds)."""
    if request.param == "smollm2":
        path = request.getfixturevalue("default_model_path")
    else:
        from app.models import fetch  # writes the synthetic model on first use
        path = fetch(request.param)
    ours = GGUFFile(path)
    theirs = gguf_py.GGUFReader(path)
    yield ours, theirs
    ours.close()


def test_model_metadata_matches_gguf_py(model_pair):
    ours, theirs = model_pair
    assert_metadata_matches(ours, theirs)
    assert ours.architecture == "llama"


def test_model_tensors_match_gguf_py(model_pair):
    ours, theirs = model_pair
    assert len(ours.tensors) > 0
    assert_tensors_match(ours, theirs)


def test_model_tensor_data_are_readonly_views_into_the_file(model_pair):
    ours, _ = model_pair
    for t in ours.tensors.values():
        assert t.data.dtype == np.uint8 and t.data.ndim == 1
        assert not t.data.flags.writeable and not t.data.flags.owndata, t.name
        assert (t.offset - ours.data_offset) % ours.alignment == 0, t.name
        assert t.rows().shape[0] * t.rows().shape[1] == t.nbytes


def test_opening_default_model_copies_no_tensor_data(default_model_path):
    """Zero-copy: the metadata (a ~49k-token vocabulary) is parsed, the 90+ MB of weights are not read."""
    size = default_model_path.stat().st_size
    tracemalloc.start()
    try:
        with GGUFFile(default_model_path) as g:
            _, peak = tracemalloc.get_traced_memory()
            n = len(g.tensors)
    finally:
        tracemalloc.stop()
    assert n > 0
    assert peak < size / 4, f"opening allocated {peak} bytes for a {size}-byte file"


def test_block_sizes_agree_with_gguf_py():
    known = gguf_py.GGML_QUANT_SIZES
    compared = 0
    for gtype, sizes in BLOCK_SIZES.items():
        their_type = gguf_py.GGMLQuantizationType(gtype.value)
        assert their_type.name == gtype.name
        if gtype == GGMLType.Q8_1:
            # ggml-common.h's block_q8_1 is two fp16 + 32 int8 = 36 bytes; gguf-py 0.19.0 still
            # lists the old float32 layout (40). ggml is the authority on its own struct.
            assert sizes == (32, 36)
            continue
        assert sizes == known[their_type], gtype.name
        compared += 1
    assert compared == len(BLOCK_SIZES) - 1


# ---- hand-built files -------------------------------------------------------------------------

def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def gstr(s: str | bytes) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else s
    return u64(len(b)) + b


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return gstr(key) + u32(vtype) + payload


def kv_u32(key: str, v: int) -> bytes:
    return kv(key, ValueType.UINT32, u32(v))


def arr(etype: int, count: int, payload: bytes) -> bytes:
    """An ARRAY value's bytes (after its own value type)."""
    return u32(etype) + u64(count) + payload


def tinfo(name: str | bytes, dims, gtype: int = GGMLType.F32, offset: int = 0, n_dims: int | None = None) -> bytes:
    return (gstr(name) + u32(len(dims) if n_dims is None else n_dims) + b"".join(u64(d) for d in dims)
            + u32(gtype) + u64(offset))


def gguf_bytes(kvs=(), tensors=(), data: bytes = b"", *, version: int = 3, n_kv: int | None = None,
               n_tensors: int | None = None, alignment: int = 32) -> bytes:
    """A GGUF file from parts; counts default to the parts given, padding as the format says."""
    head = (b"GGUF" + u32(version) + u64(len(tensors) if n_tensors is None else n_tensors)
            + u64(len(kvs) if n_kv is None else n_kv))
    body = head + b"".join(kvs) + b"".join(tensors)
    if tensors:
        body += b"\0" * (-len(body) % alignment)
    return body + data


# A valid file (checked below); most validation cases are it with one thing broken, the rest
# are a minimal file holding just the broken part.
F32x4 = np.arange(4, dtype=np.float32).tobytes()
BASE_KVS = (kv("general.architecture", ValueType.STRING, gstr("llama")),
            kv_u32("llama.block_count", 1))
BASE_TENSORS = (tinfo("w", [4]),)


def write(tmp_path: Path, blob: bytes, name: str = "t.gguf") -> Path:
    p = tmp_path / name
    p.write_bytes(blob)
    return p


def open_bounded(path: Path) -> GGUFFile:
    """GGUFFile(path), asserting it allocates no more than the file's size plus ALLOC_SLACK."""
    size = path.stat().st_size
    tracemalloc.start()
    try:
        try:
            return GGUFFile(path)
        finally:
            _, peak = tracemalloc.get_traced_memory()
            assert peak <= size + ALLOC_SLACK, f"open allocated {peak} bytes for a {size}-byte file"
    finally:
        tracemalloc.stop()


def expect_error(tmp_path: Path, blob: bytes, match: str) -> str:
    p = write(tmp_path, blob)
    with pytest.raises(GGUFError, match=match) as e:
        open_bounded(p)
    msg = str(e.value)
    assert msg.startswith(str(p)), "the message should name the file"
    assert "\n" not in msg
    return msg


def test_handmade_base_file_is_valid_for_us_and_gguf_py(tmp_path):
    p = write(tmp_path, gguf_bytes(BASE_KVS, BASE_TENSORS, F32x4))
    with open_bounded(p) as g:
        assert g.metadata == {"general.architecture": "llama", "llama.block_count": 1}
        assert np.array_equal(g.tensors["w"].data.view(np.float32), np.arange(4))
        theirs = gguf_py.GGUFReader(p)
        assert_metadata_matches(g, theirs)
        assert_tensors_match(g, theirs)


def test_version_2_is_read_like_version_3(tmp_path):
    p = write(tmp_path, gguf_bytes(BASE_KVS, BASE_TENSORS, F32x4, version=2))
    with open_bounded(p) as g:
        assert g.version == 2 and list(g.tensors) == ["w"]


def test_file_without_tensors_may_end_right_after_metadata(tmp_path):
    """Vocab-only files: no tensors, no padding, the file ends after the last value."""
    blob = gguf_bytes(BASE_KVS)
    with open_bounded(write(tmp_path, blob)) as g:
        assert g.tensors == {} and g.data_offset == len(blob)


def test_invalid_utf8_strings_survive_byte_for_byte(tmp_path):
    raw = b"ok \xff\xfe \xc3"
    blob = gguf_bytes([kv("s", ValueType.STRING, gstr(raw)),
                       kv("a", ValueType.ARRAY, arr(ValueType.STRING, 2, gstr(raw) + gstr(b"\x80")))])
    with open_bounded(write(tmp_path, blob)) as g:
        assert _as_bytes(g.metadata["s"]) == raw
        assert [_as_bytes(s) for s in g.metadata["a"]] == [raw, b"\x80"]


def test_bool_bytes_other_than_0_and_1_read_as_true(tmp_path):
    """The spec says 0 or 1; gguf.cpp takes any nonzero byte as true, and so do we."""
    blob = gguf_bytes([kv("b", ValueType.BOOL, b"\x02"),
                       kv("bs", ValueType.ARRAY, arr(ValueType.BOOL, 3, b"\x00\x01\xff"))])
    with open_bounded(write(tmp_path, blob)) as g:
        assert g.metadata["b"] is True
        assert g.metadata["bs"].dtype == bool and g.metadata["bs"].tolist() == [False, True, True]


def test_nested_arrays_up_to_the_limit_read_like_gguf_py(tmp_path):
    value = arr(ValueType.INT16, 2, struct.pack("<2h", -1, 7))
    for _ in range(MAX_ARRAY_NESTING - 1):
        value = arr(ValueType.ARRAY, 1, value)
    p = write(tmp_path, gguf_bytes([kv("deep", ValueType.ARRAY, value)]))
    with open_bounded(p) as g:
        v = g.metadata["deep"]
        for _ in range(MAX_ARRAY_NESTING - 1):
            assert isinstance(v, list) and len(v) == 1
            v = v[0]
        assert v.tolist() == [-1, 7]
        assert_metadata_matches(g, gguf_py.GGUFReader(p))


# One case per rule: (id, file bytes, regex the message must match: it names the thing).
def _nested(levels: int) -> bytes:
    value = arr(ValueType.UINT8, 1, b"\x01")
    for _ in range(levels - 1):
        value = arr(ValueType.ARRAY, 1, value)
    return value


def _alignment_case(vtype: int, payload: bytes) -> bytes:
    return gguf_bytes(BASE_KVS + (kv("general.alignment", vtype, payload),), BASE_TENSORS, F32x4)


_BASE_HEAD = gguf_bytes(BASE_KVS, BASE_TENSORS, F32x4)
INVALID = [
    ("empty file", b"", r"empty file"),
    ("shorter than magic", b"GG", r"magic"),
    ("bad magic", b"GGUG" + _BASE_HEAD[4:], r"magic b'GGUG'"),
    ("not gguf at all", b"#!/bin/sh\necho hello\n" * 4, r"magic"),
    ("byte-swapped magic", b"FUGG" + _BASE_HEAD[4:], r"magic"),
    ("truncated version", b"GGUF\x03\x00", r"version"),
    ("version 0", gguf_bytes(BASE_KVS, BASE_TENSORS, F32x4, version=0), r"version 0"),
    ("version 1", gguf_bytes(BASE_KVS, BASE_TENSORS, F32x4, version=1), r"version 1"),
    ("version 4", gguf_bytes(BASE_KVS, BASE_TENSORS, F32x4, version=4), r"version 4"),
    ("version 0xffff", gguf_bytes(BASE_KVS, BASE_TENSORS, F32x4, version=0xFFFF), r"version 65535"),
    ("big-endian v3", gguf_bytes(BASE_KVS, BASE_TENSORS, F32x4, version=0x03000000), r"big-endian"),
    ("big-endian v2", gguf_bytes(BASE_KVS, BASE_TENSORS, F32x4, version=0x02000000), r"big-endian"),
    ("truncated counts", _BASE_HEAD[:20], r"truncated.*metadata count"),
    ("kv count too large", gguf_bytes(BASE_KVS, BASE_TENSORS, F32x4, n_kv=2**40), r"metadata count 1099511627776"),
    ("kv count u64 max", gguf_bytes(BASE_KVS, BASE_TENSORS, F32x4, n_kv=2**64 - 1), r"metadata count"),
    ("kv count one too many", gguf_bytes(BASE_KVS, (), n_kv=3), r"metadata entry 2"),
    ("tensor count too large", gguf_bytes(BASE_KVS, BASE_TENSORS, F32x4, n_tensors=2**40), r"tensor count"),
    ("tensor count u64 max", gguf_bytes(BASE_KVS, BASE_TENSORS, F32x4, n_tensors=2**64 - 1), r"tensor count"),
    ("tensor count one too many", gguf_bytes(BASE_KVS, n_tensors=2) + BASE_TENSORS[0], r"name of tensor 1"),
    ("key length past end", gguf_bytes([u64(1000) + b"general"]), r"key of metadata entry 0.*1000"),
    ("key length u64 max", gguf_bytes([u64(2**64 - 1) + b"general"]), r"key of metadata entry 0"),
    ("string value past end", gguf_bytes([kv("s", ValueType.STRING, u64(2**40) + b"abc")]),
     r"string value of 's'.*1099511627776"),
    ("string element past end",
     gguf_bytes([kv("toks", ValueType.ARRAY, arr(ValueType.STRING, 2, gstr("a") + u64(99) + b"b"))]),
     r"element 1 of 'toks'"),
    ("tensor name past end", gguf_bytes(BASE_KVS, [u64(2**33) + b"w"], n_tensors=1), r"name of tensor 0"),
    ("array count past end", gguf_bytes([kv("a", ValueType.ARRAY, arr(ValueType.UINT32, 2**40, u32(1)))]),
     r"array 'a'.*1099511627776"),
    ("array count overflows u64 bytes", gguf_bytes([kv("a", ValueType.ARRAY, arr(ValueType.FLOAT64, 2**62, u64(0)))]),
     r"array 'a'"),
    ("string array count past end", gguf_bytes([kv("a", ValueType.ARRAY, arr(ValueType.STRING, 2**61, gstr("x")))]),
     r"array 'a'"),
    ("nested array count past end", gguf_bytes([kv("a", ValueType.ARRAY, arr(ValueType.ARRAY, 2**50, _nested(1)))]),
     r"array 'a'"),
    ("array count one too many", gguf_bytes([kv("a", ValueType.ARRAY, arr(ValueType.UINT32, 3, u32(1) + u32(2)))]),
     r"array 'a'"),
    ("unknown value type 13", gguf_bytes([kv("k", 13, u32(0))]), r"'k'.*unknown value type 13"),
    ("unknown value type 2**31", gguf_bytes([kv("k", 2**31, u32(0))]), r"'k'.*unknown value type 2147483648"),
    ("unknown array element type", gguf_bytes([kv("a", ValueType.ARRAY, arr(99, 1, u32(0)))]),
     r"array 'a'.*unknown value type 99"),
    ("truncated scalar value", gguf_bytes([kv("k", ValueType.UINT64, b"\0\0\0")]), r"value of 'k'"),
    ("removed ggml type 4", gguf_bytes(BASE_KVS, [tinfo("w", [32], 4)], b"\0" * 32), r"'w'.*unknown ggml type id 4"),
    ("removed ggml type 31", gguf_bytes(BASE_KVS, [tinfo("w", [4], 31)], F32x4), r"'w'.*unknown ggml type id 31"),
    ("ggml type past the table", gguf_bytes(BASE_KVS, [tinfo("w", [4], 2**32 - 1)], F32x4),
     r"unknown ggml type id 4294967295"),
    ("n_dims 0", gguf_bytes(BASE_KVS, [tinfo("w", [])], F32x4), r"'w'.*n_dims = 0"),
    ("n_dims 5", gguf_bytes(BASE_KVS, [tinfo("w", [4, 1, 1, 1, 1])], F32x4), r"'w'.*n_dims = 5"),
    ("n_dims huge", gguf_bytes(BASE_KVS, [tinfo("w", [4], n_dims=2**32 - 1)], F32x4), r"'w'.*n_dims = 4294967295"),
    ("zero dim", gguf_bytes(BASE_KVS, [tinfo("w", [4, 0])], F32x4), r"'w'.*positive"),
    ("truncated dims", gguf_bytes(BASE_KVS, [gstr("w") + u32(2) + u64(4)], n_tensors=1), r"dim 1 of tensor 'w'"),
    ("row not whole blocks", gguf_bytes(BASE_KVS, [tinfo("w", [48, 2], GGMLType.Q4_0)], b"\0" * 64),
     r"'w'.*row length 48.*Q4_0.*32"),
    ("row not whole K blocks", gguf_bytes(BASE_KVS, [tinfo("w", [128], GGMLType.Q4_K)], b"\0" * 160),
     r"'w'.*row length 128.*Q4_K.*256"),
    ("offset not aligned", gguf_bytes(BASE_KVS, [tinfo("w", [4], offset=4)], F32x4 * 2),
     r"'w'.*offset 4.*alignment 32"),
    ("tensor past end of file", gguf_bytes(BASE_KVS, [tinfo("w", [8])], F32x4), r"'w'.*past the end"),
    ("tensor offset far past end", gguf_bytes(BASE_KVS, [tinfo("w", [4], offset=2**63)], F32x4), r"'w'.*past the end"),
    ("data section past end", gguf_bytes(BASE_KVS + (kv_u32("general.alignment", 2**20),), BASE_TENSORS),
     r"data section"),
    ("overlapping tensors", gguf_bytes(BASE_KVS, [tinfo("a", [16]), tinfo("b", [16], offset=32)], b"\0" * 96),
     r"'a'.*'b'.*overlap"),
    ("tensors at the same offset", gguf_bytes(BASE_KVS, [tinfo("a", [4]), tinfo("b", [4])], F32x4), r"overlap"),
    ("duplicate key", gguf_bytes(BASE_KVS + (kv_u32("llama.block_count", 2),)),
     r"duplicate metadata key 'llama.block_count'"),
    ("duplicate tensor name", gguf_bytes(BASE_KVS, [tinfo("w", [4]), tinfo("w", [4], offset=32)], F32x4 + b"\0" * 32),
     r"duplicate tensor name 'w'"),
    ("empty key", gguf_bytes(BASE_KVS + (kv("", ValueType.UINT8, b"\1"),)), r"metadata entry 2.*empty key"),
    ("tensor name too long", gguf_bytes(BASE_KVS, [tinfo("w" * 65, [4])], F32x4), r"tensor 0.*name longer than 64"),
    ("alignment 0", _alignment_case(ValueType.UINT32, u32(0)), r"general.alignment = 0.*power of two"),
    ("alignment 48", _alignment_case(ValueType.UINT32, u32(48)), r"general.alignment = 48.*power of two"),
    ("alignment 2**32-1", _alignment_case(ValueType.UINT32, u32(2**32 - 1)), r"power of two"),
    ("alignment as UINT64", _alignment_case(ValueType.UINT64, u64(32)), r"general.alignment.*UINT32.*UINT64"),
    ("alignment as INT32", _alignment_case(ValueType.INT32, u32(32)), r"general.alignment.*UINT32.*INT32"),
    ("alignment as STRING", _alignment_case(ValueType.STRING, gstr("32")), r"general.alignment.*UINT32.*STRING"),
    ("alignment as ARRAY", _alignment_case(ValueType.ARRAY, arr(ValueType.UINT32, 1, u32(32))),
     r"general.alignment.*ARRAY"),
    ("nested array too deep", gguf_bytes([kv("deep", ValueType.ARRAY, _nested(MAX_ARRAY_NESTING + 1))]),
     r"'deep'.*nests deeper than 8"),
    ("element count overflows", gguf_bytes(BASE_KVS, [tinfo("w", [2**32, 2**32])], F32x4), r"'w'.*overflow"),
    ("element count overflows 4-d", gguf_bytes(BASE_KVS, [tinfo("w", [2**16] * 4)], F32x4), r"'w'.*overflow"),
    ("dim beyond int64", gguf_bytes(BASE_KVS, [tinfo("w", [2**64 - 1])], F32x4), r"'w'.*large"),
]


@pytest.mark.parametrize("blob, match", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_file_raises_gguf_error_naming_the_problem(tmp_path, blob, match):
    expect_error(tmp_path, blob, match)


def test_error_messages_give_the_byte_offset(tmp_path):
    first = BASE_KVS[0]
    msg = expect_error(tmp_path, gguf_bytes((first, first)), r"duplicate")
    assert f"at byte {24 + len(first)}" in msg
    kvs = BASE_KVS + (kv("k", 42, u32(0)),)
    msg = expect_error(tmp_path, gguf_bytes(kvs), r"unknown value type 42")
    assert f"at byte {24 + len(BASE_KVS[0]) + len(BASE_KVS[1])}" in msg


def test_gguf_error_is_a_value_error():
    assert issubclass(GGUFError, ValueError)


def test_unreadable_paths_raise_gguf_error(tmp_path):
    with pytest.raises(GGUFError, match="cannot open"):
        GGUFFile(tmp_path / "missing.gguf")
    with pytest.raises(GGUFError, match="cannot open"):
        GGUFFile(tmp_path)


# ---- the writer ----------------------------------------------------------------------------

INT_LIMITS = {ValueType.UINT8: (0, 255), ValueType.INT8: (-128, 127), ValueType.UINT16: (0, 65535),
              ValueType.INT16: (-32768, 32767), ValueType.UINT32: (0, 2**32 - 1),
              ValueType.INT32: (-2**31, 2**31 - 1), ValueType.UINT64: (0, 2**64 - 1),
              ValueType.INT64: (-2**63, 2**63 - 1)}
NON_ASCII = "naïve café — 日本語 🦙 \u0000 end"


def _all_value_kinds() -> dict:
    """key -> (value, ValueType or None to infer, element ValueType or None, expected value)."""
    cases = {}
    for vt, (lo, hi) in INT_LIMITS.items():
        cases[f"scalar.{vt.name.lower()}.min"] = (lo, vt, None, lo)
        cases[f"scalar.{vt.name.lower()}.max"] = (hi, vt, None, hi)
    cases["scalar.float32"] = (0.15625, ValueType.FLOAT32, None, 0.15625)
    cases["scalar.float32.rounded"] = (0.1, ValueType.FLOAT32, None, float(np.float32(0.1)))
    cases["scalar.float64"] = (0.1, ValueType.FLOAT64, None, 0.1)
    cases["scalar.bool.true"] = (True, ValueType.BOOL, None, True)
    cases["scalar.bool.false"] = (False, None, None, False)
    cases["string.ascii"] = ("llama", None, None, "llama")
    cases["string.non_ascii"] = (NON_ASCII, ValueType.STRING, None, NON_ASCII)
    cases["string.empty"] = ("", None, None, "")
    cases["inferred.int"] = (7, None, None, 7)
    cases["inferred.negative"] = (-7, None, None, -7)
    cases["inferred.big"] = (2**40, None, None, 2**40)
    cases["inferred.float"] = (1.5, None, None, 1.5)
    for vt, dtype in SCALAR_DTYPES.items():
        if vt == ValueType.BOOL:
            continue
        lo, hi = INT_LIMITS.get(vt, (-1.5, 2.25))
        a = np.array([lo, 0, hi, 1], dtype=dtype)
        cases[f"array.numpy.{vt.name.lower()}"] = (a, None, None, a)
        cases[f"array.list.{vt.name.lower()}"] = (a.tolist(), ValueType.ARRAY, vt, a)
    cases["array.bool"] = ([True, False, True], None, None, np.array([True, False, True]))
    cases["array.strings"] = (["a", NON_ASCII, "", "<|im_end|>"], None, None, ["a", NON_ASCII, "", "<|im_end|>"])
    cases["array.empty"] = ([], None, None, np.array([], dtype=np.uint32))
    cases["array.empty.float32"] = ([], ValueType.ARRAY, ValueType.FLOAT32, np.array([], dtype=np.float32))
    cases["array.ints.inferred"] = ([3, 1, 2], None, None, np.array([3, 1, 2], dtype=np.uint32))
    cases["array.negative.inferred"] = ([3, -1], None, None, np.array([3, -1], dtype=np.int32))
    nested = [np.array([1, 2], np.int32), np.array([], np.int32), np.array([-3], np.int32)]
    cases["array.nested"] = (nested, None, None, nested)
    cases["array.nested.strings"] = ([["x", "y"], [NON_ASCII]], None, None, [["x", "y"], [NON_ASCII]])
    cases["array.nested.deeper"] = ([[[1.5], [2.5, 3.5]]], None, None, [[np.array([1.5], np.float32),
                                                                        np.array([2.5, 3.5], np.float32)]])
    return cases


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and np.array_equal(a, b))
    if isinstance(a, list) or isinstance(b, list):
        return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def _tensor_cases(rng) -> list:
    """(name, data for add_tensor, ggml_type or None, shape or None, expected raw bytes, numpy shape)."""
    out = []
    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    out.append(("f32.2d", f32, None, None, f32.tobytes(), (3, 5)))
    f32_1 = rng.standard_normal(7).astype(np.float32)
    out.append(("f32.1d", f32_1, None, None, f32_1.tobytes(), (7,)))
    f16 = rng.standard_normal((2, 3, 4)).astype(np.float16)
    out.append(("f16.3d", f16, None, None, f16.tobytes(), (2, 3, 4)))
    f32_4 = rng.standard_normal((2, 1, 3, 2)).astype(np.float32)
    out.append(("f32.4d", f32_4, None, None, f32_4.tobytes(), (2, 1, 3, 2)))
    f32_t = np.asfortranarray(rng.standard_normal((4, 6)).astype(np.float32))
    out.append(("f32.fortran", f32_t, None, None, np.ascontiguousarray(f32_t).tobytes(), (4, 6)))
    for gtype, shape in [(GGMLType.Q4_0, (3, 64)), (GGMLType.Q8_0, (2, 32)), (GGMLType.Q4_1, (1, 32)),
                         (GGMLType.Q4_K, (2, 256)), (GGMLType.Q6_K, (1, 2, 512)), (GGMLType.I32, (5,)),
                         (GGMLType.BF16, (2, 8))]:
        raw = rng.integers(0, 256, type_nbytes(gtype, shape), dtype=np.uint8)
        out.append((f"raw.{gtype.name.lower()}", raw, gtype, shape, raw.tobytes(), shape))
    return out


@pytest.mark.parametrize("alignment", [32, 1, 8, 64, 4096])
def test_writer_round_trip_through_both_readers(tmp_path, alignment):
    rng = np.random.default_rng(alignment)
    path = tmp_path / "rt.gguf"
    w = GGUFWriter(path, alignment=alignment)
    kinds = _all_value_kinds()
    for key, (value, vtype, etype, _) in kinds.items():
        w.add(key, value, vtype, etype)
    tensors = _tensor_cases(rng)
    for name, data, gtype, shape, _, _ in tensors:
        w.add_tensor(name, data, gtype, shape)
    w.write()
    assert not path.with_name(path.name + ".part").exists()

    with GGUFFile(path) as g:
        for key, (_, vtype, etype, expected) in kinds.items():
            assert _same(g.metadata[key], expected), (key, g.metadata[key], expected)
            if vtype is not None:
                assert g.metadata_types[key] == vtype, key
            if etype is not None:
                assert g.array_types[key] == etype, key
        assert g.alignment == alignment
        assert ("general.alignment" in g.metadata) == (alignment != 32)
        assert g.data_offset % alignment == 0
        expected_offset = 0
        for name, _, _, _, raw, shape in tensors:
            t = g.tensors[name]
            assert t.shape == shape and t.data.tobytes() == raw, name
            # gguf.cpp is stricter than alignment: offsets must be the running sum of padded sizes.
            assert t.offset - g.data_offset == expected_offset, name
            expected_offset = align_up(expected_offset + t.nbytes, alignment)
        assert g.file_size == g.data_offset + expected_offset
        theirs = gguf_py.GGUFReader(path)
        assert_metadata_matches(g, theirs)
        assert_tensors_match(g, theirs)


def test_writer_inferred_types(tmp_path):
    path = tmp_path / "infer.gguf"
    w = GGUFWriter(path)
    for key, value in {"u": 1, "neg": -1, "big": 2**40, "huge": 2**63, "f": 1.0, "b": True, "s": "x",
                       "strs": ["x"], "i8": np.array([1], np.int8), "bools": np.array([True]),
                       "np.f32": np.float32(0.5), "np.f64": np.float64(0.1), "np.i16": np.int16(-3)}.items():
        w.add(key, value)
    w.write()
    with GGUFFile(path) as g:
        t, a = g.metadata_types, g.array_types
        assert (t["u"], t["neg"], t["big"], t["huge"]) == (ValueType.UINT32, ValueType.INT64,
                                                          ValueType.INT64, ValueType.UINT64)
        assert g.metadata["huge"] == 2**63
        assert (t["f"], t["b"], t["s"]) == (ValueType.FLOAT32, ValueType.BOOL, ValueType.STRING)
        assert (a["strs"], a["i8"], a["bools"]) == (ValueType.STRING, ValueType.INT8, ValueType.BOOL)
        # a numpy scalar keeps its own width
        assert (t["np.f32"], t["np.f64"], t["np.i16"]) == (ValueType.FLOAT32, ValueType.FLOAT64, ValueType.INT16)
        assert (g.metadata["np.f64"], g.metadata["np.i16"]) == (0.1, -3)


def test_writer_streams_tensors_from_callables(tmp_path):
    path = tmp_path / "lazy.gguf"
    w = GGUFWriter(path)
    w.add_tensor("bytes", lambda: b"\1\0\0\0" * 32, GGMLType.I32, shape=(4, 8))
    w.add_tensor("blocks", lambda: np.full(36, 7, np.uint8), GGMLType.Q4_0, shape=(64,))
    seen = []
    w.write(progress=seen.append)
    assert seen == [128, 36]
    with GGUFFile(path) as g:
        assert g.tensors["bytes"].data.view(np.int32).tolist() == [1] * 32
        assert g.tensors["blocks"].data.tolist() == [7] * 36


def test_writer_output_is_deterministic(tmp_path):
    def build(p):
        w = GGUFWriter(p, alignment=64)
        w.add("general.architecture", "llama")
        w.add("toks", ["a", "b"])
        w.add_tensor("w", np.ones((2, 3), np.float32))
        w.write()
        return p.read_bytes()
    assert build(tmp_path / "a.gguf") == build(tmp_path / "b.gguf")


def _writer_errors():
    ones = np.ones(4, np.float32)
    return [
        ("duplicate key", lambda w: (w.add("k", 1), w.add("k", 2)), r"'k' added twice"),
        ("unstorable value", lambda w: w.add("k", object()), r"cannot store"),
        ("uint8 out of range", lambda w: w.add("k", 256, ValueType.UINT8), r"'k'.*256.*UINT8"),
        ("int64 too small", lambda w: w.add("k", -2**63 - 1), r"'k'.*INT64"),
        ("array element out of range", lambda w: w.add("k", [1, 300], ValueType.ARRAY, ValueType.UINT8),
         r"'k'.*UINT8"),
        ("float in int array", lambda w: w.add("k", [1, 2.5], ValueType.ARRAY, ValueType.INT32), r"'k'.*INT32"),
        ("wrong byte count", lambda w: w.add_tensor("t", np.zeros(10, np.uint8), GGMLType.Q4_0, (32,)),
         r"'t'.*10 bytes given.*needs 18"),
        ("row not whole blocks", lambda w: w.add_tensor("t", np.zeros(18, np.uint8), GGMLType.Q4_0, (16,)),
         r"row length 16.*block of 32"),
        ("no shape for raw data", lambda w: w.add_tensor("t", np.zeros(18, np.uint8), GGMLType.Q4_0),
         r"'t'.*shape"),
        ("dtype without type", lambda w: w.add_tensor("t", np.zeros(4, np.float64)), r"'t'.*ggml_type"),
        ("duplicate tensor", lambda w: (w.add_tensor("t", ones), w.add_tensor("t", ones)), r"'t'.*twice"),
        ("scalar tensor", lambda w: w.add_tensor("t", np.zeros(4, np.uint8), GGMLType.I8, shape=()),
         r"'t'.*1\.\.4 dimensions"),
        ("5-d tensor", lambda w: w.add_tensor("t", np.ones((1, 1, 1, 1, 4), np.float32)), r"'t'.*1\.\.4 dimensions"),
        ("zero-size tensor", lambda w: w.add_tensor("t", np.ones((0, 4), np.float32)), r"'t'.*positive"),
        ("tensor name too long", lambda w: w.add_tensor("t" * 65, ones), r"longer than 64"),
        ("empty key", lambda w: w.add("", 1), r"empty"),
        ("string type, int value", lambda w: w.add("k", 5, ValueType.STRING), r"'k'.*str"),
        ("float16 array", lambda w: w.add("k", np.ones(2, np.float16)), r"'k'.*float16"),
        ("2-d array", lambda w: w.add("k", np.ones((2, 2), np.int32)), r"'k'.*1-D"),
    ]


@pytest.mark.parametrize("act, match", [c[1:] for c in _writer_errors()], ids=[c[0] for c in _writer_errors()])
def test_writer_refuses_what_the_reader_would_reject(tmp_path, act, match):
    with pytest.raises(GGUFError, match=match):
        act(GGUFWriter(tmp_path / "w.gguf"))


@pytest.mark.parametrize("alignment", [0, 3, 48, 2**32])
def test_writer_refuses_bad_alignment(tmp_path, alignment):
    with pytest.raises(GGUFError, match="alignment"):
        GGUFWriter(tmp_path / "w.gguf", alignment=alignment)


def test_writer_failure_leaves_no_file_behind(tmp_path):
    path = tmp_path / "w.gguf"
    w = GGUFWriter(path)
    w.add_tensor("t", lambda: b"\0" * 3, GGMLType.F32, shape=(4,))
    with pytest.raises(GGUFError, match="'t'.*3 bytes"):
        w.write()
    assert list(tmp_path.iterdir()) == []


# ---- hostile files: a seeded mutation run --------------------------------------------------

FUZZ_SEED = 20240611
DEFAULT_RANDOM_CASES = 5000
CASE_LIMIT_S = 1.0     # a single open of a ~1 KB file; anything near this is a hang in the making


def _fuzz_base(path: Path) -> bytes:
    """A small valid file with a bit of everything the parser walks."""
    rng = np.random.default_rng(FUZZ_SEED)
    w = GGUFWriter(path, alignment=64)       # non-default, so general.alignment is in the file
    w.add("general.architecture", "llama")
    w.add("general.name", "fuzz — ünïcode")
    w.add("llama.block_count", 2)
    w.add("llama.rope.freq_base", 10000.0)
    w.add("tokenizer.ggml.add_bos_token", True)
    w.add("tokenizer.ggml.tokens", ["<unk>", "<s>", "</s>", "▁the", "a", ""])
    w.add("tokenizer.ggml.token_type", np.array([2, 3, 3, 1, 1, 1], np.int32))
    w.add("nested", [np.array([1, 2], np.uint16), np.array([3], np.uint16)])
    w.add_tensor("norm", np.ones(8, np.float32))
    w.add_tensor("embd", rng.standard_normal((2, 8)).astype(np.float16))
    w.add_tensor("q8", rng.integers(0, 256, 68, dtype=np.uint8), GGMLType.Q8_0, shape=(2, 32))
    w.add_tensor("q4k", rng.integers(0, 256, 144, dtype=np.uint8), GGMLType.Q4_K, shape=(1, 256))
    w.write()
    return path.read_bytes()


def _walk_fields(blob: bytes) -> tuple[list, int, int]:
    """The numeric fields of a valid file, independently of the reader under test:
    ([(offset, size, kind)], data_offset, end of the last tensor's bytes)."""
    fields, pos = [], 0

    def take(size, kind):
        nonlocal pos
        fields.append((pos, size, kind))
        v = int.from_bytes(blob[pos:pos + size], "little")
        pos += size
        return v

    def string(kind):
        nonlocal pos
        n = take(8, kind)
        s = blob[pos:pos + n]
        pos += n
        return s

    def value(vtype):
        nonlocal pos
        if vtype == ValueType.STRING:
            string("string length")
        elif vtype == ValueType.ARRAY:
            etype = take(4, "array element type")
            for _ in range(take(8, "array count")):
                value(etype)
        else:
            pos += SCALAR_DTYPES[ValueType(vtype)].itemsize

    pos = 4
    take(4, "version")
    n_tensors, n_kv = take(8, "tensor count"), take(8, "kv count")
    alignment = 32
    for _ in range(n_kv):
        key = string("key length")
        vtype = take(4, "value type")
        if key == b"general.alignment":
            alignment = take(4, "alignment")
        else:
            value(vtype)
    tensors = []
    for _ in range(n_tensors):
        string("tensor name length")
        dims = [take(8, "dim") for _ in range(take(4, "n_dims"))]
        gtype = take(4, "ggml type")
        tensors.append((dims, gtype, take(8, "tensor offset")))
    data_offset = align_up(pos, alignment)
    end = max(data_offset + off + type_nbytes(GGMLType(t), tuple(reversed(d))) for d, t, off in tensors)
    return fields, data_offset, end


def _field_values(size: int, current: int, rng: random.Random) -> list[int]:
    """Values worth trying in a field: edges, off-by-ones, every single-bit flip, random."""
    top = 2 ** (8 * size) - 1
    vals = {0, 1, 2, 3, 4, 5, 8, 13, 31, 32, 33, 63, 64, 255, 256, 2**16, 2**31, 2**31 - 1, 2**32 - 1,
            current + 1, current - 1, current * 2, current + 64, top, top - 1, top // 2}
    if size == 8:
        vals |= {2**32, 2**61, 2**62, 2**63, 2**63 - 1}
    vals |= {current ^ (1 << b) for b in range(8 * size)}
    vals |= {rng.randrange(top + 1) for _ in range(8)}
    vals |= {rng.randrange(4096) for _ in range(4)}
    return sorted(v for v in vals if 0 <= v <= top and v != current)


def _fuzz_cases(blob: bytes, n_random: int):
    """(description, mutated bytes, must_fail) for every case, deterministically."""
    rng = random.Random(FUZZ_SEED)
    fields, data_offset, end = _walk_fields(blob)
    # Truncation at every byte of the header and tensor table, and a spread through the data:
    # anything short of the last tensor's end must fail, the trailing padding may go.
    cuts = list(range(data_offset + 1)) + sorted(rng.sample(range(data_offset + 1, len(blob)), 64))
    for n in cuts:
        yield f"truncated to {n} bytes", blob[:n], n < end
    for off, size, kind in fields:
        current = int.from_bytes(blob[off:off + size], "little")
        for v in _field_values(size, current, rng):
            yield (f"{kind} at byte {off}: {current} -> {v}",
                   blob[:off] + v.to_bytes(size, "little") + blob[off + size:], False)
    for i in range(n_random):
        b = bytearray(blob)
        # Half the cases aim at the header and tensor table, where the parser makes decisions.
        limit = data_offset if i % 2 == 0 else len(b)
        spots = sorted(rng.randrange(limit) for _ in range(rng.randint(1, 8)))
        for p in spots:
            b[p] = rng.randrange(256)
        if bytes(b) != blob:
            yield f"random case {i}: bytes {spots} overwritten", bytes(b), False


class _Hang(BaseException):
    """Raised by the watchdog; a BaseException so no `except Exception` in the code can swallow it."""


@contextlib.contextmanager
def _watchdog(seconds: float):
    def fire(signum, frame):
        raise _Hang()
    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _check_invariants(g: GGUFFile):
    """What a successful open promises, whatever the bytes were."""
    spans = []
    assert g.alignment > 0 and g.alignment & (g.alignment - 1) == 0
    if g.tensors:
        assert g.data_offset % g.alignment == 0
    for t in g.tensors.values():
        assert 1 <= len(t.shape) <= 4 and all(d > 0 for d in t.shape)
        assert t.nbytes == type_nbytes(t.ggml_type, t.shape) == t.data.nbytes
        assert g.data_offset <= t.offset and t.offset + t.nbytes <= g.file_size
        assert (t.offset - g.data_offset) % g.alignment == 0
        spans.append((t.offset, t.offset + t.nbytes))
    spans.sort()
    assert all(e0 <= s1 for (_, e0), (s1, _) in zip(spans, spans[1:]))


def _open_case(path: Path, blob: bytes, measure_alloc: bool) -> tuple[str, float, int]:
    """Open one mutated file: ('ok' | 'error', seconds, traced peak bytes or -1)."""
    # A fresh file each time: rewriting one in place costs ~3 ms on ext4 (truncate-and-replace
    # makes it flush on close), a new file ~0.05 ms.
    path.unlink(missing_ok=True)
    path.write_bytes(blob)
    peak = -1
    if measure_alloc:
        tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with _watchdog(5 * CASE_LIMIT_S):
            g = GGUFFile(path)
        outcome = "ok"
    except GGUFError:
        outcome = "error"
    finally:
        elapsed = time.perf_counter() - t0
        if measure_alloc:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
    if outcome == "ok":
        _check_invariants(g)
        g.close()
    return outcome, elapsed, peak


def _agrees_with_gguf_py(path: Path) -> bool:
    """For a mutated file we accepted: gguf-py reads the same, or False if gguf-py cannot read it
    at all (it is stricter on UTF-8 and looser on structure, so it may fail where we do not)."""
    try:
        theirs = gguf_py.GGUFReader(path)
    except Exception:
        return False
    with GGUFFile(path) as ours:
        assert_metadata_matches(ours, theirs)
        assert_tensors_match(ours, theirs)
    return True


def test_hostile_mutations_only_ever_raise_gguf_error(tmp_path):
    base = _fuzz_base(tmp_path / "base.gguf")
    assert len(base) < 4096
    with GGUFFile(tmp_path / "base.gguf") as g:
        assert len(g.tensors) == 4 and g.alignment == 64 and len(g.metadata) == 9
    n_random = int(os.environ.get("LLM_FUZZ_CASES", DEFAULT_RANDOM_CASES))
    path = tmp_path / "case.gguf"
    counts = {"ok": 0, "error": 0, "checked against gguf-py": 0}
    failures, worst, worst_alloc = [], (0.0, ""), (0, "")
    n = 0
    for n, (what, blob, must_fail) in enumerate(_fuzz_cases(base, n_random), 1):
        try:
            outcome, elapsed, peak = _open_case(path, blob, measure_alloc=n % 10 == 0)
        except _Hang:
            failures.append(f"{what}: no answer after {5 * CASE_LIMIT_S} s")
            continue
        except Exception as e:    # anything but GGUFError, or a broken invariant after success
            failures.append(f"{what}: {type(e).__name__}: {e}")
            continue
        counts[outcome] += 1
        if must_fail and outcome == "ok":
            failures.append(f"{what}: opened without error")
        if outcome == "ok":
            try:
                counts["checked against gguf-py"] += _agrees_with_gguf_py(path)
            except AssertionError as e:
                failures.append(f"{what}: accepted, but gguf-py reads it differently: {e}")
        worst = max(worst, (elapsed, what))
        if peak > len(blob) + ALLOC_SLACK:
            failures.append(f"{what}: allocated {peak} bytes for a {len(blob)}-byte file")
        worst_alloc = max(worst_alloc, (peak, what))
        if len(failures) >= 20:
            break
    print(f"\nfuzz: {n} cases ({counts['ok']} opened, {counts['checked against gguf-py']} of them "
          f"read alike by gguf-py, {counts['error']} GGUFError); "
          f"slowest {worst[0] * 1e3:.2f} ms ({worst[1]}); largest sampled allocation {worst_alloc[0]} bytes")
    assert not failures, f"{len(failures)} bad cases (first 20):\n" + "\n".join(failures)
    assert n >= 3000 + n_random // 2
    assert counts["error"] > 0 and counts["checked against gguf-py"] > 0    # both paths were exercised
    assert worst_alloc[0] > 0
    assert worst[0] < CASE_LIMIT_S, f"slowest case took {worst[0]:.3f} s: {worst[1]}"


def test_hostile_counts_allocate_nothing_up_front(tmp_path):
    """Claims of 2**40 elements must be refused from the file size, before any allocation."""
    for claim in (kv("a", ValueType.ARRAY, arr(ValueType.UINT8, 2**40, b"")),
                  kv("a", ValueType.ARRAY, arr(ValueType.STRING, 2**40, b"")),
                  kv("a", ValueType.ARRAY, arr(ValueType.ARRAY, 2**40, b"")),
                  kv("s", ValueType.STRING, u64(2**40))):
        p = write(tmp_path, gguf_bytes([claim]))
        tracemalloc.start()
        try:
            with pytest.raises(GGUFError):
                GGUFFile(p)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < ALLOC_SLACK


def test_allocation_stays_linear_in_file_size(tmp_path):
    """The densest legal metadata (empty strings, empty nested arrays: 8-12 file bytes per Python
    object) costs a bounded number of bytes per file byte, not more than a fixed multiple."""
    n = 20000
    blob = gguf_bytes([kv("strs", ValueType.ARRAY, arr(ValueType.STRING, n, u64(0) * n)),
                       kv("nest", ValueType.ARRAY, arr(ValueType.ARRAY, n, arr(ValueType.UINT8, 0, b"") * n))])
    p = write(tmp_path, blob)
    tracemalloc.start()
    try:
        with GGUFFile(p) as g:
            assert len(g.metadata["strs"]) == n and len(g.metadata["nest"]) == n
            _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # A Python str is ~50 bytes and an empty numpy array ~110: about 12x the 8-12 file bytes each.
    print(f"\ndensest metadata: {peak} bytes allocated for a {len(blob)}-byte file ({peak / len(blob):.1f}x)")
    assert peak < 16 * len(blob), f"{peak} bytes for a {len(blob)}-byte file"


# ---- the inspect command -------------------------------------------------------------------

def _run_common(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_inspect_json(default_model_path):
    r = _run_common("inspect", default_model_path, "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    with GGUFFile(default_model_path) as g:
        assert set(s["metadata"]) == set(g.metadata)
        assert s["metadata"]["llama.block_count"] == {"type": "UINT32", "value": g.metadata["llama.block_count"]}
        assert [t["name"] for t in s["tensors"]] == list(g.tensors)
        assert s["parameters"] == sum(t.n_elements for t in g.tensors.values())
        assert sum(v["tensors"] for v in s["type_mix"].values()) == len(g.tensors)
        assert sum(v["bytes"] for v in s["type_mix"].values()) == sum(t.nbytes for t in g.tensors.values())
    assert set(s["type_mix"]) == {"F32", "Q4_1", "Q8_0"}
    # SmolLM2-135M: 134.5 M parameters by the model card
    assert 130e6 < s["parameters"] < 140e6


def test_inspect_plain(default_model_path):
    r = _run_common("inspect", default_model_path)
    assert r.returncode == 0, r.stderr
    assert "GGUF v3" in r.stdout and "type mix:" in r.stdout and "token_embd.weight" in r.stdout


@pytest.mark.parametrize("kind", ["missing", "not gguf", "truncated"])
def test_inspect_bad_file_exits_2_with_one_line(tmp_path, default_model_path, kind):
    path = tmp_path / "x.gguf"
    if kind == "not gguf":
        path.write_text("just some text, not a model\n")
    elif kind == "truncated":
        with open(default_model_path, "rb") as f:
            path.write_bytes(f.read(100_000))
    r = _run_common("inspect", path, "--json")
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert "Traceback" not in r.stderr


# ---- model metadata: what the llama graph needs, checked before anything is built ------------------

LLAMA_MD = {"general.architecture": "llama", "llama.context_length": 2048, "llama.embedding_length": 576,
            "llama.block_count": 30, "llama.feed_forward_length": 1536, "llama.attention.head_count": 9,
            "llama.attention.head_count_kv": 3, "llama.vocab_size": 49152, "llama.rope.freq_base": 100000.0,
            "llama.attention.layer_norm_rms_epsilon": 1e-5}


def _config(**changes):
    """LlamaConfig.from_gguf on SmolLM2's metadata with some keys changed (None: removed)."""
    from types import SimpleNamespace

    from common.model import LlamaConfig
    md = {**LLAMA_MD, **{k.replace("__", "."): v for k, v in changes.items()}}
    md = {k: v for k, v in md.items() if v is not None}
    return LlamaConfig.from_gguf(SimpleNamespace(architecture=md.get("general.architecture"), metadata=md,
                                                 tensors={}))


def test_smollm2_metadata_gives_its_geometry():
    cfg = _config()
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_vocab) == (30, 576, 9, 3, 64, 49152)


METADATA_ERRORS = [
    ({"llama__attention__head_count": 0}, "'llama.attention.head_count' is 0: it must be positive"),
    ({"llama__attention__head_count_kv": 0}, "'llama.attention.head_count_kv' is 0: it must be positive"),
    ({"llama__attention__head_count_kv": 4}, "head_count 9 is not a multiple of head_count_kv 4"),
    ({"llama__attention__head_count": 7}, "embedding_length 576 is not a multiple of head_count 7"),
    ({"llama__embedding_length": 0}, "'llama.embedding_length' is 0: it must be positive"),
    ({"llama__block_count": 0}, "'llama.block_count' is 0: it must be positive"),
    ({"llama__block_count": None}, "required metadata key 'llama.block_count' is missing"),
    ({"llama__feed_forward_length": 0}, "'llama.feed_forward_length' is 0: it must be positive"),
    ({"llama__context_length": 0}, "'llama.context_length' is 0: it must be positive"),
    ({"llama__vocab_size": 0}, "'llama.vocab_size' is 0: it must be positive"),
    ({"llama__attention__layer_norm_rms_epsilon": 0.0}, "layer_norm_rms_epsilon' is 0.0: it must be a positive"),
    ({"llama__attention__layer_norm_rms_epsilon": float("nan")}, "layer_norm_rms_epsilon' is nan"),
    ({"llama__attention__layer_norm_rms_epsilon": float("inf")}, "layer_norm_rms_epsilon' is inf"),
    ({"llama__attention__layer_norm_rms_epsilon": None}, "'llama.attention.layer_norm_rms_epsilon' is missing"),
    ({"llama__attention__key_length": 63, "llama__attention__value_length": 63}, "head dimension 63 is odd"),
    ({"llama__attention__value_length": 32}, "value_length differs from key_length"),
    ({"llama__rope__dimension_count": 32}, "rope.dimension_count 32 != head dim 64"),
    ({"llama__rope__freq_base": 0.0}, "'llama.rope.freq_base' is 0.0: it must be "),
    ({"llama__rope__scaling__type": "yarn"}, "rope scaling 'yarn' is not supported"),
    ({"llama__attention__head_count": "nine"}, "'llama.attention.head_count' is 'nine': not a int"),
    ({"llama__attention__head_count_kv": [3, 3, 1]}, "'llama.attention.head_count_kv' varies per layer"),
    ({"general__architecture": "gpt2"}, "architecture 'gpt2' is not supported"),
    ({"llama__rope__freq_base": float("nan")}, "'llama.rope.freq_base' is nan: it must be a positive number"),
    ({"llama__rope__freq_base": float("inf")}, "'llama.rope.freq_base' is inf: it must be a positive number"),
    ({"llama__rope__scaling__factor": -2.0}, "'llama.rope.scaling.factor' is -2.0: it must be a positive number"),
]


@pytest.mark.parametrize("changes, message", METADATA_ERRORS, ids=[str(c) for c, _ in METADATA_ERRORS])
def test_bad_model_metadata_is_a_gguf_error_naming_the_key(changes, message):
    with pytest.raises(GGUFError, match=re.escape(message)):
        _config(**changes)


def test_a_model_with_zero_heads_is_one_line_at_the_command_line(tmp_path):
    """head_count = 0 once raised ZeroDivisionError; now `run` says which key, in one line, exit 2."""
    path = tmp_path / "zero-heads.gguf"
    w = GGUFWriter(path)
    for key, value in {**LLAMA_MD, "llama.attention.head_count": 0}.items():
        w.add(key, value, ValueType.STRING if isinstance(value, str) else
              ValueType.FLOAT32 if isinstance(value, float) else ValueType.UINT32)
    w.write()
    r = _run_common("run", "--stage", "simd", "-m", path, "-n", "1")
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert lines == ["error: 'llama.attention.head_count' is 0: it must be positive"], r.stderr
