"""OpenAI's request bodies in (completions and chat), a Job out: what the engine is asked.

Every field of OpenAI's completions and chat completions APIs is either honoured or refused by
name with a 400 (UNSUPPORTED: functions, audio, ...); a field OpenAI does not have is refused as
unrecognized, as OpenAI does. The generation parameters go through the command line's own
validation (common/generate.py: SamplingParams, check_n_predict, check_fits), so a value out of
range gets the same words in both, with the API's names for the fields.

Structured outputs and tool calls (app/structured/): chat takes `response_format` (json_object,
json_schema), `tools`, `tool_choice` and `parallel_tool_calls`; text completions take
`response_format` too, as llama-server's do (tools are for chat). They become one grammar, and
each choice decodes under it (common/constrain/: the grammar's mask first in its sampler). A
schema llguidance refuses, or a field of the wrong shape, is a 400 whose `param` names the field.
Chat messages go through app/structured's render_prompt, so assistant turns with `tool_calls` and
`tool` results render whether or not the request has tools.

Log-probabilities are the model's own: log-softmax of the logits, before logit_bias, penalties
and temperature (what vLLM returns by default), so the greedy token is the most likely one
unless a bias or penalty moved it; under a grammar, before its mask too. The answers' shapes are
app/serve/replies.py's.
"""

from __future__ import annotations

import json
import re

from app.structured import Structured, StructuredError, render_prompt, structured
from common.generate import ContextError, ParameterError, SamplingParams
from common.tokenizer import TokenizerError

# What the server sets when a request does not: OpenAI's defaults, and llama.cpp's samplers off.
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0,
                   "frequency_penalty": 0.0, "presence_penalty": 0.0}
COMPLETION_MAX_TOKENS = 16                   # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 4
MAX_COMPLETION_LOGPROBS = 5                  # OpenAI's bounds
MAX_TOP_LOGPROBS = 20

COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
                 "n", "user", "frequency_penalty", "presence_penalty", "logit_bias",
                 "top_k", "min_p", "repeat_penalty", "ignore_eos"}          # the last four: llama.cpp's
STRUCTURED_FIELDS = {"response_format", "tools", "tool_choice", "parallel_tool_calls"}    # app/structured
# completions: tools and the rest are taken in only to be refused with words that say why
COMPLETION_FIELDS = COMMON_FIELDS | STRUCTURED_FIELDS | {"prompt", "echo", "logprobs", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | STRUCTURED_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                                                   "store"}
# OpenAI's fields this server does not do: refused by name unless given their neutral value
UNSUPPORTED = {"functions": None, "function_call": None, "audio": None, "modalities": None,
               "prediction": None, "reasoning_effort": None, "web_search_options": None, "suffix": None,
               "metadata": None, "service_tier": None, "verbosity": None, "prompt_cache_key": None,
               "safety_identifier": None, "best_of": 1, "store": False}
INSTEAD = {"functions": "tools", "function_call": "tool_choice"}     # the deprecated names' successors
# SamplingParams' names for the API's
API_NAMES = {"temp": "temperature", "n_predict": "max_tokens"}


class BadRequest(ValueError):
    """A request the server refuses with 400; `param` names the field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def parse_json(body: bytes) -> dict:
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    return data


def check_fields(data: dict, allowed: set):
    for name in sorted(data):
        if name in UNSUPPORTED and data[name] is not None and data[name] != UNSUPPORTED[name]:
            instead = f"; use {INSTEAD[name]}" if name in INSTEAD else ""
            raise BadRequest(f"{name}: not supported by this server (remove {name} from the request{instead})", name)
    unknown = sorted(set(data) - allowed - set(UNSUPPORTED))
    if unknown:
        raise BadRequest(f"unrecognized request argument: {unknown[0]} (this server takes: "
                         f"{', '.join(sorted(allowed))})", unknown[0])


def typed(data: dict, name: str, kinds, what: str, default=None):
    value, kinds = data.get(name), kinds if isinstance(kinds, tuple) else (kinds,)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise BadRequest(f"{name} = {value!r}: must be {what}", name)
    return value


def count(data: dict, name: str, low: int, high: int, default=None):
    value = typed(data, name, int, f"an integer in {low}..{high}", default)
    if value is not None and not low <= value <= high:
        raise BadRequest(f"{name} = {value!r}: must be an integer in {low}..{high}", name)
    return value


def stop_strings(data: dict) -> list[str]:
    stop = data.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOP_STRINGS:
        raise BadRequest(f"stop = {stop!r}: must be a string or a list of at most {MAX_STOP_STRINGS} strings", "stop")
    return [s for s in stops if s]


def logit_bias(data: dict, n_vocab: int) -> dict:
    """OpenAI's {"token id": bias} (keys are strings in JSON) -> {int: float}."""
    bias = typed(data, "logit_bias", dict, "an object mapping token ids to numbers in [-100, 100]", {})
    out = {}
    for key, value in bias.items():
        if not re.fullmatch(r"\d+", str(key)) or int(key) >= n_vocab:
            raise BadRequest(f"logit_bias: key {key!r} is not a token id in 0..{n_vocab - 1}", "logit_bias")
        out[int(key)] = value
    return out


def sampling_params(data: dict, n_vocab: int) -> SamplingParams:
    """The request's sampler through SamplingParams: the command line's one validation."""
    values = {k: v if data.get(k) is None else data[k] for k, v in OPENAI_DEFAULTS.items()}
    try:
        return SamplingParams(temp=values["temperature"], top_p=values["top_p"], top_k=values["top_k"],
                              min_p=values["min_p"], repeat_penalty=values["repeat_penalty"],
                              frequency_penalty=values["frequency_penalty"],
                              presence_penalty=values["presence_penalty"], logit_bias=logit_bias(data, n_vocab),
                              seed=data.get("seed"))
    except ParameterError as e:
        raise api_error(e) from None


def api_error(e: ParameterError, key: str | None = None) -> BadRequest:
    """A ParameterError in the API's words: 'temp = -1: ...' -> 'temperature = -1: ...'."""
    message = str(e)
    m = re.match(r"(\w+)( \([^)]*\))? = ", message)
    if m is None:
        return BadRequest(message)
    api = key if m.group(1) == "n_predict" and key else API_NAMES.get(m.group(1), m.group(1))
    return BadRequest(api + message[m.end() - 3:], api if api in CHAT_FIELDS | COMPLETION_FIELDS else None)


def prompt_ids(data: dict, tokenizer, chat: bool, n_vocab: int, request: Structured) -> list[int]:
    """The prompt's token ids: chat's messages through the model's template (render_prompt:
    tool calls and results, and the request's tools where it has some); a completion's text
    tokenized as `run -p` does, or its list of token ids as given."""
    param = "messages" if chat else "prompt"
    try:
        if chat:
            text = render_prompt(tokenizer, data.get("messages"), request)
            ids = tokenizer.encode(text, add_bos=None, parse_special=True)
        else:
            prompt = data.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in prompt):
                if any(t < 0 or t >= n_vocab for t in prompt):
                    raise BadRequest(f"prompt token ids must be in 0..{n_vocab - 1}", "prompt")
                ids = list(prompt)
            elif isinstance(prompt, str):
                ids = tokenizer.encode(prompt)
            else:
                raise BadRequest("prompt must be a string (or a list of token ids); one prompt per request", "prompt")
    except TokenizerError as e:
        raise BadRequest(str(e), param) from None
    except StructuredError as e:
        raise BadRequest(str(e), e.param) from None
    if not ids:
        raise BadRequest("the prompt is empty (no tokens): give at least one token to continue from", param)
    return ids


def default_max_tokens(chat: bool, n_ctx: int, n_prompt: int) -> int:
    """OpenAI's: 16 for completions; chat: up to the context's end."""
    return max(1, n_ctx - n_prompt) if chat else COMPLETION_MAX_TOKENS


def constraints(server, data: dict, chat: bool) -> Structured:
    """The request's response_format and tools (app/structured: structured); without any, no
    grammar, and llguidance's tokenizer is never built (server.ll)."""
    if all(data.get(name) is None for name in STRUCTURED_FIELDS):
        return Structured(form=server.tool_form)
    try:
        return structured(data, server.ll, server.tool_form, chat)
    except StructuredError as e:
        raise BadRequest(str(e), e.param) from None


class Job:
    """A parsed request: prompt ids, max tokens, sampler, n choices, stop strings, stream or
    not, what constrains the reply (`structured`, its `grammar`), and which log-probabilities
    to return (`logprobs`: alternatives per sampled token,
    None for none; `prompt_logprobs`: the same for the prompt, when echoed)."""

    def __init__(self, server, data: dict, chat: bool):
        check_fields(data, CHAT_FIELDS if chat else COMPLETION_FIELDS)
        self.chat = chat
        model = typed(data, "model", str, "a string")
        if model is not None and model not in server.model_names:
            raise BadRequest(f"model '{model}' is not served here; this server has '{server.model_id}'", "model")
        scheduler = server.loop.scheduler
        self.stream = typed(data, "stream", bool, "true or false", False)
        options = typed(data, "stream_options", dict, "an object", {})
        self.include_usage = bool(options.get("include_usage", False))
        self.n = count(data, "n", 1, scheduler.max_batch, 1)
        self.user = typed(data, "user", str, "a string")
        ignore_eos = typed(data, "ignore_eos", bool, "true or false", False)
        self.stops = stop_strings(data)
        n_vocab = server.engine.config.n_vocab
        self.params = sampling_params(data, n_vocab)
        self._logprobs(data)
        self.structured = constraints(server, data, chat)
        self.grammar = self.structured.grammar          # None: nothing constrains the reply
        self.prompt = prompt_ids(data, server.tokenizer, chat, n_vocab, self.structured)
        default = default_max_tokens(chat, server.engine.n_ctx, len(self.prompt))
        key = "max_completion_tokens" if chat and data.get("max_completion_tokens") is not None else "max_tokens"
        self.max_tokens = data.get(key) if data.get(key) is not None else default
        # echo with max_tokens 0: the prompt alone (evaluation harnesses score it so)
        self.score_only = self.echo and self.max_tokens == 0 and not isinstance(self.max_tokens, bool)
        try:
            scheduler.check(len(self.prompt), self.max_tokens, score_only=self.score_only)
        except ParameterError as e:
            message = str(e)
            if self.max_tokens == 0:
                message += " (0 only with echo: the prompt's log-probabilities, nothing generated)"
            raise api_error(ParameterError(message), key) from None
        except ContextError as e:
            raise BadRequest(str(e), key) from None
        self.stop_ids = frozenset() if ignore_eos else frozenset(server.tokenizer.eog_ids)

    def _logprobs(self, data: dict):
        """echo, logprobs (chat: logprobs + top_logprobs), and so prompt_logprobs."""
        if self.chat:
            self.echo = False
            wanted = typed(data, "logprobs", bool, "true or false", False)
            top = count(data, "top_logprobs", 0, MAX_TOP_LOGPROBS)
            if top is not None and not wanted:
                raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
            self.logprobs = (top or 0) if wanted else None
        else:
            self.echo = typed(data, "echo", bool, "true or false", False)
            self.logprobs = count(data, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
        self.prompt_logprobs = self.logprobs if self.echo else None
