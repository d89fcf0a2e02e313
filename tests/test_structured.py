"""OpenAI's response_format and tools below the server (app/structured/).

* The request's fields: each wrong shape refused naming its field (as the server's 400 will);
  a schema llguidance refuses named where it was given.
* The grammar, by tool_choice and parallel_tool_calls, judged token by token on the default
  model's vocabulary: calls whose arguments jsonschema accepts pass, others do not; text only
  where `auto` allows it (and `none`: text that does not begin like a call); one call where
  only one may be; the tagged form; a JSON answer beside calls where they can be told apart,
  refused where they cannot.
* The prompt: SmolLM2's and TinyLlama's templates know no tools (the generic form: tools in a
  system message, calls as JSON lines, results as user turns); a template that reads `tools`
  gets them, and the turns as Hugging Face templates expect them.
* The reply: parsed whole and streamed in every split, the same calls; deltas in OpenAI's order
  (index, id and name first, then the arguments in pieces that join to the arguments); text
  stays text.
* The default model, greedy: required and named calls and a two-turn tool loop, every call's
  arguments validated by jsonschema against its tool's parameters.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from app.structured import (
    GENERIC,
    TAGGED,
    StructuredError,
    ToolCallStream,
    parse_reply,
    render_prompt,
    structured,
    tool_form,
)
from common.constrain import Constraint, ConstraintError
from common.generate import Sampler, Session
from common.tokenizer import Tokenizer


def function_tool(name: str, description: str, **properties) -> dict:
    """An OpenAI tool whose arguments are an object of exactly these properties, all required."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "additionalProperties": False, "required": list(properties),
                       "properties": properties}}}


CITY_AND_UNIT = {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["C", "F"]}}
WEATHER = function_tool("get_weather", "Current weather in a city", **CITY_AND_UNIT)
ADD = function_tool("add", "Add two numbers", x={"type": "number"}, y={"type": "number"})
TOOLS = [WEATHER, ADD]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
HERMES_TEMPLATE = ("{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
                   "Write calls in <tool_call></tool_call> tags.<|im_end|>\n{% endif %}"
                   "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                   "{% for c in m.tool_calls or [] %}<tool_call>\n{{ c.function | tojson }}\n</tool_call>{% endfor %}"
                   "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def passes(tok, ll, request, text: str) -> bool:
    """The request's grammar takes the text token by token and then allows the end."""
    c = Constraint(request.grammar, ll)
    try:
        for t in tok.encode(text, add_bos=False, add_eos=False):
            c.consume(t)
    except ConstraintError:
        return False
    return bool(c.allowed()[tok.eos_id])


def call(name: str, arguments: dict, form=GENERIC) -> str:
    return form.open + json.dumps({"name": name, "arguments": arguments}) + form.close


def valid_arguments(name: str, arguments: dict) -> bool:
    try:
        jsonschema.validate(arguments, PARAMETERS[name])
        return True
    except jsonschema.ValidationError:
        return False


# ---- the request's fields -------------------------------------------------------------------------

@pytest.mark.parametrize("data, param, message", [
    ({"response_format": {"type": "xml"}}, "response_format", 'must be {"type": "text"}'),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format",
     "json_schema.name must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", "response_format.json_schema.schema: llguidance refuses it: Invalid type: strin"),
    ({"response_format": {"type": "json_object", "json_schema": {}}}, "response_format", "unexpected field"),
    ({"tools": {"name": "f"}}, "tools", "tools must be a list"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "tools[0].function.name"),
    ({"tools": [ADD, ADD]}, "tools", "two tools have this name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "d": {"type": "string", "format": "colour"}}}}}]}, "tools",
     "tools[0].function.parameters: llguidance refuses it: Unknown format: colour"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", 'must be "none", "auto", "required"'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}}, "tool_choice",
     "not among the tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "must be true or false"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "could not be told apart"),
])
def test_a_wrong_field_is_refused_by_name(ll, data, param, message):
    with pytest.raises(StructuredError) as refused:
        structured(data, ll)
    assert refused.value.param == param and message in str(refused.value), str(refused.value)
    assert "\n" not in str(refused.value)


def test_text_completions_take_response_format_but_not_tools(ll):
    assert structured({"response_format": {"type": "json_object"}}, ll, chat=False).grammar is not None
    with pytest.raises(StructuredError, match="tools are for chat completions"):
        structured({"tools": TOOLS}, ll, chat=False)


def test_nothing_asked_is_no_grammar(ll):
    for data in ({}, {"response_format": {"type": "text"}}, {"tool_choice": "none"}):
        assert structured(data, ll).grammar is None, data


@pytest.mark.parametrize("form", [GENERIC, TAGGED], ids=["generic", "tagged"])
def test_tool_choice_none_with_tools_is_a_message_that_does_not_begin_like_a_call(tok, ll, form):
    """The tools are there (their calls in the history) but none may be called: the reply is
    text, never one written like a call (which the parser would give back as content)."""
    request = structured({"tools": TOOLS, "tool_choice": "none"}, ll, form)
    assert passes(tok, ll, request, "It is sunny in Paris.")
    assert not passes(tok, ll, request, call(*GOOD_WEATHER, form))
    assert request.parse(call(*GOOD_WEATHER, form))[1] == []        # were it written, it would be text


# ---- the grammar ---------------------------------------------------------------------------------

GOOD_WEATHER = ("get_weather", {"city": "Paris", "unit": "C"})
GOOD_ADD = ("add", {"x": 1, "y": 2.5})
BAD_CALLS = [("add", {"x": "one", "y": 2}), ("add", {"x": 1}), ("get_weather", {"city": "Paris", "unit": "K"}),
             ("get_weather", {"city": "Paris", "unit": "C", "when": "now"}), ("mul", {"x": 1, "y": 2})]


@pytest.mark.parametrize("form", [GENERIC, TAGGED], ids=["generic", "tagged"])
@pytest.mark.parametrize("data, text, one, two, only", [
    ({"tools": TOOLS}, True, True, True, None),
    ({"tools": TOOLS, "tool_choice": "required"}, False, True, True, None),
    ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, False, True, False, None),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}}, False, True, False, "add"),
])
def test_each_tool_choice_allows_what_it_says(tok, ll, form, data, text, one, two, only):
    request = structured(data, ll, form)
    assert passes(tok, ll, request, "It is sunny in Paris.") == text
    for name, args in (GOOD_WEATHER, GOOD_ADD):
        assert valid_arguments(name, args)
        assert passes(tok, ll, request, call(name, args, form)) == (one and only in (None, name)), name
    both = call(*GOOD_ADD, form) + "\n" + call(*GOOD_ADD, form)
    assert passes(tok, ll, request, both) == two
    for name, args in BAD_CALLS:                     # arguments jsonschema refuses, or a tool that is not there
        assert name not in PARAMETERS or not valid_arguments(name, args)
        assert not passes(tok, ll, request, call(name, args, form)), (name, args)


def test_text_may_not_begin_like_a_call(tok, ll):
    generic, tagged = structured({"tools": TOOLS}, ll, GENERIC), structured({"tools": TOOLS}, ll, TAGGED)
    assert not passes(tok, ll, generic, '{"city": "Paris"}') and passes(tok, ll, generic, 'Say {"a": 1}')
    assert passes(tok, ll, tagged, '{"city": "Paris"}') and not passes(tok, ll, tagged, "<tool_call>\nhi")


def test_a_json_answer_beside_calls_where_they_can_be_told_apart(tok, ll):
    answer = {"type": "object", "required": ["summary"], "additionalProperties": False,
              "properties": {"summary": {"type": "string", "maxLength": 40}}}
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": answer, "strict": True}}
    for form in (GENERIC, TAGGED):
        request = structured({"tools": TOOLS, "response_format": rf}, ll, form)
        assert passes(tok, ll, request, '{"summary": "sunny"}') and passes(tok, ll, request, call(*GOOD_ADD, form))
        assert not passes(tok, ll, request, "sunny") and not passes(tok, ll, request, '{"summary": 5}')
    # tagged calls are told apart from any answer: json_object is fine there
    request = structured({"tools": TOOLS, "response_format": {"type": "json_object"}}, ll, TAGGED)
    assert passes(tok, ll, request, '{"name": "add"}') and passes(tok, ll, request, call(*GOOD_ADD, TAGGED))
    content, calls = request.parse('{"name": "add"}')
    assert content == '{"name": "add"}' and calls == []


# ---- the prompt --------------------------------------------------------------------------------

LOOP = [{"role": "user", "content": "What's the weather in Paris, in Celsius?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]


def test_smollm2_and_tinyllama_templates_know_no_tools_and_get_the_generic_form(tok, default_model_path):
    tiny = Tokenizer.from_metadata({**tok._meta, "tokenizer.chat_template": (
        "{% for message in messages %}{% if message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + "
        "eos_token }}{% elif message['role'] == 'system' %}{{ '<|system|>\n' + message['content'] + eos_token }}"
        "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\n' + message['content'] + eos_token }}"
        "{% endif %}{% if loop.last and add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}{% endfor %}")})
    hermes = Tokenizer.from_metadata({**tok._meta, "tokenizer.chat_template": HERMES_TEMPLATE})
    assert tool_form(tok) == GENERIC and tool_form(tiny) == GENERIC and tool_form(hermes) == TAGGED


def test_the_generic_form_writes_tools_calls_and_results_in_words_any_template_renders(tok, ll):
    request = structured({"tools": TOOLS}, ll)
    text = render_prompt(tok, [{"role": "system", "content": "Be brief."}] + LOOP, request)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\nYou can call tools")
    assert all(json.dumps(t["function"]["parameters"]) in system for t in TOOLS)
    call = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in text
    assert "<|im_start|>user\nResult of get_weather (call call_1):\n18 C, sunny<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # no tools to call: none listed, but the turns so far still render
    quiet = render_prompt(tok, LOOP, structured({"tools": TOOLS, "tool_choice": "none"}, ll))
    assert "You can call tools" not in quiet and "Result of get_weather" in quiet


def test_a_template_that_reads_tools_gets_them_and_the_turns_as_they_are(tok, ll):
    hermes = Tokenizer.from_metadata({**tok._meta, "tokenizer.chat_template": HERMES_TEMPLATE})
    request = structured({"tools": TOOLS}, ll, tool_form(hermes))
    text = render_prompt(hermes, LOOP, request)
    assert json.dumps(WEATHER) in text and "You can call tools" not in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>' in text
    assert "<|im_start|>tool\n18 C, sunny<|im_end|>" in text


@pytest.mark.parametrize("messages, message", [
    ([], "non-empty list"),
    ([{"role": "robot", "content": "hi"}], "messages[0] must be an object with role"),
    ([{"role": "tool", "content": "18 C"}], "needs tool_call_id"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]}],
     "arguments: a JSON string"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "only text parts"),
])
def test_bad_messages_are_refused_naming_them(tok, ll, messages, message):
    with pytest.raises(StructuredError) as refused:
        render_prompt(tok, messages, structured({"tools": TOOLS}, ll))
    assert refused.value.param == "messages" and message in str(refused.value), str(refused.value)


SHOWS_TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
                        "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                        "{% for c in m.tool_calls or [] %}{{ c.function | tojson }}{% endfor %}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CALLED = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'


def form_problems(choose, tok, ll) -> list[str]:
    """The three forms a tool is shown in, by the template: SmolLM2's knows no tools (the generic
    form: the tools and the instructions in a system message, a call as a JSON line, a result as
    a user turn); a Hermes template (tools shown by it, calls in <tool_call> tags, tool turns as
    they are); a template that reads `tools` without those tags (tools shown by it, calls as bare
    JSON objects it renders from objects). In each, the grammar takes a call written in that form
    and refuses one in another. `choose`: the rule that picks the form from the tokenizer."""
    def with_template(text):
        return Tokenizer.from_metadata({**tok._meta, "tokenizer.chat_template": text})
    cases = [("SmolLM2's", tok, False, GENERIC.open), ("Hermes", with_template(HERMES_TEMPLATE), True, TAGGED.open),
             ("tools without tags", with_template(SHOWS_TOOLS_TEMPLATE), True, "")]
    problems = []
    for name, tokenizer, shows, opening in cases:
        form = choose(tokenizer)
        request = structured({"tools": TOOLS, "tool_choice": "required"}, ll, form)
        prompt = render_prompt(tokenizer, LOOP, request)
        if form.template_shows_tools != shows or form.open != opening:
            problems.append(f"{name}: the form {form}")
        if shows != (json.dumps(WEATHER) in prompt) or shows == ("You can call tools" in prompt):
            problems.append(f"{name}: the tools {'not ' if shows else ''}shown by the template: {prompt!r}")
        result = "<|im_start|>tool\n18 C, sunny" if shows else "<|im_start|>user\nResult of get_weather (call call_1)"
        if result not in prompt or CALLED not in prompt:
            problems.append(f"{name}: the call and its result: {prompt!r}")
        other = TAGGED if not opening else GENERIC
        args = {"city": "Paris", "unit": "C"}
        if not passes(tok, ll, request, call("get_weather", args, form)) or \
                passes(tok, ll, request, call("get_weather", args, other)):
            problems.append(f"{name}: the grammar does not hold to {form.name}'s calls")
    return problems


def tags_decide_alone(tokenizer):
    """A WRONG rule, planted: the tags alone decide (a template that reads tools without them is generic)."""
    return TAGGED if "<tool_call>" in (tokenizer.chat_template or "") else GENERIC


def never_tagged(tokenizer):
    """A WRONG rule, planted: a template that reads tools shows them, its calls always bare JSON."""
    form = tool_form(tokenizer)
    return form if form != TAGGED else tool_form(Tokenizer.from_metadata(
        {**tokenizer._meta, "tokenizer.chat_template": SHOWS_TOOLS_TEMPLATE}))


@pytest.mark.parametrize("choose", [tool_form, tags_decide_alone, never_tagged], ids=lambda f: f.__name__)
def test_each_template_gets_its_form_of_showing_tools_and_writing_calls(choose, tok, ll):
    assert (form_problems(choose, tok, ll) == []) == (choose is tool_form)


NOW = {"type": "function", "function": {"name": "now", "description": "The time now"}}


def no_parameters_problems(tok, ll) -> list[str]:
    """A tool declared without `parameters` takes none: its call's arguments are the empty object
    (anything else refused), the prompt shows it so, and the reply parses to arguments "{}"."""
    request = structured({"tools": [NOW], "tool_choice": "required"}, ll)
    problems = []
    if not passes(tok, ll, request, '{"name": "now", "arguments": {}}'):
        problems.append("the empty arguments refused")
    for other in ('{"name": "now", "arguments": {"tz": "UTC"}}', '{"name": "now", "arguments": {"": 0}}'):
        if passes(tok, ll, request, other):
            problems.append(f"{other} taken")
    prompt = render_prompt(tok, [{"role": "user", "content": "What time is it?"}], request)
    shown = [json.JSONDecoder().raw_decode(line)[0] for line in prompt.splitlines()
             if line.startswith('{"name": "now"')]
    if [t.get("parameters") for t in shown] != [{"type": "object", "properties": {}, "additionalProperties": False}]:
        problems.append(f"the prompt shows it as {shown}")
    _, calls = request.parse('{"name": "now", "arguments": {}}')
    if [c["function"]["arguments"] for c in calls] != ["{}"]:
        problems.append(f"parsed as {calls}")
    return problems


def test_a_tool_without_parameters_is_called_with_the_empty_object(tok, ll, monkeypatch):
    from app.structured import request
    assert no_parameters_problems(tok, ll) == []
    monkeypatch.setattr(request, "NO_PARAMETERS", {"type": "object"})       # planted: any object
    assert no_parameters_problems(tok, ll) != []


# ---- the reply -----------------------------------------------------------------------------------

def numbered():
    n = iter(range(100))
    return lambda: f"call_{next(n)}"


@pytest.mark.parametrize("form", [GENERIC, TAGGED], ids=["generic", "tagged"])
def test_streamed_in_any_split_the_calls_are_the_whole_replys(form):
    reply = (form.open + '{"name": "get_weather",\n  "arguments": {"city": "Pa\\"ris}", "unit": "C"}}' + form.close
             + "\n" + form.open + '{"name":"add","arguments":{"x": [1, {"y": "]"}], "y": 2}}' + form.close)
    whole = parse_reply(reply, PARAMETERS, form, new_id=numbered())
    assert whole[0] is None and [c["function"]["name"] for c in whole[1]] == ["get_weather", "add"]
    assert json.loads(whole[1][0]["function"]["arguments"]) == {"city": 'Pa"ris}', "unit": "C"}
    assert whole[1][1]["function"]["arguments"] == '{"x": [1, {"y": "]"}], "y": 2}'
    for cut in range(len(reply) + 1):
        for pieces in ([reply[:cut], reply[cut:]], list(reply) if cut == 0 else []):
            if not pieces:
                continue
            stream = ToolCallStream(PARAMETERS, form, new_id=numbered())
            deltas = [d for p in pieces for d in stream.push(p)] + stream.finish()
            assert stream.calls == whole[1] and stream.content == ""
            joined = {}
            for d in deltas:
                (entry,) = d["tool_calls"]
                i = entry["index"]
                if i not in joined:               # a call's first delta: index, id, type, name, no arguments yet
                    assert entry == {"index": i, "id": f"call_{i}", "type": "function",
                                     "function": {"name": whole[1][i]["function"]["name"], "arguments": ""}}
                    joined[i] = ""
                else:
                    assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
                    joined[i] += entry["function"]["arguments"]
            assert [joined[i] for i in sorted(joined)] == [c["function"]["arguments"] for c in whole[1]]


def test_text_is_content_and_a_call_head_naming_no_tool_is_text():
    for text in ("Hello {there}", '{"name": "mul", "arguments": {}}', '{"city": "Paris"}', "{"):
        stream = ToolCallStream(PARAMETERS)
        deltas = [d for ch in text for d in stream.push(ch)] + stream.finish()
        assert "".join(d["content"] for d in deltas) == text == stream.content and stream.calls == []
    assert parse_reply('{"name": "add", "arguments": {}}', PARAMETERS, calls_allowed=False) == (
        '{"name": "add", "arguments": {}}', [])


# ---- the default model, greedy -------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(default_model_path):
    from stages import load
    return load("threads", default_model_path, threads=1)


def reply(engine, ll, messages, data) -> tuple:
    tok = engine.tokenizer
    request = structured(data, ll, tool_form(tok))
    prompt = tok.encode(render_prompt(tok, messages, request), parse_special=True)
    gen = Session(engine).generate(prompt, 80, Sampler(constraint=Constraint(request.grammar, ll)),
                                   stop_ids=tok.eog_ids)
    assert gen.stop_reason == "eog"
    return request.parse(tok.decode(gen.tokens, skip_special=True))


def test_the_model_calls_tools_with_arguments_its_parameters_accept_in_a_two_turn_loop(engine, ll):
    messages = LOOP[:1]
    content, calls = reply(engine, ll, messages, {"tools": TOOLS, "tool_choice": "required"})
    assert content is None and calls
    forced = reply(engine, ll, messages, {"tools": TOOLS, "tool_choice": {"type": "function",
                                                                          "function": {"name": "add"}}})[1]
    assert len(forced) == 1 and forced[0]["function"]["name"] == "add"
    for c in calls + forced:
        assert c["type"] == "function" and c["id"].startswith("call_")
        jsonschema.validate(json.loads(c["function"]["arguments"]), PARAMETERS[c["function"]["name"]])
    # the second turn: the call and its result in the prompt; auto lets the model answer or call again
    messages += [{"role": "assistant", "content": None, "tool_calls": calls[:1]},
                 {"role": "tool", "tool_call_id": calls[0]["id"], "content": "18 C, sunny"}]
    content, again = reply(engine, ll, messages, {"tools": TOOLS})
    assert (content is None) == bool(again)
    for c in again:
        jsonschema.validate(json.loads(c["function"]["arguments"]), PARAMETERS[c["function"]["name"]])
