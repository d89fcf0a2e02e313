"""Chapter 15 · speculative: write the acceptance rule of speculative sampling.

Run the check:   make exercise ch=15
(or: .venv/bin/python -m exercises.check 15)

Guess k tokens cheaply, run the model once over the newest token and the k guesses (k + 1 rows:
about the price of one decode step while the weights' bytes bound it), and keep the guesses the
model agrees with. The rule that decides what "agrees" means must leave the text's distribution
exactly what plain sampling would give. Your rule is compared with the stage's
(common/speculative.py: accept): greedy choices token for token, sampled ones by their
distribution over many seeded draws; then the default model generates with prompt lookup and
your rule, timed beside the stage's rule and beside plain decoding.
"""

import numpy as np  # noqa: F401  (for your code)

from common.speculative import dense_distribution  # noqa: F401  (for your code)


def accept(logits, draft, sampler, history):
    """Which of the k guessed tokens to keep, and the model's own next token.

    logits:  float32 [k + 1, n_vocab]  the verify pass: row i is the model's logits after the text
                                       plus the first i guesses (row 0: after the text alone)
    draft:   common/speculative.py's Draft: draft.tokens, the k guesses d_1 .. d_k; draft.q, the
             distribution each was drawn from ([n_vocab] float64 each), or None for a deterministic
             guess (prompt lookup: q is one-hot at the guess)
    sampler: common/generate.py's Sampler: sampler.params.greedy, sampler.rng (its random numbers),
             sampler.distribution(row, history) -> (ids, probs), the distribution plain sampling
             draws from (penalties, top-k, top-p, min-p, temperature applied), sampler.took(tok)
    history: the text so far (token ids)
    returns (kept, token): the first `kept` guesses are accepted, then `token`, the model's own

    What to write, for i = 0, 1, ..., k - 1 with guess d = draft.tokens[i]:
        p = the sampler's distribution for row i, given history + the guesses kept so far
            (dense_distribution(ids, probs, n_vocab) makes it a full [n_vocab] array)
        greedy: keep d if it is the argmax (ids[0]); else stop: (i, ids[0])
        sampling: keep d with probability min(1, p(d) / q(d)) (q = draft.q[i], or one-hot at d);
                  else stop with a token drawn from the residual max(0, p - q), normalized: (i, that)
        each kept guess: sampler.took(d), and it joins the history for the next row
    if all k are kept: a token of the model's own from row k, (k, that token).
    Call sampler.took(token) for the final token too (the sampler counts what was drawn).

    The edges: the history of row i includes the guesses kept before it (penalties read it);
    a deterministic guess (q is None) is kept with probability p(d) and, if refused, the token is
    drawn from p without d; p must be the sampler's distribution (top-k, temperature), not a plain
    softmax of the logits.

    Why: kept with probability min(1, p/q), refused into the residual, every emitted token is
    distributed exactly as p (Leviathan et al. 2023; Chen et al. 2023): the text is the model's,
    and the guesses only save passes.

    Hint: notebooks/15_speculative.ipynb, "The rule".
    Try it before you read common/speculative.py (accept).
    """
    raise NotImplementedError("write the acceptance rule: see the docstring")
