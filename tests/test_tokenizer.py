"""common/tokenizer.py: token ids identical to llama.cpp's on every llama/gpt2 vocabulary.

Oracle: llama.cpp through llama-cpp-python. Its answers are committed under
tests/golden/tokenizer/ by scripts/goldens/make_tokenizer_golden.py (see that script to regenerate), so
these tests need no llama.cpp build. llama.cpp's own tokenizer test pairs (models/vocab/*.inp
and .out, Hugging Face's ids, which llama.cpp reproduces) are checked too. Where llama-cpp-python
is installed, one more test fuzzes fresh random text against it live.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import warnings
from pathlib import Path

import numpy as np
import pytest

from common.gguf import GGUFFile
from common.tokenizer import ATTR_NORMAL, Tokenizer, TokenizerError, clean_up_spaces, unicode_category
from scripts.goldens import make_tokenizer_golden as golden_script  # the corpus lives there

ROOT = Path(__file__).resolve().parent.parent
GOLDEN_DIR = ROOT / "tests" / "golden" / "tokenizer"
GOLDEN_FILES = sorted(GOLDEN_DIR.glob("*.json"))
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
VOCAB_DIR = ROOT / "models" / "vocab"
REGENERATE = "regenerate with `.venv/bin/python -m scripts.goldens.make_tokenizer_golden`"
# the fixture files these tests read (tests/conftest.py: one message, naming the make target, if one is missing)
NEEDS_BY_FIXTURE = {"smol": "model", "smol_meta": "model", "spm": "vocab"}
NEEDS_VOCAB = pytest.mark.needs("vocab")


def needs_of(name: str):
    """The fixture file vocabulary `name` is read from: the default model, or llama.cpp's vocab files."""
    return pytest.mark.needs("model" if name == "smollm2" else "vocab")



def _need(path: Path) -> Path:
    if not path.exists():
        hint = "`make model`" if path == DEFAULT_MODEL else "`make vocab`"
        pytest.fail(f"{path.relative_to(ROOT)} is missing: run {hint} first", pytrace=False)
    return path


@functools.lru_cache(maxsize=None)
def _tokenizer(rel_path: str) -> Tokenizer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")        # aquila / gpt-neox: "no tokenizer.ggml.pre"
        return Tokenizer.from_gguf(_need(ROOT / rel_path))


@functools.lru_cache(maxsize=None)
def _golden(name: str) -> dict:
    data = json.loads((GOLDEN_DIR / f"{name}.json").read_text(encoding="utf-8"))
    assert data["format"] == golden_script.FORMAT, f"golden file format changed: {REGENERATE}"
    return data


def _expected_bytes(value, text: str) -> bytes:
    if value is None:
        return text.encode("utf-8")
    if isinstance(value, dict):
        return bytes.fromhex(value["hex"])
    return value.encode("utf-8")


GOLDEN_NAMES = [p.stem for p in GOLDEN_FILES]
GOLDEN_VOCABS = [pytest.param(name, marks=needs_of(name)) for name in GOLDEN_NAMES]


def test_golden_files_cover_every_vocabulary():
    assert set(GOLDEN_NAMES) == set(golden_script.VOCABS), f"golden files are out of date: {REGENERATE}"
    total = sum(p.stat().st_size for p in GOLDEN_FILES)
    assert total < 2_000_000, f"golden files take {total} bytes; keep them under ~2 MB"


# ---- exactness against llama.cpp (committed golden ids) ------------------------------------------

@pytest.mark.parametrize("name", GOLDEN_VOCABS)
def test_ids_match_llama_cpp(name):
    g = _golden(name)
    tok = _tokenizer(g["file"])
    assert [c["text"] for c in g["cases"]["plain"]] == golden_script.corpus(g["specials"]), \
        f"the corpus in scripts/goldens/make_tokenizer_golden.py changed: {REGENERATE}"
    bad, n = [], 0
    for kind, cases in g["cases"].items():
        add = kind in ("add_special", "add_and_parse_special")
        parse = kind in ("parse_special", "add_and_parse_special")
        for c in cases:
            n += 1
            # add_special=False in llama.cpp means neither BOS nor EOS; None = as the metadata says
            got = tok.encode(c["text"], add_bos=None if add else False, add_eos=None if add else False,
                             parse_special=parse)
            if got != c["ids"]:
                bad.append(f"[{kind}] {c['text'][:60]!r}\n  llama.cpp {c['ids'][:20]}\n  ours      {got[:20]}")
    assert n > 600
    assert not bad, f"{len(bad)} of {n} texts differ from llama.cpp:\n" + "\n".join(bad[:8])


@pytest.mark.parametrize("name", GOLDEN_VOCABS)
def test_vocabulary_facts_match_llama_cpp(name):
    g = _golden(name)
    tok = _tokenizer(g["file"])
    m = g["meta"]
    assert tok.n_vocab == m["n_vocab"]
    assert (tok.bos_id, tok.eos_id) == (m["bos"], m["eos"])
    assert (tok.add_bos, tok.add_eos) == (m["add_bos"], m["add_eos"])
    assert sorted(tok.eog_ids) == m["eog"]
    # eot: llama.cpp takes the first match in hash-map order when several texts qualify; we take
    # the first in its list. Equal where there is one candidate; in the end-of-generation set always.
    assert m["eot"] is None or m["eot"] in tok.eog_ids
    assert tok.eot_id is None or tok.eot_id in tok.eog_ids
    ours = {}
    for i in range(tok.n_vocab):
        a = tok.token_attr(i)
        if a != ATTR_NORMAL:
            ours.setdefault(str(a), []).append(i)
    expected = {a: [i for lo, hi in runs for i in range(lo, hi + 1)] for a, runs in m["attrs"].items()}
    assert ours == expected, "token attributes (control / user-defined / byte / strip) differ"


@pytest.mark.parametrize("name", GOLDEN_VOCABS)
def test_every_token_piece_matches_llama_cpp(name):
    g = _golden(name)
    tok = _tokenizer(g["file"])
    chunk = g["pieces"]["chunk"]
    for mode, special in (("special", True), ("plain", False)):
        for k, expected in enumerate(g["pieces"][mode]):
            h = hashlib.sha256()
            for i in range(k * chunk, min(tok.n_vocab, (k + 1) * chunk)):
                p = tok.token_piece(i, special=special)
                h.update(len(p).to_bytes(4, "little") + p)
            assert h.hexdigest()[:16] == expected, \
                f"token pieces (special={special}) differ from llama.cpp in ids {k * chunk}..{(k + 1) * chunk - 1}"


@pytest.mark.parametrize("name", GOLDEN_VOCABS)
def test_decode_matches_llama_cpp(name):
    g = _golden(name)
    tok = _tokenizer(g["file"])
    bad = []
    for kind, cases in g["cases"].items():
        for c in cases:
            for key, skip in (("dec", True), ("dec_sp", False)):
                got = tok.decode_bytes(c["ids"], skip_special=skip)
                if got != _expected_bytes(c[key], c["text"]):
                    bad.append(f"[{kind} {key}] {c['text'][:50]!r}: ours {got[:60]!r}")
    for c in g["decode"]:     # random id sequences: specials, byte tokens, split characters
        for key, skip in (("dec", True), ("dec_sp", False)):
            got = tok.decode_bytes(c["ids"], skip_special=skip)
            if got.hex() != c[key]:
                bad.append(f"[random {key}] {c['ids']}: ours {got!r}, llama.cpp {bytes.fromhex(c[key])!r}")
    assert not bad, f"{len(bad)} decodes differ from llama.cpp's detokenize:\n" + "\n".join(bad[:8])


@pytest.mark.parametrize("name", GOLDEN_VOCABS)
def test_round_trip_wherever_llama_cpp_round_trips(name):
    """decode(encode(x)) == x exactly where llama.cpp's detokenize gives x back (it does not
    where BPE space clean-up rewrites " ," and friends, or SPM drops a leading space)."""
    g = _golden(name)
    tok = _tokenizer(g["file"])
    n = 0
    for c in g["cases"]["plain"]:
        if c["dec_sp"] is None:
            n += 1
            assert tok.decode(tok.encode(c["text"], add_bos=False, add_eos=False)) == c["text"]
    assert n > len(g["cases"]["plain"]) // 2


@NEEDS_VOCAB
@pytest.mark.parametrize("name", [n for n in golden_script.VOCABS
                                  if n not in ("smollm2", "baichuan", "aquila", "gpt-neox")])
def test_llama_cpp_own_test_pairs(name):
    """llama.cpp's tests/test-tokenizer-0 data shipped beside each vocab file."""
    inp = _need(VOCAB_DIR / f"ggml-vocab-{name}.gguf.inp")
    out = _need(VOCAB_DIR / f"ggml-vocab-{name}.gguf.out")
    texts = inp.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
    expected = [[int(x) for x in line.split()] for line in out.read_text(encoding="utf-8").split("\n")]
    tok = _tokenizer(f"models/vocab/ggml-vocab-{name}.gguf")
    assert len(texts) > 30
    for text, ids in zip(texts, expected):
        assert tok.encode(text, add_bos=False, add_eos=False) == ids, f"{name}: {text!r}"


# ---- behaviour on the default model -----------------------------------------------------------

@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return _tokenizer(str(DEFAULT_MODEL.relative_to(ROOT)))


@pytest.fixture(scope="module")
def spm() -> Tokenizer:
    return _tokenizer("models/vocab/ggml-vocab-llama-spm.gguf")


def test_default_model_facts(smol):
    assert (smol.model, smol.pre, smol.n_vocab) == ("gpt2", "smollm", 49152)
    assert (smol.bos_id, smol.eos_id) == (1, 2)
    assert smol.token_text(2) == "<|im_end|>" and smol.token_text(0) == "<|endoftext|>"
    assert {0, 2} <= smol.eog_ids
    assert smol.add_bos is False and smol.add_eos is False


def test_add_bos_and_add_eos(smol, spm):
    plain = smol.encode("Hello")
    assert smol.encode("Hello", add_bos=True) == [smol.bos_id] + plain
    assert smol.encode("Hello", add_eos=True) == plain + [smol.eos_id]
    assert spm.encode("Hello")[0] == spm.bos_id                      # Llama: add_bos from metadata
    assert spm.encode("Hello", add_bos=False) == spm.encode("Hello")[1:]
    assert spm.encode("") == [spm.bos_id] and spm.encode("", add_bos=False) == []


def test_special_tokens_only_with_parse_special(smol):
    text = "<|im_start|>user\nHi<|im_end|>"
    parsed = smol.encode(text, parse_special=True)
    assert parsed[0] == smol.token_to_id("<|im_start|>") and parsed[-1] == smol.token_to_id("<|im_end|>")
    literal = smol.encode(text)
    assert smol.token_to_id("<|im_start|>") not in literal and len(literal) > len(parsed)
    assert smol.decode(parsed) == text and smol.decode(literal) == text
    assert smol.decode(parsed, skip_special=True) == "user\nHi"


def test_spm_space_prefix_and_byte_fallback(spm):
    ids = spm.encode("Hello", add_bos=False)
    assert spm.token_text(ids[0]) == "▁Hello"
    cuneiform = spm.encode("\U00012000", add_bos=False)   # not in the vocabulary: four byte tokens
    assert [spm.token_text(i) for i in cuneiform[-4:]] == ["<0xF0>", "<0x92>", "<0x80>", "<0x80>"]
    assert spm.decode(cuneiform) == "\U00012000"


def test_stream_decoder_never_splits_a_character(spm, smol):
    ids = spm.encode("a\U0001f600b", add_bos=False)          # the emoji arrives as 4 byte tokens
    stream = spm.stream_decoder()
    outputs = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(outputs) == " a\U0001f600b"                # the stream keeps the "▁" space
    assert "" in outputs and "\U0001f600" in outputs
    for tok in (spm, smol):
        rng = random.Random(5)
        for _ in range(50):
            seq = [rng.randrange(tok.n_vocab) for _ in range(rng.randint(1, 20))]
            stream = tok.stream_decoder()
            pieces = [stream.push(i) for i in seq]
            tail = stream.flush()
            raw = b"".join(tok.token_piece(i) for i in seq)
            assert "".join(pieces) + tail == raw.decode("utf-8", errors="replace")


def test_stream_decoder_holds_partial_utf8(smol):
    # the one-byte tokens of the byte alphabet (SmolLM2 lacks 21 bytes no text ever needs)
    by_byte = {smol.token_piece(i)[0]: i for i in range(smol.n_vocab) if len(smol.token_piece(i)) == 1}
    assert len(by_byte) > 230
    euro = "\u20ac".encode()                                   # 3 bytes
    stream = smol.stream_decoder()
    assert [stream.push(by_byte[b]) for b in euro] == ["", "", "\u20ac"]
    stream.push(by_byte[euro[0]])
    assert stream.flush() == "\ufffd"                          # an unfinished character at the end
    stream = smol.stream_decoder()
    assert stream.push(by_byte[0xC3]) + stream.push(by_byte[0x41]) == "\ufffdA"   # broken: replaced


def test_clean_up_spaces_follows_llama_cpp():
    assert clean_up_spaces(b"Hello , world . Really ? Yes !") == b"Hello, world. Really? Yes!"
    assert clean_up_spaces(b"it 's I 'm we 're they 've") == b"it's I'm we're they've"
    assert clean_up_spaces(b"don 't I 'd we 'll") == b"don 't I 'd we 'll"
    assert clean_up_spaces(b"a ' b") == b"a'b"


def test_unicode_categories_are_llama_cpps():
    assert unicode_category(ord("a")) == "L" and unicode_category(ord("٣")) == "N"
    assert unicode_category(0x1FA77) == "S"      # Unicode 15.0 emoji, unknown to Python 3.11's tables
    assert unicode_category(0x31350) == "L"      # CJK Extension H
    assert unicode_category(0x0378) == ""        # unassigned


# ---- bad input and bad metadata: clear errors ---------------------------------------------------

@pytest.fixture(scope="module")
def smol_meta() -> dict:
    return dict(GGUFFile(_need(DEFAULT_MODEL)).metadata)


def _with(meta: dict, **changes) -> dict:
    m = dict(meta)
    for key, value in changes.items():
        key = key.replace("__", ".")
        if value is None:
            m.pop(key, None)
        else:
            m[key] = value
    return m


@pytest.mark.parametrize("changes, message", [
    ({"tokenizer__ggml__pre": "no-such-pre"}, "unknown pre-tokenizer"),
    ({"tokenizer__ggml__model": None}, "tokenizer.ggml.model"),
    ({"tokenizer__ggml__tokens": None}, "tokenizer.ggml.tokens"),
    ({"tokenizer__ggml__merges": None}, "merges"),
    ({"tokenizer__ggml__model": "bert"}, "not supported"),
    ({"tokenizer__ggml__model": 7}, "should be str"),
    ({"tokenizer__ggml__tokens": ["a", "b", "a"]}, "more than once"),
    ({"tokenizer__ggml__token_type": np.zeros(3, np.int32)}, "entries for"),
    ({"tokenizer__ggml__scores": ["x"]}, "numeric array"),
])
def test_bad_metadata_is_a_clear_error(smol_meta, changes, message):
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_metadata(_with(smol_meta, **changes))


def test_missing_pre_falls_back_to_default_with_a_warning(smol_meta):
    with pytest.warns(UserWarning, match="tokenizer.ggml.pre"):
        tok = Tokenizer.from_metadata(_with(smol_meta, tokenizer__ggml__pre=None))
    assert tok.encode("Hello world") == [19556, 905]


@NEEDS_VOCAB
def test_unsupported_vocab_file_is_a_clear_error():
    with pytest.raises(TokenizerError, match="WordPiece"):
        Tokenizer.from_gguf(_need(VOCAB_DIR / "ggml-vocab-bert-bge.gguf"))


def test_bad_text_and_ids_are_clear_errors(smol):
    with pytest.raises(TokenizerError, match="not valid UTF-8: byte 1"):
        smol.encode(b"a\xff")
    assert smol.encode("h\u00e9".encode()) == smol.encode("h\u00e9")
    with pytest.raises(TokenizerError, match="lone surrogate"):
        smol.encode("a\udcff")
    with pytest.raises(TokenizerError, match="str or UTF-8 bytes"):
        smol.encode(42)
    for bad in (-1, smol.n_vocab, 10**12):
        with pytest.raises(TokenizerError, match="out of range"):
            smol.decode([5, bad])
    for bad in (1.5, "7", None):
        with pytest.raises(TokenizerError, match="not an integer"):
            smol.decode([bad])
    assert smol.decode(np.array([19556, 905])) == "Hello world"
    with pytest.raises(TokenizerError, match="out of range"):
        smol.token_text(smol.n_vocab)


def test_adding_a_missing_bos_is_a_clear_error(smol_meta):
    tok = Tokenizer.from_metadata(_with(smol_meta, tokenizer__ggml__bos_token_id=None,
                                        tokenizer__ggml__tokens=smol_meta["tokenizer.ggml.tokens"][:11]))
    assert tok.bos_id is None      # llama.cpp's gpt2 placeholder 11 lies outside this vocabulary
    with pytest.raises(TokenizerError, match="no BOS"):
        tok.encode("a", add_bos=True)


# ---- chat templates -------------------------------------------------------------------------------

CONVERSATION = [{"role": "user", "content": "Hi there!"},
                {"role": "assistant", "content": "Hello! How can I help?"},
                {"role": "user", "content": "Tell me a joke."}]


def test_chat_template_default_model(smol):
    text = smol.apply_chat_template(CONVERSATION)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n"
                    "Hello! How can I help?<|im_end|>\n<|im_start|>user\nTell me a joke.<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert not smol.apply_chat_template(CONVERSATION, add_generation_prompt=False).endswith("assistant\n")
    ids = smol.encode(text, parse_special=True)
    assert ids[0] == smol.token_to_id("<|im_start|>")


def test_chat_template_helpers_and_sandbox(smol_meta):
    def render(template, **kw):
        return Tokenizer.from_metadata(_with(smol_meta, tokenizer__chat_template=template)) \
            .apply_chat_template(CONVERSATION, **kw)
    assert render("{{ bos_token }}|{{ eos_token }}") == "<|im_start|>|<|im_end|>"
    assert render("{{ messages | tojson }}").startswith('[{"role": "user"')
    assert render("{{ strftime_now('%Y') | length }}") == "4"
    loop = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}"
    assert render(loop) == "user"
    assert render("{{ extra }}", extra="tools here") == "tools here"
    with pytest.raises(TokenizerError, match="roles must alternate"):
        render("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TokenizerError, match="chat template"):
        render("{{ ''.__class__.__mro__[1].__subclasses__() }}")       # sandboxed
    with pytest.raises(TokenizerError, match="does not parse"):
        render("{% for %}")
    with pytest.raises(TokenizerError, match="no tokenizer.chat_template"):
        Tokenizer.from_metadata(_with(smol_meta, tokenizer__chat_template=None)).apply_chat_template(CONVERSATION)
    with pytest.raises(TokenizerError, match="list of dicts"):
        Tokenizer.from_metadata(smol_meta).apply_chat_template("hello")


@NEEDS_VOCAB
def test_chat_templates_of_other_vocabularies():
    cmdr = _tokenizer("models/vocab/ggml-vocab-command-r.gguf")
    text = cmdr.apply_chat_template(CONVERSATION)
    assert text.startswith("<BOS_TOKEN><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi there!")
    with pytest.raises(TokenizerError, match="alternate"):
        cmdr.apply_chat_template(CONVERSATION[:1] * 2)
    phi3 = _tokenizer("models/vocab/ggml-vocab-phi-3.gguf")
    assert phi3.apply_chat_template(CONVERSATION[:1]) == "<s><|user|>\nHi there!<|end|>\n<|assistant|>\n"


# ---- live comparison with llama.cpp, where llama-cpp-python is installed --------------------------

@pytest.mark.needs("model", "vocab")
def test_live_fuzz_against_llama_cpp():
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (`make baseline`); "
                                    "the committed golden ids cover the same ground")
    texts = golden_script._random_strings(seed=20240601, count=150)
    for name in ("smollm2", "llama-spm", "llama-bpe", "qwen2"):
        rel = golden_script.VOCABS[name]
        tok = _tokenizer(rel)
        llm = llama_cpp.Llama(model_path=str(_need(ROOT / rel)), vocab_only=True, verbose=False)
        for text in texts:
            for parse in (False, True):
                expected = llm.tokenize(text.encode(), add_bos=False, special=parse)
                assert tok.encode(text, add_bos=False, add_eos=False, parse_special=parse) == expected, \
                    f"{name}: {text!r}"


@NEEDS_VOCAB
def test_chat_templates_render_like_llama_cpp_python(smol_meta):
    """Same text as llama-cpp-python's Jinja2ChatFormatter (Hugging Face's settings), including
    Gemma 4's 12 KB template (rendered here over SmolLM2's vocabulary: only the template matters)."""
    chat_format = pytest.importorskip("llama_cpp.llama_chat_format",
                                      reason="llama-cpp-python not installed (`make baseline`)")
    for name in ("smollm2", "phi-3", "qwen2", "command-r", "gemma-4"):
        path = DEFAULT_MODEL if name == "smollm2" else VOCAB_DIR / f"ggml-vocab-{name}.gguf"
        template = GGUFFile(_need(path)).metadata["tokenizer.chat_template"]
        tok = Tokenizer.from_metadata(_with(smol_meta, tokenizer__chat_template=template))
        for messages in ([{"role": "system", "content": "Be brief."}] + CONVERSATION, CONVERSATION):
            for gen in (True, False):
                theirs = chat_format.Jinja2ChatFormatter(template, eos_token=tok.token_text(tok.eos_id),
                                                         bos_token=tok.token_text(tok.bos_id),
                                                         add_generation_prompt=gen)(messages=messages).prompt
                assert tok.apply_chat_template(messages, add_generation_prompt=gen) == theirs, name
