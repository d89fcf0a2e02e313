"""The article's two GPU mistakes, brought back behind the cuda stage's switches and checked on the
CPU emulator of the kernels (app/cuda_emulator/), so that whoever has a GPU can measure
what each costs in time to first token (`LLM_CUDA_ALLOC_PER_OP=1` / `LLM_CUDA_HOST_EMBEDDING=1
make stage=cuda run`):

    alloc_per_op     a device allocation for every op's result, freed when it is dropped
                     (the article's cudaMalloc/cudaFree around every op)
    host_embedding   the embedding rows dequantized on the host and copied over, n_embd floats
                     per token, instead of a 4-byte id (the article's lookup on the host)

Both compute the same logits as the stage without them, bit for bit: only where the memory
comes from, and what crosses the bus, changes. The emulator counts allocations and copies
exactly; timing is a GPU's to measure."""

from __future__ import annotations

import numpy as np
import pytest

from common.gguf import GGUFFile
from common.model import LlamaModel
from stages import cuda as cs
from tests.test_cuda import TINY, TINY_TOKENS, emulated_device, write_tiny_model


@pytest.fixture(scope="module")
def emulator():
    return emulated_device()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("mistakes") / "tiny-llama.gguf")


def engine(path, device, **switches):
    return LlamaModel(GGUFFile(path), cs.CudaBackend(device=device, scratch_bytes=16 << 20, **switches))


def prefill_then_decode(e, n_prompt: int = 4, n_decode: int = 3):
    """Logits of a prefill and of n_decode single-token steps, with the transfer counters
    before and after the decode steps."""
    e.reset()
    rows = [e.forward(TINY_TOKENS[:n_prompt], 0)]
    before = e.backend.transfer_stats() | {"frees": e.backend.device_frees}
    for i in range(n_prompt, n_prompt + n_decode):
        rows.append(e.forward(TINY_TOKENS[i:i + 1], i, all_logits=False))
    after = e.backend.transfer_stats() | {"frees": e.backend.device_frees}
    return np.concatenate(rows), before, after


def test_the_switches_are_off_by_default(emulator, tiny, monkeypatch):
    monkeypatch.delenv("LLM_CUDA_ALLOC_PER_OP", raising=False)
    monkeypatch.delenv("LLM_CUDA_HOST_EMBEDDING", raising=False)
    b = engine(tiny, emulator).backend
    assert not b.alloc_per_op and not b.host_embedding
    monkeypatch.setenv("LLM_CUDA_ALLOC_PER_OP", "1")
    monkeypatch.setenv("LLM_CUDA_HOST_EMBEDDING", "1")
    b = engine(tiny, emulator).backend
    assert b.alloc_per_op and b.host_embedding
    assert not engine(tiny, emulator, alloc_per_op=False, host_embedding=False).backend.alloc_per_op


def test_alloc_per_op_allocates_and_frees_every_op_and_changes_no_logit(emulator, tiny):
    want, w0, w1 = prefill_then_decode(engine(tiny, emulator))
    assert w1["device_allocs"] == w0["device_allocs"]                   # the stage as it is: none
    e = engine(tiny, emulator, alloc_per_op=True)
    got, before, after = prefill_then_decode(e)
    np.testing.assert_array_equal(got, want)
    allocs = after["device_allocs"] - before["device_allocs"]
    frees = after["frees"] - before["frees"]
    # every op of every layer returns a new buffer: at least the 7 matmuls, 2 norms, 2 ropes,
    # attention, 2 adds and swiglu per layer, for each of the 3 decode steps
    assert allocs >= 3 * TINY["n_layer"] * 15, allocs
    assert allocs - 8 <= frees <= allocs, (allocs, frees)             # freed as the graph drops them
    assert e.backend.arena is None                                     # no arena at all
    emulator.check_guards()


def test_host_embedding_sends_a_row_per_token_not_an_id(emulator, tiny):
    want, w0, w1 = prefill_then_decode(engine(tiny, emulator))
    assert w1["h2d_bytes"] - w0["h2d_bytes"] == 3 * 4                   # the stage as it is: one id each
    e = engine(tiny, emulator, host_embedding=True)
    assert isinstance(e.token_embd, cs.HostEmbedding)
    got, before, after = prefill_then_decode(e)
    np.testing.assert_array_equal(got, want)                           # the same rows, decoded on the host
    assert after["h2d_bytes"] - before["h2d_bytes"] == 3 * TINY["n_embd"] * 4
    assert after["h2d_count"] - before["h2d_count"] == 3
    e.reset()
    b = e.backend
    h0 = b.h2d_bytes
    e.forward(TINY_TOKENS[:5], 0)
    assert b.h2d_bytes - h0 == 5 * TINY["n_embd"] * 4                  # a prefill sends every row
    emulator.check_guards()


def test_both_mistakes_together_still_generate_the_same_tokens(emulator, tiny):
    from common.generate import generate
    want = generate(engine(tiny, emulator), TINY_TOKENS[:3], 4, ignore_eos=True).tokens
    got = generate(engine(tiny, emulator, alloc_per_op=True, host_embedding=True), TINY_TOKENS[:3], 4,
                   ignore_eos=True).tokens
    assert got == want
