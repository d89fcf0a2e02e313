"""The sampler on fixed logits: each filter of llama.cpp's chain (repeat penalty, top-k, top-p,
min-p, temperature), the order they run in, seeds, and the one validation of generation
parameters (common/generate.py) the command line and the server share.

Logits are chosen so that each filter keeps a known set: logits = log(probabilities), with
probabilities far from every threshold used. Draws are counted over many seeded samples, so
every statistical check here gives the same answer on every run.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from common.generate import (
    ContextError,
    ParameterError,
    Sampler,
    SamplingParams,
    check_ctx_size,
    check_n_predict,
    check_threads,
    generate,
    log_softmax,
    token_logprobs,
)

PROBS = np.array([0.05, 0.5, 0.15, 0.3])            # best first: 1, 3, 2, 0
LOGITS = np.log(PROBS).astype(np.float32)
N_DRAWS = 4000


def draws(logits=LOGITS, n=N_DRAWS, seed=0, history=(), **params) -> np.ndarray:
    """How often each id was drawn in n samples (one sampler, so one random stream)."""
    params.setdefault("temp", 1.0)
    params.setdefault("top_k", 0)
    params.setdefault("top_p", 1.0)
    params.setdefault("min_p", 0.0)
    sampler = Sampler(SamplingParams(seed=seed, **params))
    counts = np.zeros(len(logits), int)
    for _ in range(n):
        counts[sampler(logits, history)] += 1
    return counts


def kept(**params) -> set:
    return set(np.flatnonzero(draws(**params)).tolist())


# ---- each filter --------------------------------------------------------------------------------

def test_greedy_is_the_argmax_and_draws_nothing():
    s = Sampler(SamplingParams(temp=0.0))
    assert s.params.greedy and s(LOGITS) == 1
    state = s.rng.bit_generator.state
    s(LOGITS)
    assert s.rng.bit_generator.state == state                 # greedy consumes no randomness


def test_no_filter_draws_the_softmax():
    counts = draws()
    sigma = np.sqrt(N_DRAWS * PROBS * (1 - PROBS))
    assert (np.abs(counts - N_DRAWS * PROBS) < 4 * sigma).all(), counts


@pytest.mark.parametrize("k, want", [(1, {1}), (2, {1, 3}), (3, {1, 3, 2}), (0, {0, 1, 2, 3}), (10, {0, 1, 2, 3})])
def test_top_k_keeps_the_k_best(k, want):
    assert kept(top_k=k) == want


@pytest.mark.parametrize("p, want", [(0.4, {1}), (0.7, {1, 3}), (0.9, {1, 3, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_shortest_prefix_reaching_p(p, want):
    assert kept(top_p=p) == want                               # cumulative 0.5, 0.8, 0.95, 1.0


@pytest.mark.parametrize("m, want", [(0.0, {0, 1, 2, 3}), (0.2, {1, 3, 2}), (0.4, {1, 3}), (1.0, {1})])
def test_min_p_drops_what_is_below_min_p_times_the_best(m, want):
    assert kept(min_p=m) == want                               # thresholds 0.1, 0.2, 0.5 of p_max = 0.5


def test_temperature_sharpens_and_flattens():
    cold, hot = draws(temp=0.25), draws(temp=4.0)
    want_cold = PROBS ** 4 / (PROBS ** 4).sum()
    want_hot = PROBS ** 0.25 / (PROBS ** 0.25).sum()
    for counts, want in ((cold, want_cold), (hot, want_hot)):
        sigma = np.sqrt(N_DRAWS * want * (1 - want)) + 1
        assert (np.abs(counts - N_DRAWS * want) < 4 * sigma).all(), (counts, N_DRAWS * want)


def test_repeat_penalty_shrinks_recent_tokens_both_signs():
    logits = np.array([2.0, -2.0, 1.0, 0.5], np.float32)
    s = Sampler(SamplingParams(repeat_penalty=2.0, repeat_last_n=2))
    np.testing.assert_array_equal(s.penalize(logits, [2, 0, 1]), [1.0, -4.0, 1.0, 0.5])   # only the last 2: 0, 1
    whole = Sampler(SamplingParams(repeat_penalty=2.0, repeat_last_n=-1))
    np.testing.assert_array_equal(whole.penalize(logits, [2, 0, 1]), [1.0, -4.0, 0.5, 0.5])
    off = Sampler(SamplingParams(repeat_penalty=2.0, repeat_last_n=0))
    np.testing.assert_array_equal(off.penalize(logits, [2, 0, 1]), logits)
    assert not off.params.penalized and not Sampler().params.penalized
    np.testing.assert_array_equal(logits, [2.0, -2.0, 1.0, 0.5])                      # the input is untouched


def test_frequency_and_presence_penalties_are_openais_over_what_was_drawn():
    """logit[j] -= count[j] * frequency + (count[j] > 0) * presence, count over this
    completion's draws (not the prompt): drawn 1 twice and 3 once."""
    s = Sampler(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25))
    s.drawn.update({1: 2, 3: 1})
    got = s.penalize(LOGITS, history=[0, 0, 0, 2])            # the history (prompt) is not counted
    want = LOGITS.copy()
    want[1] -= 2 * 0.5 + 0.25
    want[3] -= 1 * 0.5 + 0.25
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    negative = Sampler(SamplingParams(frequency_penalty=-1.0))
    negative.drawn[2] = 3
    assert negative.penalize(LOGITS, [])[2] == pytest.approx(LOGITS[2] + 3.0)     # a negative one encourages


def test_the_sampler_counts_its_own_draws_until_a_new_completion():
    s = Sampler(SamplingParams(frequency_penalty=2.0))
    first = [s(LOGITS) for _ in range(3)]
    assert first[0] == 1 and s.drawn == {t: first.count(t) for t in set(first)}
    assert first[1] != 1, "drawn once, 1 is penalized below the next best"
    s.new_completion()
    assert s.drawn == {} and s(LOGITS) == 1


def test_logit_bias_is_added_before_everything():
    assert Sampler(SamplingParams(logit_bias={0: 10.0}))(LOGITS) == 0
    assert Sampler(SamplingParams(logit_bias={1: -100}))(LOGITS) == 3
    assert SamplingParams(logit_bias={1: 1}).penalized and not SamplingParams().penalized


def test_random_streams_of_one_seed_differ_and_stream_0_is_the_seeds_own():
    def draws_of(stream):
        s = Sampler(SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=5), stream=stream)
        return [s(LOGITS) for _ in range(40)]
    plain = Sampler(SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=5))
    assert draws_of(0) == [plain(LOGITS) for _ in range(40)]
    assert draws_of(1) != draws_of(0) and draws_of(1) == draws_of(1)


def test_token_logprobs_are_the_log_softmax_and_the_top_ones_best_first():
    lp, top = token_logprobs(LOGITS, 2, k=3)
    assert lp == pytest.approx(np.log(0.15)) and [i for i, _ in top] == [1, 3, 2]
    assert sum(np.exp(v) for _, v in top) <= 1 + 1e-12
    tied = np.array([1.0, 3.0, 3.0, 0.0])
    assert token_logprobs(tied, 0, k=1)[1][0][0] == int(np.argmax(tied)) == 1, "ties go to the lower id"
    assert token_logprobs(tied, 0, k=9)[1][-1][0] == 3 and len(token_logprobs(tied, 0, k=9)[1]) == 4
    np.testing.assert_allclose(np.exp(log_softmax(LOGITS)), PROBS, rtol=1e-6)


def test_repeat_penalty_comes_before_greedy():
    logits = np.array([3.0, 2.0], np.float32)
    assert Sampler(SamplingParams(repeat_penalty=2.0))(logits, history=[0]) == 1         # 3/2 < 2


# ---- the chain's order: penalties -> top-k -> top-p -> min-p -> temperature -> draw ----------------

def test_top_k_runs_before_top_p():
    """top_k = 2 leaves 0.5 and 0.3, renormalized 0.625 and 0.375: top_p = 0.6 keeps one. Were
    top_p first (over all four), 0.6 would need two."""
    assert kept(top_k=2, top_p=0.6) == {1}


def test_top_p_runs_before_min_p():
    """p = 0.4, 0.3, 0.2, 0.1: top_p = 0.75 over all four keeps three; min_p = 0.3 (threshold
    0.12) then keeps them. Were min_p first, it would drop 0.1 and top_p over the renormalized
    three (0.44, 0.33, 0.22) would keep two."""
    logits = np.log([0.4, 0.3, 0.2, 0.1]).astype(np.float32)
    assert kept(logits=logits, top_p=0.75, min_p=0.3) == {0, 1, 2}


def test_temperature_runs_after_the_filters():
    """A hot temperature flattens the distribution, but top_p was decided on the untempered
    one: still only the two best. (Tempered first, 0.7 would need three of the four.)"""
    assert kept(top_p=0.7, temp=10.0) == {1, 3}
    assert kept(top_k=1, temp=100.0) == {1}


# ---- seeds --------------------------------------------------------------------------------------

def sequence(seed, n=50):
    s = Sampler(SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed))
    return [s(LOGITS) for _ in range(n)]


def test_a_seed_reproduces_its_draws():
    assert sequence(7) == sequence(7)
    assert sequence(7) != sequence(8)
    assert len(set(sequence(7))) == 4                          # it does draw, not repeat one id


# ---- generation over an engine ------------------------------------------------------------------

class ScriptedEngine:
    """An engine whose logits are fixed per position: enough for Session's bookkeeping."""

    def __init__(self, n_vocab=4, n_ctx=16, kv_cache=True):
        self.uses_kv_cache, self.n_ctx = kv_cache, n_ctx
        self.config = SimpleNamespace(n_ctx_train=n_ctx)
        self.fed = []
        self.greedy_calls = 0

    def reset(self):
        self.fed.clear()

    def forward(self, tokens, start, all_logits=False):
        self.fed.append((list(tokens), start))
        return LOGITS[None, :].copy()

    def greedy_next(self, tokens, start):
        self.greedy_calls += 1
        self.fed.append((list(tokens), start))
        return int(np.argmax(LOGITS))


def test_session_feeds_only_what_the_cache_has_not_seen():
    e = ScriptedEngine()
    gen = generate(e, [5, 6, 7], 3)
    assert gen.tokens == [1, 1, 1] and gen.stop_reason == "length"
    assert e.fed == [([5, 6, 7], 0), ([1], 3), ([1], 4)]
    assert gen.ttft_ms > 0 and len(gen.decode_ms) == 2


def test_session_without_a_cache_feeds_everything():
    e = ScriptedEngine(kv_cache=False)
    generate(e, [5, 6], 2)
    assert e.fed == [([5, 6], 0), ([5, 6, 1], 0)]


def test_a_stop_token_ends_generation_unless_ignored():
    assert generate(ScriptedEngine(), [5], 4, stop_ids={1}).tokens == [1]
    assert generate(ScriptedEngine(), [5], 4, stop_ids={1}, ignore_eos=True).tokens == [1, 1, 1, 1]


def test_sampled_generation_goes_through_the_sampler_with_the_history():
    e = ScriptedEngine()
    sampler = Sampler(SamplingParams(temp=1.0, top_k=1, repeat_penalty=100.0, repeat_last_n=1))
    gen = generate(e, [1], 2, sampler)          # 1 is in the history: penalized, 3 is drawn; then 1 again
    assert gen.tokens == [3, 1]
    assert e.greedy_calls == 0                  # the logits came back to the sampler, not an argmax
    assert generate(ScriptedEngine(), [1], 2).tokens == [1, 1]          # the same without a penalty


def test_bad_requests_fail_before_any_work():
    e = ScriptedEngine(n_ctx=8)
    with pytest.raises(ParameterError, match="prompt is empty"):
        generate(e, [], 3)
    with pytest.raises(ParameterError, match=r"n_predict \(-n, max_tokens\) = -1: must be an integer >= 1"):
        generate(e, [5], -1)
    with pytest.raises(ContextError, match="context window of 8"):
        generate(e, [5] * 6, 3)
    assert e.fed == []


# ---- the validation the command line and the server share ---------------------------------------

@pytest.mark.parametrize("name, value", [
    ("temp", -1.0), ("temp", float("nan")), ("temp", float("inf")), ("temp", True), ("temp", "0.5"),
    ("top_k", -1), ("top_k", 1.5), ("top_k", True),
    ("top_p", 0.0), ("top_p", 5.0), ("top_p", -0.5), ("top_p", float("nan")),
    ("min_p", -0.1), ("min_p", 1.5),
    ("repeat_penalty", 0.0), ("repeat_penalty", -1.0),
    ("repeat_last_n", -2), ("repeat_last_n", 2.0),
    ("seed", -1), ("seed", 1.5),
    ("frequency_penalty", 2.5), ("frequency_penalty", -2.01), ("presence_penalty", float("nan")),
    ("presence_penalty", "1"), ("logit_bias", {1: 101}), ("logit_bias", {-1: 1}), ("logit_bias", {"3": 1}),
    ("logit_bias", [1, 2]),
])
def test_sampling_values_out_of_range_are_refused(name, value):
    with pytest.raises(ParameterError, match=rf"^{name} = .*: must be "):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("name, value", [
    ("temp", 0), ("temp", 2.5), ("top_k", 0), ("top_k", np.int64(5)), ("top_p", 1.0), ("top_p", 1e-6),
    ("min_p", 0.0), ("min_p", 1.0), ("repeat_penalty", 0.5), ("repeat_last_n", -1), ("repeat_last_n", 0),
    ("seed", 0), ("seed", None), ("frequency_penalty", -2.0), ("presence_penalty", 2),
    ("logit_bias", {0: -100, 7: 100.0}), ("logit_bias", {}),
])
def test_sampling_values_at_the_edges_are_accepted(name, value):
    SamplingParams(**{name: value})


@pytest.mark.parametrize("check, bad, good", [
    (check_n_predict, [0, -1, 1.5, True, "3", None], [1, np.int32(64)]),
    (check_threads, [0, -2, 1.0, False], [None, 1, 64]),
    (check_ctx_size, [0, -1, 2.5], [None, 1, 4096]),
])
def test_counts(check, bad, good):
    for value in bad:
        with pytest.raises(ParameterError, match=r" = .*: must be an integer >= 1"):
            check(value)
    for value in good:
        assert check(value) == value
