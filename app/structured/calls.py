"""Generated text -> OpenAI's tool calls: as stream deltas while it arrives, or whole.

A reply is text, or calls (never both: the grammar's `start: answer | calls`). The head of a call
decides: `open`, then `{"name": "<one of the tools>", "arguments":` with any JSON whitespace
(llguidance writes the properties in the schema's order, name first). While what has arrived
could still be such a head it is held back; once it cannot, it is text, and everything after it
too. In a call, the arguments object is passed on as it arrives (its text, exactly as generated:
that is OpenAI's `function.arguments`, a JSON string), its end found by counting brackets outside
strings; then `}`, `close`, a newline, and perhaps the next call.

Deltas, one per change (a server puts each in a chunk's `choices[i].delta`):

    {"content": "..."}                                                    text
    {"tool_calls": [{"index": i, "id": "call_...", "type": "function",
                     "function": {"name": "...", "arguments": ""}}]}     a call begins
    {"tool_calls": [{"index": i, "function": {"arguments": "..."}}]}     its arguments, in pieces
"""

from __future__ import annotations

import json
import secrets

from app.structured.form import GENERIC, ToolForm

WHITESPACE = " \t\n\r"
HOLD, NOT_A_CALL = "hold", "no"               # head(): wait for more text; it is text


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


NAME = object()                               # match(): a JSON string here, its value kept


def match(text: str, steps):
    """Match `steps` (literals, or NAME for a JSON string) at the start of `text`, whitespace
    allowed before each: HOLD (could still match, given more text), NOT_A_CALL, or (the NAME's
    value, the index past the match)."""
    pos, name = 0, None
    for step in steps:
        while pos < len(text) and text[pos] in WHITESPACE:
            pos += 1
        if step is NAME:
            if pos == len(text):
                return HOLD
            if text[pos] != '"':
                return NOT_A_CALL
            end = string_end(text, pos)
            if end is None:
                return HOLD
            name, pos = json.loads(text[pos:end]), end
            continue
        part = text[pos:pos + len(step)]
        if part != step[:len(part)]:
            return NOT_A_CALL
        if len(part) < len(step):
            return HOLD
        pos += len(step)
    return name, pos


def head(text: str, form: ToolForm):
    """Is `text` the start of a call? HOLD, NOT_A_CALL, or (name, where its arguments begin)."""
    found = match(text, [s for s in (form.open.strip(WHITESPACE), "{", '"name"', ":", NAME, ",", '"arguments"', ":")
                         if s])
    if not isinstance(found, tuple):
        return found
    name, pos = found
    while pos < len(text) and text[pos] in WHITESPACE:
        pos += 1
    return HOLD if pos == len(text) else (name, pos)


def string_end(text: str, start: int) -> int | None:
    """Index just past the JSON string that opens at text[start] ('"'), None if it is not closed yet."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i + 1
        i += 1
    return None


class ToolCallStream:
    """Feed it the generated text in pieces (`push`), then `finish`; each returns the deltas
    the text made (the module docstring). `content` and `calls` hold the reply so far:
    calls as OpenAI's message.tool_calls entries. tools: the names a call may have (a head
    naming another is text); calls_allowed: False when tool_choice is none (all text)."""

    def __init__(self, tools=(), form: ToolForm = GENERIC, calls_allowed: bool = True, new_id=new_call_id):
        self.tools, self.form, self.new_id = set(tools), form, new_id
        self.state = "start" if calls_allowed and self.tools else "text"
        self.buf = ""                 # text not yet passed on
        self.content = ""
        self.calls: list[dict] = []
        self.depth, self.in_string, self.escaped = 0, False, False

    def push(self, text: str) -> list:
        self.buf += text
        out = []
        while self.buf:
            before = (self.state, len(self.buf))
            out += getattr(self, "_" + self.state)()
            if (self.state, len(self.buf)) == before:
                break                 # needs more text
        return out

    def finish(self) -> list:
        """The end of the text: whatever is still held back is text (a head never completed
        where no call was made), or the rest of a call."""
        out = self.push("")
        if self.buf and self.state in ("start", "text"):
            self.state = "text"
            out += self._text()
        self.buf = ""
        return out

    # ---- states ---------------------------------------------------------------------------------
    def _text(self) -> list:
        piece, self.buf = self.buf, ""
        self.content += piece
        return [{"content": piece}] if piece else []

    def _start(self) -> list:
        """Before the first call: is this a call or text?"""
        verdict = head(self.buf, self.form)
        if verdict == HOLD:
            return []
        if verdict == NOT_A_CALL or verdict[0] not in self.tools:
            self.state = "text"
            return []
        return self._begin(*verdict)

    def _between(self) -> list:
        """After a call: the next call's head (the grammar allows nothing else)."""
        verdict = head(self.buf, self.form)
        if verdict == HOLD:
            return []
        if verdict == NOT_A_CALL or verdict[0] not in self.tools:
            self.buf = ""             # the grammar allows nothing here but another call
            return []
        return self._begin(*verdict)

    def _begin(self, name: str, at: int) -> list:
        call_id = self.new_id()
        self.calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}})
        self.buf = self.buf[at:]
        self.state, self.depth, self.in_string, self.escaped = "arguments", 0, False, False
        return [{"tool_calls": [{"index": len(self.calls) - 1, "id": call_id, "type": "function",
                                 "function": {"name": name, "arguments": ""}}]}]

    def _arguments(self) -> list:
        """The arguments' JSON value as it arrives, to the bracket that closes it."""
        i = 0
        while i < len(self.buf):
            c = self.buf[i]
            i += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.state = "closing"
                    break
        piece, self.buf = self.buf[:i], self.buf[i:]
        if not piece:
            return []
        self.calls[-1]["function"]["arguments"] += piece
        return [{"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": piece}}]}]

    def _closing(self) -> list:
        """The call object's `}` and the form's `close`, then on to the next call."""
        found = match(self.buf, [s for s in ("}", self.form.close.strip(WHITESPACE)) if s])
        if found == HOLD:
            return []
        self.buf = "" if found == NOT_A_CALL else self.buf[found[1]:]    # else: the grammar allows nothing
        self.state = "between"
        return []


def parse_reply(text: str, tools=(), form: ToolForm = GENERIC, calls_allowed: bool = True,
                new_id=new_call_id) -> tuple[str | None, list]:
    """The whole reply: (message.content, message.tool_calls), content None when calls were
    made; the arguments are the streamed pieces joined, so both ways give the same strings."""
    stream = ToolCallStream(tools, form, calls_allowed, new_id)
    stream.push(text)
    stream.finish()
    return (None if stream.calls else stream.content), stream.calls
