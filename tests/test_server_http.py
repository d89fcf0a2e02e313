"""The HTTP server (app/serve/routes.py, server.py) over StubEngine, in this process: OpenAI's fields and
shapes through the official `openai` client, llama-server's /tokenize and /detokenize, /metrics
through prometheus-client's own parser, the operator's switches (API key, CORS, body limit,
time limit, draining), a failing engine step, and the text pieces (stop strings, log-probability
entries). The engine is a stub (tests/stub_engine.py: each next token a hash of every token the
sequence's pages hold), so these run in seconds; tests/test_serve.py runs the real model.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from app.serve.replies import token_string
from app.serve.text import StopMatcher, TextStream
from tests.stub_engine import StubServer

openai = pytest.importorskip("openai", reason="openai is in requirements.txt")

MODEL = "stub-model"


@pytest.fixture(scope="module")
def srv(default_model_path):
    with StubServer(default_model_path, n_ctx=512, kv_pages=64, max_batch=8, max_queue=8) as s:
        yield s


def client(s, key="none", **kw):
    return openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0, timeout=30, **kw)


def settled(s, timeout=10.0) -> dict:
    deadline = time.time() + timeout
    while True:
        h = httpx.get(s.url + "/health", timeout=5).json()
        if (h["running"], h["waiting"], h["kv_pages_free"]) == (0, 0, h["kv_pages_total"]) or time.time() > deadline:
            return h
        time.sleep(0.02)


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
    assert len(texts) > 1, "seeded choices are drawn apart"


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
    plain = c.completions.create(model=MODEL, prompt="Just this", max_tokens=0, echo=True)
    assert plain.choices[0].text == "Just this" and plain.choices[0].logprobs is None


def test_paths_without_v1_answer_too(srv):
    assert httpx.get(srv.url + "/models").json()["data"][0]["id"] == MODEL
    r = httpx.post(srv.url + "/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["object"] == "text_completion"
    r = httpx.post(srv.url + "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 2})
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"


REFUSED = [
    ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools: not supported", "tools"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format: not supported",
     "response_format"),
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


def test_a_kv_pool_too_small_for_the_request_is_a_400_that_says_so(default_model_path):
    with StubServer(default_model_path, n_ctx=512, kv_pages=4) as s:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 100})
        assert r.status_code == 400 and "--kv-pages" in r.json()["error"]["message"]
        assert httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 40}).status_code == 200


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
    assert after[("llm_kv_pages_free", ())] + after[("llm_kv_pages_used", ())] == h["kv_pages_total"]
    assert ("llm_preemptions_total", ()) in after and ("llm_requests_waiting", ()) in after


def test_the_metrics_check_uses_a_parser_that_refuses_a_broken_exposition():
    from prometheus_client.parser import text_string_to_metric_families
    good = "# TYPE x counter\nx_total 1\n"
    assert [s.value for f in text_string_to_metric_families(good) for s in f.samples] == [1]
    with pytest.raises(ValueError):
        list(text_string_to_metric_families("# TYPE x counter\nx_total{outcome=\"a} 1\n"))


# ---- the operator's switches -------------------------------------------------------------------

def test_an_api_key_guards_everything_but_health_and_the_page(default_model_path):
    with StubServer(default_model_path, api_key="sesame", cors_origins=["http://allowed.example"]) as s:
        with pytest.raises(openai.AuthenticationError):
            client(s).completions.create(model=MODEL, prompt="hi", max_tokens=1)
        r = client(s, key="sesame").completions.create(model=MODEL, prompt="hi", max_tokens=1)
        assert r.choices[0].finish_reason == "length"
        for path in ("/v1/models", "/models", "/metrics", "/engine"):
            denied = httpx.get(s.url + path)
            assert denied.status_code == 401, path
            assert denied.json()["error"]["code"] == "invalid_api_key" and "Bearer" in denied.json()["error"]["message"]
            assert httpx.get(s.url + path, headers={"Authorization": "Bearer sesame"}).status_code == 200
        wrong = httpx.post(s.url + "/tokenize", json={"content": "x"}, headers={"Authorization": "Bearer open"})
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
        assert scrape_with_key(s)[("llm_requests_total", (("outcome", "unauthorized"),))] >= 6


def scrape_with_key(s):
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(s.url + "/metrics", headers={"Authorization": "Bearer sesame"}).text
    return {(x.name, tuple(sorted(x.labels.items()))): x.value for f in text_string_to_metric_families(text)
            for x in f.samples}


def test_a_body_over_the_limit_is_a_413_declared_or_not(default_model_path):
    with StubServer(default_model_path, max_body_bytes=2000) as s:
        big = json.dumps({"prompt": "word " * 1000, "max_tokens": 1}).encode()
        r = httpx.post(s.url + "/v1/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]

        def chunks():                                   # no Content-Length: sent in pieces
            for i in range(0, len(big), 500):
                yield big[i:i + 500]
        r = httpx.post(s.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and "over 2000 bytes" in r.json()["error"]["message"]
        small = httpx.post(s.url + "/v1/completions", json={"prompt": "word", "max_tokens": 1})
        assert small.status_code == 200


def test_a_request_past_the_time_limit_ends_with_a_clear_error_and_gives_its_pages_back(default_model_path):
    with StubServer(default_model_path, delay=0.02, request_timeout=0.5) as s:
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


def test_a_client_that_leaves_a_request_cancels_it(default_model_path):
    with StubServer(default_model_path, delay=0.01) as s:
        async def leave():
            c = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(c.completions.create(model=MODEL, prompt="long", max_tokens=400), 0.5)
            stream = await c.completions.create(model=MODEL, prompt="long", max_tokens=400, stream=True)
            await anext(aiter(stream))
            await stream.close()
        asyncio.run(leave())
        h = settled(s)
        assert h["finished"]["cancelled"] == 2 and h["finished"]["length"] == 0
        assert h["kv_pages_free"] == h["kv_pages_total"] and h["generated_tokens"] < 400


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
    stream = TextStream(tok, ["three"])
    sent, entries = "", []
    for t in ids:
        text, more, hit = stream.push(t, -1.0, [])
        sent += text
        entries += more
        if hit:
            break
    assert [tok.decode([t]) for t in ids] == [" one", " two", " three", " four"]
    assert sent == " one two " and hit
    # " three" begins with the space that was sent: its entry goes with it; " four" never comes
    assert [e[0] for e in entries] == ids[:3] and [e[3] for e in entries] == [0, 4, 8]
    end = TextStream(tok, [])
    im_end = tok.token_to_id("<|im_end|>")
    assert end.push(im_end)[0] == "" and end.flush() == ("", []), "an end-of-generation token is not text"


def test_the_drain_waits_for_the_running_until_its_deadline_and_a_second_signal_ends_it(default_model_path):
    import signal
    import threading

    from app.serve.command import Drain
    from app.serve.sequence import Ask, Sequence
    with StubServer(default_model_path, delay=0.01) as s:
        alive = threading.Thread(target=time.sleep, args=(30,), daemon=True)
        alive.start()
        drain = Drain(s.server, alive, timeout=0.6)
        assert drain.keep_going(), "serving: go on"
        long = Sequence(Ask([1, 2], 500))
        s.loop.submit(long)
        deadline = time.time() + 10
        while not s.loop.stats()["running"] and time.time() < deadline:
            time.sleep(0.01)
        drain.signalled(signal.SIGTERM, None)
        assert s.server.draining and drain.keep_going(), "draining with a request running: go on"
        time.sleep(0.7)
        assert not drain.keep_going(), "past --drain-timeout: stop"
        drain.deadline = time.monotonic() + 60
        assert drain.keep_going()
        drain.signalled(signal.SIGTERM, None)                # the second signal
        assert not drain.keep_going()
        s.loop.cancel(long)
        settled(s)
        assert not Drain(s.server, alive, timeout=60).keep_going(), "draining and nothing left: stop at once"
