"""OpenAI's chat messages, tools and tool results -> the prompt, through the model's template.

Messages are {role, content} with roles system (developer is its newer name), user, assistant
and tool; content a string or text parts; an assistant turn may carry `tool_calls` (its content
then often null), a tool turn answers one by `tool_call_id`.

Where the template shows tools (ToolForm.template_shows_tools) the messages go to it as Hugging
Face templates expect them: `tools` as a variable, assistant tool_calls with their arguments as
objects, tool turns as they are. Elsewhere, the generic form, in words any template renders:

    system     the request's system text, then GENERIC_INSTRUCTIONS and one line per tool
               ({"name", "description", "parameters"} as JSON); a system message of its own
               when the request has none (when calls are allowed: tool_choice is not none)
    assistant  its text, then each call as the model is asked to write one
    tool       a user turn: "Result of NAME (call ID):" and the result (TinyLlama's template
               drops a role it does not know; SmolLM2's would pass "tool" on to a model that
               never saw it)
"""

from __future__ import annotations

import json

from app.structured.form import GENERIC, ToolForm
from app.structured.request import Structured, StructuredError

GENERIC_INSTRUCTIONS = (
    "You can call tools (functions). To call one, reply with one JSON object and nothing else: "
    '{"name": <the tool\'s name>, "arguments": <an object of its parameters>}.')
SEVERAL = " To call several, write one such object per line."
ROLES = ("system", "developer", "user", "assistant", "tool")


def text_of(content, where: str) -> str:
    """A message's content as text: a string, text parts joined, or nothing (null)."""
    if content is None:
        return ""
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise StructuredError(f"{where}.content: only text parts are supported", "messages")
        return "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise StructuredError(f"{where}.content must be a string, text parts or null", "messages")
    return content


def checked_calls(calls, where: str) -> list:
    """An assistant turn's tool_calls: [{id, type: function, function: {name, arguments: str}}]."""
    if not isinstance(calls, list):
        raise StructuredError(f"{where}.tool_calls must be a list", "messages")
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(f.get("arguments"), str)
                and c.get("type", "function") == "function"):
            raise StructuredError(f"{where}.tool_calls[{j}] must be {{id, type: \"function\", function: "
                                  "{name, arguments: a JSON string}}", "messages")
    return calls


def call_text(name: str, arguments: str, form: ToolForm) -> str:
    """A call as the model writes one in `form`."""
    return form.open + json.dumps({"name": name, "arguments": _object(arguments)}, ensure_ascii=False) + form.close


def tool_lines(tools) -> str:
    return "\n".join(json.dumps({k: t[k] for k in ("name", "description", "parameters") if k in t},
                                ensure_ascii=False) for t in tools)


def chat_messages(messages, tools=(), form: ToolForm = GENERIC, calls_allowed: bool = True,
                  parallel: bool = True) -> tuple[list, dict]:
    """(messages for the template, its extra variables). tools: the request's functions
    ({"name", "description", "parameters"}, as request.Structured holds them)."""
    if not isinstance(messages, list) or not messages:
        raise StructuredError("messages must be a non-empty list of {role, content} objects", "messages")
    shown = list(tools) if calls_allowed else []
    out, names = [], {}
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise StructuredError(f"{where} must be an object with role {', '.join(ROLES)}", "messages")
        role, text = ("system" if m["role"] == "developer" else m["role"]), text_of(m.get("content"), where)
        if role == "assistant" and m.get("tool_calls"):
            calls = checked_calls(m["tool_calls"], where)
            names.update({c.get("id"): c["function"]["name"] for c in calls})
            if form.template_shows_tools:
                out.append({"role": role, "content": text, "tool_calls": [
                    {**c, "function": {**c["function"], "arguments": _object(c["function"]["arguments"])}}
                    for c in calls]})
            else:
                lines = [call_text(c["function"]["name"], c["function"]["arguments"], form) for c in calls]
                out.append({"role": role, "content": "\n".join(([text] if text else []) + lines)})
        elif role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise StructuredError(f"{where}: a tool message needs tool_call_id (the call it answers)", "messages")
            if form.template_shows_tools:
                out.append({"role": "tool", "content": text, "tool_call_id": call_id})
            else:
                out.append({"role": "user", "content": f"Result of {names.get(call_id, 'a tool')} (call {call_id}):\n"
                                                       f"{text}"})
        elif role == "assistant" or m.get("content") is not None:
            out.append({"role": role, "content": text})
        else:
            raise StructuredError(f"{where}.content must be a string or text parts", "messages")
    if not shown:
        return out, {}
    if form.template_shows_tools:
        return out, {"tools": [{"type": "function", "function": t} for t in shown]}
    instructions = GENERIC_INSTRUCTIONS + (SEVERAL if parallel else "") + "\nThe tools:\n" + tool_lines(shown)
    if out[0]["role"] == "system":
        out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + instructions}
    else:
        out.insert(0, {"role": "system", "content": instructions})
    return out, {}


def _object(arguments: str):
    """Arguments given as a JSON string, as the object templates expect (as given if not JSON)."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def render_prompt(tokenizer, messages, request: Structured | None = None) -> str:
    """The prompt text for a chat request (encode it with parse_special=True). request: what
    `structured` made of its tools fields (None: no tools)."""
    request = request or Structured()
    chat, variables = chat_messages(messages, request.tools, request.form, request.calls_allowed, request.parallel)
    return tokenizer.apply_chat_template(chat, add_generation_prompt=True, **variables)
