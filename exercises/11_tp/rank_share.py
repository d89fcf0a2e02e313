"""Chapter 11 · tp: one rank's share of a layer, before the all-reduces.

Run the check:   make exercise ch=11
(or: .venv/bin/python -m exercises.check 11)

The tp stage splits every layer over N ranks (stages/parallel/split.py). A rank holds whole KV
groups (a KV head and the query heads that read it) and a range of the feed-forward's hidden units.
It computes its heads' attention and its units' gate, each with no word from another rank, and then
its slice of the two row-parallel matmuls (attn_output, ffn_down): a partial sum of the whole
[M, D] output. The all-reduce adds the N partial sums, and the layer is complete. The check needs no
MPI: it runs your function once per rank of a plan, in one process, compares each partial sum with
the stage's split of the same layer, and adds them up as the all-reduce would.
"""

import numpy as np  # noqa: F401  (for your code)


def layer_partial(x, w, share):
    """One rank's partial sums of one layer's attention block and feed-forward block.

    x:      float32 [M, D]   the normed hidden state of M positions 0 .. M-1 of one sequence;
                             every rank holds all of it
    w:      dict of the layer's whole matrices, float32, each [outputs, inputs] as the GGUF holds it:
              "attn_q" [H * hd, D], "attn_k" [Hkv * hd, D], "attn_v" [Hkv * hd, D],
              "attn_output" [D, H * hd],
              "ffn_gate" [F, D], "ffn_up" [F, D], "ffn_down" [D, F]
    share:  this rank's stages.parallel.split.Share: [start, end) ranges
              share.heads      its query heads         share.kv_heads   its KV heads
              share.q_rows     rows of attn_q, columns of attn_output (share.heads times hd)
              share.kv_rows    rows of attn_k and attn_v (share.kv_heads times hd)
              share.ff         its hidden units: rows of ffn_gate and ffn_up, columns of ffn_down
              share.head_dim   hd
    returns (attn, ffn), float32 [M, D] each, this rank's partial sums:
        attn = the attention of its query heads over its KV heads (causal: position i sees
               positions 0 .. i; scores scaled by 1 / sqrt(hd); query head h of the model reads
               KV head h // G, G = H / Hkv), times its columns of attn_output
        ffn  = silu(x gate^T) * (x up^T) over its hidden units (silu(z) = z / (1 + e^-z)),
               times its columns of ffn_down

    The check feeds both blocks the same x and leaves RoPE out: RoPE turns each head's q and k in
    place, and changes nothing of who owns what.

    What to write: slice the rank's rows and columns out of w, then the two blocks as one process
    computes them, on the slices. Summed over the ranks of a plan, your partial sums must be the
    whole layer.

    The edges: a rank's first query head is not head 0 (its KV heads neither), so a head's KV head
    is counted from the rank's first; ranks may hold unequal numbers of KV heads (3 over 2 ranks:
    1 and 2) and unequal ranges of hidden units (the split evens out bytes, not units); a single
    row (a decode step); one rank (the whole layer).

    Why: attn_q, attn_k, attn_v, ffn_gate and ffn_up are split by rows (column-parallel: each
    rank's outputs are complete), attn_output and ffn_down by columns (row-parallel: each rank's
    output is a partial sum over its inputs). Column-parallel then row-parallel needs one
    all-reduce per block and nothing in between: attention reads only its own group's K and V,
    and silu(gate) * up acts on each hidden unit alone.

    Hint: notebooks/11_tp.ipynb, "Who owns what". Try it before you read
    stages/parallel/split.py (Share) and stages/tp.py (prepare_matrix, BY_ROWS, BY_COLUMNS).
    """
    raise NotImplementedError("write this rank's partial sums of the two blocks: see the docstring")
