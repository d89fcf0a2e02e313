"""Prefill, decode, sampling: turning logits into text, timed the way the report measures.

    TTFT    from the tokenized prompt to the first sampled token (prefill + first sample)
    decode  ms per token for every token after the first

Stages without a KV cache re-run the whole sequence for every token; stages with one feed
only the tokens the cache has not seen. `Session` keeps that bookkeeping across calls, so a
chat can add turns without recomputing the conversation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np


class ContextError(ValueError):
    """The prompt plus the tokens asked for do not fit in the context window."""


class ParameterError(ValueError):
    """A generation parameter outside its range, or an empty prompt: the message names the
    parameter, the value given and what is allowed. The CLI and the server both raise it."""


def check_count(name: str, value, minimum: int = 1, note: str = "") -> int:
    """value as an int >= minimum (a bool is not a count), or ParameterError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ParameterError(f"{name} = {value!r}: must be an integer >= {minimum}{note}")
    return int(value)


def check_n_predict(n_predict) -> int:
    """The number of tokens to generate: an integer >= 1."""
    return check_count("n_predict (-n, max_tokens)", n_predict)


def check_threads(threads) -> int | None:
    """Threads for the stages that use several: None (their default) or an integer >= 1."""
    return None if threads is None else check_count("threads (-t)", threads, note=" (default: the physical cores)")


def check_ctx_size(n_ctx) -> int | None:
    """The context window in tokens: None (the model's, at most 2048) or an integer >= 1."""
    return None if n_ctx is None else check_count("ctx_size (-c)", n_ctx, note=" (default: the model's, at most 2048)")


def check_fits(n_prompt: int, n_predict: int, n_ctx: int, n_ctx_train: int):
    """Raise ContextError, before any work is done, if the tokens cannot fit the context."""
    need = n_prompt + n_predict
    if need > n_ctx:
        raise ContextError(
            f"{n_prompt} prompt tokens + {n_predict} to generate = {need} exceeds the context window "
            f"of {n_ctx} tokens; use a shorter prompt or a smaller -n, or a larger --ctx-size "
            f"(the model was trained on {n_ctx_train})")


MAX_LOGIT_BIAS = 100.0          # OpenAI's range for logit_bias values
MAX_PENALTY = 2.0               # and for frequency_penalty and presence_penalty


@dataclass
class SamplingParams:
    """llama.cpp's sampler chain: logit bias -> penalties -> top_k -> top_p -> min_p ->
    temperature -> draw (a grammar's mask before all of it: Sampler's constraint). temp = 0
    means greedy (argmax), the default here so every stage prints the same text. Values out of
    range raise ParameterError: the one validation the CLI and the server share.

    The penalties: repeat_penalty as llama.cpp's (divide a positive logit, multiply a negative
    one, for each token in the last repeat_last_n of prompt and text); frequency_penalty and
    presence_penalty as OpenAI defines them, over the tokens this completion has drawn so far:
    logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty.
    logit_bias: {token id: a number added to its logit} (OpenAI's; -100 all but bans it)."""
    temp: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict = field(default_factory=dict)

    def __post_init__(self):
        def number(x):
            return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) \
                and np.isfinite(x)

        def integer(x):
            return isinstance(x, (int, np.integer)) and not isinstance(x, bool)

        rules = (("temp", number(self.temp) and self.temp >= 0, "a number >= 0 (0: greedy)"),
                 ("top_k", integer(self.top_k) and self.top_k >= 0, "an integer >= 0 (0: off)"),
                 ("top_p", number(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1] (1: off)"),
                 ("min_p", number(self.min_p) and 0 <= self.min_p <= 1, "a number in [0, 1] (0: off)"),
                 ("repeat_penalty", number(self.repeat_penalty) and self.repeat_penalty > 0,
                  "a number > 0 (1: off)"),
                 ("repeat_last_n", integer(self.repeat_last_n) and self.repeat_last_n >= -1,
                  "an integer >= -1 (0: off, -1: the whole text)"),
                 ("seed", self.seed is None or (integer(self.seed) and self.seed >= 0), "an integer >= 0"),
                 ("frequency_penalty", number(self.frequency_penalty) and abs(self.frequency_penalty) <= MAX_PENALTY,
                  f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0: off)"),
                 ("presence_penalty", number(self.presence_penalty) and abs(self.presence_penalty) <= MAX_PENALTY,
                  f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0: off)"),
                 ("logit_bias", isinstance(self.logit_bias, dict) and all(
                     integer(k) and k >= 0 and number(v) and abs(v) <= MAX_LOGIT_BIAS
                     for k, v in self.logit_bias.items()),
                  f"a map of token ids >= 0 to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"))
        for name, ok, allowed in rules:
            if not ok:
                raise ParameterError(f"{name} = {getattr(self, name)!r}: must be {allowed}")

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    @property
    def repeat_penalized(self) -> bool:
        return self.repeat_penalty != 1.0 and self.repeat_last_n != 0

    @property
    def penalized(self) -> bool:
        """Whether anything changes the logits before the choice (bias or a penalty)."""
        return self.repeat_penalized or self.frequency_penalty != 0 or self.presence_penalty != 0 \
            or bool(self.logit_bias)


class Sampler:
    """Draws tokens for one completion. It remembers what it drew (frequency and presence
    penalties count those) and its random state, so a completion interrupted and resumed with
    the same Sampler draws what it would have drawn. `stream` picks one of several independent
    random streams of one seed (the n choices of a request); stream 0 is the seed's own.

    `constraint` (common/constrain: a grammar's matcher for this sequence), if given, comes
    first in the chain: its mask puts the forbidden tokens at -inf before bias and penalties,
    and every token taken (`took`) moves it on. Without one, nothing of it runs."""

    def __init__(self, params: SamplingParams | None = None, stream: int = 0, constraint=None):
        self.params = params or SamplingParams()
        seed = self.params.seed
        self.rng = np.random.default_rng(seed if seed is None or stream == 0 else [seed, stream])
        self.drawn: dict[int, int] = {}                   # token id -> times drawn in this completion
        self.constraint = constraint

    def new_completion(self):
        """Forget what was drawn (a chat's next turn), and start the constraint over; the random
        state goes on."""
        self.drawn.clear()
        if self.constraint is not None:
            self.constraint.reset()

    @property
    def ended(self) -> bool:
        """The constraint's grammar is complete and its end token was taken."""
        return self.constraint is not None and self.constraint.ended

    def penalize(self, logits: np.ndarray, history) -> np.ndarray:
        """The constraint's mask, then logit bias, then the repeat penalty on the last
        repeat_last_n tokens of history, then frequency and presence penalties on what this
        completion drew (SamplingParams)."""
        p = self.params
        if self.constraint is not None:
            logits = self.constraint.apply(logits)       # its buffer: forbidden tokens at -inf
        if not p.penalized:
            return logits
        logits = logits.astype(np.float32, copy=True)
        if p.logit_bias:
            ids = np.fromiter(p.logit_bias.keys(), dtype=np.int64)
            logits[ids] += np.fromiter(p.logit_bias.values(), dtype=np.float64).astype(np.float32)
        if p.repeat_penalized and history:
            recent = history[-p.repeat_last_n:] if p.repeat_last_n > 0 else history
            ids = np.unique(np.asarray(recent, dtype=np.int64))
            v = logits[ids]
            logits[ids] = np.where(v <= 0, v * p.repeat_penalty, v / p.repeat_penalty)
        if (p.frequency_penalty or p.presence_penalty) and self.drawn:
            ids = np.fromiter(self.drawn.keys(), dtype=np.int64)
            counts = np.fromiter(self.drawn.values(), dtype=np.float64)
            logits[ids] -= (counts * p.frequency_penalty + p.presence_penalty).astype(np.float32)
        return logits

    def __call__(self, logits: np.ndarray, history=()) -> int:
        """logits [n_vocab] -> the next token id."""
        tok = self.choose(logits, history)
        self.took(tok)
        return tok

    def took(self, tok: int):
        """Count a token as drawn by this completion (the frequency and presence penalties read
        the counts) and move the constraint on: __call__ does it; speculative decoding does it
        for each guess it keeps."""
        self.drawn[tok] = self.drawn.get(tok, 0) + 1
        if self.constraint is not None:
            self.constraint.consume(tok)

    def choose(self, logits: np.ndarray, history=()) -> int:
        """A draw from distribution(), without counting it."""
        if self.params.greedy:
            return int(np.argmax(self.penalize(np.asarray(logits, dtype=np.float32), list(history))))
        ids, probs = self.distribution(logits, history)
        return int(ids[self.rng.choice(len(ids), p=probs)])

    def distribution(self, logits: np.ndarray, history=()) -> tuple[np.ndarray, np.ndarray]:
        """What __call__ draws from: (candidate ids, their probabilities, float64 summing to 1);
        greedy: the argmax alone. Speculative decoding (common/speculative.py) verifies drafts
        against exactly this distribution."""
        p = self.params
        logits = self.penalize(np.asarray(logits, dtype=np.float32), list(history))
        if p.greedy:
            return np.array([np.argmax(logits)]), np.ones(1)
        ids = np.argsort(-logits, kind="stable")                 # candidates, best first
        if p.top_k > 0:
            ids = ids[:p.top_k]
        cand = logits[ids].astype(np.float64)
        if p.top_p < 1.0:
            probs = np.exp(cand - cand[0])
            probs /= probs.sum()
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)   # shortest prefix reaching top_p
            ids, cand = ids[:keep], cand[:keep]
        if p.min_p > 0.0:
            keep = cand >= cand[0] + np.log(p.min_p)              # p >= min_p * p_max
            ids, cand = ids[keep], cand[keep]
        z = cand / p.temp
        probs = np.exp(z - z.max())
        return ids, probs / probs.sum()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log p over the vocabulary, in float64: [..., n_vocab] -> [..., n_vocab]."""
    x = np.asarray(logits, dtype=np.float64)
    top = x.max(axis=-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True))


def token_logprobs(logits: np.ndarray, token: int, k: int = 0) -> tuple[float, list[tuple[int, float]]]:
    """The model's log-probability of `token` (log-softmax of the raw logits: before bias,
    penalties and temperature) and the k most likely tokens as (id, logprob), best first,
    ties to the lower id (as argmax breaks them)."""
    lp = log_softmax(logits)
    top = []
    if k > 0:
        k = min(k, len(lp))
        kth = np.partition(lp, len(lp) - k)[len(lp) - k]             # the k-th largest value
        idx = np.flatnonzero(lp >= kth)                              # all of them, ties included
        idx = idx[np.lexsort((idx, -lp[idx]))][:k]
        top = [(int(i), float(lp[i])) for i in idx]
    return float(lp[token]), top


@dataclass
class Generation:
    prompt_tokens: list
    tokens: list = field(default_factory=list)          # generated ids (the stop token included)
    ttft_ms: float = 0.0
    decode_ms: list = field(default_factory=list)       # one figure per token after the first
    stop_reason: str = ""                                # 'eog' | 'length'
    drafted: int = 0                                     # speculative decoding: tokens guessed,
    accepted: int = 0                                    # and those the model agreed with

    @property
    def decode_ms_median(self) -> float:
        return float(np.median(self.decode_ms)) if self.decode_ms else float("nan")

    @property
    def decode_ms_mean(self) -> float:
        return float(np.mean(self.decode_ms)) if self.decode_ms else float("nan")

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput (tokens after the first)."""
        return 1000.0 / self.decode_ms_median if self.decode_ms else float("nan")


class Session:
    """A sequence of tokens and how much of it the engine's KV cache already holds."""

    def __init__(self, engine):
        self.engine = engine
        self.tokens = []
        self.n_cached = 0
        engine.reset()

    def reset(self):
        self.tokens, self.n_cached = [], 0
        self.engine.reset()

    def truncate(self, n: int):
        """Keep the first n tokens (speculative decoding's rollback of rejected guesses). The
        arena needs nothing more: positions past what the cache holds are never read, and the
        next forward pass writes over them. The newest kept token counts as not cached, so the
        next step computes its logits (writing its K/V again, the same values)."""
        if not 0 <= n <= len(self.tokens):
            raise ValueError(f"cannot truncate {len(self.tokens)} tokens to {n}")
        del self.tokens[n:]
        self.n_cached = min(self.n_cached, max(n - 1, 0))

    def _next(self, sampler: Sampler) -> int:
        e = self.engine
        if e.uses_kv_cache:
            feed, start = self.tokens[self.n_cached:], self.n_cached
        else:
            feed, start = self.tokens, 0
        if sampler.params.greedy and not sampler.params.penalized and sampler.constraint is None:
            tok = e.greedy_next(feed, start)        # argmax where the logits live
        else:
            tok = sampler(e.forward(feed, start, all_logits=False)[0], self.tokens)
        self.n_cached = len(self.tokens)
        return tok

    def generate(self, new_tokens, n_predict: int, sampler: Sampler | None = None, stop_ids=(),
                 on_token=None, ignore_eos: bool = False) -> Generation:
        """Append new_tokens, then sample up to n_predict tokens (stopping at a stop id unless
        ignore_eos, and where the sampler's constraint ends the text, whatever ignore_eos says).
        on_token(id) is called as each token arrives."""
        sampler = sampler or Sampler()
        new_tokens = list(new_tokens)
        if not new_tokens and not self.tokens:
            raise ParameterError("the prompt is empty (no tokens): give at least one token to continue from")
        n_predict = check_n_predict(n_predict)
        check_fits(len(self.tokens) + len(new_tokens), n_predict, self.engine.n_ctx,
                   self.engine.config.n_ctx_train)
        gen = Generation(prompt_tokens=list(self.tokens) + new_tokens)
        self.tokens += new_tokens
        stop_ids = set() if ignore_eos else set(stop_ids)
        t_prev = time.perf_counter()
        for i in range(n_predict):
            tok = self._next(sampler)
            now = time.perf_counter()
            if i == 0:
                gen.ttft_ms = (now - t_prev) * 1e3
            else:
                gen.decode_ms.append((now - t_prev) * 1e3)
            t_prev = now
            gen.tokens.append(tok)
            self.tokens.append(tok)
            if on_token:
                on_token(tok)
            if tok in stop_ids or sampler.ended:
                gen.stop_reason = "eog"
                break
        else:
            gen.stop_reason = "length"
        return gen


def generate(engine, prompt_tokens, n_predict: int, sampler: Sampler | None = None, **kw) -> Generation:
    """One completion from an empty context."""
    return Session(engine).generate(prompt_tokens, n_predict, sampler, **kw)
