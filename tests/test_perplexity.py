"""`python -m app perplexity` (app/measure/perplexity.py) against llama.cpp's perplexity of the same
tokens: the golden file tests/golden/llama_cpp_perplexity.npz (scripts/goldens/make_perplexity_golden.py)
holds llama.cpp's token ids of the committed text and, per context size, the negative
log-likelihood sums of every chunk. Our tokens must be llama.cpp's, and each stage's perplexity
over the first chunks within 1% of llama.cpp's over the same chunks (2% for int8, which rounds
its activations); the method's bookkeeping (which positions are scored, BOS in front of every
chunk) is checked on an engine whose answers are known."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from app.measure import perplexity as ppl
from common.gguf import GGMLType, GGUFFile, GGUFWriter, ValueType
from common.quants import dequantize_tensor
from stages import REGISTRY
from tests.util import cpu_stages

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden" / "llama_cpp_perplexity.npz"
TOLERANCE = {"int8": 0.02}          # relative; every other stage 1%
CTX, CHUNKS = 128, 8                # the fast check; naive and tiling (slow tests) run 2 chunks


@pytest.fixture(scope="module")
def golden():
    return np.load(GOLDEN)


@pytest.fixture(scope="module")
def text_ids(default_model_path):
    with GGUFFile(default_model_path) as g:
        ids, tok = ppl.tokenize(g, ppl.DEFAULT_TEXT.read_text(encoding="utf-8"))
    return ids, tok


def golden_ppl(golden, ctx: int, n_chunks: int) -> float:
    sums, counts = golden[f"ctx{ctx}_nll_sums"][:n_chunks], golden[f"ctx{ctx}_counts"][:n_chunks]
    return math.exp(sums.sum() / counts.sum())


def test_our_tokens_are_llama_cpps(golden, text_ids, default_model_path):
    ids, tok = text_ids
    assert str(golden["text"]) == ppl.DEFAULT_TEXT.name and str(golden["model"]) == default_model_path.name
    assert bool(golden["add_bos"]) == tok.add_bos
    assert ids == golden["ids"].tolist()


def test_golden_counts_follow_the_method(golden, text_ids):
    ids, _ = text_ids
    for ctx in golden["ctxs"]:
        counts = golden[f"ctx{ctx}_counts"]
        assert len(counts) == len(ids) // ctx and (counts == ctx - ctx // 2 - 1).all()


def stages_to_check():
    fast = [s for s in cpu_stages() if REGISTRY[s].max_params is None]
    slow = [pytest.param(s, marks=pytest.mark.slow) for s in cpu_stages() if REGISTRY[s].max_params is not None]
    return fast + slow


@pytest.mark.parametrize("stage", stages_to_check())
def test_a_stage_agrees_with_llama_cpp(stage, golden, text_ids, default_model_path):
    from stages import load
    ids, tok = text_ids
    ctx, n = (CTX, CHUNKS) if REGISTRY[stage].max_params is None else (CTX, 2)
    engine = load(stage, default_model_path, n_ctx=ctx)
    got = ppl.evaluate(engine, ids, ctx, tok.bos_id if tok.add_bos else None, n_chunks=n)
    want = golden_ppl(golden, ctx, n)
    tol = TOLERANCE.get(stage, 0.01)
    print(f"\n{stage}: PPL {got['ppl']:.4f}, llama.cpp {want:.4f} ({got['ppl'] / want - 1:+.3%}; tolerance {tol:.0%})")
    assert got["n_chunks"] == n and got["scored"] == n * (ctx // 2 - 1)
    assert got["ppl"] == pytest.approx(want, rel=tol)


# ---- the method, on an engine whose answers are known -----------------------------------------

class Oracle:
    """forward() puts all the probability on the true next token from position `sure_from` on,
    and spreads it evenly before; records what it was fed."""

    def __init__(self, text, n_vocab=50, sure_from=None):
        self.text, self.n_vocab, self.sure_from, self.fed = text, n_vocab, sure_from, []
        self.n_ctx = 4096

    def reset(self):
        pass

    def forward(self, tokens, start_pos, all_logits=True):
        self.fed.append(list(tokens))
        start = self._find(tokens)
        logits = np.zeros((len(tokens), self.n_vocab), np.float32)
        for j in range(len(tokens) - 1):
            if self.sure_from is not None and j >= self.sure_from:
                logits[j, self.text[start + j + 1]] = 1e4
        return logits

    def _find(self, tokens):
        for s in range(0, len(self.text), len(tokens)):
            if self.text[s + 1:s + len(tokens)] == list(tokens[1:]):
                return s
        raise AssertionError("fed tokens are not a chunk of the text")


def test_only_the_second_half_of_each_chunk_is_scored():
    rng = np.random.default_rng(0)
    text = rng.integers(2, 50, 64).tolist()
    sure = ppl.evaluate(Oracle(text, sure_from=8), text, ctx=16, bos_id=None)
    assert sure["n_chunks"] == 4 and sure["scored"] == 4 * 7
    assert sure["ppl"] == pytest.approx(1.0)               # positions 8..14 of each chunk: all certain
    early = ppl.evaluate(Oracle(text, sure_from=9), text, ctx=16, bos_id=None)
    assert early["ppl"] > 1.5                              # position 8 is scored too: it is not certain
    even = ppl.evaluate(Oracle(text), text, ctx=16, bos_id=None)
    assert even["ppl"] == pytest.approx(50.0, rel=1e-6)    # uniform over 50: perplexity 50


def test_each_chunk_starts_with_bos_where_the_vocabulary_adds_one():
    text = list(range(2, 42))
    oracle = Oracle(text)
    ppl.evaluate(oracle, text, ctx=8, bos_id=1)
    assert [f[0] for f in oracle.fed] == [1] * 5 and [f[1:] for f in oracle.fed] == [text[i + 1:i + 8]
                                                                                  for i in range(0, 40, 8)]
    oracle = Oracle(text)
    ppl.evaluate(oracle, text, ctx=8, bos_id=None, n_chunks=2)
    assert oracle.fed == [text[:8], text[8:16]]


def test_a_text_too_short_is_refused_in_one_line(tmp_path, default_model_path, capsys):
    from app.cli import main
    short = tmp_path / "short.txt"
    short.write_text("Too short for two chunks of 512 tokens.")
    assert main(["perplexity", "-m", str(default_model_path), "-f", str(short)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the text is") and "needs at least 1024" in err and "\n" not in err
    assert main(["perplexity", "-m", str(default_model_path), "-f", str(short), "--ctx", "7"]) == 2


def test_the_command_prints_the_json_keys(default_model_path, capsys):
    from app.cli import main
    assert main(["perplexity", "--stage", "quantized", "-m", str(default_model_path), "--ctx", "128", "--chunks", "2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"ppl", "n_tokens", "n_chunks", "ctx", "stage", "model"} <= set(out)
    assert (out["n_chunks"], out["ctx"], out["stage"], out["model"]) == (2, 128, "quantized", default_model_path.name)
    assert out["ppl"] == pytest.approx(golden_ppl(np.load(GOLDEN), 128, 2), rel=0.01)


# ---- requantizing ----------------------------------------------------------------------------

def test_requantize_rounds_every_matrix_again_and_falls_back_where_blocks_do_not_fit(tmp_path):
    rng = np.random.default_rng(1)
    src = tmp_path / "small.gguf"
    w = GGUFWriter(src)
    w.add("general.architecture", "llama")
    w.add("general.file_type", 3, ValueType.UINT32)
    w.add_tensor("a.weight", rng.normal(0, 0.05, (8, 512)).astype(np.float32))       # 512: two Q4_K blocks
    w.add_tensor("b.weight", rng.normal(0, 0.05, (4, 288)).astype(np.float32))       # 288: no whole block of 256
    w.add_tensor("norm.weight", rng.normal(1, 0.1, 288).astype(np.float32))
    w.write()
    out = ppl.requantize(src, "Q4_K", tmp_path / "out")
    with GGUFFile(src) as a, GGUFFile(out) as b:
        assert b.tensors["a.weight"].ggml_type == GGMLType.Q4_K
        assert b.tensors["b.weight"].ggml_type == GGMLType.Q4_1                   # the fallback
        assert b.tensors["norm.weight"].ggml_type == GGMLType.F32
        assert "general.file_type" not in b.metadata and "Q4_K" in b.metadata["general.requantized_from"]
        for name in ("a.weight", "b.weight", "norm.weight"):
            before, after = dequantize_tensor(a.tensors[name]), dequantize_tensor(b.tensors[name])
            assert after.shape == before.shape
            assert np.abs(after - before).max() <= (0 if name == "norm.weight" else 0.02)
    assert ppl.requantize(src, "Q4_K", tmp_path / "out") == out                       # reused, not redone
