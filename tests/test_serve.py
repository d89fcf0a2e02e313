"""`python -m app serve` on the default model, through the official `openai` client.

One live server (a subprocess, as a user starts it) for most of the module: concurrent
requests, streamed or not, complete and equal what each gives alone; clients that go away
mid-way are cancelled (only cancelling can end their requests that soon) and give every page
back; the queue takes exactly max batch + max queue requests and answers the rest 503 with
Retry-After; bad requests get a 400 in OpenAI's error shape and the server keeps serving; a
repeated prompt shares its pages (counted); OpenAI's fields on the real model (penalties,
log-probabilities, echo against `python -m app perplexity`'s own per-token values); /metrics
through prometheus-client's parser; the page in a real headless browser. A second server with
a pool too small for every request's worst case preempts, counts it, and gives every request
its output alone; then SIGTERM drains it.
tests/test_server_http.py checks the HTTP layer's other paths on a stub engine (/tokenize against
llama.cpp's ids among them).

Timing: a client here waits as long as the server lets a request run (its --request-timeout),
never less, and the server's state is read once it has settled (SETTLE_S bounds a failure, it
decides nothing), so a machine loaded by other work makes these tests slower, not wrong.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from stages import runnable_stages  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

CTX, MAX_BATCH, MAX_QUEUE, PAGES = 512, 8, 8, 160
LONG = 440                       # tokens: what a client that leaves asks for (its prompt + LONG fit CTX)
ECHO_TOLERANCE = 1e-4            # log-probability: the batched rows against perplexity's forward (float32 rounding)
SETTLE_S = 600                   # the longest a cancelled request may take to leave (a failure past it)
PROMPTS = ["The meaning of life is", "Once upon a time", "In 1492, Columbus", "The best way to cook rice is",
           "Python is a programming language that", "The capital of France is", "My favourite animal is",
           "Water boils at"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STAGE = "threads" if "threads" in runnable_stages() else "quantized"


def start(model_path, log, *args):
    """`python -m app serve` as a user starts it: (process, base url, model id)."""
    port = free_port()
    env = dict(os.environ, NUMBA_CACHE_DIR=os.environ.get("NUMBA_CACHE_DIR", str(ROOT / ".numba_cache")))
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "app", "serve", "-m", str(model_path), "--stage", STAGE,
                                 "--port", str(port), "--ctx-size", str(CTX), *map(str, args)],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
        try:
            return proc, url, httpx.get(url + "/health", timeout=2).json()["model"]
        except httpx.HTTPError:
            if proc.poll() is not None or time.time() > deadline:
                stop(proc)
                pytest.fail(f"the server did not start:\n{log.read_text()[-3000:]}", pytrace=False)
            time.sleep(0.5)


def stop(proc):
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def server(default_model_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    proc, url, model = start(default_model_path, log, "--max-batch", MAX_BATCH, "--max-queue", MAX_QUEUE,
                             "--kv-pages", PAGES)
    try:
        yield {"url": url, "model": model, "log": log, "proc": proc}
    finally:
        stop(proc)


def health(server) -> dict:
    return httpx.get(server["url"] + "/health", timeout=None).json()


def settled(server) -> dict:
    """/health once nothing runs or waits any more (cancellations land at a step boundary)."""
    deadline = time.time() + SETTLE_S
    while True:
        h = health(server)
        if h["running"] == 0 and h["waiting"] == 0 and h["kv_pages_free"] == h["kv_pages_total"]:
            return h
        if time.time() > deadline:
            pytest.fail(f"the server did not settle in {SETTLE_S} s: {h}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def tok(default_model_path):
    """What `run -p` tokenizes with (app/run.py), read once."""
    from tests.stub_engine import tokenizer
    return tokenizer(str(default_model_path))


def client(server, retries=0):
    return openai.AsyncOpenAI(base_url=server["url"] + "/v1", api_key="none", max_retries=retries, timeout=None)


def client_sync(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key="none", max_retries=0, timeout=None)


async def ask(c, model, i, stream, **kw):
    """Request i: even ones are completions, odd ones chat; the text, streamed or not."""
    chat = i % 2 == 1
    args = dict(dict(model=model, max_tokens=16, temperature=0, stream=stream), **kw)
    if chat:
        args["messages"] = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        if stream:
            return "".join([ch.choices[0].delta.content or "" async for ch in await c.chat.completions.create(**args)
                            if ch.choices])
        return (await c.chat.completions.create(**args)).choices[0].message.content
    args["prompt"] = PROMPTS[i % len(PROMPTS)]
    if stream:
        return "".join([ch.choices[0].text async for ch in await c.completions.create(**args)])
    return (await c.completions.create(**args)).choices[0].text


def test_health_and_models(server):
    h = health(server)
    assert h["status"] == "ok" and h["kv_pages_total"] == PAGES and h["kv_pages_free"] == PAGES
    assert {"running", "waiting"} <= set(h)
    models = httpx.get(server["url"] + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [server["model"]]


def test_concurrent_requests_equal_their_output_alone(server, tok):
    """8 at once (completions and chat, streamed and not, one sampled with a seed) give the
    text each gives alone, and the prompt counts as `run -p` tokenizes it."""
    async def main():
        c = client(server)
        seeded = dict(temperature=0.9, seed=1234)
        alone = [await ask(c, server["model"], i, stream=False) for i in range(8)]
        alone_seeded = await ask(c, server["model"], 0, stream=False, **seeded)
        together = await asyncio.gather(*[ask(c, server["model"], i, stream=i % 4 < 2) for i in range(8)],
                                        ask(c, server["model"], 0, stream=True, **seeded))
        r = await c.completions.create(model=server["model"], prompt=PROMPTS[0], max_tokens=1, temperature=0)
        return alone, alone_seeded, together, r.usage.prompt_tokens
    alone, alone_seeded, together, n_prompt = asyncio.run(main())
    assert together[:8] == alone and all(alone)
    assert together[8] == alone_seeded
    assert n_prompt == len(tok.encode(PROMPTS[0]))
    assert settled(server)["kv_pages_free"] == PAGES


def test_cancelled_clients_give_every_page_back(server):
    """50 requests, 12 at a time; about half the clients go away at a random moment (closing a
    stream mid-way, or abandoning a request before its answer). The ones that leave asked for
    LONG tokens, more than the test's whole time allows, so only cancelling can end them:
    afterwards exactly the ones that stayed ended 'length', the server counted no other
    ending but cancellation, and every page is free again."""
    rng = random.Random(15)
    before = health(server)["finished"]

    async def one(c, i, sem):
        async with sem:
            stream, leave = rng.random() < 0.5, rng.random() < 0.5
            kw = dict(model=server["model"], prompt=PROMPTS[i % 8] * (1 + i % 5), temperature=0,
                      max_tokens=LONG if leave else rng.randint(8, 40), extra_body={"ignore_eos": True})
            if stream:
                s = await c.completions.create(stream=True, **kw)
                n_leave = rng.randint(0, 6)
                async for n, _ in aenumerate(s):
                    if leave and n >= n_leave:
                        await s.close()
                        return "left"
                return "done"
            if leave:
                try:
                    await asyncio.wait_for(c.completions.create(**kw), timeout=rng.uniform(0.01, 0.5))
                except asyncio.TimeoutError:
                    return "left"
                return "finished although it asked for more than the test's time"
            r = await c.completions.create(**kw)
            assert r.choices[0].finish_reason == "length"
            return "done"

    async def main():
        c, sem = client(server), asyncio.Semaphore(12)
        return await asyncio.gather(*[one(c, i, sem) for i in range(50)])
    outcomes = asyncio.run(main())
    assert set(outcomes) == {"left", "done"} and outcomes.count("left") >= 10 and outcomes.count("done") >= 10
    h = settled(server)
    assert (h["kv_pages_free"], h["kv_pages_reserved"], h["running"], h["waiting"]) == (PAGES, 0, 0, 0)
    ended = {k: h["finished"][k] - before[k] for k in before}
    assert ended["length"] == outcomes.count("done"), f"{ended}: a request that was left ran to its end"
    assert ended["stop"] == ended["error"] == 0 and ended["cancelled"] <= outcomes.count("left")


async def aenumerate(it):
    n = 0
    async for x in it:
        yield n, x
        n += 1


def test_a_full_queue_takes_exactly_max_batch_plus_max_queue_and_answers_the_rest_503(server):
    """Twice as many streamed requests as fit (max batch + max queue) at once, each long
    enough that none ends while the others arrive: exactly max batch + max queue are taken
    (a stream answers 200 as soon as it is queued), the rest get a 503 with Retry-After at
    once; then every stream is closed and every page comes back."""
    async def one(c, i):
        body = {"prompt": PROMPTS[i % 8], "max_tokens": LONG, "temperature": 0, "stream": True, "ignore_eos": True}
        req = c.build_request("POST", server["url"] + "/v1/completions", json=body)
        r = await c.send(req, stream=True)
        return r

    async def main():
        async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=100)) as c:
            responses = await asyncio.gather(*[one(c, i) for i in range(2 * (MAX_BATCH + MAX_QUEUE))])
            out = []
            for r in responses:
                out.append((r.status_code, r.headers.get("retry-after"),
                            json.loads(await r.aread()) if r.status_code != 200 else None))
                await r.aclose()
            return out
    results = asyncio.run(main())
    taken = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] != 200]
    assert len(taken) == MAX_BATCH + MAX_QUEUE, f"{len(taken)} taken"
    for status, retry_after, body in refused:
        assert status == 503 and int(retry_after) >= 1 and body["error"]["type"] == "server_error"
        assert "--max-queue" in body["error"]["message"]
    assert settled(server)["kv_pages_free"] == PAGES


BAD = [
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 4', "not valid JSON"),
    ("/v1/completions", b'["hi"]', "JSON object"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens = 0"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, "max_tokens = -5"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens = 'ten'"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature = -1"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature = 'hot'"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p = 0"),
    ("/v1/completions", {"prompt": "hi", "seed": "x"}, "seed = 'x'"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream = 'yes'"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, "stop = 5"),
    ("/v1/completions", {"prompt": "hi", "colour": "blue"}, "unrecognized request argument: colour"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, "model 'gpt-4' is not served"),
    ("/v1/completions", {"prompt": ""}, "prompt is empty"),
    ("/v1/completions", {"prompt": 42}, "prompt must be a string"),
    ("/v1/completions", {"prompt": "word " * 600, "max_tokens": 4}, f"context window of {CTX}"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": CTX}, f"context window of {CTX}"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages must be"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "content must be a string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens = 0"),
]


@pytest.mark.parametrize("path,body,reason", BAD, ids=[b[2] for b in BAD])
def test_bad_requests_get_a_400_and_the_server_keeps_serving(server, path, body, reason):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server["url"] + path, content=content, headers={"content-type": "application/json"}, timeout=None)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert reason in err["message"] and err["type"] == "invalid_request_error" and set(err) >= {"param", "code"}
    ok = httpx.post(server["url"] + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=None)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_stop_string_ends_the_text_before_it(server):
    """`stop`: the text up to the stop string, finish_reason 'stop', streamed or not (the
    stream holds back what could be the start of the stop string)."""
    async def main():
        c = client(server)
        kw = dict(model=server["model"], prompt="1, 2, 3, 4, 5,", max_tokens=24, temperature=0)
        free = (await c.completions.create(**kw)).choices[0].text
        stop = free[len(free) // 2:len(free) // 2 + 3]
        cut = (await c.completions.create(stop=[stop, "never seen"], **kw)).choices[0]
        parts = [ch.choices[0] async for ch in await c.completions.create(stop=stop, stream=True, **kw)]
        return free, stop, cut, "".join(p.text for p in parts), parts[-1].finish_reason
    free, stop, cut, streamed, finish = asyncio.run(main())
    assert len(free) > 6 and stop.strip()
    assert cut.text == free[:free.index(stop)] == streamed
    assert cut.finish_reason == finish == "stop"


def test_the_openai_client_sees_the_400_as_a_bad_request(server):
    async def main():
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            await client(server).completions.create(model=server["model"], prompt="hi", max_tokens=0)
    asyncio.run(main())


def test_a_repeated_prompt_shares_its_full_pages(server):
    """Two clients with the same long prompt: while both run, the first one's full prompt pages
    are referenced by both (kv_pages_shared counts them), and each page is held once."""
    prompt = "The history of the printing press is long and full of surprises. " * 6

    async def main():
        c = client(server)
        kw = dict(model=server["model"], prompt=prompt, max_tokens=200, temperature=0, stream=True,
                  extra_body={"ignore_eos": True})
        first = await c.completions.create(**kw)
        await anext(aiter(first))                              # prefilled and decoding
        second = await c.completions.create(**kw)
        await anext(aiter(second))
        h = health(server)
        usage = await c.completions.create(model=server["model"], prompt=prompt, max_tokens=1)
        await first.close()
        await second.close()
        return h, usage.usage.prompt_tokens
    h, n_prompt = asyncio.run(main())
    full = n_prompt // h["kv_page_size"]
    assert full >= 4
    assert h["running"] == 2 and h["kv_pages_shared"] == full
    used = h["kv_pages_total"] - h["kv_pages_free"]
    each = -(-n_prompt // h["kv_page_size"])                   # at least the prompt's pages each
    assert 2 * each - full <= used <= 2 * each - full + 4, "the shared pages are held once"
    assert settled(server)["kv_pages_free"] == PAGES


# ---- OpenAI's fields on the real model ---------------------------------------------------------

def test_frequency_penalty_makes_a_repetitive_prompt_repeat_less(server):
    prompt = "Repeat after me: hello hello hello hello hello hello"

    def repeats(**kw) -> tuple[int, int]:
        # no client timeout: on a loaded machine a reply may take longer than any fixed figure
        # (a 60 s one failed so); the server's --request-timeout bounds it
        r = httpx.post(server["url"] + "/v1/completions", timeout=None, json=dict(
            prompt=prompt, max_tokens=24, temperature=0, logprobs=0, ignore_eos=True, **kw)).json()
        tokens = r["choices"][0]["logprobs"]["tokens"]
        return len(tokens) - len(set(tokens)), len(tokens)
    plain, n = repeats()
    penalized, m = repeats(frequency_penalty=2.0)
    assert n == m == 24 and plain >= n // 2, f"the plain reply repeats {plain} of {n}: not a repetitive case"
    assert penalized < plain // 2, (plain, penalized)


def test_top_logprobs_are_probabilities_and_the_greedy_token_is_the_top_one(server):
    r = client_sync(server).chat.completions.create(
        model=server["model"], messages=[{"role": "user", "content": "Name three colours."}], max_tokens=12,
        temperature=0, logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) >= 3
    for e in content:
        tops = e.top_logprobs
        assert len(tops) == 5 and sum(math.exp(t.logprob) for t in tops) <= 1 + 1e-9
        assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert e.token == tops[0].token and e.logprob == tops[0].logprob, "greedy picks the most likely"


def test_echo_scores_the_prompt_as_perplexity_does(server, default_model_path, tmp_path):
    """`python -m app perplexity --per-token` on a text, and the same chunks echoed with
    max_tokens 0 through the server: each scored token's log-probability is minus its
    negative log-likelihood there (the two paths sum in other orders: within TOLERANCE)."""
    ctx, chunks = 64, 2
    text = (ROOT / "tests" / "fixtures" / "text" / "alice-in-wonderland-ch1-4.txt").read_text()[:3000]
    path = tmp_path / "text.txt"
    path.write_text(text)
    env = dict(os.environ, NUMBA_CACHE_DIR=os.environ.get("NUMBA_CACHE_DIR", str(ROOT / ".numba_cache")))
    out = subprocess.run([sys.executable, "-m", "app", "perplexity", "--stage", STAGE, "-m", str(default_model_path),
                          "-f", str(path), "--ctx", str(ctx), "--chunks", str(chunks), "--per-token", "--json"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    ppl = json.loads(out.stdout)
    ids = httpx.post(server["url"] + "/tokenize", json={"content": text, "add_special": True}).json()["tokens"]
    worst = shifted = 0.0
    for c in range(chunks):
        chunk = ids[c * ctx:(c + 1) * ctx]
        r = httpx.post(server["url"] + "/v1/completions", timeout=None, json={
            "prompt": chunk, "max_tokens": 0, "echo": True, "logprobs": 0}).json()["choices"][0]
        got = r["logprobs"]["token_logprobs"]
        assert got[0] is None and len(got) == ctx and r["finish_reason"] == "length"
        for t in ppl["per_token"]:
            if c * ctx <= t["index"] < (c + 1) * ctx:
                assert chunk[t["index"] - c * ctx] == t["token"]
                worst = max(worst, abs(got[t["index"] - c * ctx] + t["nll"]))
                shifted = max(shifted, abs(got[t["index"] - c * ctx - 1] + t["nll"]))
    assert len(ppl["per_token"]) == chunks * (ctx // 2 - 1)
    assert worst <= ECHO_TOLERANCE, f"echo and perplexity differ by {worst}"
    assert shifted > 100 * ECHO_TOLERANCE, "the twin: scores one position off must not pass"


def test_the_fields_openai_clients_send_get_openai_shaped_answers(server):
    c = client_sync(server)
    m = server["model"]
    r = c.completions.create(model=m, prompt="The capital of France is", max_tokens=5, temperature=0, n=2,
                             logprobs=2, echo=True, user="tester", presence_penalty=0.5, frequency_penalty=0.5,
                             logit_bias={"0": -100}, seed=1, extra_body={"ignore_eos": True})
    assert len(r.choices) == 2 and r.choices[0].text == r.choices[1].text
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith("The capital of France is") and lp.token_logprobs[0] is None
    assert r.usage.completion_tokens == 2 * 5, "usage counts every choice's tokens"
    assert len(lp.tokens) == len(lp.text_offset) == r.usage.prompt_tokens + 5
    assert "".join(lp.tokens) == r.choices[0].text
    chunks = list(c.chat.completions.create(model=m, messages=[{"role": "user", "content": "Hi!"}], max_tokens=4,
                                            temperature=0.7, seed=2, n=2, stream=True,
                                            stream_options={"include_usage": True}, logprobs=True, top_logprobs=1,
                                            extra_body={"ignore_eos": True}))
    assert {ch.choices[0].index for ch in chunks if ch.choices} == {0, 1}
    assert chunks[-1].usage.completion_tokens == 2 * 4, "usage counts every choice's tokens"
    assert chunks[-1].usage.prompt_tokens_details is not None
    again = c.chat.completions.create(model=m, messages=[{"role": "developer", "content": "You are terse."},
                                                         {"role": "user", "content": "Hi!"}],
                                      max_completion_tokens=3, temperature=0)
    system = c.chat.completions.create(model=m, messages=[{"role": "system", "content": "You are terse."},
                                                          {"role": "user", "content": "Hi!"}],
                                       max_tokens=3, temperature=0)
    assert again.choices[0].message.content == system.choices[0].message.content
    assert again.usage.completion_tokens <= 3


def test_a_prompt_of_token_ids_is_the_prompt_of_its_text(server):
    ids = httpx.post(server["url"] + "/tokenize", json={"content": PROMPTS[2]}).json()["tokens"]
    c = client_sync(server)
    by_text = c.completions.create(model=server["model"], prompt=PROMPTS[2], max_tokens=8, temperature=0)
    by_ids = c.completions.create(model=server["model"], prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text and by_ids.usage.prompt_tokens == len(ids)
    other = c.completions.create(model=server["model"], prompt=ids[:-1], max_tokens=8, temperature=0)
    assert other.usage.prompt_tokens == len(ids) - 1


def test_metrics_parse_and_agree_with_health(server):
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(server["url"] + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in [("llm_requests", "counter"), ("llm_prompt_tokens", "counter"),
                       ("llm_generated_tokens", "counter"), ("llm_time_to_first_token_seconds", "histogram"),
                       ("llm_time_between_tokens_seconds", "histogram"), ("llm_batch_rows", "histogram"),
                       ("llm_preemptions", "counter"), ("llm_requests_running", "gauge"),
                       ("llm_requests_waiting", "gauge"), ("llm_kv_pages_used", "gauge"),
                       ("llm_kv_pages_free", "gauge")]:
        assert families[name].type == kind, name
    samples = {s.name: s.value for f in families.values() for s in f.samples if not s.labels}
    h = settled(server)
    assert samples["llm_kv_pages_free"] == h["kv_pages_free"] and samples["llm_batch_rows_count"] == h["steps"]
    assert samples["llm_generated_tokens_total"] > 0 and samples["llm_preemptions_total"] == h["preemptions"]


# ---- the page, in a real browser ---------------------------------------------------------------

@pytest.fixture
def browser(tmp_path):
    from app.report import browser as headless
    reason = headless.missing()
    if reason:
        pytest.skip(f"no headless browser: {reason} (`make browser` installs Debian's chromium and chromium-driver)")
    driver = headless.chromium(tmp_path / "profile")
    try:
        yield driver
    finally:
        driver.quit()


POOL = "return Array.from(document.querySelectorAll('#pool .page')).map(c => Number(c.dataset.owner || 0))"
REPLY = ("const r = document.querySelector('#messages .msg.assistant:last-child');"
         "return r ? [r.textContent, r.classList.contains('done')] : null")


def test_the_page_chats_streamed_and_shows_the_pool_change(server, browser):
    """The page loads from the server alone, draws the pool, streams the reply to a prompt
    typed in (the text grows while it comes), shows pages held while the request runs, and the
    reply is the one the API gives the same request."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    settled(server)
    browser.get(server["url"] + "/")
    wait = WebDriverWait(browser, 30, poll_frequency=0.05)
    wait.until(lambda d: len(d.execute_script(POOL)) == PAGES)
    assert browser.find_element(By.ID, "model").text == server["model"]
    idle = browser.execute_script(POOL)
    assert not any(o > 0 for o in idle), "nothing runs: no page held"
    prompt = "Write a short story about a lighthouse keeper and a storm."
    tokens = browser.find_element(By.ID, "max-tokens")
    tokens.clear()
    tokens.send_keys("64")
    browser.find_element(By.ID, "prompt").send_keys(prompt)
    browser.find_element(By.ID, "send").click()
    lengths, held = set(), []
    deadline = time.time() + 120
    while time.time() < deadline:
        reply = browser.execute_script(REPLY)
        if reply:
            lengths.add(len(reply[0]))
            held.append(sum(o > 0 for o in browser.execute_script(POOL)))
            if reply[1]:
                break
        time.sleep(0.05)
    text, done = browser.execute_script(REPLY)
    assert done and text.strip(), f"no reply: {browser.find_element(By.ID, 'status').text}"
    assert len(lengths - {0, len(text)}) >= 2, f"the reply came at once, not streamed ({sorted(lengths)})"
    assert max(held) >= 1, "the pool view never showed the request's pages"
    wait.until(lambda d: not any(o > 0 for o in d.execute_script(POOL)))
    api = client_sync(server).chat.completions.create(model=server["model"], temperature=0, max_tokens=64,
                                                      messages=[{"role": "user", "content": prompt}])
    assert text == api.choices[0].message.content


# ---- a pool too small for every worst case; then SIGTERM ---------------------------------------

SMALL_PAGES, SMALL_BATCH = 16, 6


@pytest.fixture(scope="module")
def small_server(default_model_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-small") / "server.log"
    proc, url, model = start(default_model_path, log, "--max-batch", SMALL_BATCH, "--max-queue", 8,
                             "--kv-pages", SMALL_PAGES, "--drain-timeout", 120)
    try:
        yield {"url": url, "model": model, "log": log, "proc": proc}
    finally:
        stop(proc)


def test_a_pool_too_small_for_every_worst_case_preempts_and_loses_nothing(small_server):
    """6 clients at once, prompts of 15 tokens and 24 tokens each: their worst cases need 18 pages
    of the 16. Every one completes, each equal to its output alone; the server counts the
    preemptions, in /health and /metrics; every page is free at the end."""
    # each admitted with 2 pages (its prompt and room to decode into), all 6 at once; at about
    # 17 tokens each wants a third and the 4 left go round: one is preempted mid-reply, recomputed
    prompts = [f"Request {i}: tell me about the sea and the ships on it." for i in range(SMALL_BATCH)]
    kw = dict(model=small_server["model"], max_tokens=24, temperature=0, extra_body={"ignore_eos": True})

    async def main():
        c = client(small_server)
        alone = [(await c.completions.create(prompt=p, **kw)).choices[0].text for p in prompts]
        before = health(small_server)["preemptions"]
        together = await asyncio.gather(*[c.completions.create(prompt=p, stream=i % 2 == 0, **kw)
                                          for i, p in enumerate(prompts)])
        texts = []
        for r in together:
            texts.append("".join([ch.choices[0].text async for ch in r]) if isinstance(r, openai.AsyncStream)
                         else r.choices[0].text)
        return alone, texts, before
    alone, together, before = asyncio.run(main())
    h = settled(small_server)
    assert together == alone and all(alone)
    assert h["preemptions"] > before, "the pool was too small and nothing was preempted"
    assert h["kv_pages_free"] == SMALL_PAGES and h["kv_pages_reserved"] == 0
    metrics = httpx.get(small_server["url"] + "/metrics").text
    assert f"llm_preemptions_total {float(h['preemptions'])}" in metrics


def test_sigterm_drains_lets_running_requests_finish_and_exits_0(small_server):
    """SIGTERM while two streams run: new requests get 503 with Retry-After, /health says
    draining; the short stream finishes whole; a second SIGTERM ends the long one with an error
    that says why; the server exits 0."""
    url, proc = small_server["url"], small_server["proc"]
    results, started = {}, {"short": threading.Event(), "long": threading.Event()}

    def consume(name, max_tokens):
        try:
            chunks = []
            for c in client_sync(small_server).completions.create(
                    model=small_server["model"], prompt="Once upon a time", max_tokens=max_tokens, temperature=0,
                    stream=True, extra_body={"ignore_eos": True}):
                chunks.append(c)
                started[name].set()
            results[name] = ("".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason)
        except openai.APIError as e:
            results[name] = ("error", str(e))
    long = threading.Thread(target=consume, args=("long", 200))      # 14 of the 16 pages at its end
    short = threading.Thread(target=consume, args=("short", 24))
    long.start()
    assert started["long"].wait(300), "the long request never started"
    short.start()
    assert started["short"].wait(300), "the short request never started"
    proc.send_signal(signal.SIGTERM)
    deadline = time.time() + SETTLE_S
    refused = None
    while time.time() < deadline:
        refused = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=None)
        if refused.status_code == 503:
            break
        time.sleep(0.05)
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
    assert "shutting down" in refused.json()["error"]["message"]
    assert httpx.get(url + "/health", timeout=None).json()["status"] == "draining"
    short.join(timeout=SETTLE_S)
    assert results["short"][1] == "length", results
    deadline = time.time() + SETTLE_S                         # the short one's end is published after its event
    while health(small_server)["running"] != 1 and time.time() < deadline:
        time.sleep(0.05)
    assert health(small_server)["running"] == 1 and "long" not in results, "the long request still runs"
    proc.send_signal(signal.SIGTERM)                          # a second signal: stop now
    long.join(timeout=SETTLE_S)
    assert results["long"][0] == "error" and "--drain-timeout" in results["long"][1], results
    assert proc.wait(timeout=60) == 0, small_server["log"].read_text()[-2000:]
    assert "draining" in small_server["log"].read_text()


def test_serve_picks_the_stage_run_picks_among_those_that_can_serve(monkeypatch):
    """`serve` with no --stage batches through the stage `make run` picks (the best decode
    recorded here, else the last CPU stage), restricted to CPU stages with a KV cache; a
    stage without one is refused by name."""
    from app import args
    from app.serve.command import serving_stage
    from stages import StageError, info
    picked = serving_stage("fastest")
    assert info(picked).kv_cache and not info(picked).gpu and picked == args.fastest_stage(serving=True)
    cpu = [s for s in runnable_stages() if info(s).kv_cache and not info(s).gpu and not info(s).ranks]
    monkeypatch.setattr(args, "recorded_decode_ms", lambda: {s: 10.0 for s in cpu} | {cpu[0]: 1.0})
    assert serving_stage("fastest") == cpu[0]              # measured, not assumed
    monkeypatch.setattr(args, "recorded_decode_ms", lambda: {})
    assert serving_stage("fastest") == cpu[-1]
    with pytest.raises(StageError, match="needs a CPU stage with a KV cache"):
        serving_stage("naive")
