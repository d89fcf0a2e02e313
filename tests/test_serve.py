"""`python -m app serve` on the default model, through the official `openai` client.

One live server (a subprocess, as a user starts it) for the module: concurrent requests,
streamed or not, complete and equal what each gives alone; clients that go away mid-way give
every page back; a full queue answers 503 with Retry-After; bad requests get a 400 in OpenAI's
error shape and the server keeps serving; a repeated prompt shares its pages (counted).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from stages import runnable_stages  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

CTX, MAX_BATCH, MAX_QUEUE, PAGES = 512, 8, 8, 160
PROMPTS = ["The meaning of life is", "Once upon a time", "In 1492, Columbus", "The best way to cook rice is",
           "Python is a programming language that", "The capital of France is", "My favourite animal is",
           "Water boils at"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(default_model_path, tmp_path_factory):
    stage = "threads" if "threads" in runnable_stages() else "quantized"
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    env = dict(os.environ, NUMBA_CACHE_DIR=os.environ.get("NUMBA_CACHE_DIR", str(ROOT / ".numba_cache")))
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "app", "serve", "-m", str(default_model_path),
                                 "--stage", stage, "--port", str(port), "--ctx-size", str(CTX),
                                 "--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE),
                                 "--kv-pages", str(PAGES)], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                health = httpx.get(url + "/health", timeout=2).json()
                break
            except httpx.HTTPError:
                if proc.poll() is not None or time.time() > deadline:
                    pytest.fail(f"the server did not start:\n{log.read_text()[-3000:]}", pytrace=False)
                time.sleep(0.5)
        yield {"url": url, "model": health["model"], "log": log}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def health(server) -> dict:
    return httpx.get(server["url"] + "/health", timeout=5).json()


def settled(server, timeout=20.0) -> dict:
    """/health once nothing runs or waits any more (cancellations land at a step boundary)."""
    deadline = time.time() + timeout
    while True:
        h = health(server)
        idle = h["running"] == 0 and h["waiting"] == 0 and h["kv_pages_free"] == h["kv_pages_total"]
        if idle or time.time() > deadline:
            return h
        time.sleep(0.05)


def client(server, retries=0):
    return openai.AsyncOpenAI(base_url=server["url"] + "/v1", api_key="none", max_retries=retries, timeout=60)


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


def test_concurrent_requests_equal_their_output_alone(server):
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
    from common.gguf import GGUFFile
    from common.tokenizer import Tokenizer
    with GGUFFile(ROOT / "models" / (server["model"] + ".gguf")) as g:
        assert n_prompt == len(Tokenizer.from_gguf(g).encode(PROMPTS[0]))
    assert settled(server)["kv_pages_free"] == PAGES


def test_cancelled_clients_give_every_page_back(server):
    """50 requests, 12 at a time; about half the clients go away at a random moment (closing a
    stream mid-way, or abandoning a request before its answer). Every other one completes, and
    once all is over every page is free again."""
    rng = random.Random(15)

    async def one(c, i, sem):
        async with sem:
            stream, leave = rng.random() < 0.5, rng.random() < 0.5
            kw = dict(model=server["model"], prompt=PROMPTS[i % 8] * (1 + i % 5), max_tokens=rng.randint(8, 40),
                      temperature=0)
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
                return "done"
            r = await c.completions.create(**kw)
            assert r.choices[0].finish_reason in ("stop", "length")
            return "done"

    async def main():
        c, sem = client(server), asyncio.Semaphore(12)
        return await asyncio.gather(*[one(c, i, sem) for i in range(50)])
    outcomes = asyncio.run(main())
    assert outcomes.count("left") >= 10 and outcomes.count("done") >= 10
    h = settled(server)
    assert (h["kv_pages_free"], h["kv_pages_reserved"], h["running"], h["waiting"]) == (PAGES, 0, 0, 0)


async def aenumerate(it):
    n = 0
    async for x in it:
        yield n, x
        n += 1


def test_a_full_queue_answers_503_with_retry_after_and_loses_nothing(server):
    """Twice as many requests as fit (max batch + max queue) at once: the rest get a 503 with
    Retry-After at once; every request admitted completes."""
    async def one(c, i):
        try:
            r = await c.completions.create(model=server["model"], prompt=PROMPTS[i % 8], max_tokens=24,
                                           temperature=0, extra_body={"ignore_eos": True})
            return r.usage.completion_tokens
        except openai.APIStatusError as e:
            return e.status_code, e.response.headers.get("retry-after"), e.body

    async def main():
        c = client(server)
        return await asyncio.gather(*[one(c, i) for i in range(2 * (MAX_BATCH + MAX_QUEUE))])
    results = asyncio.run(main())
    done = [r for r in results if r == 24]
    refused = [r for r in results if r != 24]
    assert len(done) >= MAX_BATCH + MAX_QUEUE and refused
    for status, retry_after, body in refused:
        assert status == 503 and int(retry_after) >= 1 and body["type"] == "server_error"
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
    r = httpx.post(server["url"] + path, content=content, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert reason in err["message"] and err["type"] == "invalid_request_error" and set(err) >= {"param", "code"}
    ok = httpx.post(server["url"] + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
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
