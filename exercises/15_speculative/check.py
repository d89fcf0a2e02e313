"""Chapter 15's check: your acceptance rule against common/speculative.py's accept. Greedy: the
same (kept, token) and the same tokens taken by the sampler, case for case. Sampling: the rule's
promise, over many seeded draws of the guesses from their draft distribution: the emitted token is
distributed as the sampler's own distribution p, and a guess is kept as often as min(1, p/q)
allows (the stage's rule is run on the same draws, its figures beside yours). Then the default
model generates with prompt lookup and your rule, beside the stage's rule and plain decoding."""

from __future__ import annotations

import math

import numpy as np

from common.generate import Sampler, SamplingParams
from common.speculative import DRAFT_MAX, Draft, accept, dense_distribution, from_flags
from exercises.harness import Case, Exercise, Timing
from exercises.harness import engine as harness_engine

TRIALS = 4000           # draws per sampling case
SIGMAS = 5              # a correct rule's frequency lies within 5 standard deviations of p: one chance in
                        # ~3.5 million per token, so under 1 in 100,000 for a case of a few tokens, any seed


def lookup(rule, draft_max: int = DRAFT_MAX):
    """`run --spec lookup --draft-max N`'s step strategy (common/speculative.py: from_flags), deciding
    with `rule`: set where the strategy keeps its rule (its planner, if it has one)."""
    spec = from_flags("lookup", draft_max)
    getattr(spec, "speculation", spec).rule = rule
    return spec


def softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def frequency_bound(p: np.ndarray, n: int) -> np.ndarray:
    """How far a frequency out of n draws may honestly lie from probability p: SIGMAS binomial
    standard deviations, plus one draw (p = 0 or 1 gets the one draw alone)."""
    return SIGMAS * np.sqrt(p * (1 - p) / n) + 1.0 / n


def greedy_cases(rng) -> list[Case]:
    V = 12
    out = []
    logits = rng.standard_normal((4, V)).astype(np.float32)
    top = [int(np.argmax(r)) for r in logits]
    out.append(Case("greedy: every guess is the argmax: all 3 kept, the 4th row's argmax after them",
                    dict(logits=logits, draft=top[:3], params=SamplingParams(temp=0.0))))
    wrong = list(top[:3])
    wrong[1] = (wrong[1] + 1) % V
    out.append(Case("greedy: the second guess is not the argmax: 1 kept, row 1's argmax",
                    dict(logits=logits, draft=wrong, params=SamplingParams(temp=0.0))))
    out.append(Case("greedy, no guesses (k = 0): the argmax of row 0",
                    dict(logits=logits[:1], draft=[], params=SamplingParams(temp=0.0))))
    pen = rng.standard_normal((3, V)).astype(np.float32)
    pen[:, 5] = 4.0                                # guess 1: token 5, the argmax of row 0
    pen[1, 5], pen[1, 7] = 3.0, 2.0                # row 1: 5 first, 7 next; 5 in the history: 3 / 2 < 2
    out.append(Case("greedy with a repeat penalty: a kept guess joins the history, so row 1 picks 7, not 5",
                    dict(logits=pen, draft=[5, 7], params=SamplingParams(temp=0.0, repeat_penalty=2.0))))
    return out


def sampling_cases(rng) -> list[Case]:
    V = 6
    z = rng.standard_normal((3, V)) * 1.2
    q = softmax(rng.standard_normal(V) * 1.2)
    plain = SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11)
    return [
        Case("sampling, a draft model's q: the emitted token is distributed as p, a guess kept min(1, p/q)",
             dict(z=z[:2], q=q, params=plain, kind="draft")),
        Case("sampling, prompt lookup (q one-hot at the guess): kept with probability p(guess)",
             dict(z=z[:2], q=None, guess=int(np.argsort(z[0])[-2]), params=plain, kind="lookup")),
        Case("sampling at temperature 0.5, top-k 3: p is the sampler's distribution, not a softmax",
             dict(z=z[:2], q=q, params=SamplingParams(temp=0.5, top_k=3, top_p=1.0, min_p=0.0, seed=12),
                  kind="draft")),
        Case("sampling, the draft is the model (q = p): every guess kept, the last token from row k",
             dict(z=z[:2], q=None, params=plain, kind="same")),
    ]


def draws(rule, case, seed) -> tuple[np.ndarray, float]:
    """TRIALS runs of the rule on one case: the frequencies of the first emitted token, and how
    often the first guess was kept. Each trial's guess is drawn from q with an rng of the check's
    own (the same guesses for every rule)."""
    c = case.inputs
    sampler = Sampler(SamplingParams(**{**c["params"].__dict__, "seed": seed}))
    logits = c["z"].astype(np.float32)
    V = logits.shape[1]
    ids, probs = sampler.distribution(logits[0], [])
    p0 = dense_distribution(ids, probs, V)
    guesses = np.random.default_rng(seed)
    counts, kept_first = np.zeros(V), 0
    for _ in range(TRIALS):
        if c["kind"] == "draft":
            d, q = int(guesses.choice(V, p=c["q"])), [c["q"]]
        elif c["kind"] == "lookup":
            d, q = c["guess"], None
        else:                                            # the draft is the model: d ~ p0, q = p0
            d, q = int(guesses.choice(V, p=p0)), [p0]
        kept, tok = rule(logits, Draft([d], q), sampler, [])
        first = d if kept >= 1 else tok
        counts[first] += 1
        kept_first += kept >= 1
    return counts / TRIALS, kept_first / TRIALS


def expected_keep(case, p0) -> float:
    c = case.inputs
    if c["kind"] == "draft":
        return float(np.minimum(p0, c["q"]).sum())
    if c["kind"] == "lookup":
        return float(p0[c["guess"]])
    return 1.0


class Speculative(Exercise):
    chapter = "15"
    title = "speculative: the acceptance rule that keeps the distribution"
    folder = "exercises/15_speculative"
    file = "acceptance.py"
    reference = {"accept": accept}
    reference_code = "common/speculative.py: accept"

    def cases(self, rng, quick):
        return greedy_cases(rng) + sampling_cases(rng)

    def judge(self, sol, case):
        if "draft" in case.inputs:
            return self._greedy(sol, case)
        return self._sampled(sol, case)

    def _greedy(self, sol, case):
        c = case.inputs
        results = []
        for rule in (sol.accept, accept):
            sampler = Sampler(c["params"])
            kept, tok = rule(c["logits"], Draft(list(c["draft"])), sampler, [3, 1])
            results.append((int(kept), int(tok), dict(sampler.drawn)))
        got, want = results
        if got[:2] != want[:2]:
            return f"(kept, token) = {got[:2]}, the stage's {want[:2]}", ""
        if got[2] != want[2]:
            return (f"tokens the sampler was told were taken (sampler.took): {got[2]}, the stage's {want[2]} "
                    "(every kept guess and the final token)"), ""
        return None, f"(kept, token) = {got[:2]}"

    def _sampled(self, sol, case):
        c = case.inputs
        V = c["z"].shape[1]
        sampler = Sampler(c["params"])
        ids, probs = sampler.distribution(c["z"][0].astype(np.float32), [])
        p0 = dense_distribution(ids, probs, V)
        freq, keep = draws(sol.accept, case, seed=1)
        stage_freq, stage_keep = draws(accept, case, seed=1)
        bound = frequency_bound(p0, TRIALS)
        over = np.flatnonzero(np.abs(freq - p0) > bound)
        if over.size:
            t = int(over[np.argmax(np.abs(freq - p0)[over] / bound[over])])
            return (f"token {t} came first {freq[t]:.4f} of {TRIALS} times; p({t}) = {p0[t]:.4f}, bound "
                    f"+-{bound[t]:.4f} ({SIGMAS} standard deviations); the stage's rule: {stage_freq[t]:.4f}\n"
                    f"p = {np.round(p0, 4).tolist()}\nyours = {np.round(freq, 4).tolist()}"), ""
        want = expected_keep(case, p0)
        kb = SIGMAS * math.sqrt(want * (1 - want) / TRIALS) + 1.0 / TRIALS
        if abs(keep - want) > kb:
            return (f"the guess was kept {keep:.4f} of the time; the rule keeps it {want:.4f} (+-{kb:.4f}); "
                    f"the stage's rule: {stage_keep:.4f} (a rule that refuses more guesses than it must is "
                    "still correct in distribution, and saves fewer passes)"), ""
        return None, (f"max |freq - p| {np.abs(freq - p0).max():.4f} (bound {bound.max():.4f}; the stage's "
                      f"{np.abs(stage_freq - p0).max():.4f}); kept {keep:.3f}, expected {want:.3f}")

    def timings(self, sol, quick):
        from app.args import fastest_stage
        from app.measure.speculative import prompt_sets, run_ours
        from common.tokenizer import Tokenizer
        stage = fastest_stage()
        engine = harness_engine(stage)                  # FileNotFoundError naming `make model` if it is missing
        tok = Tokenizer.from_gguf(engine.gguf)
        ids = tok.encode(prompt_sets()["copy"][0], add_bos=True)
        n = 16 if quick else 64
        self.timing_note = (f"the {stage} stage generating {n} tokens of an answer that copies its prompt "
                            "(prompt lookup's guesses), greedy; per token")
        rows = []
        for label, who, rule in (("yours", "yours", sol.accept), ("the stage's rule", "stage", accept),
                                 ("plain decoding (the chapters before)", "previous", None)):
            best = min((run_ours(engine, ids, n, lookup(rule) if rule else None) for _ in range(1 if quick else 3)),
                       key=lambda r: r["decode_s"])
            kept = f", {best['accepted']} of {best['drafted']} guesses kept" if rule else ""
            rows.append(Timing(label + kept, best["decode_s"] / max(1, len(best["tokens"]) - 1), who))
        return rows


EXERCISE = Speculative()
