"""Planted bug: p taken as the softmax of the logits (the penalties applied, the history kept),
not the sampler's distribution: its temperature and top-k ignored."""
import numpy as np


def accept(logits, draft, sampler, history):
    history = list(history)
    rng = sampler.rng
    V = logits.shape[1]

    def soft(row):
        z = sampler.penalize(np.asarray(row, np.float32), history).astype(np.float64)
        e = np.exp(z - z.max())
        return e / e.sum()
    for i, d in enumerate(draft.tokens):
        p = soft(logits[i])
        if sampler.params.greedy:
            if int(np.argmax(p)) != d:
                sampler.took(int(np.argmax(p)))
                return i, int(np.argmax(p))
        else:
            q = draft.q[i] if draft.q is not None else np.eye(V)[d]
            if not rng.random() < min(1.0, p[d] / q[d]):
                r = np.maximum(p - q, 0.0)
                tok = int(rng.choice(V, p=r / r.sum()))
                sampler.took(tok)
                return i, tok
        sampler.took(d)
        history.append(d)
    p = soft(logits[len(draft.tokens)])
    tok = int(np.argmax(p)) if sampler.params.greedy else int(rng.choice(V, p=p))
    sampler.took(tok)
    return len(draft.tokens), tok
