"""A correct acceptance rule written otherwise than the stage's: row i's distribution is taken with
the history and the i guesses before it (no list kept growing), and a guess's chance to be kept,
alpha = min(1, p / q), is computed for every token at once, so that the refusal's residual reads
p - q alpha (= max(p - q, 0))."""
import numpy as np

from common.speculative import dense_distribution


def accept(logits, draft, sampler, history):
    V = logits.shape[1]

    def row(i):
        ids, probs = sampler.distribution(logits[i], [*history, *draft.tokens[:i]])
        return ids, dense_distribution(ids, probs, V)

    for i, d in enumerate(draft.tokens):
        ids, p = row(i)
        if sampler.params.greedy:
            kept, token = int(ids[0]) == d, int(ids[0])
        else:
            q = np.eye(V)[d] if draft.q is None else np.asarray(draft.q[i], np.float64)
            alpha = np.minimum(1.0, np.divide(p, q, out=np.ones(V), where=q > 0))
            kept = sampler.rng.random() < alpha[d]
            if not kept:
                residual = np.maximum(p - q * alpha, 0.0)
                token = int(sampler.rng.choice(V, p=residual / residual.sum()))
        if not kept:
            sampler.took(token)
            return i, token
        sampler.took(d)
    ids, p = row(len(draft.tokens))
    token = int(ids[0]) if sampler.params.greedy else int(sampler.rng.choice(V, p=p))
    sampler.took(token)
    return len(draft.tokens), token
