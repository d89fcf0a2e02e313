"""Planted bug: a guess kept half as often as the rule allows, min(1, p/q) / 2, and the residual
p - min(p, q) / 2 drawn from on refusal: every emitted token still follows p, but half the guesses
that could survive are thrown away (the speedup, not the text, is what suffers)."""
import numpy as np

from common.speculative import dense_distribution


def accept(logits, draft, sampler, history):
    history = list(history)
    rng = sampler.rng
    V = logits.shape[1]
    for i, d in enumerate(draft.tokens):
        ids, probs = sampler.distribution(logits[i], history)
        if sampler.params.greedy:
            if int(ids[0]) != d:
                sampler.took(int(ids[0]))
                return i, int(ids[0])
        else:
            p = dense_distribution(ids, probs, V)
            q = draft.q[i] if draft.q is not None else dense_distribution([d], [1.0], V)
            if not rng.random() < 0.5 * min(1.0, p[d] / q[d]):
                r = np.maximum(p - 0.5 * np.minimum(p, q), 0.0)
                tok = int(rng.choice(V, p=r / r.sum()))
                sampler.took(tok)
                return i, tok
        sampler.took(d)
        history.append(d)
    k = len(draft.tokens)
    ids, probs = sampler.distribution(logits[k], history)
    tok = int(ids[0]) if sampler.params.greedy else int(ids[rng.choice(len(ids), p=probs)])
    sampler.took(tok)
    return k, tok
