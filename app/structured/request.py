"""A request's response_format, tools, tool_choice and parallel_tool_calls -> one grammar.

OpenAI's shapes, checked field by field (StructuredError names the field: the server's 400):

    response_format       {"type": "text"} | {"type": "json_object"} | {"type": "json_schema",
                          "json_schema": {"name", "schema", "strict", "description"}}
                          (no schema: any JSON object; strict or not, the schema is enforced)
    tools                 [{"type": "function", "function": {"name", "description",
                          "parameters", "strict"}}]   (no parameters: an empty object)
    tool_choice           "none" | "auto" (the default with tools) | "required" |
                          {"type": "function", "function": {"name": ...}}
    parallel_tool_calls   true (the default): one call or more; false: one

Each schema is compiled on its own first, so that a schema llguidance refuses is named where it
was given (response_format, or tools[i]); then the whole grammar (app/structured/__init__.py).
Text completions may take response_format too, as llama-server's do.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from app.structured.calls import ToolCallStream, new_call_id, parse_reply
from app.structured.form import GENERIC, ToolForm
from common.constrain import ConstraintError, Grammar
from common.constrain.grammar import ANY_OBJECT, with_json_options
from common.generate import ParameterError

NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")          # OpenAI's rule for function and schema names
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class StructuredError(ParameterError):
    """A response_format, tools or tool_choice the server refuses (400); `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class Structured:
    """What a request asks of the reply. grammar: None when nothing constrains it."""
    grammar: Grammar | None = None
    tools: list = field(default_factory=list)       # {"name", "description", "parameters"}
    tool_choice: str = "none"                       # none | auto | required | function
    forced: str | None = None                       # tool_choice function: its name
    parallel: bool = True
    form: ToolForm = GENERIC
    response_schema: dict | None = None             # response_format's schema (json_object: any object)

    @property
    def calls_allowed(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def tool_names(self) -> list:
        return [t["name"] for t in self.tools]

    def stream(self, new_id=new_call_id) -> ToolCallStream:
        """A parser of this request's reply as it streams (calls.py)."""
        return ToolCallStream(self.tool_names, self.form, self.calls_allowed, new_id)

    def parse(self, text: str, new_id=new_call_id) -> tuple[str | None, list]:
        """The whole reply: (message.content, message.tool_calls)."""
        return parse_reply(text, self.tool_names, self.form, self.calls_allowed, new_id)


def structured(data: dict, ll, form: ToolForm = GENERIC, chat: bool = True) -> Structured:
    """The request's fields (a parsed body) -> Structured, its grammar compiled for `ll` (the
    model's llguidance tokenizer: common/constrain ll_tokenizer)."""
    s = Structured(form=form)
    s.response_schema = response_schema(data.get("response_format"), ll)
    if chat:
        s.tools = functions(data.get("tools"), ll)
        s.tool_choice, s.forced = choice(data.get("tool_choice"), s.tools)
        s.parallel = flag(data, "parallel_tool_calls", True)
    else:
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            if data.get(name) is not None:
                raise StructuredError(f"{name}: tools are for chat completions", name)
    s.grammar = grammar(s, ll)
    return s


def flag(data: dict, name: str, default: bool) -> bool:
    value = data.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise StructuredError(f"{name} = {value!r}: must be true or false", name)
    return value


def compiled(schema, what: str, param: str, ll) -> dict:
    """The schema, once llguidance compiles it (else StructuredError naming `what`)."""
    try:
        Grammar.json_schema(schema, what).checked(ll)
    except ConstraintError as e:
        raise StructuredError(str(e), param) from None
    return schema


def response_schema(rf, ll) -> dict | None:
    if rf is None:
        return None
    where = "response_format"
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise StructuredError(f'{where} must be {{"type": "text"}}, {{"type": "json_object"}} or '
                              f'{{"type": "json_schema", "json_schema": {{"name": ..., "schema": {{...}}}}}}', where)
    extra = sorted(set(rf) - {"type", "json_schema"})
    if extra or ("json_schema" in rf and rf["type"] != "json_schema"):
        raise StructuredError(f"{where}: unexpected field {(extra or ['json_schema'])[0]!r} for type {rf['type']!r}",
                              where)
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return ANY_OBJECT
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise StructuredError(f"{where}.json_schema must be an object with name and schema", where)
    extra = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if extra:
        raise StructuredError(f"{where}.json_schema: unexpected field {extra[0]!r}", where)
    if not isinstance(spec.get("name"), str) or not NAME.fullmatch(spec["name"]):
        raise StructuredError(f"{where}.json_schema.name must be 1 to 64 letters, digits, _ or -", where)
    if not isinstance(spec.get("strict", False), bool):
        raise StructuredError(f"{where}.json_schema.strict must be true or false", where)
    schema = spec.get("schema", ANY_OBJECT)
    if not isinstance(schema, dict):
        raise StructuredError(f"{where}.json_schema.schema must be a JSON schema (an object)", where)
    return compiled(schema, f"{where}.json_schema.schema", where, ll)


def functions(tools, ll) -> list:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise StructuredError("tools must be a list of {type: function, function: {name, parameters}}", "tools")
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict):
            raise StructuredError(f'{where} must be {{"type": "function", "function": {{...}}}}', "tools")
        name = f.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise StructuredError(f"{where}.function.name must be 1 to 64 letters, digits, _ or -", "tools")
        if name in (o["name"] for o in out):
            raise StructuredError(f"{where}.function.name {name!r}: two tools have this name", "tools")
        if not isinstance(f.get("description", ""), str) or not isinstance(f.get("strict", False), bool):
            raise StructuredError(f"{where}.function: description must be a string, strict true or false", "tools")
        params = f.get("parameters", NO_PARAMETERS)
        if not isinstance(params, dict):
            raise StructuredError(f"{where}.function.parameters must be a JSON schema (an object)", "tools")
        compiled(params, f"{where}.function.parameters", "tools", ll)
        out.append({"name": name, **({"description": f["description"]} if "description" in f else {}),
                    "parameters": params})
    return out


def choice(value, tools) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if tools else "none"), None
    if value in ("none", "auto", "required"):
        if value != "none" and not tools:
            raise StructuredError(f"tool_choice {value!r} needs tools", "tool_choice")
        return value, None
    f = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise StructuredError('tool_choice must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}', "tool_choice")
    if f["name"] not in (t["name"] for t in tools):
        raise StructuredError(f"tool_choice names {f['name']!r}, which is not among the tools", "tool_choice")
    return "function", f["name"]


# ---- the grammar ------------------------------------------------------------------------------

def inline(schema) -> str:
    """A schema inside a Lark grammar, with the JSON options a top-level one gets."""
    return "%json " + json.dumps(with_json_options(schema), ensure_ascii=False)


def call_schema(tool: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": tool["name"]}, "arguments": tool["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False}


def cannot_be_a_call(schema) -> bool:
    """Provably, no call object ({"name": ..., "arguments": {...}}, nothing else) matches this
    schema (read at its top level only: a schema it cannot tell about counts as matching)."""
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    if kind is not None and kind != "object" and not (isinstance(kind, list) and "object" in kind):
        return True
    if set(schema.get("required", ())) - {"name", "arguments"}:
        return True
    return schema.get("additionalProperties") is False and "name" not in schema.get("properties", {})


def regex_literal(text: str) -> str:
    """text as a regex matching it (hex escapes: Rust's regex reads some escaped letters as classes)."""
    return "".join(c if c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


def text_rules(form: ToolForm) -> list:
    """`answer`: text that does not begin like a call."""
    return ["answer: TEXT", f"TEXT: /(?s:.+)/ & ~/{regex_literal(form.first)}(?s:.*)/"]


def grammar(s: Structured, ll) -> Grammar | None:
    if s.response_schema is not None and not s.calls_allowed:
        return Grammar.json_schema(s.response_schema, "response_format").checked(ll)
    if not s.calls_allowed:                      # tools given, tool_choice none: a message, not a call
        return Grammar.lark("\n".join(["start: answer", *text_rules(s.form)]) + "\n", "tools").checked(ll) \
            if s.tools else None
    tools = [t for t in s.tools if s.forced in (None, t["name"])]
    one = call_schema(tools[0]) if len(tools) == 1 else {"anyOf": [call_schema(t) for t in tools]}
    f = s.form
    call = " ".join(part for part in (f.open and json.dumps(f.open), inline(one), f.close and json.dumps(f.close))
                    if part)
    rules = [f"call: {call}",
             f"calls: call ({json.dumps(f.separator)} call)*" if s.parallel and not s.forced else "calls: call"]
    if s.tool_choice == "auto":
        if s.response_schema is not None and not f.open and not cannot_be_a_call(s.response_schema):
            raise StructuredError("response_format with tools (tool_choice auto): this model writes a call as a bare "
                                  'JSON object {"name", "arguments"}, which its answer\'s schema would also match, so '
                                  "the two could not be told apart; give the answer's schema a required property "
                                  "other than name and arguments (or additionalProperties false without a name "
                                  "property), or use tool_choice required or none", "response_format")
        if s.response_schema is None:
            rules += text_rules(f)
        else:
            rules += [f"answer: {inline(s.response_schema)}"]
        rules.insert(0, "start: answer | calls")
    else:
        rules.insert(0, "start: calls")
    what = "tools" if s.response_schema is None else "tools with response_format"
    try:
        return Grammar.lark("\n".join(rules) + "\n", what).checked(ll)
    except ConstraintError as e:
        raise StructuredError(str(e), "tools") from None
