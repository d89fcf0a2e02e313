"""The HTTP server (app/serve/routes.py, server.py) over StubEngine, in this process: OpenAI's fields and
shapes through the official `openai` client, llama-server's /tokenize and /detokenize, /metrics
through prometheus-client's own parser, the operator's switches (API key, CORS, body limit,
time limit, draining), a failing engine step, and the text pieces (stop strings, log-probability
entries). The engine is a stub (tests/stub_engine.py: each next token a hash of every token the
sequence's pages hold), so these run in seconds; tests/test_serve.py runs the real model.

What is expected comes from outside the server where it can: llama.cpp's token ids
(tests/golden/tokenizer/), the vocabulary's strings read from the GGUF file and GPT-2's byte
alphabet for the logprobs' token strings, OpenAI's definitions of the penalties computed over
the stub's own logits. Each check is a function that returns what it found wrong, run on the
server as it is and on one with a bug planted (monkeypatch), which it must flag. Moments are
made known, not waited for: the engine loop is parked between two steps (StubServer.paused),
and the tests wait on the conditions the loop and the metrics expose, never on a clock.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections import Counter

import httpx
import jsonschema
import numpy as np
import pytest

from app.serve import api, replies, routes
from app.serve import engine_loop as app_engine_loop
from app.serve import server as server_module
from app.serve.metrics import OUTCOMES
from app.serve.replies import token_string
from app.serve.sequence import Ask, Sequence
from app.serve.text import StopMatcher, TextStream
from common.tokenizer import Tokenizer
from tests.conftest import ROOT
from tests.stub_engine import StubServer
from tests.stub_engine import tokenizer as stub_tokenizer
from tests.util import sent_until_stop

openai = pytest.importorskip("openai", reason="openai is in requirements.txt")

MODEL = "stub-model"


@pytest.fixture(scope="module")
def srv(default_model_path):
    with StubServer(default_model_path, n_ctx=512, kv_pages=64, max_batch=8, max_queue=8) as s:
        yield s


def client(s, key="none", **kw):
    return openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0, timeout=30, **kw)


def settled(s) -> dict:
    """/health once nothing runs or waits (the engine loop's own condition: cancellations land
    at a step boundary)."""
    s.idle()
    return httpx.get(s.url + "/health", timeout=30).json()


def greedy(s, prompt_ids, n):
    return s.engine.reference(prompt_ids, n)


# ---- OpenAI's fields, OpenAI's shapes ----------------------------------------------------------

def test_completions_with_n_logprobs_and_echo_come_back_in_openais_shape(srv):
    tok = srv.engine.tokenizer
    prompt = "The history of the printing press"
    ids = tok.encode(prompt)
    r = client(srv).completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, n=2, logprobs=3,
                                       echo=True, user="someone", seed=3, frequency_penalty=0.0,
                                       presence_penalty=0.0)
    assert [c.index for c in r.choices] == [0, 1]
    want = greedy(srv, ids, 6)
    for c in r.choices:
        lp = c.logprobs
        assert c.text.startswith(prompt) and c.finish_reason == "length"
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids) + 6
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, "the first prompt token has no context"
        assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
        assert "".join(lp.tokens) == c.text
        assert [c.text[o:o + len(t)] for o, t in zip(lp.text_offset, lp.tokens)] == lp.tokens
        assert all(len(top) == 3 for top in lp.top_logprobs[1:])
        assert lp.tokens[len(ids):] == [token_string(tok, t)[0] for t in want]
        for t, x, top in zip(lp.tokens[len(ids):], lp.token_logprobs[len(ids):], lp.top_logprobs[len(ids):]):
            assert max(top.values()) == x == top[t], "greedy: the chosen token is the most likely"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 12
    assert settled(srv)["kv_pages_free"] == 64


def test_chat_with_logprobs_streamed_and_not(srv):
    kw = dict(model=MODEL, messages=[{"role": "developer", "content": "Be brief."},
                                     {"role": "user", "content": "Hello"}],
              max_completion_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    c = client(srv)
    r = c.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert r.usage.completion_tokens == 5 and len(content) == 5
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob
        assert bytes(e.bytes).decode() == e.token
    chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].choices == []
    system = c.chat.completions.create(**dict(kw, messages=[{"role": "system", "content": "Be brief."},
                                                            {"role": "user", "content": "Hello"}]))
    other = c.chat.completions.create(**dict(kw, messages=[{"role": "system", "content": "Be long."},
                                                           {"role": "user", "content": "Hello"}]))
    assert system.usage.prompt_tokens == r.usage.prompt_tokens and system.choices[0].message == r.choices[0].message
    assert other.choices[0].message.content != r.choices[0].message.content, "the twin: another system prompt"


def test_n_choices_stream_each_with_its_index(srv):
    chunks = list(client(srv).completions.create(model=MODEL, prompt="Once", max_tokens=4, temperature=0.8,
                                                 seed=11, n=3, stream=True))
    by_index = {}
    for ch in chunks:
        for c in ch.choices:
            by_index.setdefault(c.index, []).append(c)
    assert sorted(by_index) == [0, 1, 2]
    assert all(cs[-1].finish_reason == "length" for cs in by_index.values())
    texts = {"".join(c.text for c in cs) for cs in by_index.values()}
    assert len(texts) == 3, "seeded choices are drawn apart, each its own"


def paced_stream_problems(s, monkeypatch) -> list[str]:
    """A stream on a server whose --stream-interval no decode outlasts: its first token wakes the
    handler at once, the others wait for the end's wake-up and go out together in one event, with
    their log-probability entries; the text is the whole reply's, and a request with a stop string
    still wakes the handler per token (a stop string is looked for as the text grows)."""
    wakes = []
    send = server_module.Mail.send
    monkeypatch.setattr(server_module.Mail, "send", lambda self, inbox: wakes.append(inbox) or send(self, inbox))
    kw = dict(model=MODEL, prompt="Once", max_tokens=12, temperature=0, logprobs=1)
    c = client(s)
    whole = c.completions.create(**kw).choices[0]
    wakes.clear()
    chunks = list(c.completions.create(stream=True, **kw))
    problems = []
    pieces = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].text]
    if "".join(p.text for p in pieces) != whole.text:
        problems.append("the streamed text is not the whole reply's")
    if [t for p in pieces for t in p.logprobs.tokens] != whole.logprobs.tokens:
        problems.append("the entries did not go out with their text")
    if len(wakes) != 2:
        problems.append(f"{len(wakes)} wake-ups of the handler for 12 tokens, not 2 (the first token, the end)")
    if len(pieces) > 2:
        problems.append(f"{len(pieces)} events of text, not at most 2")
    wakes.clear()
    list(c.completions.create(stream=True, stop=["never there"], **kw))
    if len(wakes) < 12:
        problems.append(f"a request with a stop string woke its handler {len(wakes)} times for 12 tokens")
    return problems


@pytest.mark.parametrize("planted", [None, "each token wakes", "one event per token"])
def test_a_paced_stream_sends_the_tokens_made_between_two_wake_ups_together(default_model_path, monkeypatch,
                                                                             planted):
    if planted == "each token wakes":
        monkeypatch.setattr(server_module.Inbox, "put_paced", lambda self, event: self.put(event))
    elif planted == "one event per token":
        monkeypatch.setattr(server_module.Inbox, "take_ready", lambda self: [])
    with StubServer(default_model_path, stream_interval=1e6) as s:
        problems = paced_stream_problems(s, monkeypatch)
    assert (problems == []) == (planted is None), problems


def test_logit_bias_moves_the_greedy_token(srv):
    tok = srv.engine.tokenizer
    ids = tok.encode("Water boils at")
    first = greedy(srv, ids, 1)[0]
    c = client(srv)

    def first_token(**kw):
        r = c.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=0, **kw)
        return r.choices[0].logprobs.tokens[0]
    assert first_token() == token_string(tok, first)[0]
    assert first_token(logit_bias={str(first): -100}) != token_string(tok, first)[0]
    near = first + 3                                         # the stub's logit there: 1.5 below the best
    assert first_token(logit_bias={str(near): 2}) == token_string(tok, near)[0]
    assert first_token(logit_bias={str(near): 1}) == token_string(tok, first)[0], "the twin: too small a bias"


def test_cached_tokens_count_the_shared_prefix_pages(srv):
    prompt = list(range(400, 450))                              # 3 full pages and 2 positions
    c = client(srv)
    first = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 48
    assert second.choices[0].text == first.choices[0].text


def test_echo_with_max_tokens_0_scores_the_prompt(srv):
    ids = list(range(500, 540))
    c = client(srv)
    r = c.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert r.usage.completion_tokens == 0 and r.choices[0].finish_reason == "length"
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    for j in range(1, len(ids)):                            # the stub's log-softmax: its peak at the next token
        peak = srv.engine.next_token(ids[:j])
        want = -0.5 * abs(ids[j] - peak)
        assert lp.token_logprobs[j] - max(lp.top_logprobs[j].values()) == pytest.approx(want)
    boundary = list(range(500, 565))                       # 65 tokens: the first chunk (64) ends at its last but one
    r = c.completions.create(model=MODEL, prompt=boundary, max_tokens=0, echo=True, logprobs=0)
    assert len(r.choices[0].logprobs.token_logprobs) == 65 and r.choices[0].finish_reason == "length"
    plain = c.completions.create(model=MODEL, prompt="Just this", max_tokens=0, echo=True)
    assert plain.choices[0].text == "Just this" and plain.choices[0].logprobs is None


def test_paths_without_v1_answer_too(srv):
    assert httpx.get(srv.url + "/models").json()["data"][0]["id"] == MODEL
    r = httpx.post(srv.url + "/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["object"] == "text_completion"
    r = httpx.post(srv.url + "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 2})
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"


CITY = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["C", "F"]}}}}}
SUM = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                                  "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                                                 "y": {"type": "integer", "minimum": 0, "maximum": 99}}}}}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (CITY, SUM)}
REFUSED = [
    ("/v1/chat/completions", {"tools": [{"type": "function"}]}, 'tools[0] must be {"type": "function"', "tools"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}}, "llguidance refuses it: Invalid type: strin", "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, 'response_format must be {"type": "text"}',
     "response_format"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice 'required' needs tools", "tool_choice"),
    ("/v1/chat/completions", {"tools": [CITY], "tool_choice": {"type": "function", "function": {"name": "mul"}}},
     "'mul', which is not among the tools", "tool_choice"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions: not supported", "functions"),
    ("/v1/completions", {"tools": [CITY]}, "tools: tools are for chat completions", "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "18 C"}]}, "needs tool_call_id", "messages"),
    ("/v1/completions", {"suffix": "x"}, "suffix: not supported", "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of: not supported", "best_of"),
    ("/v1/completions", {"n": 9}, "n = 9: must be an integer in 1..8", "n"),
    ("/v1/completions", {"logprobs": 6}, "logprobs = 6", "logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs needs logprobs: true", "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs = 21", "top_logprobs"),
    ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias: key 'x'", "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias = ", "logit_bias"),
    ("/v1/completions", {"frequency_penalty": 3}, "frequency_penalty = 3", "frequency_penalty"),
    ("/v1/completions", {"presence_penalty": "a"}, "presence_penalty = 'a'", "presence_penalty"),
    ("/v1/completions", {"max_tokens": 0}, "0 only with echo", "max_tokens"),
    ("/v1/completions", {"prompt": [1, 99999999]}, "prompt token ids must be in", "prompt"),
    ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens = 0", "max_completion_tokens"),
    ("/v1/completions", {"max_tokens": 600}, "context window of 512", "max_tokens"),
]


@pytest.mark.parametrize("path,fields,reason,param", REFUSED, ids=[r[2] for r in REFUSED])
def test_what_is_not_done_here_is_a_400_that_names_it(srv, path, fields, reason, param):
    body = dict({"prompt": "hi"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]},
                **fields)
    r = httpx.post(srv.url + path, json=body, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert reason in err["message"] and err["param"] == param and err["type"] == "invalid_request_error"


def test_neutral_values_of_unsupported_fields_are_accepted(srv):
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 1, "store": False, "tools": None})
    assert r.status_code == 200, r.text

# ---- structured outputs and tool calls (app/structured/ through the server) ---------------------
# The stub's next token is a hash of the context; under a grammar it takes the allowed token
# nearest that hash, so what comes back is the grammar's doing, and the shapes are the server's.

def test_a_refused_schema_leaves_the_server_serving(srv):
    before = srv.loop.stats()["failures"]
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "d": {"type": "string", "format": "colour"}}}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client(srv).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            response_format=bad)
    assert refused.value.body["param"] == "response_format" and "Unknown format: colour" in refused.value.message
    unit = {"type": "object", "required": ["unit"], "properties": {"unit": {"enum": ["C", "F"]}},
            "additionalProperties": False}
    good = client(srv).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=80, temperature=0, response_format={
                                                   "type": "json_schema", "json_schema": {"name": "u", "schema": unit}})
    jsonschema.validate(json.loads(good.choices[0].message.content), unit)
    assert srv.loop.stats()["failures"] == before


def tool_call_problems(s) -> list[str]:
    """tool_choice required, one call. Whole: content null, one call with an id, type function,
    a tool's name and arguments its parameters accept (jsonschema), finish_reason tool_calls.
    Streamed: the call opens with its index, id, type, name and empty arguments, then only
    arguments follow, in pieces that join to the whole's; finish_reason tool_calls at the end;
    and the log-probability entries are the whole's, token for token."""
    body = dict(model=MODEL, messages=[{"role": "user", "content": "The weather in Paris?"}], tools=[CITY, SUM],
                tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=150, logprobs=True)
    problems = []
    whole = client(s).chat.completions.create(**body).choices[0]
    calls = whole.message.tool_calls or []
    if whole.message.content is not None or len(calls) != 1 or whole.finish_reason != "tool_calls":
        return [f"whole: {whole}"]
    call = calls[0]
    if not call.id.startswith("call_") or call.type != "function" or call.function.name not in PARAMETERS:
        problems.append(f"whole: the call {call}")
    else:
        try:
            jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
        except (ValueError, jsonschema.ValidationError) as e:
            problems.append(f"whole: arguments {call.function.arguments!r}: {e}")
    chunks = [ch.choices[0] for ch in client(s).chat.completions.create(stream=True, **body) if ch.choices]
    pieces = [d.tool_calls for ch in chunks if (d := ch.delta).tool_calls]
    if not pieces or any(len(p) != 1 or p[0].index != 0 for p in pieces):
        return problems + [f"streamed: {pieces}"]
    head, rest = pieces[0][0], [p[0] for p in pieces[1:]]
    if not (head.id and head.id.startswith("call_") and head.type == "function"
            and (head.function.name, head.function.arguments) == (call.function.name, "")):
        problems.append(f"streamed: the call opens with {head}")
    if any(p.id or p.type or p.function.name for p in rest):
        problems.append("streamed: an id, type or name after the call's first delta")
    if "".join(p.function.arguments for p in rest) != call.function.arguments or len(rest) < 2:
        problems.append(f"streamed: arguments {[p.function.arguments for p in rest]} for {call.function.arguments!r}")
    if any(ch.delta.content for ch in chunks) or chunks[-1].finish_reason != "tool_calls":
        problems.append(f"streamed: content {[ch.delta.content for ch in chunks]}, end {chunks[-1].finish_reason}")
    streamed = [e.token for ch in chunks if ch.logprobs for e in ch.logprobs.content]
    if streamed != [e.token for e in whole.logprobs.content]:
        problems.append(f"streamed log-probabilities: {streamed}")
    return problems


@pytest.mark.parametrize("planted", [None, "finish", "text"])
def test_tool_calls_come_back_in_openais_shape_whole_and_streamed(srv, monkeypatch, planted):
    if planted == "finish":                                 # planted: the reason stays 'stop'
        monkeypatch.setattr(replies, "called", lambda finish: finish)
    if planted == "text":                                   # planted: a streamed call goes out as text
        plain = replies.Reply.piece

        def as_text(self, i, text, entries, finish=None):
            self.tools = False
            return plain(self, i, text, entries, finish)
        monkeypatch.setattr(replies.Reply, "piece", as_text)
    assert (tool_call_problems(srv) == []) == (planted is None), planted


def forked_choices_problems(s, stream: bool) -> list[str]:
    """A text completion (response_format, as llama-server takes it) with n = 3 sampled choices:
    each follows the schema on its own, valid (jsonschema) and ended by the grammar."""
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "n"],
              "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                             "n": {"type": "integer", "minimum": 0, "maximum": 999}}}
    body = dict(model=MODEL, prompt="A city as JSON:", n=3, temperature=1.0, seed=7, max_tokens=120,
                extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}})
    try:
        if stream:
            texts, finish = [""] * 3, [None] * 3
            for ch in client(s).completions.create(stream=True, **body):
                for c in ch.choices:
                    texts[c.index] += c.text
                    finish[c.index] = c.finish_reason or finish[c.index]
        else:
            choices = sorted(client(s).completions.create(**body).choices, key=lambda c: c.index)
            texts, finish = [c.text for c in choices], [c.finish_reason for c in choices]
    except openai.APIError as e:
        return [f"the request failed: {e}"]
    problems = [] if finish == ["stop"] * 3 else [f"finish reasons {finish}"]
    for text in texts:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as e:
            problems.append(f"{text!r}: {e}")
    return problems


def unforked(self):
    """WRONG, planted: followers take the pages, not the constraint (they decode free)."""
    followers = [f for f in self.followers if not f.done]
    self.followers = []
    for f in followers:
        f.leader, f.table = None, self.table.fork()
    return followers


def shared(self):
    """WRONG, planted: followers share the leader's matcher (each token moves all of them)."""
    followers = unforked(self)
    for f in followers:
        f.sampler.constraint = self.sampler.constraint
    return followers


@pytest.mark.parametrize("planted", [None, unforked, shared], ids=["fork", "unforked", "shared"])
def test_n_choices_each_follow_the_grammar_on_their_own(srv, monkeypatch, planted):
    if planted is not None:
        monkeypatch.setattr(Sequence, "fork", planted)
    found = forked_choices_problems(srv, stream=False) + forked_choices_problems(srv, stream=True)
    assert (found == []) == (planted is None), found
    srv.idle()


def grammar_end_problems(s) -> list[str]:
    """ignore_eos with a grammar: the grammar's end still ends the reply ('stop', long before
    max_tokens), and the end token is no text."""
    schema = {"type": "object", "additionalProperties": False, "required": ["unit"],
              "properties": {"unit": {"enum": ["C", "F"]}}}
    r = httpx.post(s.url + "/v1/completions", json={
        "prompt": "A unit:", "max_tokens": 300, "temperature": 0, "ignore_eos": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "u", "schema": schema}}}).json()
    c = r["choices"][0]
    problems = [] if (c["finish_reason"], r["usage"]["completion_tokens"] < 300) == ("stop", True) else \
        [f"{c['finish_reason']} after {r['usage']['completion_tokens']} tokens"]
    try:
        jsonschema.validate(json.loads(c["text"]), schema)
    except (ValueError, jsonschema.ValidationError) as e:
        problems.append(f"{c['text']!r}: {e}")
    return problems


def test_a_grammar_ends_the_reply_even_with_ignore_eos(srv, monkeypatch):
    assert grammar_end_problems(srv) == []
    monkeypatch.setattr(Sequence, "end_reason", lambda self: (    # planted: the grammar's end not heard
        "stop" if self.generated and self.generated[-1] in self.ask.stop_ids else
        "length" if len(self.generated) >= self.ask.max_tokens else None))
    assert grammar_end_problems(srv) != []


def test_requests_without_a_grammar_make_no_matcher_and_no_mask(srv, monkeypatch):
    """Unconstrained requests (completions, chat, n = 2, streamed, response_format text) pay
    nothing: no matcher is made, no mask computed, the engine loop fills none; one constrained
    request afterwards is seen by the same counters."""
    from app.serve import engine_loop
    from common.constrain import Constraint
    made = Counter()
    real_init, real_mask, real_fill = Constraint.__init__, Constraint.mask, engine_loop.fill_masks
    monkeypatch.setattr(Constraint, "__init__", lambda self, *a, **k: (made.update(["matcher"]),
                                                                      real_init(self, *a, **k))[1])
    monkeypatch.setattr(Constraint, "mask", lambda self: (made.update(["mask"]), real_mask(self))[1])
    monkeypatch.setattr(engine_loop, "fill_masks", lambda cs: (made.update(["fill"]), real_fill(cs))[1])
    c, chat = client(srv), [{"role": "user", "content": "hi"}]
    c.completions.create(model=MODEL, prompt="hi", max_tokens=8, n=2, temperature=0)
    c.chat.completions.create(model=MODEL, messages=chat, max_tokens=8, response_format={"type": "text"})
    list(c.chat.completions.create(model=MODEL, messages=chat, max_tokens=8, stream=True))
    assert made == Counter()
    c.chat.completions.create(model=MODEL, messages=chat, max_tokens=60, response_format={"type": "json_object"})
    assert made["matcher"] == 1 and made["fill"] > 0 and made["mask"] > 0


def test_a_kv_pool_too_small_for_the_request_is_a_400_that_says_so(default_model_path):
    with StubServer(default_model_path, n_ctx=512, kv_pages=4) as s:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 100})
        assert r.status_code == 400 and "--kv-pages" in r.json()["error"]["message"]
        assert httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 40}).status_code == 200


# ---- the fields' behaviour, computed outside the server ----------------------------------------

def penalized_greedy(engine, prompt, n: int, presence: float = 0.0, frequency: float = 0.0) -> list[int]:
    """Greedy over the stub's own logits (tests/stub_engine.py: -0.5 |id - peak|) with OpenAI's
    penalties as OpenAI defines them: logit[j] -= count[j] * frequency + (count[j] > 0) * presence,
    count over the tokens this completion has drawn."""
    ctx, out, counts = list(prompt), [], Counter()
    ids = np.arange(engine.config.n_vocab)
    for _ in range(n):
        logits = -0.5 * np.abs(ids - engine.next_token(ctx))
        for j, c in counts.items():
            logits[j] -= c * frequency + presence
        t = int(np.argmax(logits))
        out.append(t)
        ctx.append(t)
        counts[t] += 1
    return out


def presence_problems(s) -> list[str]:
    """presence_penalty alone, on a stub that draws among 4 tokens (so it repeats): the text
    OpenAI's rule gives, which is not the plain greedy text."""
    prompt, n = [5, 6, 7], 24
    want = penalized_greedy(s.engine, prompt, n, presence=0.75)
    assert want != s.engine.reference(prompt, n), "the scene: presence must change the greedy text"
    r = httpx.post(s.url + "/v1/completions", timeout=30, json={
        "prompt": prompt, "max_tokens": n, "temperature": 0, "presence_penalty": 0.75}).json()
    text = r["choices"][0]["text"]
    return [] if text == s.engine.tokenizer.decode(want) else [f"presence_penalty 0.75: {text!r}"]


def test_presence_penalty_alone_is_openais(default_model_path, monkeypatch):
    with StubServer(default_model_path, low=300, high=304) as s:
        assert presence_problems(s) == []
        real = api.sampling_params                          # planted: presence_penalty dropped
        monkeypatch.setattr(api, "sampling_params", lambda data, n_vocab: real(
            {k: v for k, v in data.items() if k != "presence_penalty"}, n_vocab))
        assert presence_problems(s) != []


def repeat_problems(s) -> list[str]:
    """llama.cpp's repeat_penalty (taken beside OpenAI's fields) as llama.cpp defines it, over the
    prompt and the text so far (the last 64 tokens): a positive logit divided by it, a negative one
    multiplied. The stub's logits (-0.5 |id - peak|, never positive) are lifted by a logit_bias on
    the 4 tokens it draws among, so that dividing changes which is greatest."""
    prompt, n, bias, penalty = [5, 6, 302], 24, 5.0, 1.5
    ids = np.arange(s.engine.config.n_vocab)

    def greedy(penalized):
        ctx, out = list(prompt), []
        for _ in range(n):
            logits = (-0.5 * np.abs(ids - s.engine.next_token(ctx))).astype(np.float32)
            logits[300:304] += np.float32(bias)
            if penalized:
                seen = np.unique(np.asarray(ctx[-64:]))
                v = logits[seen]
                logits[seen] = np.where(v <= 0, v * penalty, v / penalty)
            out.append(int(np.argmax(logits)))
            ctx.append(out[-1])
        return out
    want = greedy(True)
    assert want != greedy(False), "the scene: the penalty must change the greedy text"
    r = httpx.post(s.url + "/v1/completions", timeout=30, json={
        "prompt": prompt, "max_tokens": n, "temperature": 0, "repeat_penalty": penalty,
        "logit_bias": {str(t): bias for t in range(300, 304)}}).json()
    text = r["choices"][0]["text"]
    return [] if text == s.engine.tokenizer.decode(want) else [f"repeat_penalty {penalty}: {text!r}"]


def test_repeat_penalty_looks_back_over_the_prompt_and_the_text(default_model_path, monkeypatch):
    with StubServer(default_model_path, low=300, high=304) as s:
        assert repeat_problems(s) == []
        monkeypatch.setattr(Sequence, "history", property(lambda self: []))     # planted: nothing looked back on
        assert repeat_problems(s) != []


class FirstListed(StopMatcher):
    """A planted bug: the stop string listed first wins, wherever the others occur."""

    def push(self, text):
        for stop in self.stops:
            i = (self.pending + text).find(stop)
            if i >= 0:
                out, self.pending = (self.pending + text)[:i], ""
                return out, True
        return super().push(text)


def several_stops(cls) -> list[str]:
    """(stops, pieces, the text sent): the earliest stop string in the text wins whatever its
    place in the list, found over pieces, and what was held back for one is sent when another
    matches later."""
    cases = [(["lo", "el"], ["hel", "lo"], "h"),
             (["world", "o w"], ["hello world"], "hell"),
             (["</end>", "<x>"], ["ab", "c<", "/e", "nd>x"], "abc"),
             (["xyz", "yq"], ["ax", "yq"], "ax")]
    problems = []
    for stops, pieces, want in cases:
        m, sent, hit = cls(stops), "", False
        for piece in pieces:
            out, hit = m.push(piece)
            sent += out
            if hit:
                break
        if (sent, hit) != (want, True):
            problems.append(f"{stops} over {pieces}: sent {sent!r} (stopped: {hit}), not {want!r}")
    return problems


def test_of_several_stop_strings_the_earliest_wins_over_pieces():
    assert several_stops(StopMatcher) == []
    assert several_stops(FirstListed) != []


def stop_limit_problems(url: str) -> list[str]:
    body = {"prompt": "hi", "max_tokens": 2}
    four = httpx.post(url + "/v1/completions", json=dict(body, stop=["a1", "b2", "c3", "d4"]))
    five = httpx.post(url + "/v1/completions", json=dict(body, stop=["a1", "b2", "c3", "d4", "e5"]))
    problems = [] if four.status_code == 200 else [f"4 stop strings: {four.status_code}"]
    if five.status_code != 400 or "at most 4 strings" not in five.json()["error"]["message"]:
        problems.append(f"5 stop strings: {five.status_code}")
    return problems


def test_at_most_four_stop_strings(srv, monkeypatch):
    assert stop_limit_problems(srv.url) == []
    monkeypatch.setattr(api, "MAX_STOP_STRINGS", 5)         # planted: one more taken
    assert stop_limit_problems(srv.url) != []


def choices_stop_problems(s) -> list[str]:
    """n = 2 seeded choices, streamed and not, with a stop string found in both texts at other
    places: each choice ends at the first stop string in its own text."""
    body = {"prompt": "Once", "max_tokens": 12, "temperature": 1.0, "seed": 5, "n": 2}
    free = httpx.post(s.url + "/v1/completions", json=body).json()["choices"]
    full = [c["text"] for c in sorted(free, key=lambda c: c["index"])]
    stop = min(ch for ch in set(full[0][1:]) & set(full[1][1:]) if ch.strip())
    want = [(t[:t.index(stop)], "stop") for t in full]
    assert all(w for w, _ in want) and want[0] != want[1], "the scene: the choices end apart"
    got = httpx.post(s.url + "/v1/completions", json=dict(body, stop=stop)).json()["choices"]
    problems = []
    if sorted((c["index"], c["text"], c["finish_reason"]) for c in got) != [(i, *w) for i, w in enumerate(want)]:
        problems.append(f"stop {stop!r}: {got}, not {want}")
    texts, finish = ["", ""], [None, None]
    for ch in client(s).completions.create(model=MODEL, stream=True, stop=stop, **body):
        for c in ch.choices:
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
    if list(zip(texts, finish)) != want:
        problems.append(f"streamed, stop {stop!r}: {list(zip(texts, finish))}, not {want}")
    return problems


def test_each_choice_ends_at_its_own_stop_string(srv, monkeypatch):
    assert choices_stop_problems(srv) == []
    made = iter(range(10 ** 6))

    class FirstChoiceOnly(TextStream):                      # planted: the stops reach choice 0 only
        def __init__(self, tokenizer, stops, special=False, base=0, end_ids=frozenset()):
            super().__init__(tokenizer, stops if next(made) % 2 == 0 else [], special, base, end_ids)
    monkeypatch.setattr(server_module, "TextStream", FirstChoiceOnly)
    assert choices_stop_problems(srv) != []


def stop_frees_problems(s) -> list[str]:
    """A stop string met early in a request for 400 tokens: the reply ends there, the sequence
    is cancelled at the next step boundary (not run to its length) and its pages come back."""
    prompt = [11, 12, 13]
    text = s.engine.tokenizer.decode(s.engine.reference(prompt, 12))
    stop = text[len(text) // 2:len(text) // 2 + 3]
    before = s.loop.stats()
    r = httpx.post(s.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 400, "temperature": 0,
                                                    "stop": stop}).json()
    after = s.idle()
    problems = []
    if (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) != (text[:text.index(stop)], "stop"):
        problems.append(f"the reply: {r['choices'][0]}")
    ended = {k: after["finished"][k] - before["finished"][k] for k in ("cancelled", "length")}
    if ended != {"cancelled": 1, "length": 0}:
        problems.append(f"the sequence ended {ended}: it ran on after its stop string")
    if after["generated_tokens"] - before["generated_tokens"] >= 400:
        problems.append("all 400 tokens were made")
    return problems


def test_a_stop_string_ends_the_sequence_and_frees_its_pages(default_model_path, monkeypatch):
    from app.serve.engine_loop import EngineLoop
    with StubServer(default_model_path) as s:
        assert stop_frees_problems(s) == []
        monkeypatch.setattr(EngineLoop, "cancel", lambda self, seq: None)      # planted: never cancelled
        assert stop_frees_problems(s) != []


def logit_bias_bound_problems(s) -> list[str]:
    n_vocab = s.engine.config.n_vocab
    last = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1,
                                                       "logit_bias": {str(n_vocab - 1): 1}})
    past = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1,
                                                       "logit_bias": {str(n_vocab): 1}})
    problems = [] if last.status_code == 200 else [f"key {n_vocab - 1}: {last.status_code}"]
    if past.status_code != 400 or f"key '{n_vocab}' is not a token id in 0..{n_vocab - 1}" not in past.text:
        problems.append(f"key {n_vocab}: {past.status_code}")
    return problems


def test_logit_bias_keys_are_the_vocabularys_ids(srv, monkeypatch):
    assert logit_bias_bound_problems(srv) == []
    real = api.logit_bias                                   # planted: one id past the vocabulary taken
    monkeypatch.setattr(api, "logit_bias", lambda data, n_vocab: real(data, n_vocab + 1))
    assert logit_bias_bound_problems(srv) != []


def end_of_generation_problems(s) -> list[str]:
    """On a stub that ends every sequence of 7 tokens (its next token <|im_end|>): a prompt of 4
    gets 3 tokens, then the end; the end is no text and no log-probability entry, whole or
    streamed; a chat prompt (longer than 7) ends at once, with nothing."""
    prompt, eos = [21, 22, 23, 24], s.engine.eos
    made = s.engine.reference(prompt, 10, stop={eos})
    assert made[-1] == eos and len(made) == 4, "the scene: 3 tokens, then the end"
    want = [token_string(s.engine.tokenizer, t)[0] for t in made[:3]]
    text = s.engine.tokenizer.decode(made[:3])
    body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 1}
    problems = []
    c = httpx.post(s.url + "/v1/completions", json=body).json()["choices"][0]
    if (c["text"], c["logprobs"]["tokens"], c["finish_reason"]) != (text, want, "stop"):
        problems.append(f"whole: {c['text']!r} {c['logprobs']['tokens']} {c['finish_reason']}")
    streamed = list(client(s).completions.create(model=MODEL, stream=True, **body))
    tokens = [t for ch in streamed for c in ch.choices if c.logprobs for t in c.logprobs.tokens]
    if ("".join(c.text for ch in streamed for c in ch.choices), tokens) != (text, want):
        problems.append(f"streamed: {tokens}")
    chat = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                            "temperature": 0, "logprobs": True}).json()["choices"][0]
    if (chat["message"]["content"], chat["logprobs"]["content"], chat["finish_reason"]) != ("", [], "stop"):
        problems.append(f"chat: {chat}")
    return problems


def test_the_end_of_generation_is_never_text_nor_a_logprob(default_model_path, monkeypatch):
    tok = stub_tokenizer(str(default_model_path))
    with StubServer(default_model_path, eos=tok.token_to_id("<|im_end|>"), eos_at=7) as s:
        assert end_of_generation_problems(s) == []

        class EndsAreTokens(TextStream):                    # planted: end ids streamed like any token
            def __init__(self, tokenizer, stops, special=False, base=0, end_ids=frozenset()):
                super().__init__(tokenizer, stops, special, base)
        monkeypatch.setattr(server_module, "TextStream", EndsAreTokens)
        assert end_of_generation_problems(s) != []


def default_length_problems(s) -> list[str]:
    """Without max_tokens: 16 tokens for completions (OpenAI's default), and for chat up to the
    context's end (128 here)."""
    c = httpx.post(s.url + "/v1/completions", json={"prompt": "hi"}).json()
    chat = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    problems = []
    if (c["usage"]["completion_tokens"], c["choices"][0]["finish_reason"]) != (16, "length"):
        problems.append(f"completions: {c['usage']}")
    u = chat["usage"]
    if (u["prompt_tokens"] + u["completion_tokens"], chat["choices"][0]["finish_reason"]) != (128, "length"):
        problems.append(f"chat: {u}")
    return problems


def test_max_tokens_defaults_are_openais(default_model_path, monkeypatch):
    with StubServer(default_model_path, n_ctx=128) as s:
        assert default_length_problems(s) == []
        real = api.default_max_tokens                        # planted: one short
        monkeypatch.setattr(api, "default_max_tokens", lambda chat, n_ctx, n_prompt: real(chat, n_ctx, n_prompt) - 1)
        assert default_length_problems(s) != []


# ---- llama-server's /tokenize and /detokenize --------------------------------------------------

def test_tokenize_and_detokenize_take_llama_servers_shapes(srv):
    tok = srv.engine.tokenizer
    text = "Hello world <|im_end|> 🦙"
    r = httpx.post(srv.url + "/tokenize", json={"content": text}).json()
    assert r == {"tokens": tok.encode(text, add_bos=False, parse_special=True)}
    assert tok.token_to_id("<|im_end|>") in r["tokens"], "parse_special defaults to true"
    plain = httpx.post(srv.url + "/tokenize", json={"content": text, "parse_special": False}).json()["tokens"]
    assert tok.token_to_id("<|im_end|>") not in plain
    pieces = httpx.post(srv.url + "/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == r["tokens"]
    assert any(isinstance(p["piece"], list) for p in pieces), "a piece that is not whole UTF-8 comes as bytes"
    assert b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"])
                    for p in pieces) == text.encode()
    back = httpx.post(srv.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"content": tok.decode(r["tokens"])}
    for path, body, what in [("/tokenize", {"content": 5}, "content must be"),
                             ("/tokenize", {"content": "x", "add_special": "yes"}, "add_special = 'yes'"),
                             ("/detokenize", {"tokens": [-1]}, "tokens must be"),
                             ("/detokenize", {"tokens": "12"}, "tokens must be")]:
        bad = httpx.post(srv.url + path, json=body)
        assert bad.status_code == 400 and what in bad.json()["error"]["message"]


GOLDEN = ROOT / "tests" / "golden" / "tokenizer" / "smollm2.json"
MODES = {"plain": (False, False), "add_special": (True, False), "parse_special": (False, True),
         "add_and_parse_special": (True, True)}               # golden case kind: (add_special, parse_special)


@functools.lru_cache(maxsize=None)
def golden_cases() -> list[tuple[str, str, list[int]]]:
    """llama.cpp's own ids for the default model's vocabulary (scripts/goldens/make_tokenizer_golden.py
    made them with llama-cpp-python): (kind, text, ids)."""
    data = json.loads(GOLDEN.read_text(encoding="utf-8"))
    assert data["vocab"] == "smollm2"
    return [(kind, c["text"], c["ids"]) for kind in MODES for c in data["cases"][kind]]


def tokenize_problems(url: str, cases) -> list[str]:
    problems = []
    with httpx.Client(base_url=url, timeout=30) as c:
        for kind, text, ids in cases:
            add, parse = MODES[kind]
            got = c.post("/tokenize", json={"content": text, "add_special": add, "parse_special": parse}).json()
            if got.get("tokens") != ids:
                problems.append(f"{kind} {text[:40]!r}: {got.get('tokens', got)[:8]}..., llama.cpp's {ids[:8]}...")
    return problems


def test_tokenize_gives_llama_cpps_ids(srv, monkeypatch):
    """/tokenize against llama.cpp's ids (not against the server's own tokenizer), every golden
    case of every add_special / parse_special combination."""
    cases = golden_cases()
    assert {k for k, _, _ in cases} == set(MODES) and len(cases) > 600
    assert tokenize_problems(srv.url, cases) == []
    real = Tokenizer.encode                                  # planted: runs of spaces folded before encoding
    monkeypatch.setattr(Tokenizer, "encode", lambda self, text, **kw: real(self, re.sub("  +", " ", text), **kw))
    assert tokenize_problems(srv.url, cases[:60]) != [], "the check sees a tokenizer that differs from llama.cpp"


# ---- logprobs' token strings, from the vocabulary itself ----------------------------------------

def gpt2_byte_of() -> dict[str, int]:
    """GPT-2's byte-level alphabet (openai/gpt-2, encoder.py: bytes_to_unicode): a printable
    byte stands for itself, the others for chr(256 + n) in order; the vocabulary's strings
    are written in it."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(shown), 0
    for b in range(256):
        if b not in shown:
            shown.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(shown, chars)}


@functools.lru_cache(maxsize=None)
def vocabulary(model_path: str) -> tuple[list[str], list[int]]:
    """The token strings and types as the GGUF file stores them (common/gguf.py's parser is
    checked against gguf-py in tests/test_gguf.py)."""
    from common.gguf import GGUFFile
    with GGUFFile(model_path) as g:
        return list(g.metadata["tokenizer.ggml.tokens"]), [int(t) for t in g.metadata["tokenizer.ggml.token_type"]]


def expected_token(model_path, token_id: int) -> tuple[str, list[int]]:
    """OpenAI's token string and bytes for a token: its bytes decoded, or 'bytes:\\xNN...' where
    they are not whole UTF-8; a control token (type 3) is its text."""
    strings, types = vocabulary(str(model_path))
    text = strings[token_id]
    raw = text.encode() if types[token_id] == 3 else bytes(gpt2_byte_of()[ch] for ch in text)
    try:
        return raw.decode("utf-8"), list(raw)
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)


def token_string_problems(s, model_path) -> list[str]:
    """On a stub that generates bytes that are not whole UTF-8 (ids 111..115): a prompt of ids
    with control tokens, such bytes and ordinary pieces, echoed with its log-probabilities; and a
    chat reply held (logit_bias) to one byte token: every token string and byte list as the
    vocabulary says."""
    ids = [1, 111, 300, 303, 112, 2]                 # <|im_start|>, b'\xa1', 'om', ' l', b'\xa2', <|im_end|>
    problems = []
    r = httpx.post(s.url + "/v1/completions", timeout=30, json={
        "prompt": ids, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1}).json()
    generated = s.engine.reference(ids, 3)
    got = r["choices"][0]["logprobs"]["tokens"]
    want = [expected_token(model_path, t)[0] for t in ids + generated]
    if got != want:
        problems.append(f"completion tokens {got} where the vocabulary says {want}")
    chat = httpx.post(s.url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0, "logprobs": True,
        "logit_bias": {"113": 100}}).json()
    for e in chat["choices"][0]["logprobs"]["content"]:
        if (e["token"], e["bytes"]) != expected_token(model_path, 113):
            problems.append(f"chat entry {e['token']!r} {e['bytes']} where {expected_token(model_path, 113)}")
    return problems


def test_logprob_token_strings_are_the_vocabularys_bytes_shown_as_openai_does(default_model_path, monkeypatch):
    assert expected_token(default_model_path, 111) == ("bytes:\\xa1", [0xA1]), "the oracle's own bytes form"
    assert expected_token(default_model_path, 303) == (" l", [32, 108])
    with StubServer(default_model_path, low=111, high=116) as s:
        assert token_string_problems(s, default_model_path) == []

        def replaced(tokenizer, token_id):                   # planted: bytes that are not UTF-8 replaced
            raw = tokenizer.token_piece(token_id, special=True)
            return raw.decode("utf-8", errors="replace"), list(raw)
        monkeypatch.setattr(replies, "token_string", replaced)
        assert token_string_problems(s, default_model_path) != []


# ---- /metrics ----------------------------------------------------------------------------------

def scrape(s) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(s.url + "/metrics").text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_metrics_parse_and_count_what_happened(srv):
    before = scrape(srv)
    r = client(srv).completions.create(model=MODEL, prompt="count me", max_tokens=7, temperature=0)
    httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "colour": "blue"})
    after = scrape(srv)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0)
    assert delta("llm_requests_total", outcome="length") == 1
    assert delta("llm_requests_total", outcome="bad_request") == 1
    assert delta("llm_generated_tokens_total") == 7
    assert delta("llm_prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("llm_time_to_first_token_seconds_count") == 1
    assert delta("llm_time_between_tokens_seconds_count") == 6
    h = httpx.get(srv.url + "/health").json()
    assert after[("llm_batch_rows_count", ())] == h["steps"]


def scrape_key(s, key=None) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    text = httpx.get(s.url + "/metrics", headers=headers, timeout=30).text
    return {(x.name, tuple(sorted(x.labels.items()))): x.value for f in text_string_to_metric_families(text)
            for x in f.samples}


def gauge_problems(s) -> list[str]:
    """A 32-token prompt served and done (its 2 full pages stay cached, idle: free); then two
    sequences that share a 48-token prefix, decoding, and a third waiting. With the engine loop
    parked, the gauges against what is known: the pages the running sequences hold, counted
    from their page tables; 2 running; 1 waiting."""
    loop = s.loop
    loop.submit(Sequence(Ask(list(range(800, 832)), 2)))
    s.idle()
    prefix = list(range(600, 648))
    a, b = Sequence(Ask(prefix + [700], 300)), Sequence(Ask(prefix + [701], 300))
    loop.submit(a)
    loop.submit(b)
    assert loop.wait_for(lambda _: len(a.generated) >= 2 and len(b.generated) >= 2, 60), "a and b never decoded"
    with s.paused():
        c = Sequence(Ask([900, 901], 5))
        loop.submit(c)
        held = {p for seq in loop.scheduler.running for p in seq.table.pages}
        idle_cached = len(loop.pool.idle_cached_pages())
        got = scrape(s)
    for seq in (a, b, c):
        loop.cancel(seq)
    s.idle()
    problems = [] if idle_cached == 2 else [f"the scene is not set: {idle_cached} idle cached pages, not 2"]
    total = loop.pool.n_pages
    want = {"llm_kv_pages_used": len(held), "llm_kv_pages_free": total - len(held), "llm_requests_running": 2,
            "llm_requests_waiting": 1}
    for name, value in want.items():
        if got[(name, ())] != value:
            problems.append(f"{name} {got[(name, ())]:g} where {value} is known")
    return problems


def with_stats(loop, change):
    """The loop's stats() as a planted bug reports them."""
    real = loop.stats
    return lambda: change(real())


@pytest.mark.parametrize("planted", [None, "free without the idle cached pages", "running and waiting swapped"])
def test_the_gauges_say_what_the_page_tables_and_queues_hold(default_model_path, monkeypatch, planted):
    with StubServer(default_model_path) as s:
        if planted == "free without the idle cached pages":
            monkeypatch.setattr(s.loop, "stats", with_stats(s.loop, lambda st: dict(
                st, kv_pages_free=st["kv_pages_free"] - st["kv_pages_cached"])))
        elif planted == "running and waiting swapped":
            monkeypatch.setattr(s.loop, "stats", with_stats(s.loop, lambda st: dict(
                st, running=st["waiting"], waiting=st["running"])))
        problems = gauge_problems(s)
    assert (problems == []) == (planted is None), problems


class Answered:
    """The server's answers by outcome, as Metrics.outcome is told of them, so that a test can
    wait for one (some are counted after their response has left); `relabel`: a planted bug."""

    def __init__(self, metrics, monkeypatch, relabel=None):
        self.seen, self.changed = Counter(), threading.Condition()
        real = metrics.outcome

        def outcome(name):
            real((relabel or {}).get(name, name))
            with self.changed:
                self.seen[name] += 1
                self.changed.notify_all()
        monkeypatch.setattr(metrics, "outcome", outcome)

    def wait(self, name: str, n: int):
        with self.changed:
            assert self.changed.wait_for(lambda: self.seen[name] >= n, 60), f"{name}: {self.seen}"


KEY = "sesame"


def outcome_problems(s, answered: Answered) -> list[str]:
    """One request of every outcome the server can have, each counted under its own label and
    nothing else: /metrics' llm_requests_total against what was sent. The moments that decide
    an outcome (a queue full, a time limit, a client gone) are made while the engine loop is
    parked, so they do not depend on how fast anything runs."""
    before, sent = scrape_key(s, KEY), Counter()
    c = httpx.Client(base_url=s.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)

    def post(body, status, outcome, **kw):
        r = c.post("/v1/completions", json=body, **kw) if isinstance(body, dict) else \
            c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, (outcome, r.status_code, r.text)
        sent[outcome] += 1
        return r
    text = post({"prompt": "hi", "max_tokens": 8, "temperature": 0}, 200, "length").json()["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip() and text.index(stop) > 0
    post({"prompt": "hi", "max_tokens": 8, "temperature": 0, "stop": stop}, 200, "stop")
    s.idle()                                         # its cancellation lands at the next step boundary
    post({"prompt": [5, 6, 77], "max_tokens": 3}, 500, "error")
    post({"prompt": "hi", "colour": "blue"}, 400, "bad_request")
    post(json.dumps({"prompt": "word " * 1000}).encode(), 413, "too_large")
    assert httpx.post(s.url + "/v1/completions", json={"prompt": "hi"}).status_code == 401
    sent["unauthorized"] += 1
    s.server.draining = True
    post({"prompt": "hi", "max_tokens": 1}, 503, "draining")
    s.server.draining = False
    with s.paused():
        s.server.request_timeout = 0.2               # nothing moves while parked: it passes, surely
        waits = threading.Thread(target=post, args=({"prompt": "hi", "max_tokens": 4}, 408, "timeout"))
        waits.start()
        assert s.loop.wait_for(lambda st: st["waiting"] == 1, 60), "the request never queued"
        post({"prompt": "hi", "max_tokens": 4}, 503, "busy")   # max batch 1, max queue 0: full
        waits.join()
        s.server.request_timeout = None
        with httpx.Client(base_url=s.url, headers=c.headers, timeout=60) as own:
            with own.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True}) as r:
                assert r.status_code == 200                  # the stream began; its client leaves
        answered.wait("cancelled", 1)
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=0.3)
        answered.wait("cancelled", 2)
        sent["cancelled"] += 2
    c.close()
    after = scrape_key(s, KEY)
    got = {o: after[("llm_requests_total", (("outcome", o),))] - before[("llm_requests_total", (("outcome", o),))]
           for o in OUTCOMES}
    problems = [f"{o}: {got[o]:g} counted, {sent[o]} sent" for o in OUTCOMES if got[o] != sent[o]]
    if set(sent) != set(OUTCOMES):
        problems.append(f"outcomes not exercised: {set(OUTCOMES) - set(sent)}")
    return problems


@pytest.mark.parametrize("relabel", [None, {"timeout": "error"}, {"draining": "busy"}])
def test_every_outcome_is_counted_under_its_own_label(default_model_path, monkeypatch, relabel):
    with StubServer(default_model_path, api_key=KEY, max_body_bytes=2000, fail_on=77, max_batch=1,
                    max_queue=0) as s:
        problems = outcome_problems(s, Answered(s.server.metrics, monkeypatch, relabel))
    assert (problems == []) == (relabel is None), problems


# ---- the operator's switches -------------------------------------------------------------------

def test_an_api_key_guards_everything_but_health_and_the_page(default_model_path):
    with StubServer(default_model_path, api_key="sesame", cors_origins=["http://allowed.example"]) as s:
        denied = 0
        with pytest.raises(openai.AuthenticationError):
            client(s).completions.create(model=MODEL, prompt="hi", max_tokens=1)
        denied += 1
        r = client(s, key="sesame").completions.create(model=MODEL, prompt="hi", max_tokens=1)
        assert r.choices[0].finish_reason == "length"
        for path in ("/v1/models", "/models", "/metrics", "/engine"):
            refused = httpx.get(s.url + path)
            denied += 1
            assert refused.status_code == 401, path
            error = refused.json()["error"]
            assert error["code"] == "invalid_api_key" and "Bearer" in error["message"]
            assert httpx.get(s.url + path, headers={"Authorization": "Bearer sesame"}).status_code == 200
        wrong = httpx.post(s.url + "/tokenize", json={"content": "x"}, headers={"Authorization": "Bearer open"})
        denied += 1
        assert wrong.status_code == 401 and "not this server's" in wrong.json()["error"]["message"]
        for path in ("/health", "/", "/static/page.js"):
            assert httpx.get(s.url + path).status_code == 200, path
        # CORS: a browser's preflight from the allowed origin, and from another
        pre = {"Origin": "http://allowed.example", "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization,content-type"}
        ok = httpx.options(s.url + "/v1/completions", headers=pre)
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://allowed.example"
        other = httpx.options(s.url + "/v1/completions", headers=dict(pre, Origin="http://elsewhere.example"))
        assert "access-control-allow-origin" not in other.headers
        assert scrape_key(s, "sesame")[("llm_requests_total", (("outcome", "unauthorized"),))] == denied == 6


def cors_problems(url: str) -> list[str]:
    """The answers themselves, not only the preflight: a browser reads a response only if it
    names the page's origin. From the allowed origin: a completion, a 401 (the browser must be
    able to read why) and /health name it; from another origin nothing does."""
    problems = []
    key = {"Authorization": "Bearer sesame"}
    for origin, headers, path, status in [
            ("http://allowed.example", key, "/v1/completions", 200),
            ("http://allowed.example", {}, "/v1/completions", 401),
            ("http://allowed.example", {}, "/health", 200),
            ("http://elsewhere.example", key, "/v1/completions", 200)]:
        if path == "/health":
            r = httpx.get(url + path, headers={"Origin": origin})
        else:
            r = httpx.post(url + path, json={"prompt": "hi", "max_tokens": 1}, headers=dict(headers, Origin=origin))
        named = r.headers.get("access-control-allow-origin")
        want = origin if origin == "http://allowed.example" else None
        if r.status_code != status or named != want:
            problems.append(f"{path} from {origin}: {r.status_code}, allow-origin {named!r} (want {status}, {want!r})")
    return problems


def test_cors_headers_are_on_the_answers_not_only_the_preflight(default_model_path, monkeypatch):
    from starlette.middleware.cors import CORSMiddleware
    with StubServer(default_model_path, api_key="sesame", cors_origins=["http://allowed.example"]) as s:
        assert cors_problems(s.url) == []

        async def preflight_only(self, scope, receive, send, request_headers):       # planted
            await self.app(scope, receive, send)
        monkeypatch.setattr(CORSMiddleware, "simple_response", preflight_only)
        assert cors_problems(s.url) != []


def body_limit_problems(url: str, limit: int) -> list[str]:
    """A body of exactly the limit is taken; one byte more is a 413 that says what it saw: the
    declared length (Content-Length), or that the body sent in chunks passed the limit. And a
    64 MiB body, declared or chunked, sent by Python's urllib (which reads no answer before it
    has sent everything): it reads the 413, not a reset connection."""
    problems = []
    json_type = {"content-type": "application/json"}
    exact = json.dumps({"prompt": "word", "max_tokens": 1}).encode().ljust(limit)
    r = httpx.post(url + "/v1/completions", content=exact, headers=json_type)
    if r.status_code != 200:
        problems.append(f"a body of exactly {limit} bytes: {r.status_code}")
    over = exact + b" "
    declared = httpx.post(url + "/v1/completions", content=over, headers=json_type)
    said = f"the request body is {limit + 1} bytes; this server takes at most {limit}"
    if declared.status_code != 413 or not declared.json()["error"]["message"].startswith(said):
        problems.append(f"declared {limit + 1} bytes: {declared.status_code} {declared.text[:100]}")
    chunked = httpx.post(url + "/v1/completions", content=iter([over[:1000], over[1000:]]), headers=json_type)
    said = f"the request body is over {limit} bytes"
    if chunked.status_code != 413 or not chunked.json()["error"]["message"].startswith(said):
        problems.append(f"chunked {limit + 1} bytes: {chunked.status_code} {chunked.text[:100]}")
    huge = b"x" * (64 << 20)
    for kind, data in (("declared", huge), ("chunked", (huge[i:i + (1 << 20)] for i in range(0, len(huge), 1 << 20)))):
        request = urllib.request.Request(url + "/v1/completions", data=data, headers=json_type)
        try:
            urllib.request.urlopen(request, timeout=120)
            problems.append(f"urllib, 64 MiB {kind}: taken")
        except urllib.error.HTTPError as e:
            if e.code != 413:
                problems.append(f"urllib, 64 MiB {kind}: {e.code}")
        except OSError as e:                               # ConnectionResetError, inside URLError or not
            problems.append(f"urllib, 64 MiB {kind}: {e!r}")
    return problems


async def streamed_only(request, limit):
    """A planted read_body: the declared length never looked at."""
    parts, n, chunks = [], 0, request.stream()
    async for chunk in chunks:
        n += len(chunk)
        if n > limit:
            await routes.discard(chunks, n)
            raise routes.BodyTooLarge(f"the request body is over {limit} bytes, the most this server takes "
                                      f"(--max-body-bytes)")
        parts.append(chunk)
    return b"".join(parts)


@pytest.mark.parametrize("planted", [None, "the declared length ignored", "nothing discarded"])
def test_a_body_over_the_limit_is_a_413_declared_or_not_and_every_client_reads_it(default_model_path, monkeypatch,
                                                                                  planted):
    if planted == "the declared length ignored":
        monkeypatch.setattr(routes, "read_body", streamed_only)
    elif planted == "nothing discarded":
        monkeypatch.setattr(routes, "DISCARD_BYTES", 0)
    with StubServer(default_model_path, max_body_bytes=2000) as s:
        problems = body_limit_problems(s.url, 2000)
        assert httpx.post(s.url + "/v1/completions", json={"prompt": "word", "max_tokens": 1}).status_code == 200
    assert (problems == []) == (planted is None), problems


def test_a_request_past_the_time_limit_ends_with_a_clear_error_and_gives_its_pages_back(default_model_path):
    with StubServer(default_model_path, request_timeout=0.5) as s:
        with s.paused():                                    # nothing moves while parked: the limit passes
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "slow", "max_tokens": 400}, timeout=10)
            assert r.status_code == 408 and "--request-timeout" in r.json()["error"]["message"]
            with pytest.raises(openai.APIError, match="--request-timeout"):
                for _ in client(s).completions.create(model=MODEL, prompt="slow", max_tokens=400, stream=True):
                    pass
        h = settled(s)
        assert h["kv_pages_free"] == h["kv_pages_total"] and h["finished"]["cancelled"] == 2
        fast = httpx.post(s.url + "/v1/completions", json={"prompt": "fast", "max_tokens": 3}, timeout=10)
        assert fast.status_code == 200


def test_a_failing_engine_step_is_a_500_or_an_error_event_and_the_server_goes_on(default_model_path):
    with StubServer(default_model_path, fail_on=77) as s:                # token 77: never generated (300..2999)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": [5, 6, 77], "max_tokens": 3}, timeout=10)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "planted failure" in r.json()["error"]["message"]
        with pytest.raises(openai.APIError, match="planted failure"):
            for _ in client(s).completions.create(model=MODEL, prompt=[5, 6, 77], max_tokens=3, stream=True):
                pass
        ok = client(s).completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3, temperature=0)
        assert ok.choices[0].finish_reason == "length"
        h = settled(s)
        assert h["failures"] == 2 and h["kv_pages_free"] == h["kv_pages_total"]


async def until(condition, what: str):
    """Wait (in the client's event loop) until condition() holds; a failure after a minute."""
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.005)


def test_a_client_that_leaves_a_request_cancels_it(default_model_path):
    """A client leaves a request that runs (whole, then streamed): each is cancelled, after the
    one step it had. The moments are made, not waited for: the engine loop parked, the request
    queued, one step run by hand (it is admitted and makes its first token), the client gone and
    its request marked cancelled, then the loop goes on and ends it at its next step."""
    with StubServer(default_model_path) as s:
        def running_cancelled():
            return [seq.cancelled for seq in s.loop.scheduler.running] == [True]

        async def leave():
            c = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
            with s.paused():
                task = asyncio.create_task(c.completions.create(model=MODEL, prompt="long", max_tokens=400))
                await until(lambda: s.loop.stats()["waiting"] == 1, "the request queued")
                s.loop.step()
                assert s.loop.stats()["running"] == 1, "the request never ran"
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                await until(running_cancelled, "the whole request cancelled")
            await until(lambda: s.loop.stats()["running"] == 0, "the cancelled request ended")
            with s.paused():
                stream = await c.completions.create(model=MODEL, prompt="long", max_tokens=400, stream=True)
                await until(lambda: s.loop.stats()["waiting"] == 1, "the stream queued")
                s.loop.step()
                await anext(aiter(stream))
                await stream.close()
                await until(running_cancelled, "the stream cancelled")
        asyncio.run(leave())
        h = settled(s)
        assert h["finished"]["cancelled"] == 2 and h["finished"]["length"] == 0
        assert h["kv_pages_free"] == h["kv_pages_total"] and h["generated_tokens"] == 2


def test_a_draining_server_refuses_new_requests_with_retry_after(default_model_path):
    with StubServer(default_model_path) as s:
        s.server.draining = True
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "server_shutting_down"
        h = httpx.get(s.url + "/health")
        assert h.status_code == 503 and h.json()["status"] == "draining"
        s.server.draining = False
        assert httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_the_page_and_its_files_are_served_from_the_package(srv):
    page = httpx.get(srv.url + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    for ref in ("/static/page.js", "/static/page.css"):
        assert ref in page.text and httpx.get(srv.url + ref).status_code == 200
    assert "http" not in page.text.replace("http-equiv", ""), "no file from elsewhere: the page works offline"
    view = httpx.get(srv.url + "/engine").json()
    assert len(view["page_owner"]) == view["kv_pages_total"] and {"recent_rows", "page_shared",
                                                                   "sequences"} <= set(view)


# ---- text: stop strings and log-probability entries --------------------------------------------

class NoHoldBack(StopMatcher):
    """A planted bug: text sent at once, even what could be the start of a stop string."""

    def push(self, text):
        out, hit = super().push(text)
        out, self.pending = out + ("" if hit else self.pending), "" if not hit else self.pending
        return out, hit


def stop_string_leaks(cls) -> list[str]:
    """Pieces "ab", "c<", "/e", "nd>x" with the stop string "</end>": nothing of it is ever
    sent, and everything before it is."""
    m = cls(["</end>", "never"])
    sent, hit = "", False
    for piece in ["ab", "c<", "/e", "nd>x"]:
        out, hit = m.push(piece)
        sent += out
        if hit:
            break
    problems = []
    if not hit:
        problems.append("the stop string was not found")
    if sent != "abc":
        problems.append(f"sent {sent!r}")
    return problems


def test_a_stop_string_split_over_pieces_is_never_sent():
    assert stop_string_leaks(StopMatcher) == []
    assert stop_string_leaks(NoHoldBack) != [], "the planted matcher without hold-back is seen"
    m = StopMatcher(["xyz"])
    assert m.push("abx") == ("ab", False) and m.push("y") == ("", False) and m.flush() == "xy"
    assert StopMatcher([]).push("<anything>") == ("<anything>", False)


def test_log_probability_entries_go_out_with_the_text_they_begin(srv):
    tok = srv.engine.tokenizer
    ids = tok.encode(" one two three four")
    sent, entries, hit = sent_until_stop(TextStream(tok, ["three"]), ids, -1.0, [])
    assert [tok.decode([t]) for t in ids] == [" one", " two", " three", " four"]
    assert sent == " one two " and hit
    # " three" begins with the space that was sent: its entry goes with it; " four" never comes
    assert [e[0] for e in entries] == ids[:3] and [e[3] for e in entries] == [0, 4, 8]
    end = TextStream(tok, [])
    im_end = tok.token_to_id("<|im_end|>")
    assert end.push(im_end)[0] == "" and end.flush() == ("", []), "an end-of-generation token is not text"


class Clock:
    """Seconds, moved by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Web:
    """The HTTP thread, as Drain asks of it."""

    alive = True

    def is_alive(self) -> bool:
        return self.alive


def test_the_drain_waits_for_the_running_until_its_deadline_and_a_second_signal_ends_it(default_model_path):
    import signal

    from app.serve.command import Drain
    with StubServer(default_model_path) as s:
        clock, web = Clock(), Web()
        drain = Drain(s.server, web, timeout=0.6, clock=clock)
        assert drain.keep_going(), "serving: go on"
        long = Sequence(Ask([1, 2], 500))
        with s.paused():                                     # the request stays running: no step ends it
            s.loop.submit(long)
            s.loop.step()
            assert s.loop.stats()["running"] == 1
            drain.signalled(signal.SIGTERM, None)
            assert s.server.draining and drain.keep_going(), "draining with a request running: go on"
            clock.now += 0.6
            assert not drain.keep_going(), "at --drain-timeout: stop"
            clock.now -= 0.001
            assert drain.keep_going(), "the twin: just before it, go on"
            drain.signalled(signal.SIGTERM, None)            # the second signal
            assert not drain.keep_going()
            s.loop.cancel(long)
        s.idle()
        assert not Drain(s.server, web, timeout=60, clock=clock).keep_going(), "draining and nothing left: stop at once"
        s.server.draining = False
        web.alive = False
        assert not Drain(s.server, web, timeout=60, clock=clock).keep_going(), "the HTTP thread gone: stop"


def drain_problems(drain_class, model_path) -> list[str]:
    """A drain with only waiting requests (the engine loop parked, nothing admitted yet): they
    are work to finish, so the loop goes on until the deadline."""
    import signal
    with StubServer(model_path) as s, s.paused():
        clock = Clock()
        waiting = Sequence(Ask([1, 2], 5))
        s.loop.submit(waiting)
        stats = s.loop.stats()
        assert (stats["running"], stats["waiting"]) == (0, 1), "the scene: one waiting, none running"
        drain = drain_class(s.server, Web(), timeout=5, clock=clock)
        drain.signalled(signal.SIGTERM, None)
        problems = [] if drain.keep_going() else ["draining with one request waiting: stopped"]
        clock.now += 5
        if drain.keep_going():
            problems.append("past the deadline: went on")
        s.loop.cancel(waiting)
    return problems


def test_a_drain_finishes_the_waiting_requests_too(default_model_path):
    from app.serve.command import Drain

    class RunningOnly(Drain):                               # planted: the waiting forgotten
        def keep_going(self):
            s = self.server.loop.stats()
            return self.web.is_alive() and (not self.server.draining or bool(s["running"])) and \
                (not self.server.draining or self.clock() < self.deadline)
    assert drain_problems(Drain, default_model_path) == []
    assert drain_problems(RunningOnly, default_model_path) != []


# ---- the hand-over from the engine thread (server.py: Mail, Inbox) and the published state -------------

def hand_over_problems() -> list[str]:
    """Events put into inboxes as the engine thread does, read as handlers do, on one asyncio loop
    whose wake-ups (call_soon_threadsafe) are counted: a step's events for several requests wake
    the loop once; an event that need not be seen now wakes nothing and arrives, in order, with the
    next that does; news after a delivery wakes the loop again; past its deadline an empty inbox
    raises RequestTimeout, after handing out what it holds."""
    problems = []

    async def scene():
        loop = asyncio.get_running_loop()
        wakes, real = [], loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda f, *a: (wakes.append(f), real(f, *a))[1]
        mail = server_module.Mail(loop)
        boxes = [server_module.Inbox(mail) for _ in range(3)]
        for i, box in enumerate(boxes):                          # one step: a token for each request,
            box.put((0, "token", i, 0.0))
        boxes[0].put((0, "done", "length", 0.0))                 # and the end of the first
        if len(wakes) != 1:
            problems.append(f"a step's 4 events for 3 requests woke the loop {len(wakes)} times, not once")
        got = [await box.get() for box in boxes] + [await boxes[0].get()]
        if [g[1:3] for g in got] != [("token", 0), ("token", 1), ("token", 2), ("done", "length")]:
            problems.append(f"events read: {got}")
        await asyncio.sleep(0)                                    # the loop turns: what is on its way arrives
        boxes[1].put((0, "token", 7, 0.0), wake=False)
        if len(wakes) != 1:
            problems.append("a token nobody must see now woke the loop")
        boxes[1].put((0, "done", "stop", 0.0))
        got = [await boxes[1].get(), await boxes[1].get()]
        if [g[1:3] for g in got] != [("token", 7), ("done", "stop")]:
            problems.append(f"a quiet token and the event after it read as {got}")
        await asyncio.sleep(0)                                    # the loop turns: what is on its way arrives
        before = len(wakes)
        boxes[2].put((0, "token", 8, 0.0))
        if len(wakes) != before + 1:
            problems.append("news after a delivery did not wake the loop again (a lost wake-up)")
        await boxes[2].get()
        late = server_module.Inbox(mail)
        late.put((0, "token", 9, 0.0), wake=False)
        late.expire_at(time.perf_counter() - 1, "too late")
        if (await late.get())[2] != 9:
            problems.append("past the deadline, the event already there was not handed out first")
        try:
            await late.get()
            problems.append("past the deadline, an empty inbox waited on")
        except server_module.RequestTimeout as e:
            if str(e) != "too late":
                problems.append(f"the timeout said {e}")

    asyncio.run(asyncio.wait_for(scene(), 60))
    return problems


def every_event_wakes(self, inbox):
    """A planted Mail.send: a wake-up for every event."""
    self.ready.append(inbox)
    self.loop.call_soon_threadsafe(self.deliver)


def flags_kept(self):
    """A planted Mail.deliver: the inboxes' flags never cleared."""
    self.pending = False
    while self.ready:
        self.ready.popleft().wake()


@pytest.mark.parametrize("planted", [None, "a wake-up per event", "quiet events wake", "flags kept"])
def test_the_engine_thread_wakes_the_http_loop_once_a_step_and_only_for_what_must_be_seen(monkeypatch, planted):
    if planted == "a wake-up per event":
        monkeypatch.setattr(server_module.Mail, "send", every_event_wakes)
    elif planted == "quiet events wake":
        real = server_module.Inbox.put
        monkeypatch.setattr(server_module.Inbox, "put", lambda self, event, wake=True: real(self, event))
    elif planted == "flags kept":
        monkeypatch.setattr(server_module.Mail, "deliver", flags_kept)
    problems = hand_over_problems()
    assert (problems == []) == (planted is None), problems


def wake_problems(s) -> list[str]:
    """12 tokens asked for, whole, whole with a stop string, and streamed: the events that wake the
    HTTP thread (Mail.send, counted): a whole reply's end only; with a stop string, or streamed,
    every token too."""
    sends = []
    real = server_module.Mail.send

    def counted(self, inbox):
        sends.append(inbox)
        real(self, inbox)
    problems = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(server_module.Mail, "send", counted)
        for what, extra, want in (("whole", {}, 1), ("whole with a stop string", {"stop": ["\u2603"]}, 13),
                                  ("streamed", {"stream": True}, 13)):
            before = len(sends)
            r = httpx.post(s.url + "/v1/completions", json=dict(prompt=list(range(900, 910)), max_tokens=12,
                                                                temperature=0, **extra), timeout=60)
            assert r.status_code == 200 and ("\u2603" not in r.text), r.text
            if len(sends) - before != want:
                problems.append(f"{what}: {len(sends) - before} events woke the HTTP thread, not {want}")
    return problems


@pytest.mark.parametrize("planted", [None, "every token wakes", "no token wakes"])
def test_a_whole_reply_wakes_the_http_thread_at_its_end_a_stream_at_every_token(srv, monkeypatch, planted):
    if planted is not None:
        monkeypatch.setattr(server_module, "wakes_per_token", lambda job: planted == "every token wakes")
    problems = wake_problems(srv)
    assert (problems == []) == (planted is None), problems


def view_problems(s) -> list[str]:
    """The published view against the pool, the engine loop parked: a finished request's full pages
    cached and idle (-1), an older sequence, and two choices of one prompt sharing its full pages (the
    older choice owns them). Read after a step: what the pool holds; read during a step (from inside
    its forward pass, as another thread may): the state after the step before, not the one in flight."""
    loop, P = s.loop, s.loop.pool.page_size
    problems = []
    with s.paused():
        def run_out(*seqs):
            while any(not q.done for q in seqs):
                loop.step()
        done = Sequence(Ask(list(range(400, 440)), 2))
        loop.submit(done)
        run_out(done)
        a = Sequence(Ask(list(range(500, 530)), 60))
        b = [Sequence(Ask(list(range(600, 640)), 60, choice=i)) for i in range(2)]
        loop.submit(a)
        loop.submit(b[0], b[1:])
        loop.step()
        while len(a.table) % P:                           # until a's next token takes a new page
            loop.step()
        before, during = loop.view(), []
        forward = loop.forward

        def watched(batch):
            during.append(loop.view())
            return forward(batch)
        loop.forward = watched
        try:
            loop.step()
        finally:
            loop.forward = forward
        view, pool = loop.view(), loop.pool
        owner = [0] * pool.n_pages
        for page in pool.idle_cached_pages():
            owner[page] = -1
        for seq in sorted(loop.scheduler.running, key=lambda q: -q.id):       # the oldest holder wins
            for page in seq.table.pages:
                owner[page] = seq.id
        want = {"page_owner": owner, "page_shared": [p for p in range(pool.n_pages) if pool.refs[p] > 1],
                "kv_pages_shared": int((pool.refs > 1).sum()), "running": 3,
                "sequences": [{"id": q.id, "tokens": len(q.context), "pages": len(q.table.pages),
                               "preemptions": 0} for q in loop.scheduler.running]}
        if not want["page_shared"] or -1 not in owner:
            problems.append(f"the scene: no shared page or no idle cached page ({want})")
        problems += [f"{k}: {view[k]}, the pool says {v}" for k, v in want.items() if view[k] != v]
        if during != [before]:
            problems.append("read during a step, the view showed the step in flight")
        for q in (a, *b):
            loop.cancel(q)
    s.idle()
    return problems


def newest_holder_wins(real):
    def readable(self, snap, view):
        out = real(self, snap, view)
        if view:
            for sid, _, pages, _ in snap[app_engine_loop.RAW][3]:             # newest last: it wins
                for p in pages:
                    out["page_owner"][p] = sid
        return out
    return readable


def idle_as_free(real):
    def readable(self, snap, view):
        out = real(self, snap, view)
        if view:
            out["page_owner"] = [max(0, o) for o in out["page_owner"]]
        return out
    return readable


def state_by_reference(real):
    """A planted _capture: the pool's counts and the page tables kept by reference, not copied."""
    def capture(self):
        snap = real(self)
        refs, idle, recent, _ = snap[app_engine_loop.RAW]
        snap[app_engine_loop.RAW] = (self.pool.refs, idle, recent,
                                     [(q.id, len(q.context), q.table.pages if q.table else [], q.preemptions)
                                      for q in self.scheduler.running])
        return snap
    return capture


@pytest.mark.parametrize("planted", [None, "the newest holder wins", "idle cached pages free", "by reference"])
def test_the_published_view_is_the_pool_at_the_last_step_boundary(default_model_path, monkeypatch, planted):
    EngineLoop = app_engine_loop.EngineLoop
    if planted == "the newest holder wins":
        monkeypatch.setattr(EngineLoop, "_readable", newest_holder_wins(EngineLoop._readable))
    elif planted == "idle cached pages free":
        monkeypatch.setattr(EngineLoop, "_readable", idle_as_free(EngineLoop._readable))
    elif planted == "by reference":
        monkeypatch.setattr(EngineLoop, "_capture", state_by_reference(EngineLoop._capture))
    with StubServer(default_model_path, kv_pages=64) as s:
        problems = view_problems(s)
    assert (problems == []) == (planted is None), problems
