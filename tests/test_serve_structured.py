"""Structured outputs and tool calls through `python -m app serve` on the default model, with the
official `openai` client: what SDKs and agent frameworks send.

One live server for the module (a pool of KV_PAGES pages: room for the batch below, too little
for the preemption scene). What is judged comes from outside the server: pydantic (the client's
own parse()), jsonschema for every schema and every call's arguments, the client's stream
helper for tool-call deltas. Each check's failure is shown where it can be: the same prompt
without the schema gives text the same judge refuses.

* parse() into a pydantic model; every schema feature claimed (nested objects, arrays with
  minItems/maxItems, enums, number bounds, string patterns and lengths, anyOf with null,
  additionalProperties false) in one request, validated by jsonschema.
* Tools: tool_choice "required" and a named function each give a call (llama-server gave plain
  text there on this model) whose arguments validate against that tool's parameters; a loop of
  two turns (a call, its result as a `tool` message, then the answer); streamed deltas in
  OpenAI's shape, reassembled by hand and by the client's own helper, equal to the whole reply.
* The batched step: four constrained requests of four kinds running together beside two free
  ones, every reply equal to its reply alone (constrained or not: batch invariance holds with
  constrained neighbours); a constrained request preempted mid-reply and recomputed: its reply
  unchanged.

tests/test_server_http.py checks the HTTP shapes and refusals on the stub engine, with planted
bugs; tests/test_constrain.py and tests/test_structured.py the layers below.
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import jsonschema
import pytest

from tests.test_serve import health, settled, start, stop
from tests.test_structured import CITY_AND_UNIT, function_tool

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

KV_PAGES = 48                    # pages of 16 positions
HOG_REPEATS = 23                 # the preemption scene: two prompts of 300 tokens, 19 pages each
WEATHER = function_tool("get_weather", "The current weather in a city", **CITY_AND_UNIT)
BOUNDED = {"type": "integer", "minimum": -1000, "maximum": 1000}
ADD = function_tool("add", "Add two numbers", x=BOUNDED, y=BOUNDED)
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
FEATURES = {                     # every feature claimed, in one schema
    "type": "object", "additionalProperties": False,
    "required": ["name", "age", "score", "email", "tags", "address", "nickname"],
    "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 20},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 10},
        "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.(com|org)$"},
        "tags": {"type": "array", "items": {"enum": ["friend", "work", "family"]}, "minItems": 1, "maxItems": 2},
        "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                    "properties": {"city": {"type": "string", "maxLength": 20},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
        "nickname": {"anyOf": [{"type": "string", "maxLength": 12}, {"type": "null"}]}}}
UNIT = {"type": "object", "additionalProperties": False, "required": ["unit"],
        "properties": {"unit": {"enum": ["C", "F", "K"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def server(default_model_path, tmp_path_factory):
    """One thread: a busy machine's cores are not ours (replies do not depend on it)."""
    log = tmp_path_factory.mktemp("serve-structured") / "server.log"
    proc, url, model = start(default_model_path, log, "--kv-pages", KV_PAGES, "--max-batch", 8, "--threads", 1,
                             "--ctx-size", 1024)
    try:
        yield {"url": url, "model": model, "log": log, "proc": proc}
    finally:
        stop(proc)


def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key="none", max_retries=0, timeout=None)


def aclient(server):
    return openai.AsyncOpenAI(base_url=server["url"] + "/v1", api_key="none", max_retries=0, timeout=None)


def valid(instance_text: str, schema: dict) -> bool:
    """jsonschema's verdict on a JSON text (not JSON at all: False)."""
    try:
        jsonschema.validate(json.loads(instance_text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def assert_calls_valid(calls):
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function", call
        assert valid(call.function.arguments, PARAMETERS[call.function.name]), call


# ---- response_format -----------------------------------------------------------------------------

class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=40)
    country: str = pydantic.Field(max_length=40)
    population: int = pydantic.Field(ge=0, le=100_000_000)       # a bound: a 135M model writes digits on


CITY = {**City.model_json_schema(), "additionalProperties": False}


def test_parse_into_a_pydantic_model(server):
    """The client's parse() sends City's strict schema and parses the reply into a City; without
    response_format the same question's reply is no City (the check can fail)."""
    c = client(server)
    kw = dict(model=server["model"], messages=[{"role": "user", "content": "Describe Paris as JSON."}],
              temperature=0, max_tokens=120)
    r = c.chat.completions.parse(response_format=City, **kw)
    assert isinstance(r.choices[0].message.parsed, City) and r.choices[0].finish_reason == "stop"
    free = c.chat.completions.create(**dict(kw, max_tokens=40)).choices[0].message.content
    with pytest.raises(pydantic.ValidationError):
        City.model_validate_json(free)


def features_request(server) -> dict:
    """The request of every schema feature: the preemption scene below asks it again."""
    return dict(model=server["model"], temperature=0, max_tokens=200,
                messages=[{"role": "user", "content": "Write a JSON record for Ada, a mathematician from London."}],
                response_format=schema_format("person", FEATURES))


@pytest.fixture(scope="module")
def features_alone(server):
    """The reply to features_request with the server to itself: asked once for the module (a
    reply of a hundred tokens and more, on one thread), by the tests that judge it."""
    return client(server).chat.completions.create(**features_request(server))


def test_every_schema_feature_claimed_validates(server, features_alone):
    """One schema with every feature claimed: the reply validates (jsonschema), whole and
    streamed alike; the same prompt without the schema does not."""
    c = client(server)
    kw = features_request(server)
    del kw["response_format"]
    r = features_alone
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and valid(text, FEATURES), text
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        stream=True, response_format=schema_format("person", FEATURES), **kw) if ch.choices)
    assert streamed == text
    assert not valid(c.chat.completions.create(**dict(kw, max_tokens=40)).choices[0].message.content, FEATURES)


# ---- tools ----------------------------------------------------------------------------------------

def test_required_and_a_named_function_give_calls_whose_arguments_validate(server):
    """Where llama-server answered in words on this model, tool_choice "required" and a named
    function each give calls (finish_reason tool_calls); without tools, the same question gets
    words, no call."""
    c = client(server)
    kw = dict(model=server["model"], messages=ASK_WEATHER, tools=[WEATHER, ADD], temperature=0, max_tokens=80)
    required = c.chat.completions.create(tool_choice="required", **kw).choices[0]
    named = c.chat.completions.create(tool_choice={"type": "function", "function": {"name": "add"}}, **kw).choices[0]
    one = c.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **kw).choices[0]
    for choice in (required, named, one):
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        assert_calls_valid(choice.message.tool_calls)
    assert [t.function.name for t in named.message.tool_calls] == ["add"]
    assert len(one.message.tool_calls) == 1
    free = c.chat.completions.create(model=server["model"], messages=ASK_WEATHER, temperature=0, max_tokens=40)
    assert free.choices[0].message.tool_calls is None


class GetWeather(pydantic.BaseModel):
    """The current weather in a city"""
    city: str = pydantic.Field(max_length=30)
    unit: Literal["C", "F"]


def test_a_tool_loop_of_two_turns(server):
    """Turn 1, through the client's parse(): a call of a pydantic tool, its arguments parsed
    into the model. Turn 2: the assistant's call and the tool's result in the messages, and the
    answer in words. (This 135M model under "auto" answers turn 1 in words and calls again at
    turn 2, so the loop says what it wants at each turn: "required", then "none", which the
    grammar holds to text that does not begin like a call.)"""
    c = client(server)
    tools = [openai.pydantic_function_tool(GetWeather, name="get_weather"), {**ADD, "function": {
        **ADD["function"], "strict": True}}]
    kw = dict(model=server["model"], tools=tools, temperature=0, max_tokens=80)
    first = c.chat.completions.parse(messages=ASK_WEATHER, tool_choice="required", **kw).choices[0]
    calls = first.message.tool_calls
    assert first.finish_reason == "tool_calls" and calls and calls[0].function.name == "get_weather"
    assert isinstance(calls[0].function.parsed_arguments, GetWeather)
    turn = ASK_WEATHER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": calls[0].id, "type": "function", "function": {"name": "get_weather",
                                                             "arguments": calls[0].function.arguments}}]},
                          {"role": "tool", "tool_call_id": calls[0].id, "content": "18 C and sunny"}]
    answer = c.chat.completions.create(messages=turn, tool_choice="none", **kw)
    choice = answer.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None, (calls[0].function.arguments,
                                                                                choice.message.content)
    assert choice.message.content and not choice.message.content.lstrip().startswith("{"), choice.message.content
    again = c.chat.completions.create(messages=turn, **kw).choices[0]       # auto: words or a call, valid either way
    assert_calls_valid(again.message.tool_calls or [])
    finish, content, names = None, "", []                                   # and streamed, the same reply
    for ch in c.chat.completions.create(messages=turn, stream=True, **kw):
        content += ch.choices[0].delta.content or ""
        names += [t.function.name for t in ch.choices[0].delta.tool_calls or [] if t.id]
        finish = ch.choices[0].finish_reason or finish
    assert (finish, content or None, names) == (again.finish_reason, again.message.content,
                                                 [t.function.name for t in again.message.tool_calls or []])


def test_streamed_tool_call_deltas_reassemble_into_the_whole_reply(server):
    """Streamed: each call opens with its index, id, type and name, then only its arguments,
    in pieces; reassembled by hand and by the client's own stream helper, the calls are the
    whole reply's (ids aside: each reply makes its own)."""
    c = client(server)
    kw = dict(model=server["model"], messages=ASK_WEATHER, tools=[WEATHER, ADD], tool_choice="required",
              temperature=0, max_tokens=80)
    whole = [(t.function.name, t.function.arguments) for t in c.chat.completions.create(**kw).choices[0]
             .message.tool_calls]
    calls, finish = {}, None
    for ch in c.chat.completions.create(stream=True, **kw):
        for d in ch.choices[0].delta.tool_calls or []:
            if d.index not in calls:
                assert d.id and d.type == "function" and d.function.name and d.function.arguments == "", d
                calls[d.index] = [d.function.name, ""]
            else:
                assert d.id is None and d.function.name is None, d
                calls[d.index][1] += d.function.arguments
        finish = ch.choices[0].finish_reason or finish
    assert [tuple(calls[i]) for i in sorted(calls)] == whole and finish == "tool_calls"
    with c.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion().choices[0]
    assert [(t.function.name, t.function.arguments) for t in final.message.tool_calls] == whole


# ---- in the batched step ---------------------------------------------------------------------------

async def reply(c, model: str, kind: str) -> str:
    """One request of each kind: its reply as a string (tool calls as their names and arguments)."""
    chat = dict(model=model, temperature=0, max_tokens=60)
    if kind == "free completion":
        r = await c.completions.create(model=model, prompt="The capital of France is", max_tokens=24,
                                       temperature=0)
        return r.choices[0].text
    if kind == "free chat":
        r = await c.chat.completions.create(messages=[{"role": "user", "content": "Name three colours."}], **chat)
        return r.choices[0].message.content
    if kind == "schema completion":
        r = await c.completions.create(model=model, prompt="The temperature unit, as JSON:", max_tokens=40,
                                       temperature=0, extra_body={"response_format": schema_format("unit", UNIT)})
        assert valid(r.choices[0].text, UNIT), r.choices[0].text
        return r.choices[0].text
    if kind == "schema chat":
        r = await c.chat.completions.create(messages=[{"role": "user", "content": "Describe Oslo as JSON."}],
                                            response_format=schema_format("city", CITY), **chat)
        assert City.model_validate_json(r.choices[0].message.content)
        return r.choices[0].message.content
    if kind == "tool call":
        r = await c.chat.completions.create(messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required", **chat)
        assert_calls_valid(r.choices[0].message.tool_calls)
        return json.dumps([(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls])
    r = await c.chat.completions.create(messages=[{"role": "user", "content": "Add 2 and 3."}], tools=[ADD], **chat)
    m = r.choices[0].message                                # "auto": words or calls, constrained either way
    assert_calls_valid(m.tool_calls or [])
    return m.content if m.tool_calls is None else json.dumps([(t.function.name, t.function.arguments)
                                                              for t in m.tool_calls])


KINDS = ["schema completion", "schema chat", "tool call", "auto tools", "free completion", "free chat"]


def test_four_constrained_requests_in_one_batch_beside_free_ones(server):
    """Four constrained requests of four kinds and two free ones at once: all six run in the
    same steps (/health counts them running together), and each reply, constrained or free, is
    the one it has alone."""
    async def main():
        c = aclient(server)
        alone = [await reply(c, server["model"], k) for k in KINDS]
        running, done = [], asyncio.Event()

        async def watch():
            async with httpx.AsyncClient(timeout=None) as h:
                while not done.is_set():
                    running.append((await h.get(server["url"] + "/health")).json()["running"])
                    await asyncio.sleep(0.02)
        watcher = asyncio.ensure_future(watch())
        together = await asyncio.gather(*[reply(c, server["model"], k) for k in KINDS])
        done.set()
        await watcher
        return alone, together, max(running)
    before = health(server)["preemptions"]
    alone, together, most = asyncio.run(main())
    assert together == alone and most == len(KINDS), (most, together, alone)
    assert settled(server)["preemptions"] == before, "the pool was meant to hold them all"


def test_a_constrained_request_preempted_mid_reply_gives_its_reply_alone(server, features_alone):
    """Two long free requests hold most of the pool (HOG_REPEATS: their prompts take 2 x 19 of
    the 48 pages, and they grow a page every 16 tokens); a constrained one (every schema
    feature) joins, and while it decodes the pool runs out: the newest, the constrained one, is
    preempted (/health counts it, and only the two long ones are left running). The long ones
    are then closed; the constrained one is readmitted, recomputes its prompt and what it had
    written (its matcher kept its place in its sampler), and its reply is the one it has alone."""
    hog = "The history of the printing press is long and full of surprises. " * HOG_REPEATS
    kw = features_request(server)

    state = {"text": "", "seen": None}

    async def main():
        c = aclient(server)
        alone, state["prompt"] = features_alone.choices[0].message.content, features_alone.usage.prompt_tokens
        started, release = [asyncio.Event(), asyncio.Event()], asyncio.Event()

        async def hold(i):
            try:
                s = await c.completions.create(model=server["model"], prompt=hog, max_tokens=300, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
                async for _ in s:
                    started[i].set()
                    if release.is_set():
                        break
                await s.close()
            finally:
                started[i].set()                # (a failure is raised by the gather below)

        async def watch(h, since):
            """The first preemption once the constrained reply has begun: what was running then."""
            while not release.is_set():
                view = (await h.get(server["url"] + "/engine")).json()
                if view["preemptions"] > since:
                    state["seen"] = (len(state["text"]), [s["tokens"] for s in view["sequences"]])
                    release.set()
                await asyncio.sleep(0.01)
        hogs = [asyncio.ensure_future(hold(i)) for i in range(2)]
        for e in started:
            await e.wait()
        async with httpx.AsyncClient(timeout=None) as h:
            watcher = None
            async for ch in await c.chat.completions.create(stream=True, **kw):
                state["text"] += ch.choices[0].delta.content or "" if ch.choices else ""
                if watcher is None and state["text"]:
                    watcher = asyncio.ensure_future(watch(h, (await h.get(server["url"] + "/health")).json()[
                        "preemptions"]))
            release.set()
            await asyncio.gather(*hogs, *([watcher] if watcher else []))
        return alone, state["text"], state["seen"]
    alone, text, seen = asyncio.run(main())
    assert seen is not None, "the pool never ran out while the constrained request decoded"
    n_hog = len(httpx.post(server["url"] + "/tokenize", json={"content": hog}).json()["tokens"])
    assert n_hog > state["prompt"] + kw["max_tokens"], "the scene: a hog is longer than the other can grow"
    assert 0 < seen[0] < len(alone) and len(seen[1]) == 2 and min(seen[1]) >= n_hog, seen   # only the hogs ran
    assert text == alone and valid(text, FEATURES)
    assert settled(server)["kv_pages_free"] == KV_PAGES
