"""The server's text and its requests at their edges (app/serve/text.py, api.py, server.py,
routes.py, metrics.py), on StubEngine (tests/stub_engine.py: each next token a hash of what the
sequence's pages hold). Each check returns what it found wrong; it runs on the code, which must
pass, and on a planted bug, which it must flag:

    stop strings   how much text is held back where the text's tail could begin two stop strings;
                   an empty stop string stops nothing; a log-probability entry goes out only with
                   text that was sent (a token whose text a stop string cut has none), and the
                   entries of text held back to the end come with it
    bounds         each at its exact edge: a prompt token id n_vocab - 1 taken and n_vocab refused;
                   top_logprobs 20 (OpenAI's most) and completions' logprobs 5 taken, each giving
                   that many alternatives; n = --max-batch taken; a prompt and max_tokens that fill
                   the context exactly taken, one token more refused
    n > 1          a streamed echo of several choices: each choice's text begins with the prompt,
                   once, its log-probabilities line up with its text, and both are the whole reply's
    /metrics       per request: one time to first token, the prompt's tokens once, one outcome;
                   per choice: every token generated, the gaps between one choice's tokens
"""

from __future__ import annotations

import json

import httpx
import pytest

from app.serve import api, replies, routes
from app.serve import scheduler as scheduler_module
from app.serve import server as server_module
from app.serve.text import StopMatcher, TextStream
from tests.stub_engine import StubServer
from tests.stub_engine import tokenizer as stub_tokenizer
from tests.util import sent_until_stop

N_CTX, MAX_BATCH = 512, 8


@pytest.fixture(scope="module")
def srv(default_model_path):
    with StubServer(default_model_path, n_ctx=N_CTX, kv_pages=64, max_batch=MAX_BATCH, max_queue=8) as s:
        yield s


@pytest.fixture(scope="module")
def text_tok(default_model_path):
    return stub_tokenizer(str(default_model_path))


def post(s, path: str, body: dict) -> httpx.Response:
    return httpx.post(s.url + path, json=body, timeout=60)


def events(response: httpx.Response) -> list[dict]:
    """A stream's chunks (its data: lines but the last, [DONE])."""
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]


# ---- stop strings: what is held back ---------------------------------------------------------------

# stops, pieces pushed, what each push sends, whether the last found a stop string, what flush() gives
HOLD_CASES = [
    (["yq", "xyz"], ["axy", "z"], ["a", ""], True, ""),          # "xy" may begin xyz: held, not only "y"
    (["yq", "xyz"], ["axy", "w"], ["a", "xyw"], False, ""),       # ... and sent once it cannot
    (["abcd", "cx"], ["zab", "c", "x"], ["z", "", "ab"], True, ""),   # held for one, cut by the other
    (["aab"], ["aaa", "b"], ["a", ""], True, ""),                 # a stop string whose tail begins it again
    (["xyz"], ["abx", "y"], ["ab", ""], False, "xy"),             # held to the end: flush sends it
]


class PlantedHold(StopMatcher):
    """StopMatcher's push with another rule for how much of the text's tail is held back: `pick`
    chooses among the lengths n whose tail begins a stop string (each stop string in turn, its
    longest first); the real rule takes the largest."""

    def pick(self, tails: list[int]) -> int:
        raise NotImplementedError

    def push(self, text):
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        tails = [n for s in self.stops for n in range(min(len(s) - 1, len(self.pending)), 0, -1)
                 if self.pending.endswith(s[:n])]
        keep = self.pick(tails) if tails else 0
        out = self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(out):]
        return out, False


class FirstTailOnly(PlantedHold):
    """A planted bug: the hold-back looks at the first stop string that the tail could begin."""

    def pick(self, tails):
        return tails[0]


class ShortestTail(PlantedHold):
    """A planted bug: of the stop strings the tail could begin, the shortest such tail is held."""

    def pick(self, tails):
        return min(tails)


def hold_problems(matcher) -> list[str]:
    problems = []
    for stops, pieces, want, stopped, rest in HOLD_CASES:
        m = matcher(stops)
        got, hit = [], False
        for piece in pieces:
            out, hit = m.push(piece)
            got.append(out)
        flushed = m.flush()
        if (got, hit, flushed) != (want, stopped, rest):
            problems.append(f"{stops} over {pieces}: sent {got}, stopped {hit}, then {flushed!r}; "
                            f"want {want}, {stopped}, {rest!r}")
    return problems


@pytest.mark.parametrize("matcher", [StopMatcher, FirstTailOnly, ShortestTail], ids=lambda m: m.__name__)
def test_the_longest_tail_that_begins_any_stop_string_is_held_back(matcher):
    assert (hold_problems(matcher) == []) == (matcher is StopMatcher)


def keeps_empty(data: dict) -> list[str]:
    """A planted stop_strings: the empty string kept."""
    stop = data.get("stop")
    return [] if stop is None else [stop] if isinstance(stop, str) else list(stop)


def empty_stop_problems(stop_strings, tok) -> list[str]:
    """stop "" or ["", "never"]: the whole text goes out, nothing stopped."""
    ids = tok.encode(" one two three")
    problems = []
    for stop in ("", ["", "never"]):
        stream = TextStream(tok, stop_strings({"stop": stop}))
        sent, _, hit = sent_until_stop(stream, ids)
        sent += stream.flush()[0]
        if (sent, hit) != (" one two three", False):
            problems.append(f"stop {stop!r}: sent {sent!r}, stopped {hit}")
    return problems


def test_an_empty_stop_string_stops_nothing(text_tok):
    assert empty_stop_problems(api.stop_strings, text_tok) == []
    assert empty_stop_problems(keeps_empty, text_tok) != []


# ---- log-probability entries and the text a stop string cut ------------------------------------------

# stops over " one two three": the text sent, the tokens whose entries go out with it (0 1 2),
# whether it stopped, then what flush() gives (text, tokens)
ENTRY_CASES = [
    (["two"], " one ", [0, 1], True, ("", [])),                # " two" begins with the space sent
    ([" two"], " one", [0], True, ("", [])),                   # " two" is all cut: no entry
    (["e tw"], " on", [0], True, ("", [])),                    # cut inside " one": its entry; " two" none
    (["three!"], " one two ", [0, 1, 2], False, ("three", [])),
    ([" three!"], " one two", [0, 1], False, (" three", [2])),     # held to the end: its entry at the end
]


class EntriesOfCutText(TextStream):
    """A planted bug: a stop string found sends every entry pending, the cut tokens' too."""

    def push(self, token_id, logprob=None, top=None):
        waiting = self.pending + [(token_id, logprob, top, self.decoded)]
        text, out, stopped = super().push(token_id, logprob, top)
        return text, waiting if stopped else out, stopped


class FlushForgetsEntries(TextStream):
    """A planted bug: the entries of text held back to the end are dropped."""

    def flush(self):
        return super().flush()[0], []


def entry_problems(stream_class, tok) -> list[str]:
    ids = tok.encode(" one two three")
    assert [tok.decode([t]) for t in ids] == [" one", " two", " three"], "the scene: three tokens"
    problems = []
    for stops, want_text, want_entries, want_stop, want_rest in ENTRY_CASES:
        stream = stream_class(tok, stops)
        sent, entries, hit = sent_until_stop(stream, ids, -1.0, [])
        rest = ("", []) if hit else stream.flush()
        got = (sent, [ids.index(e[0]) for e in entries], hit, (rest[0], [ids.index(e[0]) for e in rest[1]]))
        if got != (want_text, want_entries, want_stop, want_rest):
            problems.append(f"stop {stops}: {got}, want {(want_text, want_entries, want_stop, want_rest)}")
        offsets = [e[3] for e in entries + list(rest[1])]
        if offsets != [[0, 4, 8][i] for i in sorted({ids.index(e[0]) for e in entries + list(rest[1])})]:
            problems.append(f"stop {stops}: offsets {offsets}")
    return problems


@pytest.mark.parametrize("stream_class", [TextStream, EntriesOfCutText, FlushForgetsEntries], ids=lambda c: c.__name__)
def test_a_log_probability_entry_goes_out_only_with_text_that_was_sent(stream_class, text_tok):
    assert (entry_problems(stream_class, text_tok) == []) == (stream_class is TextStream)


# ---- request bounds at their exact edges -------------------------------------------------------------

def bound_problems(s) -> list[str]:
    n_vocab = s.engine.config.n_vocab
    problems = []
    last = post(s, "/v1/completions", {"prompt": [5, n_vocab - 1], "max_tokens": 1})
    past = post(s, "/v1/completions", {"prompt": [5, n_vocab], "max_tokens": 1})
    if last.status_code != 200:
        problems.append(f"prompt id {n_vocab - 1}: {last.status_code}")
    if past.status_code != 400 or past.json()["error"]["param"] != "prompt":
        problems.append(f"prompt id {n_vocab}: {past.status_code}")
    chat = post(s, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                            "logprobs": True, "top_logprobs": 20})
    if chat.status_code != 200 or [len(e["top_logprobs"]) for e in chat.json()["choices"][0]["logprobs"]
                                   ["content"]] != [20, 20]:
        problems.append(f"top_logprobs 20: {chat.status_code} {chat.text[:200]}")
    five = post(s, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": 5})
    if five.status_code != 200 or [len(t) for t in five.json()["choices"][0]["logprobs"]["top_logprobs"]] != [5, 5]:
        problems.append(f"logprobs 5: {five.status_code} {five.text[:200]}")
    n = post(s, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "n": MAX_BATCH})
    if n.status_code != 200 or len(n.json()["choices"]) != MAX_BATCH:
        problems.append(f"n = {MAX_BATCH} (--max-batch): {n.status_code}")
    prompt = list(range(400, 412))
    full = post(s, "/v1/completions", {"prompt": prompt, "max_tokens": N_CTX - len(prompt), "temperature": 0})
    if full.status_code != 200 or full.json()["usage"]["completion_tokens"] != N_CTX - len(prompt):
        problems.append(f"a prompt and max_tokens filling the context: {full.status_code} {full.text[:200]}")
    over = post(s, "/v1/completions", {"prompt": prompt, "max_tokens": N_CTX - len(prompt) + 1})
    if over.status_code != 400 or over.json()["error"]["param"] != "max_tokens":
        problems.append(f"one token past the context: {over.status_code}")
    return problems


def one_lower(real):
    """A planted bug: every counted field's upper bound one lower."""
    return lambda data, name, low, high, default=None: real(data, name, low, high - 1, default)


@pytest.mark.parametrize("planted", [None, "upper bounds one lower", "a prompt id one past", "the context one short"])
def test_each_bound_holds_at_its_exact_edge(srv, monkeypatch, planted):
    if planted == "upper bounds one lower":
        monkeypatch.setattr(api, "count", one_lower(api.count))
    elif planted == "a prompt id one past":
        real = api.prompt_ids
        monkeypatch.setattr(api, "prompt_ids", lambda data, tok, chat, n_vocab, request:
                            real(data, tok, chat, n_vocab + 1, request))
    elif planted == "the context one short":
        real = scheduler_module.check_fits
        monkeypatch.setattr(scheduler_module, "check_fits", lambda n_prompt, n_predict, n_ctx, n_ctx_train:
                            real(n_prompt, n_predict, n_ctx - 1, n_ctx_train))
    problems = bound_problems(srv)
    srv.idle()
    assert (problems == []) == (planted is None), problems


# ---- n > 1: a streamed echo ----------------------------------------------------------------------------

def choices_of(chunks) -> dict:
    """{index: (text, tokens, offsets)} from a completion's chunks or its whole choices."""
    out = {}
    for c in chunks:
        text, tokens, offsets = out.setdefault(c["index"], ("", [], []))
        lp = c.get("logprobs") or {"tokens": [], "text_offset": []}
        out[c["index"]] = (text + c["text"], tokens + lp["tokens"], offsets + lp["text_offset"])
    return out


def echo_problems(s) -> list[str]:
    """n = 3 seeded choices, echo with log-probabilities: streamed and whole, each choice's text is
    the prompt once and then its own, its tokens join to its text at their offsets, and the
    stream's choices are the whole reply's."""
    tok = s.engine.tokenizer
    prompt = tok.encode("The lighthouse keeper")
    said = tok.decode(prompt)
    body = {"prompt": prompt, "n": 3, "echo": True, "logprobs": 1, "max_tokens": 6, "temperature": 1.0, "seed": 9}
    whole = choices_of(post(s, "/v1/completions", body).json()["choices"])
    streamed = choices_of([c for ch in events(post(s, "/v1/completions", dict(body, stream=True)))
                           for c in ch["choices"]])
    problems = [] if len({t for t, _, _ in whole.values()}) == 3 else ["the scene: three choices apart"]
    for name, got in (("whole", whole), ("streamed", streamed)):
        for i, (text, tokens, offsets) in sorted(got.items()):
            if not text.startswith(said) or text[len(said):].startswith(said) or len(tokens) != len(prompt) + 6:
                problems.append(f"{name} choice {i}: {text!r}, {len(tokens)} tokens")
            if "".join(tokens) != text or [text[o:o + len(t)] for o, t in zip(offsets, tokens)] != tokens:
                problems.append(f"{name} choice {i}: offsets {offsets} do not place its tokens in {text!r}")
    if streamed != whole:
        problems.append(f"streamed {streamed} is not the whole reply {whole}")
    return problems


def prompt_to_choice_zero(real):
    """A planted Reply.piece: a stream's echoed prompt reaches choice 0 only."""
    def piece(self, i, text, entries, finish=None):
        self.pieces = getattr(self, "pieces", 0) + 1
        if self.job.echo and self.pieces <= self.job.n and i > 0:
            return ""
        return real(self, i, text, entries, finish)
    return piece


def first_streams_offsets(real):
    """A planted Server._echoed: the completion's offsets follow the prompt in choice 0 only."""
    def echoed(self, job, seqs, streams, inbox):
        return real(self, job, seqs, streams[:1], inbox)
    return echoed


@pytest.mark.parametrize("planted", [None, "the prompt to choice 0", "offsets of choice 0"])
def test_a_streamed_echo_of_several_choices_is_the_whole_replys(srv, monkeypatch, planted):
    if planted == "the prompt to choice 0":
        monkeypatch.setattr(replies.Reply, "piece", prompt_to_choice_zero(replies.Reply.piece))
    elif planted == "offsets of choice 0":
        monkeypatch.setattr(server_module.Server, "_echoed", first_streams_offsets(server_module.Server._echoed))
    problems = echo_problems(srv)
    assert (problems == []) == (planted is None), problems


# ---- /metrics: per request and per choice ----------------------------------------------------------------

def scrape(s) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(s.url + "/metrics", timeout=60).text
    return {(x.name, tuple(sorted(x.labels.items()))): x.value for f in text_string_to_metric_families(text)
            for x in f.samples}


def per_request_problems(s) -> list[str]:
    """n = 3 choices of 5 tokens, whole then streamed: each request counts one outcome, one time
    to its first token, its prompt's tokens once; every choice's 5 tokens count, and the 4 gaps
    between each choice's tokens."""
    prompt = list(range(700, 709))
    problems = []
    for stream in (False, True):
        before = scrape(s)
        r = post(s, "/v1/completions", {"prompt": prompt, "n": 3, "max_tokens": 5, "temperature": 1.0, "seed": 4,
                                        "stream": stream})
        assert r.status_code == 200, r.text
        s.idle()
        after = scrape(s)
        got = {name: after[(name, labels)] - before.get((name, labels), 0) for name, labels in [
            ("llm_requests_total", (("outcome", "length"),)), ("llm_prompt_tokens_total", ()),
            ("llm_generated_tokens_total", ()), ("llm_time_to_first_token_seconds_count", ()),
            ("llm_time_between_tokens_seconds_count", ())]}
        want = {"llm_requests_total": 1, "llm_prompt_tokens_total": len(prompt), "llm_generated_tokens_total": 15,
                "llm_time_to_first_token_seconds_count": 1, "llm_time_between_tokens_seconds_count": 12}
        problems += [f"{'streamed' if stream else 'whole'}: {k} {got[k]:g}, want {v}" for k, v in want.items()
                     if got[k] != v]
    return problems


def first_token_of_every_choice(self, i, last, t0, now):
    """A planted Server._timed: a time to first token for every choice."""
    if last[i] is None:
        self.metrics.ttft.observe(now - t0)
    else:
        self.metrics.tbt.observe(now - last[i])
    last[i] = now
    self.metrics.generated_tokens.inc()


def prompt_per_choice(real):
    """A planted Server.submit: the prompt's tokens counted for every choice."""
    def submit(self, job):
        out = real(self, job)
        self.metrics.prompt_tokens.inc(len(job.prompt) * (job.n - 1))
        return out
    return submit


@pytest.mark.parametrize("planted", [None, "first token per choice", "prompt per choice", "outcome per choice"])
def test_metrics_count_per_request_and_per_choice_as_they_say(default_model_path, monkeypatch, planted):
    with StubServer(default_model_path, n_ctx=N_CTX, kv_pages=64, max_batch=MAX_BATCH) as s:
        if planted == "first token per choice":
            monkeypatch.setattr(server_module.Server, "_timed", first_token_of_every_choice)
        elif planted == "prompt per choice":
            monkeypatch.setattr(server_module.Server, "submit", prompt_per_choice(server_module.Server.submit))
        elif planted == "outcome per choice":
            monkeypatch.setattr(routes.Routes, "finished", lambda self, outcomes: [
                self.metrics.outcome(o) for o in outcomes])
        problems = per_request_problems(s)
    assert (problems == []) == (planted is None), problems


# ---- a reply under tools: its finish reason, whole and streamed -------------------------------------------

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
# pieces of the generated text, how the engine ended it, then the reply's finish_reason, content, calls
TOOL_REPLIES = [
    (["The weather", " is fine."], "stop", "stop", "The weather is fine.", []),       # auto: words
    (['{"name": "get_weather", ', '"arguments": {"city": "Paris"}}'], "stop", "tool_calls", None, ["get_weather"]),
    (['{"name": "get_weather", "arguments": {"ci'], "length", "length", None, ["get_weather"]),  # cut in a call
    (['{"name": "get_weather", "argu'], "length", "length", '{"name": "get_weather", "argu', []),  # in its head
]


def tool_reply(tok, reply_class):
    from types import SimpleNamespace

    from app.structured import Structured
    job = SimpleNamespace(chat=True, n=1, logprobs=None, prompt=[1],
                          structured=Structured(tools=[WEATHER], tool_choice="auto"))
    return reply_class(job, "m", tok)


def tool_reply_problems(tok, reply_class) -> list[str]:
    """tool_choice auto (words or calls): the finish reason says which, whole and streamed; a
    reply cut by max_tokens says length, in a call or not."""
    problems = []
    for pieces, ended, finish, content, names in TOOL_REPLIES:
        whole = tool_reply(tok, reply_class).whole(["".join(pieces)], [[]], [ended], [])["choices"][0]
        got = (whole["finish_reason"], whole["message"]["content"],
               [c["function"]["name"] for c in whole["message"].get("tool_calls", [])])
        if got != (finish, content, names):
            problems.append(f"whole {pieces}: {got}")
        reply = tool_reply(tok, reply_class)
        sent = "".join(reply.piece(0, p, []) for p in pieces) + reply.piece(0, "", [], ended)
        chunks = [c["choices"][0] for c in map(json.loads, (x[6:] for x in sent.split("\n\n") if x))]
        streamed = ("".join(c["delta"].get("content") or "" for c in chunks) or None,
                    [d["function"]["name"] for c in chunks for d in c["delta"].get("tool_calls", []) if "id" in d])
        if (chunks[-1]["finish_reason"], *streamed) != (finish, content, names):
            problems.append(f"streamed {pieces}: {chunks[-1]['finish_reason']}, {streamed}")
    return problems


class StreamSaysCalled(replies.Reply):
    """A planted bug: a streamed reply under tools ends "tool_calls" whether it called or not."""

    def tool_pieces(self, i, text, entries, finish=None):
        out = super().tool_pieces(i, text, entries, finish)
        return out.replace('"finish_reason": "stop"', '"finish_reason": "tool_calls"')


class WholeSaysCalled(replies.Reply):
    """A planted bug: a whole reply under tools ends "tool_calls" whether it called or not."""

    def whole(self, texts, entries, finish, seqs):
        out = super().whole(texts, entries, finish, seqs)
        for c in out["choices"]:
            c["finish_reason"] = replies.called(c["finish_reason"])
        return out


@pytest.mark.parametrize("planted", [None, StreamSaysCalled, WholeSaysCalled, "called always"],
                         ids=["reply", "stream says called", "whole says called", "called always"])
def test_under_tool_choice_auto_the_finish_reason_says_words_or_calls(text_tok, monkeypatch, planted):
    reply_class = planted if isinstance(planted, type) else replies.Reply
    if planted == "called always":                 # planted: a reply with calls ends "tool_calls" even when cut
        monkeypatch.setattr(replies, "called", lambda finish: "tool_calls")
    assert (tool_reply_problems(text_tok, reply_class) == []) == (planted is None)
