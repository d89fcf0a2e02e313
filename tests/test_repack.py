"""The repack stage: the layout undone gives the file's bytes back for every type; every type's
repacked kernel against the int8 stage's integer loops; one kernel whatever the rows around a
row (decode = prefill = batch, bit for bit, with a neighbour-dependent variant the same check
catches); 1 thread and N; float16 K/V; the model within int8's tolerance of the reference and
the fused stage's greedy tokens but at near-ties.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

from common import reference
from common.batch import Batch, Segment
from common.gguf import GGMLType, GGUFFile
from common.paged_kv import PagePool, PageTable
from stages import load
from stages.int8 import LOGIT_TOLERANCE as INT8_TOLERANCE
from stages.kernels import repacked, vector_ir
from stages.kernels.repack_steps import REPACKED
from tests.test_fused import _int8_rows, _weights, kernel_rows, packs_of
from tests.test_fused import _kernel as fused_kernels
from tests.test_int8 import activations
from tests.test_quantized import MIXED_TYPES, stage_logits, write_tiny_llama
from tests.util import expected_isa, greedy_at_clear_choices, lacks, lacks_vnni, thread_counts

F32 = np.float32
TYPES = [GGMLType(t) for t in repacked.REPACK_TYPES]
# skipped by LLVM's view of the CPU numba compiles for (tests/util.py), not by vector_ir.ISA: a
# probe that lost AVX2 would otherwise turn these tests into expected skips
NO_ISA = lacks("avx2", "f16c", then="the repack stage's kernels need them")
needs_isa = pytest.mark.skipif(expected_isa() is None, reason=str(NO_ISA))


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_unpack_gives_the_files_bytes_back(ggml_type):
    """13 rows (a group and a part of one): repacked, then unpacked, byte for byte; the group
    blocks are exactly as long as the blocks they hold, plus the zero rows of the last group."""
    raw, _, _ = _weights(ggml_type, 13, int(ggml_type))
    packed = repacked.repack(raw, int(ggml_type))
    assert packed.nbytes == 16 * raw.shape[1]
    assert np.array_equal(repacked.unpack(packed, int(ggml_type), 13, raw.shape[1]), raw)
    assert not np.array_equal(packed[:raw.nbytes], raw.reshape(-1))          # it did move the bytes


@pytest.mark.isa_paths
@needs_isa
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_every_type_against_the_int8_loops(ggml_type):
    """Decode (1 row), and 3 and 7 rows (the tile's rows and the rest), for 21 weight rows (two
    groups and a part): the same integer sums as the int8 stage's loops, scaled in another order.
    (1 thread and N: the model's test below.)"""
    raw, K, rng = _weights(ggml_type, 21, 100 + int(ggml_type))
    for M in (1, 3, 7):
        x = activations(rng, M, K)
        want, scale = _int8_rows(x, raw, ggml_type)
        got = kernel_rows(x, raw, ggml_type, layout=REPACKED)
        err = np.abs(got - want) / np.maximum(scale, 1e-30)
        assert np.isfinite(got).all() and err.max() < 2e-6, f"{ggml_type.name} M={M}: {err.max():.2e}"


def test_the_prefetch_follows_the_cpus_maker_and_the_type():
    """An AMD CPU's K-quants ask for their lines into L2 far ahead, everything else into L1 near
    (stages/kernels/repacked.py says what was measured on each maker's CPU)."""
    amd = repacked.group_prefetch({"vendor_id": "AuthenticAMD"})
    intel = repacked.group_prefetch({"vendor_id": "GenuineIntel"})
    assert all(amd[k] == (repacked.L2_FAR if k in (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K) else repacked.L1_NEAR)
               for k in repacked.REPACK_TYPES)
    assert set(intel.values()) == {repacked.L1_NEAR} and repacked.group_prefetch({}) == intel
    assert repacked.GROUP_PREFETCH == repacked.group_prefetch()


@needs_isa
def test_the_prefetch_changes_no_bit(monkeypatch):
    """The kernel compiled with each prefetch (none, into L1 near, into L2 far: the ones this CPU
    does not take included) has that instruction in its machine code and nothing else, and gives
    the same bits: where the lines are asked for is speed alone."""
    results = []
    for choice, instruction in (((0, 0), None), (repacked.L1_NEAR, "prefetcht0"), (repacked.L2_FAR, "prefetcht1")):
        monkeypatch.setattr(repacked, "GROUP_PREFETCH", dict.fromkeys(repacked.REPACK_TYPES, choice))

        @numba.njit
        def run(kind, w, row_bytes, p32, pk, out, r1):
            repacked.group_gemm(kind, w, 0, row_bytes, p32, pk, out.shape[0], out, 0, 0, r1)
        got = []
        for t in (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q4_1):
            raw, K, rng = _weights(t, 19, 300 + int(t))
            p32, pk = packs_of(activations(rng, 3, K), K)
            out = np.zeros((3, 19), F32)
            run(int(t), repacked.repack(raw, int(t)), raw.shape[1], p32, pk, out, 19)
            got.append(out)
        results.append(got)
        asm = run.inspect_asm(run.signatures[0])
        assert {i for i in ("prefetcht0", "prefetcht1", "prefetcht2", "prefetchnta") if i in asm} == \
            ({instruction} if instruction else set()), choice
    assert all(np.array_equal(a, b) for r in results[1:] for a, b in zip(results[0], r))
    assert all(np.isfinite(a).all() and np.abs(a).max() > 0 for a in results[0])


@pytest.mark.isa_paths
@needs_isa
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_a_row_gets_the_same_bits_whatever_rows_come_with_it(ggml_type):
    """Activation row 0 alone, first of 3, and among 7 (a whole tile, then the rows left over in one
    narrower tile), and row 6 alone and last of 7: identical bits. (The fused stage's tiles do not
    promise it: its decode and its tiles sum in different orders, which the same comparison sees.)"""
    raw, K, rng = _weights(ggml_type, 16, 200 + int(ggml_type))
    x = activations(rng, 8, K)
    alone = kernel_rows(x[:1], raw, ggml_type, layout=REPACKED)[0]
    for M in (3, 7):
        assert np.array_equal(kernel_rows(x[:M], raw, ggml_type, layout=REPACKED)[0], alone)
    assert np.array_equal(kernel_rows(x[6:7], raw, ggml_type, layout=REPACKED)[0],
                          kernel_rows(x[:7], raw, ggml_type, layout=REPACKED)[6])
    fused = [kernel_rows(x[:M], raw, ggml_type)[0] for M in (1, 8)]         # decode vs one 4x4 / 1x8 tile
    if ggml_type in (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q4_1):          # the negative control
        assert not np.array_equal(fused[0], fused[1])


@pytest.mark.skipif(expected_isa() != "vnni", reason=str(lacks_vnni(
    "the AVX2 form is compared with the VNNI one here; without VNNI the AVX2 form runs in every test")))
def test_the_avx2_form_on_a_vnni_cpu(monkeypatch):
    """Without VNNI the byte products are vpmaddubsw + vpmaddwd + vpaddd (and its own tile width,
    repacked.tile_rows): compiled here in that form too, the same bits for 7 rows (a whole tile of
    either form and the rows left over), and no vpdpbusd in its code. The VNNI side is the kernel
    the other checks of this file compiled (kernel_rows), so only the AVX2 form compiles here."""
    cases = {}
    for ggml_type in TYPES:                                     # the VNNI form, as compiled natively
        raw, K, rng = _weights(ggml_type, 8, 300 + int(ggml_type))
        x = activations(rng, 7, K)
        cases[ggml_type] = raw, K, x, kernel_rows(x, raw, ggml_type, layout=REPACKED)
    vnni_asm = "\n".join(fused_kernels.inspect_asm().values())
    monkeypatch.setattr(vector_ir, "ISA", "avx2")

    @numba.njit
    def run(kind, w, rb, p32, pk, out):
        repacked.group_gemm(kind, w, 0, rb, p32, pk, out.shape[0], out, 0, 0, out.shape[1])
    for ggml_type, (raw, K, x, vnni) in cases.items():
        p32, pk = packs_of(x, K)
        out = np.zeros((7, 8), F32)
        run(int(ggml_type), repacked.repack(raw, int(ggml_type)), raw.shape[1], p32, pk, out)
        assert np.array_equal(vnni, out), ggml_type.name
    assert "vpdpbusd" in vnni_asm and "vpdpbusd" not in "\n".join(run.inspect_asm().values())


# ---- the stage -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("repack") / "tiny-mixed.gguf",
                            {**MIXED_TYPES, "attn_k": GGMLType.Q5_1, "attn_v": GGMLType.F16,
                             "attn_output": GGMLType.Q4_0, "ffn_up": GGMLType.Q4_1, "output": GGMLType.Q6_K})


@needs_isa
def test_tiny_model_of_every_type_against_the_reference(tiny_path):
    """Every integer type in the layers, a float one among them (attn_v F16, left as the file has
    it), a repacked output head; prefill then decode on 1 thread and all: the same bits, within
    the relative size int8 is held to, and a repacked matrix unpacks to its tensor's bytes."""
    tokens = [3, 17, 42, 5, 63, 0, 8, 21, 9, 30]
    want = reference.forward(GGUFFile(tiny_path), tokens)
    engines = [load("repack", tiny_path, threads=n) for n in thread_counts()]
    runs = [stage_logits(e, tokens, split=6) for e in engines]
    got = runs[0]
    assert np.isfinite(got).all() and all(np.array_equal(r, got) for r in runs)
    rel = np.sqrt(((got - want) ** 2).mean() / (want ** 2).mean())
    assert rel < 0.05, f"relative RMS difference {rel:.4f}"
    layer = engines[0].layers[0]
    from stages.repack import RepackedMatrix
    assert isinstance(layer.w_down, RepackedMatrix) and not isinstance(layer.wv, RepackedMatrix)
    assert np.array_equal(layer.w_down.rows(), layer.w_down.source.data)


@needs_isa
def test_decode_rows_are_prefill_rows(tiny_path):
    """One token at a time or the whole prompt at once: every position's logits the same bits
    (one kernel for both, and float16 K/V written and read the same way)."""
    tokens = [3, 17, 42, 5, 63, 0, 8, 21]
    e = load("repack", tiny_path)
    whole = stage_logits(e, tokens, split=len(tokens))
    one_by_one = stage_logits(e, tokens, split=1)
    assert np.array_equal(whole, one_by_one)


def crowd_differences(engine, prompts, crowds):
    """For each crowd (indices into prompts), every sequence's logits of one step in that crowd
    against the same sequence alone: the rows whose bits differ ([] = batch invariant)."""
    def step(idx):
        pool = PagePool(engine.config.n_layer, engine.config.kv_dim, 64, dtype=engine.backend.kv_dtype)
        tables = [PageTable(pool) for _ in idx]
        for t, i in zip(tables, idx):
            t.admit(prompts[i], len(prompts[i]) + 4)
        batch = Batch(pool, [Segment(t, prompts[i]) for t, i in zip(tables, idx)], engine.backend.row_block)
        return engine.forward_batch(batch)
    alone = {i: step([i])[0] for i in range(len(prompts))}
    bad = []
    for crowd in crowds:
        for row, i in zip(step(crowd), crowd):
            if not np.array_equal(row, alone[i]):
                bad.append((tuple(crowd), i))
    return bad


@needs_isa
def test_batch_invariance_with_a_negative_control(tiny_path):
    """A sequence's logits in a batched step (one compiled call, each row over its own pages) are
    the same bits alone and beside any others, for the repack stage with nothing padded; the
    fused stage with its padding taken away (row_block 1: a row's path then depends on how many
    rows came with it) is caught by the same check."""
    prompts = [[3, 17, 42], [5, 63, 0, 8, 21, 9, 30, 2, 7], [11], [40, 41, 42, 43, 44]]
    crowds = [[0, 1], [2, 0, 3], [1, 2, 3, 0]]
    assert crowd_differences(load("repack", tiny_path), prompts, crowds) == []
    fused = load("fused", tiny_path)
    assert crowd_differences(fused, prompts, crowds) == []              # padded: invariant
    fused.backend.row_block = 1
    assert crowd_differences(fused, prompts, crowds) != []              # unpadded: caught


@needs_isa
def test_float16_and_float32_kv(tiny_path, monkeypatch):
    """The cache in float16 by default (half the bytes), float32 with LLM_KV_TYPE=f32: both within
    the tolerance; an unknown type is refused by name."""
    tokens = [3, 17, 42, 5, 63, 0, 8, 21, 9, 30]
    want = reference.forward(GGUFFile(tiny_path), tokens)
    e16 = load("repack", tiny_path)
    monkeypatch.setenv("LLM_KV_TYPE", "f32")
    e32 = load("repack", tiny_path)
    assert e16.kv.k.dtype == np.float16 and e32.kv.k.dtype == np.float32
    assert e16.kv_bytes() * 2 == e32.kv_bytes()
    a, b = stage_logits(e16, tokens, split=4), stage_logits(e32, tokens, split=4)
    assert not np.array_equal(a, b)
    for got in (a, b):
        assert np.sqrt(((got - want) ** 2).mean() / (want ** 2).mean()) < 0.05
    monkeypatch.setenv("LLM_KV_TYPE", "q8")
    with pytest.raises(ValueError, match="LLM_KV_TYPE='q8'"):
        load("repack", tiny_path)


@needs_isa
def test_default_model_within_int8s_tolerance_and_fuseds_greedy_tokens(default_model_path):
    """Teacher-forced on the fused stage's 16 greedy tokens: the repack stage's argmax is fused's
    pick wherever fused's own top two are more than NEAR_TIE apart, and its logits stay within
    int8's tolerance of the float64 reference; 1 thread and all give the same bits."""
    from common.generate import generate
    from tests.test_stages import NEAR_TIE, PROMPT
    fused = load("fused", default_model_path, n_ctx=256)
    prompt = fused.tokenizer.encode(PROMPT)
    cont = generate(fused, prompt, 16, ignore_eos=True).tokens
    ids = prompt + cont
    runs = [stage_logits(load("repack", default_model_path, threads=n, n_ctx=256), ids, split=len(prompt))
            for n in thread_counts()]
    assert all(np.array_equal(r, runs[0]) for r in runs)
    ours = runs[0][len(prompt) - 1:-1]
    theirs = stage_logits(fused, ids, split=len(prompt))[len(prompt) - 1:-1]
    greedy_at_clear_choices(ours, theirs, cont, NEAR_TIE)
    want = reference.forward(GGUFFile(default_model_path), ids)[len(prompt) - 1:-1]
    assert np.abs(ours - want).max() <= INT8_TOLERANCE
