"""Chapter 04 · kv_cache: write the KV cache's store and the attention that reads it.

Run the check:   make exercise ch=04
(or: .venv/bin/python -m exercises.check 04)

With a KV cache the model feeds only the tokens it has not seen: the prompt once, then one row
per decode step. Each layer writes the new rows' keys and values into an arena allocated once,
and attention reads every position so far from it. Your function is fed a sequence in pieces
(a prompt, a prompt in two chunks, decode steps) and compared with the stage's store and
attention; then one layer's decode step with your cache is timed against recomputing the whole
text, which is what every stage before this one does.
"""

import numpy as np  # noqa: F401  (for your code)


def store_and_attend(cache, layer, start_pos, q, k, v, n_head, n_head_kv):
    """Store this step's keys and values, then attend over every position so far.

    cache:     the arena (stages/kv_cache.py's KVCache): cache.k, cache.v float32 [n_layer, n_ctx, kv_dim]
               with kv_dim = n_head_kv * hd; positions 0 .. start_pos - 1 are already in it
    layer:     which layer's slice of the arena this is
    start_pos: the position of the first new row
    q:         float32 [M, n_head * hd]     the M new rows' queries (M = the prompt, or 1 to decode)
    k, v:      float32 [M, n_head_kv * hd]  their keys and values
    returns    float32 [M, n_head * hd]     causal attention of each new row over positions
                                            0 .. start_pos + i (row i sits at start_pos + i)

    What to write:
    1. store: k and v into rows start_pos .. start_pos + M - 1 of cache.k[layer], cache.v[layer]
       (nothing else of the arena changes);
    2. attend: for each new row i and each query head h, the scores q_h . k_t / sqrt(hd) against
       the stored keys t = 0 .. start_pos + i (not later ones: causal), their softmax, and the
       probability-weighted sum of the stored values. Query head h reads KV head h // (n_head //
       n_head_kv) (grouped-query attention: SmolLM2 has 9 query heads and 3 KV heads).
       numpy is fine here (the matmuls, not attention, are the stage's cost).

    The edge: start_pos > 0 with M > 1 (a prompt fed in two chunks). Row i of the chunk may see
    the chunk's rows up to its own and nothing after: a mask built from i alone, forgetting
    start_pos, reads the future or hides the past.

    Why: a position's key and value depend only on the tokens up to it, so once stored they
    never change; a decode step then pushes one row through the matmuls instead of the whole
    text, and only attention still grows with the length.

    Hint: notebooks/04_kv_cache.ipynb, "The stage's code"; common/backend.py's attention says how
    the heads are grouped. Try it before you read stages/kv_cache.py (KVCache.store).
    """
    raise NotImplementedError("write the store, then the attention over the arena: see the docstring")
