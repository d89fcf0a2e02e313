"""Planted bug: every row's distribution taken with the text's history alone, the guesses kept
before it left out (a repeat penalty then reads the wrong history)."""
import numpy as np

from common.speculative import dense_distribution


def accept(logits, draft, sampler, history):
    history = list(history)
    rng = sampler.rng
    for i, d in enumerate(draft.tokens):
        ids, probs = sampler.distribution(logits[i], history)
        if sampler.params.greedy:
            if int(ids[0]) != d:
                sampler.took(int(ids[0]))
                return i, int(ids[0])
        else:
            p = dense_distribution(ids, probs, logits.shape[1])
            q = draft.q[i] if draft.q is not None else dense_distribution([d], [1.0], logits.shape[1])
            if not rng.random() < min(1.0, p[d] / q[d]):
                r = np.maximum(p - q, 0.0)
                tok = int(rng.choice(len(r), p=r / r.sum()))
                sampler.took(tok)
                return i, tok
        sampler.took(d)
    k = len(draft.tokens)
    ids, probs = sampler.distribution(logits[k], history)
    tok = int(ids[0]) if sampler.params.greedy else int(ids[rng.choice(len(ids), p=probs)])
    sampler.took(tok)
    return k, tok
