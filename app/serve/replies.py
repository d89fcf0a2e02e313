"""What goes back, in OpenAI's shapes: a completion or a chat completion, whole or as stream
chunks; the log-probabilities of each; OpenAI's error body; llama-server's token pieces.

    completions      {"object": "text_completion", "choices": [{"text", "logprobs", ...}]}
                     logprobs: parallel lists (tokens, token_logprobs, top_logprobs, text_offset)
    chat             {"object": "chat.completion", "choices": [{"message", "logprobs", ...}]}
                     logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}
    stream chunks    the same, ".chunk" objects for chat, one choice's piece each, as
                     "data: {...}" server-sent events; chat opens each choice with its role

Tool calls (chat with tools, tool_choice not none): each choice's text goes through its
request's parser (app/structured/calls.py). Whole, a reply with calls is a message with
`content` null and `tool_calls` [{id, type: "function", function: {name, arguments}}], its
finish_reason "tool_calls" (where it ended on its own; "length" where max_tokens cut it). Streamed,
the parser's deltas are the chunks' deltas: text as `content`, a call opening with its index, id,
type and name (arguments ""), then its arguments in pieces; a token's log-probability entries
ride on the next chunk that goes out (text that could still begin a call is held back).

Log-probabilities are the model's own (app/serve/api.py says which); a token is shown as its
text, or 'bytes:\\xNN...' where its piece is not whole UTF-8, as OpenAI does.
"""

from __future__ import annotations

import json
import time
import uuid


def error_body(message: str, kind: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def token_string(tokenizer, token_id: int) -> tuple[str, list[int]]:
    """A token as the logprobs objects show it: its text (a special token's too), and its bytes;
    a piece that is not whole UTF-8 is written 'bytes:\\xe2\\x80' as OpenAI does."""
    raw = tokenizer.token_piece(token_id, special=True)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return text, list(raw)


def completion_logprobs(tokenizer, entries) -> dict:
    """Completions' shape: parallel lists. entries: (token id, logprob | None, top | None,
    offset in the text)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, lp, top, offset in entries:
        out["tokens"].append(token_string(tokenizer, tid)[0])
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append(None if top is None else {token_string(tokenizer, i)[0]: v for i, v in top})
        out["text_offset"].append(offset)
    return out


def chat_logprobs(tokenizer, entries) -> dict:
    """Chat's shape: one object per token, its alternatives inside."""
    content = []
    for tid, lp, top, _ in entries:
        text, raw = token_string(tokenizer, tid)
        alternatives = []
        for i, v in top or ():
            t, b = token_string(tokenizer, i)
            alternatives.append({"token": t, "logprob": v, "bytes": b})
        content.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": alternatives})
    return {"content": content, "refusal": None}


def token_pieces(tokenizer, ids) -> list[dict]:
    """llama-server's /tokenize with_pieces: each id and its piece, as text, or as its bytes
    where the piece is not whole UTF-8."""
    pieces = []
    for i in ids:
        raw = tokenizer.token_piece(i, special=True)
        try:
            piece = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        pieces.append({"id": i, "piece": piece})
    return pieces


class Reply:
    """One request's answer in its shape (chat or completions), whole or in chunks."""

    def __init__(self, job, model_id: str, tokenizer):
        self.job, self.chat, self.model_id, self.tokenizer = job, job.chat, model_id, tokenizer
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"
        self.tools = self.chat and job.structured.calls_allowed      # replies may be tool calls
        self.calls = [job.structured.stream() for _ in range(job.n)] if self.tools else []
        self.held = [[] for _ in range(job.n)]      # log-probability entries waiting for a chunk

    def logprobs(self, entries) -> dict | None:
        if self.job.logprobs is None:
            return None
        return (chat_logprobs if self.chat else completion_logprobs)(self.tokenizer, entries)

    def usage(self, seqs) -> dict:
        """Every choice's tokens; the prompt positions found in the prefix cache."""
        n_prompt, n = len(self.job.prompt), sum(len(s.generated) for s in seqs)
        cached = seqs[0].cached_tokens if seqs and seqs[0].cached_tokens else 0
        return {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def whole(self, texts, entries, finish, seqs) -> dict:
        """The answer at once: each choice's text (or tool calls), log-probabilities and finish
        reason."""
        choices = []
        for i in range(self.job.n):
            choice = {"index": i, "logprobs": self.logprobs(entries[i]), "finish_reason": finish[i]}
            if not self.chat:
                choice["text"] = texts[i]
            elif not self.tools:
                choice["message"] = {"role": "assistant", "content": texts[i], "refusal": None}
            else:
                content, calls = self.job.structured.parse(texts[i])
                choice["message"] = {"role": "assistant", "content": content, "refusal": None}
                if calls:
                    choice["message"]["tool_calls"] = calls
                    choice["finish_reason"] = called(finish[i])
            choices.append(choice)
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model_id,
                "choices": choices, "usage": self.usage(seqs)}

    # ---- a stream ------------------------------------------------------------------------------
    def chunk(self, choices, **extra) -> str:
        body = {"id": self.id, "object": self.object + (".chunk" if self.chat else ""), "created": self.created,
                "model": self.model_id, "choices": choices, **extra}
        return f"data: {json.dumps(body)}\n\n"

    def opening(self) -> list[str]:
        """Chat opens each choice with its role; completions open with nothing."""
        if not self.chat:
            return []
        return [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]) for i in range(self.job.n)]

    def piece(self, i: int, text: str, entries, finish=None) -> str:
        """Choice i's next text and its entries; with `finish`, its last chunk. Tool calls:
        the chunks the text makes, perhaps none (see the module docstring)."""
        if self.tools:
            return self.tool_pieces(i, text, entries, finish)
        lp = self.logprobs(entries) if entries or finish is None else None
        if self.chat:
            delta = {"content": text} if text or finish is None else {}
            return self.chunk([{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}])
        return self.chunk([{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}])

    def tool_pieces(self, i: int, text: str, entries, finish=None) -> str:
        """Choice i's text through its call parser: a chunk per delta (the entries held so far
        on the first), and with `finish` the rest and the last chunk ("" when nothing goes out)."""
        parser = self.calls[i]
        deltas = parser.push(text) + (parser.finish() if finish is not None else [])
        self.held[i] += entries
        out = []
        for delta in deltas:
            held, self.held[i] = self.held[i], []
            out.append(self.chunk([{"index": i, "delta": delta, "logprobs": self.logprobs(held) if held else None,
                                    "finish_reason": None}]))
        if finish is not None:
            held, self.held[i] = self.held[i], []
            out.append(self.chunk([{"index": i, "delta": {}, "logprobs": self.logprobs(held) if held else None,
                                    "finish_reason": called(finish) if parser.calls else finish}]))
        return "".join(out)


def called(finish: str) -> str:
    """A reply with tool calls: finish_reason "tool_calls" where it ended on its own."""
    return "tool_calls" if finish == "stop" else finish
