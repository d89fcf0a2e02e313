"""Constrained decoding (common/constrain/, run's -j/--json-schema and --grammar).

* The vocabulary handed to llguidance: every token's bytes as llguidance sees them are our
  token_piece's, the special tokens and the end tokens ours (SmolLM2's byte-level BPE, llama's
  SentencePiece with its <0xFF> byte token); a planted wrong byte, a planted special flag and a
  planted end token are each caught.
* The matcher: after a rollback, in a fork, rebuilt from tokens, its masks are a fresh matcher's
  fed the same tokens (a planted mask that goes stale is caught); the masks of a batch computed
  at once are the ones computed one by one.
* The sampler: the mask comes first, so a forbidden token is never drawn, greedy or sampled,
  whatever bias or penalty pushes it (and without the mask, planted, it is); a complete grammar
  ends the text with an end token, even with ignore_eos; without a constraint the unconstrained
  path runs (no mask is ever computed) and greedy text is the argmax's.
* Every schema feature claimed (nested objects, arrays with minItems/maxItems, enums, number
  bounds, string patterns and lengths, anyOf with null, additionalProperties false): texts at
  each boundary pass the constraint exactly when jsonschema accepts them; then greedy outputs of
  the real model through run's path, each validated by jsonschema (and the same prompts without
  the schema, planted, fail it). A Lark grammar; --chat; errors on one line before the weights.
* Speculative decoding under a constraint: its greedy text is plain constrained decoding's, with
  guesses right and wrong, and guesses kept past the grammar's end are taken back.
* The server's batched step as it is: four requests, three constrained, through preemption: the
  outputs of a roomy pool, valid, and the free request's text its own.
* The benchmark's page, drawn from a made-up record.
"""

from __future__ import annotations

import io
import json
import re
from types import SimpleNamespace

import jsonschema
import numpy as np
import pytest

from common.constrain import (
    Constraint,
    ConstraintError,
    Grammar,
    VocabularyMismatch,
    check_vocabulary,
    fill_masks,
    handed_over,
    ll_tokenizer,
)
from common.constrain.vocabulary import build, shown_empty
from common.generate import Sampler, SamplingParams, Session
from common.tokenizer import Tokenizer
from stages import load
from tests.test_speculative import Scripted, always_guessing

STAGE = "threads"               # float activations: its multi-row pass is its one-row step's (test_speculative)
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
COLORS = 'start: "red" | "green" | "blue"'


@pytest.fixture(scope="module")
def engine(default_model_path):
    return load(STAGE, default_model_path, threads=1)      # one thread: a busy machine's cores are not ours


def ids(tok, text: str) -> list:
    return tok.encode(text, add_bos=False, add_eos=False)


# ---- the vocabulary ------------------------------------------------------------------------------

def test_llguidance_sees_every_token_as_our_tokenizer_writes_it(tok, ll):
    """Checked here by the test itself, token for token, and by check_vocabulary."""
    special = 0
    for i in range(tok.n_vocab):
        assert ll.decode_bytes([i]) == tok.token_piece(i, special=True), i
        special += ll.is_special_token(i)
        assert ll.is_special_token(i) == (tok.token_piece(i, special=False) == b"" != tok.token_piece(i)), i
    assert special == 17 and sorted(ll.eos_tokens) == sorted(tok.eog_ids) and ll.eos_token == tok.eos_id
    check_vocabulary(ll, tok)


@pytest.mark.needs("vocab")
def test_a_sentencepiece_vocabulary_and_its_0xff_byte_token():
    """llama's vocabulary: byte tokens are their bytes; <0xFF> (which would read as llguidance's
    special-token marker, and which UTF-8 never holds) is handed over empty and no mask allows it."""
    from app.models import VOCAB_DIR
    spm = Tokenizer.from_gguf(VOCAB_DIR / "ggml-vocab-llama-spm.gguf")
    ll = ll_tokenizer(spm)
    ff = spm._byte_token(0xFF)
    assert spm.token_piece(ff) == b"\xff" and ll.decode_bytes([ff]) == shown_empty(ff) == b"<[%d]>" % ff
    assert ll.decode_bytes([spm._byte_token(0x0A)]) == b"\n"
    for i in range(spm.n_vocab):
        want = spm.token_piece(i)
        assert ll.decode_bytes([i]) == (shown_empty(i) if want[:1] == b"\xff" else want), i
    anything = Constraint(Grammar.lark("start: /(?s:.*)/").checked(ll), ll)
    assert not anything.allowed()[spm._byte_token(0xFF)] and anything.allowed()[spm._byte_token(0xC3)]


@pytest.mark.parametrize("plant", ["a wrong byte", "a token made special", "a special token made text",
                                   "another end token"])
def test_a_planted_mismatch_is_caught_and_named(tok, plant):
    vocab = handed_over(tok)
    if plant == "a wrong byte":
        vocab.tokens[500] = vocab.tokens[500][:-1] + bytes([vocab.tokens[500][-1] ^ 1])
        want = "token 500"
    elif plant == "a token made special":
        vocab.special_token_ids.append(501)
        want = "token 501"
    elif plant == "a special token made text":
        vocab.special_token_ids.remove(1)
        want = "token 1 "
    else:
        vocab.eos = [vocab.eos[0], 17]
        want = "end tokens"
    with pytest.raises(VocabularyMismatch, match=want):
        check_vocabulary(build(vocab), tok)


# ---- the matcher -------------------------------------------------------------------------------

ALICE = '{"name": "Alice", "age": 42}'


def masks_along(grammar, ll, tokens, make=Constraint) -> list:
    """The mask at every position of `tokens`, each from a fresh matcher fed the prefix."""
    return [make(grammar, ll, tokens[:k]).mask().copy() for k in range(len(tokens) + 1)]


class StaleMask(Constraint):
    """WRONG, planted: keeps the mask it computed after a rollback (forgets to forget it)."""

    def rollback(self, k):
        kept = self._mask
        super().rollback(k)
        self._mask = kept


@pytest.mark.parametrize("make", [Constraint, StaleMask])
def test_rollback_fork_and_rebuild_give_a_fresh_matchers_masks(tok, ll, make):
    grammar = Grammar.json_schema(PERSON).checked(ll)
    tokens = ids(tok, ALICE) + [tok.eos_id, tok.eos_id]          # past the end: the second one changes nothing
    fresh = masks_along(grammar, ll, tokens)
    assert not any(np.array_equal(fresh[0], m) for m in fresh[1:3])    # the masks do move
    agree = True
    for k in range(len(tokens) + 1):
        c = make(grammar, ll, tokens)
        c.mask()
        c.rollback(len(tokens) - k)
        agree &= np.array_equal(c.mask(), fresh[k]) and c.tokens == tokens[:k]
        twin = make(grammar, ll, tokens[:k]).fork()
        rest = make(grammar, ll, tokens[:k])
        for t in tokens[k:]:
            twin.consume(t)
        agree &= np.array_equal(twin.mask(), fresh[-1]) and np.array_equal(rest.mask(), fresh[k])
        agree &= np.array_equal(make(grammar, ll, c.tokens).mask(), fresh[k])      # rebuilt from its tokens
    assert agree == (make is Constraint)


def test_a_batchs_masks_computed_at_once_are_each_ones_own(tok, ll):
    grammar = Grammar.json_schema(PERSON).checked(ll)
    tokens = ids(tok, ALICE)
    batch = [Constraint(grammar, ll, tokens[:k]) for k in range(0, len(tokens), 1)]
    fill_masks(batch)
    for k, c in enumerate(batch):
        assert np.array_equal(c.mask(), Constraint(grammar, ll, tokens[:k]).mask()), k


class BigEndianTerms(Constraint):
    """WRONG, planted: reads each mask byte's bits from the top (the table's rows reversed)."""

    def apply(self, logits):
        from common.constrain import constraint
        right = constraint.BYTE_TERMS
        constraint.BYTE_TERMS = right[:, ::-1].copy()
        try:
            return super().apply(logits)
        finally:
            constraint.BYTE_TERMS = right


@pytest.mark.parametrize("make", [Constraint, BigEndianTerms])
def test_apply_puts_exactly_the_forbidden_tokens_at_minus_inf(tok, ll, make):
    """Along a reply under the schema (masks of a few tokens, of nearly all, and of allowed and
    forbidden ones alternating, inside a number): apply's row is np.where(allowed, logits, -inf)
    bit for bit, and a fork's result is its own (apply writes into its constraint's buffer)."""
    grammar = Grammar.json_schema(PERSON).checked(ll)
    logits = np.random.default_rng(3).normal(size=tok.n_vocab).astype(np.float32)
    c, counts, agree = make(grammar, ll), [], True
    for t in ids(tok, ALICE) + [tok.eos_id]:
        want = np.where(c.allowed(), logits, -np.inf).astype(np.float32)
        agree &= np.array_equal(c.apply(logits), want)
        counts.append(int(c.allowed().sum()))
        c.consume(t)
    assert min(counts) <= 2 and max(counts) > tok.n_vocab * 0.9 and any(100 < n < tok.n_vocab // 2 for n in counts)
    start = make(grammar, ll)
    twin = start.fork()
    twin.consume(ids(tok, "{")[0])
    first = start.apply(logits)
    assert not np.array_equal(first, twin.apply(logits)) and np.array_equal(first, start.apply(logits))
    assert agree == (make is Constraint)


def test_a_token_the_grammar_refuses_is_an_error_that_leaves_the_state(tok, ll):
    c = Constraint(Grammar.lark(COLORS).checked(ll), ll)
    before = c.mask().copy()
    with pytest.raises(ConstraintError, match="not allowed after 0 tokens"):
        c.consume(ids(tok, "pink")[0])
    assert np.array_equal(c.mask(), before) and c.tokens == []
    c.consume(ids(tok, "red")[0])
    assert not c.ended and c.allowed()[tok.eos_id] and c.allowed().sum() == len(tok.eog_ids)
    c.consume(tok.eos_id)
    assert c.ended and c.ended_at(1) == 0


def test_an_end_token_a_grammar_names_inside_its_text_ends_nothing(tok, ll):
    c = Constraint(Grammar.lark('start: "a" <|im_end|> "b"').checked(ll), ll)
    for t in ids(tok, "a") + [tok.eos_id]:                      # <|im_end|> is SmolLM2's EOS
        c.consume(t)
    assert not c.ended
    for t in ids(tok, "b") + [tok.eos_id]:
        c.consume(t)
    assert c.ended and c.ended_at(4) == 3


# ---- the sampler -------------------------------------------------------------------------------

@pytest.mark.parametrize("masked", [True, False])
def test_a_forbidden_token_is_never_drawn_whatever_pushes_it(tok, ll, masked):
    """Logit bias +100 on a forbidden token, a presence penalty, a hot temperature: with the mask
    it is never drawn, greedy or sampled; without it (planted), it is."""
    grammar = Grammar.lark(COLORS).checked(ll)
    words = (b"red", b"green", b"blue")
    allowed = {i for i in range(tok.n_vocab) if tok.token_piece(i) and any(w.startswith(tok.token_piece(i))
                                                                           for w in words)}
    pushed = ids(tok, "pink")[0]
    logits = np.random.default_rng(0).normal(size=tok.n_vocab).astype(np.float32)
    drawn = set()
    for temp in (0.0, 1.5):
        params = SamplingParams(temp=temp, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=1.0, seed=1,
                                logit_bias={pushed: 100.0, ids(tok, "red")[0]: -100.0})
        for _ in range(50):
            sampler = Sampler(params, constraint=Constraint(grammar, ll) if masked else None)
            drawn.add(sampler(logits))
    assert (drawn <= allowed) == masked and (pushed in drawn) != masked


def test_a_complete_grammar_ends_the_text_even_with_ignore_eos(tok, ll, engine):
    prompt = ids(tok, "Pick a color:")
    gen = Session(engine).generate(prompt, 20, Sampler(constraint=Constraint(Grammar.lark(COLORS).checked(ll), ll)),
                                   stop_ids=tok.eog_ids, ignore_eos=True)
    assert gen.stop_reason == "eog" and gen.tokens[-1] in tok.eog_ids and len(gen.tokens) == 2
    assert tok.decode(gen.tokens[:-1]) in ("red", "green", "blue")


def test_without_a_constraint_no_mask_runs_and_greedy_is_the_argmax(tok, ll, engine, monkeypatch):
    """The unconstrained path: the engine's own argmax (no logits come back, no mask is made),
    token for token the argmax of the full logits; and a grammar that allows any text leaves
    the greedy text as it was."""
    prompt = ids(tok, "The capital of France is")
    oracle, feed = [], list(prompt)
    engine.reset()
    for _ in range(8):
        t = int(np.argmax(engine.forward(feed, len(prompt) + len(oracle) - len(feed), all_logits=False)[0]))
        oracle.append(t)
        feed = [t]
    anything = Session(engine).generate(
        prompt, 8, Sampler(constraint=Constraint(Grammar.lark("start: /(?s:.*)/").checked(ll), ll)), ignore_eos=True)

    def no_mask(*a, **k):
        raise AssertionError("a mask was computed for an unconstrained sequence")
    monkeypatch.setattr(Constraint, "mask", no_mask)
    monkeypatch.setattr(engine, "forward", no_mask)               # greedy_next: the argmax stays in the engine
    plain = Session(engine).generate(prompt, 8, Sampler(), ignore_eos=True)
    assert plain.tokens == oracle == anything.tokens


# ---- schema features: the constraint agrees with jsonschema at the boundaries ----------------------

FEATURES = {
    "nested objects": ({"type": "object", "additionalProperties": False, "required": ["name", "address"],
                        "properties": {"name": {"type": "string", "maxLength": 16},
                                       "address": {"type": "object", "required": ["city", "zip"],
                                                   "additionalProperties": False,
                                                   "properties": {"city": {"type": "string", "maxLength": 16},
                                                                  "zip": {"type": "string",
                                                                          "pattern": "^[0-9]{5}$"}}}}},
                       ['{"name": "Al", "address": {"city": "Oslo", "zip": "01234"}}'],
                       ['{"name": "Al", "address": {"city": "Oslo"}}', '{"name": "Al", "address": "Oslo"}',
                        '{"name": "Al", "address": {"city": "Oslo", "zip": "1234"}}']),
    "arrays with minItems/maxItems": ({"type": "array", "items": {"type": "string", "maxLength": 12},
                                       "minItems": 2, "maxItems": 3},
                                      ['["a", "b"]', '["a", "b", "c"]'], ['["a"]', '["a", "b", "c", "d"]', '[1, 2]']),
    "enums": ({"type": "object", "required": ["color"], "additionalProperties": False,
               "properties": {"color": {"enum": ["red", "green", "blue"]}}},
              ['{"color": "red"}', '{"color": "blue"}'], ['{"color": "pink"}', '{"color": "reddish"}']),
    "number bounds": ({"type": "object", "required": ["celsius", "percent"], "additionalProperties": False,
                       "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 60},
                                      "percent": {"type": "integer", "minimum": 0, "exclusiveMaximum": 100}}},
                      ['{"celsius": -50, "percent": 0}', '{"celsius": 60, "percent": 99}',
                       '{"celsius": 59.5, "percent": 5}'],
                      ['{"celsius": 60.5, "percent": 5}', '{"celsius": -51, "percent": 5}',
                       '{"celsius": 0, "percent": 100}', '{"celsius": 0, "percent": 1.5}']),
    "string patterns and lengths": ({"type": "object", "required": ["phone", "code"], "additionalProperties": False,
                                     "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"},
                                                    "code": {"type": "string", "minLength": 2, "maxLength": 4}}},
                                    ['{"phone": "555-1234", "code": "ab"}', '{"phone": "555-1234", "code": "abcd"}'],
                                    ['{"phone": "5551234", "code": "ab"}', '{"phone": "555-1234", "code": "a"}',
                                     '{"phone": "555-1234", "code": "abcde"}']),
    "anyOf with null": ({"type": "object", "required": ["middle"], "additionalProperties": False,
                         "properties": {"middle": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]}}},
                        ['{"middle": "Lee"}', '{"middle": null}'], ['{"middle": 5}', '{"middle": "toolong"}']),
    "additionalProperties false": ({"type": "object", "required": ["title"], "additionalProperties": False,
                                    "properties": {"title": {"type": "string"}, "year": {"type": "integer"}}},
                                   ['{"title": "Emma"}', '{"title": "Emma", "year": 1815}'],
                                   ['{"title": "Emma", "author": "Austen"}']),
}


def passes(tok, grammar, ll, text: str) -> bool:
    """The constraint takes the text's tokens one by one, and then allows the end."""
    c = Constraint(grammar, ll)
    try:
        for t in ids(tok, text):
            c.consume(t)
    except ConstraintError:
        return False
    return bool(c.allowed()[tok.eos_id])


def judged(schema, text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except jsonschema.ValidationError:
        return False


PAIR = {"type": "object", "required": ["a", "b"], "additionalProperties": False,
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
# JSON whitespace (grammar.py's JSON_WHITESPACE): none, one space, or one or two newlines and an
# indent of at most 20 spaces or tabs; nothing else, and nothing after the object
WHITESPACE = [('{"a":1,"b":2}', True), ('{"a": 1, "b": 2}', True), ('{\n  "a": 1,\n\t"b": 2\n}', True),
              ('{\n\n"a": 1, "b": 2}', True), ("{\n" + " " * 20 + '"a": 1, "b": 2}', True),
              ('{"a":  1, "b": 2}', False), ('{\n\n\n"a": 1, "b": 2}', False),
              ("{\n" + " " * 21 + '"a": 1, "b": 2}', False), ('{\t"a": 1, "b": 2}', False),
              ('{"a": 1, "b": 2} ', False)]


def whitespace_problems(tok, ll) -> list[str]:
    """The JSON whitespace a schema's text may hold, and a schema's own x-guidance pattern (here
    up to three spaces, no newline) taking the place of ours."""
    pair = Grammar.json_schema(PAIR).checked(ll)
    problems = [f"{text!r}: {'refused' if want else 'taken'}" for text, want in WHITESPACE
                if passes(tok, pair, ll, text) != want]
    own = Grammar.json_schema({**PAIR, "x-guidance": {"whitespace_pattern": "[ ]{0,3}"}}).checked(ll)
    if not passes(tok, own, ll, '{"a":   1, "b": 2}') or passes(tok, own, ll, '{\n"a": 1, "b": 2}'):
        problems.append("the schema's own whitespace pattern did not win")
    return problems


def test_json_whitespace_is_bounded_and_a_schemas_own_pattern_wins(tok, ll, monkeypatch):
    from common.constrain import grammar
    assert whitespace_problems(tok, ll) == []
    monkeypatch.setattr(grammar, "with_json_options", lambda schema: schema)       # planted: llguidance's default
    assert whitespace_problems(tok, ll) != []
    monkeypatch.undo()
    monkeypatch.setattr(grammar, "with_json_options", lambda schema: {             # planted: ours win
        **schema, "x-guidance": {**schema.get("x-guidance", {}), **grammar.JSON_WHITESPACE}})
    assert whitespace_problems(tok, ll) != []


@pytest.mark.parametrize("feature", FEATURES)
def test_the_constraint_passes_what_jsonschema_accepts_and_nothing_else(tok, ll, feature):
    schema, good, bad = FEATURES[feature]
    grammar = Grammar.json_schema(schema).checked(ll)
    for text in good + bad:
        assert passes(tok, grammar, ll, text) == judged(schema, text) == (text in good), text


def test_a_schema_fixes_the_order_of_properties(tok, ll):
    """llguidance's one departure from JSON Schema that a text can meet: properties come in the
    schema's order (jsonschema accepts either)."""
    schema = FEATURES["additionalProperties false"][0]
    text = '{"year": 1815, "title": "Emma"}'
    assert judged(schema, text) and not passes(tok, Grammar.json_schema(schema).checked(ll), ll, text)


# ---- through run: the real model, greedy ----------------------------------------------------------

PROMPTS = {"nested objects": "A person and their address, as JSON:",
           "arrays with minItems/maxItems": "Three fruits as a JSON list:",
           "enums": "The color of the sky, as JSON:",
           "number bounds": "A temperature in Celsius and a percentage, as JSON:",
           "string patterns and lengths": "A US phone number and a short code, as JSON:",
           "anyOf with null": "A middle name if any, as JSON:",
           "additionalProperties false": "A book with title and year, as JSON:"}


@pytest.fixture(scope="module")
def run_json(engine, default_model_path):
    """`python -m app run ... --json` in this process, its record parsed; the module's engine
    stands in for loading it again (the rest of run's path is run's)."""
    import app.run as run_module
    from app.cli import main

    def run(*args, capsys, expect=0):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(run_module, "load", lambda stage, g, **kw: engine)
            assert main(["run", "--stage", STAGE, "-t", "1", "-m", str(default_model_path), *args, "--json"]) == expect
        out = capsys.readouterr()
        return json.loads(out.out.strip().splitlines()[-1]) if expect == 0 else out.err
    return run


@pytest.mark.parametrize("feature", PROMPTS)
def test_greedy_outputs_validate_against_their_schemas(run_json, feature, capsys):
    schema = FEATURES[feature][0]
    rec = run_json("-p", PROMPTS[feature], "-n", "80", "-j", json.dumps(schema), capsys=capsys)
    assert rec["constraint"] == "json_schema" and rec["stop_reason"] == "eog", rec["text"]
    jsonschema.validate(json.loads(rec["text"]), schema)
    # the planted case: the same prompt without the schema is not valid (the check can fail)
    free = run_json("-p", PROMPTS[feature], "-n", "6", capsys=capsys)
    assert free["constraint"] is None and not valid_json(free["text"], schema)


def valid_json(text: str, schema) -> bool:
    try:
        return judged(schema, text)
    except json.JSONDecodeError:
        return False


def test_a_schema_file_and_a_lark_grammar_file(run_json, tmp_path, capsys):
    path = tmp_path / "person.json"
    path.write_text(json.dumps(PERSON))
    rec = run_json("-p", "A person, as JSON:", "-n", "40", "--json-schema-file", str(path), capsys=capsys)
    jsonschema.validate(json.loads(rec["text"]), PERSON)
    lark = tmp_path / "date.lark"
    lark.write_text('start: DATE "."\nDATE: /[0-9]{4}-[0-9]{2}-[0-9]{2}/\n')
    rec = run_json("-p", "The date the Berlin Wall fell:", "-n", "20", "--grammar-file", str(lark), capsys=capsys)
    assert rec["constraint"] == "lark" and re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}\.", rec["text"]), rec["text"]


def test_spec_lookup_under_a_schema_is_plain_constrained_text(run_json, capsys):
    common = ("-p", "A person, as JSON:", "-n", "40", "-j", json.dumps(PERSON))
    plain = run_json(*common, capsys=capsys)
    look = run_json(*common, "--spec", "lookup", "--draft-max", "4", capsys=capsys)
    assert look["spec"] == "lookup" and look["tokens"] == plain["tokens"]
    jsonschema.validate(json.loads(look["text"]), PERSON)


def test_every_chat_reply_matches_the_grammar(tok, ll, engine):
    from app.chat import chat_loop
    out = io.StringIO()
    args = SimpleNamespace(n_predict=12, special=False)
    chat_loop(engine, STAGE, args, SamplingParams(), inp=io.StringIO("Name a color.\nAnother one.\n"), out=out,
              constraint=Constraint(Grammar.lark(COLORS).checked(ll), ll))
    replies = [line[2:] for line in out.getvalue().split("\n") if line.startswith("> ") and line[2:]]
    assert len(replies) == 2 and set(replies) <= {"red", "green", "blue"}, out.getvalue()


@pytest.mark.parametrize("args, message", [
    (["-j", '{"type": '], "--json-schema: not valid JSON: Expecting value"),
    (["-j", "[1]"], "--json-schema: a JSON schema is an object"),
    (["--grammar-file", "never/there.lark"], "--grammar-file never/there.lark: cannot read it"),
    (["-j", "{}", "--grammar", COLORS], "argument --grammar: not allowed with argument -j/--json-schema"),
])
def test_bad_input_is_one_line_before_any_file_opens(args, message, capsys):
    from app.cli import main
    try:
        code = main(["run", "--stage", STAGE, "-m", "never/opened.gguf", *args])
    except SystemExit as stopped:                     # argparse's own refusals
        code = stopped.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {message}") and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("grammar, message", [
    (Grammar.json_schema({"type": "strin"}), "the JSON schema: llguidance refuses it: Invalid type: strin"),
    (Grammar.json_schema({"type": "string", "pattern": "(?=a)b"}),
     "regex parse error: (?=a)b error: look-around, including look-ahead and look-behind, is not supported"),
    (Grammar.json_schema({"type": "string", "format": "colour"}), "Unknown format: colour"),
    (Grammar.lark("start: foo"), 'the grammar: llguidance refuses it: at 1(8): unknown name: "foo"'),
    (Grammar.lark("start: <|no_such_token|>"), "the grammar: llguidance refuses it"),
    (Grammar.lark('root ::= "a"'), "this looks like llama.cpp's GBNF"),
])
def test_what_llguidance_refuses_is_one_line_that_names_it(ll, grammar, message):
    with pytest.raises(ConstraintError) as refused:
        grammar.checked(ll)
    assert message in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


@pytest.mark.parametrize("args, message", [
    (["-j", '{"type": "strin"}'], "--json-schema: llguidance refuses it: Invalid type: strin"),
    (["--grammar", 'root ::= "a"'], "--grammar: llguidance refuses it"),
])
def test_what_llguidance_refuses_is_one_line_before_the_weights_load(default_model_path, args, message, capsys):
    import app.run as run_module
    from app.cli import main
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(run_module, "load", lambda *a, **k: pytest.fail("the weights were loaded"))
        assert main(["run", "--stage", STAGE, "-m", str(default_model_path), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err


# ---- speculative decoding under a constraint ------------------------------------------------------

def test_guesses_right_wrong_and_past_the_end_give_plain_constrained_text(tok, ll, engine):
    grammar = Grammar.json_schema(PERSON).checked(ll)
    prompt = ids(tok, "A person, as JSON:")
    plain = Session(engine).generate(prompt, 40, Sampler(constraint=Constraint(grammar, ll)), stop_ids=tok.eog_ids)
    assert plain.stop_reason == "eog" and plain.tokens[-1] == tok.eos_id
    script = prompt + plain.tokens + [tok.eos_id, tok.eos_id, 17]     # guesses past the end of the text
    class Counted(Constraint):
        def rollback(self, k):
            self.rolled = getattr(self, "rolled", 0) + k
            super().rollback(k)

    for wrong, ignore_eos in ((None, True), (3, False)):       # ignore_eos: the grammar's end alone ends it
        constraint = Counted(grammar, ll)
        session = Session(engine)
        gen = session.generate(prompt, 40, Sampler(constraint=constraint), stop_ids=tok.eog_ids,
                               ignore_eos=ignore_eos, step=always_guessing(Scripted(script, wrong=wrong)))
        assert gen.tokens == plain.tokens and gen.stop_reason == "eog", (wrong, ignore_eos)
        assert constraint.tokens == plain.tokens and session.tokens == prompt + plain.tokens
        assert gen.accepted > 0 and (wrong is None or gen.drafted > gen.accepted)
        assert getattr(constraint, "rolled", 0) > 0 or not ignore_eos     # tokens past the end were taken back


# ---- in the server's batched step (app/serve/engine_loop.py, as it is) -------------------------------

def test_constrained_requests_in_one_batch_through_preemption(tok, ll, engine):
    """Four requests in one batch: two under the schema, one under a Lark grammar, one free. A
    pool far too small preempts some (the scheduler keeps a preempted request's sampler, so its
    matcher keeps its place); every output is the one a roomy pool gives, the constrained ones
    valid, and the free one's text is what it has alone, beside constrained neighbours."""
    from app.serve.engine_loop import EngineLoop
    from app.serve.sequence import Ask, Sequence
    from common.paged_kv import PageTable
    n = 32
    date = 'start: DATE "."\nDATE: /[0-9]{4}-[0-9]{2}-[0-9]{2}/\n'
    asks = [("The capital of France is", None), ("A person, as JSON:", Grammar.json_schema(PERSON)),   # the free
            ("The date the Berlin Wall fell:", Grammar.lark(date)), ("Another person, as JSON:",       # one grows,
                                                                     Grammar.json_schema(PERSON))]   # newer ones yield

    def run(pages, which, speculation=None):
        loop = EngineLoop(engine, kv_pages=pages, max_batch=len(which), prefill_chunk=16, speculation=speculation)
        seqs = []
        for text, grammar in which:
            seq = Sequence(Ask(prompt=ids(tok, text), max_tokens=n, stop_ids=frozenset(tok.eog_ids)))
            seq.sampler = Sampler(constraint=None if grammar is None else Constraint(grammar.checked(ll), ll))
            loop.submit(seq)
            seqs.append(seq)
        while not loop.scheduler.idle:
            loop.step()
        return loop, [s.generated for s in seqs], [s.preemptions for s in seqs], seqs
    alone = max(PageTable.pages_for(len(ids(tok, text)) + n) for text, _ in asks)
    _, roomy, _, _ = run(64, asks)
    _, crowded, preempted, _ = run(alone + 1, asks)   # room for one request's worst case and a page
    assert crowded == roomy and any(preempted[1:]), preempted                  # a constrained one was preempted
    # with speculative decoding (every guess lookup finds, a step's rows costing nothing more):
    # guesses the grammar forbids refused, the kept ones moving each matcher on, the same texts
    from app.serve.speculation import Speculation, StepTime
    loop, guessed, _, seqs = run(64, asks, Speculation(engine.n_ctx, 8, StepTime({1: 1.0, 1 << 16: 1.0})))
    assert guessed == roomy and all(s.guesser.counts.drafted for s in seqs[1:3]), \
        [s.guesser.counts.drafted for s in seqs]
    assert all(s.sampler.constraint.tokens == out for s, out in zip(seqs[1:], guessed[1:]))
    for (text, grammar), out in zip(asks, roomy):
        body = tok.decode([t for t in out if t not in tok.eog_ids])
        if grammar is None:
            assert out == run(64, [(text, None)])[1][0]
        elif grammar.kind == "lark":
            assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}\.", body) and out[-1] in tok.eog_ids, body
        else:
            jsonschema.validate(json.loads(body), PERSON)


# ---- the benchmark's page -------------------------------------------------------------------------

def test_the_bench_page_is_drawn_from_its_record():
    """`python -m app bench constrain`'s page from a made-up record: medians over rounds, ratios taken
    within each round, the mask's share of the server's step."""
    from app.measure.constrain_bench import page
    b1 = [(6.0, 6.5), (8.0, 8.0), (7.0, 14.0)]                 # run: plain, constrained
    one = [(5.0, 5.5), (6.0, 6.0), (5.5, 11.0)]                # the server, 1 request
    eight = [(10.0, 11.0, 12.5), (12.0, 12.0, 12.0), (11.0, 11.0, 22.0)]   # 8: plain, filled, one by one
    rounds = [{"batch1": {"plain_ms": a, "constrained_ms": b, "tokens": 30},
               "server": {"1": {"plain_ms": c, "constrained_ms": d},
                          "8": {"plain_ms": e, "constrained_ms": f, "one by one_ms": g}}}
              for (a, b), (c, d), (e, f, g) in zip(b1, one, eight)]
    masks = {"batch1": {"mask_us": [30.0, 40.0, 50.0], "apply_us": [20.0, 20.0, 20.0]},
             "batch8": {"fill_us_per_row": [35.0, 45.0], "apply_us_per_row": [25.0, 25.0]}}
    record = {"kind": "constrain", "command": "python -m app bench constrain", "n_vocab": 49152,
              "settings": {"stage": "repack", "threads": 2, "model": "m.gguf", "rounds": 3, "n_predict": 64},
              "machine": {"cpu": "a CPU", "physical_cores": 2}, "provenance": {"commit": "abc", "code_hash": "h"},
              "rounds": rounds, "masks": {"json schema": masks}, "texts": {"json schema": '{"a": 1}'}}
    text = page(record, "profiles/bench/constrain.json")
    assert "| run | 1 | 7.00 | 8.00 | 0.923 |" in text                  # ratios 0.923, 1.0, 0.5: their median
    assert "| server | 1 | 5.50 | 6.00 | 0.909 |" in text               # 0.909, 1.0, 0.5
    assert "| server | 8 | 11.00 | 11.00 (masks filled at once) | 1.000 |" in text      # 0.909, 1.0, 1.0: their median
    assert "| server | 8 | 11.00 | 12.50 (masks one by one) | 0.800 |" in text        # 0.8, 1.0, 0.5
    # mask 40 + apply 20 us of a 5.5 ms step; 8 rows of (40 + 25) us of an 11 ms step
    assert "| json schema | 40.0 / 48.0 | 20.0 | 1.1% | 40.0 / 44.0 | 25.0 | 4.7% |" in text
