"""Who owns what when a llama model is split across N ranks (Megatron's tensor parallelism).

Per layer, each rank holds:

    attention   whole KV groups: KV heads k0..k1 and their query heads (group = H / Hkv each),
                so a rank's attention never needs another rank's keys or values
                Wq, Wk, Wv: the rows of those heads (column-parallel: whole rows of the file)
                Wo:         the columns of those heads (row-parallel: a slice of every row)
    feed-forward hidden units f0..f1
                W_gate, W_up: those rows;  W_down: those columns
    output head vocabulary rows v0..v1 (logits gathered once per step)

A ggml row is a run of blocks (32 or 256 values, one scale each), so a row-parallel matrix can
only be cut between blocks: every rank's first column of Wo and W_down must fall on a block
boundary. The KV heads are split as evenly as whole groups allow; where N does not divide them
the ranks get unequal numbers (SmolLM2's 3 KV heads over 2 ranks: 1 and 2), and the hidden
units and vocabulary rows are then split to even out the bytes each rank holds, its KV cache
included (Costs): memory is what a split is for. The time is then not even: at a short context
the rank with fewer heads holds more weights, streams more of them per token, and the others
wait for it at the all-reduce. A rank needs at least one KV head and one block of hidden units.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.gguf import BLOCK_SIZES, GGMLType


class SplitError(ValueError):
    """The model cannot be split over this many ranks; the message says why and which N can."""


@dataclass(frozen=True)
class Share:
    """One rank's slices: [start, end) ranges of KV heads, query heads, hidden units, vocabulary."""
    rank: int
    n_ranks: int
    head_dim: int
    kv_heads: tuple
    heads: tuple
    ff: tuple
    vocab: tuple

    @property
    def n_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def q_rows(self) -> tuple:            # rows of Wq, columns of Wo
        return self.heads[0] * self.head_dim, self.heads[1] * self.head_dim

    @property
    def kv_rows(self) -> tuple:           # rows of Wk and Wv, columns of this rank's K/V cache
        return self.kv_heads[0] * self.head_dim, self.kv_heads[1] * self.head_dim


def block_values(gguf, role: str) -> int:
    """Values per block of the coarsest type among the layers' `role` matrices (1 for float types)."""
    sizes = [BLOCK_SIZES[GGMLType(t.ggml_type)][0] for name, t in gguf.tensors.items()
             if name.startswith("blk.") and name.endswith(f".{role}.weight")]
    return max(sizes, default=1)


@dataclass(frozen=True)
class Costs:
    """Bytes a rank holds per unit it owns, over all layers: a KV group (its Wq, Wk, Wv rows, Wo
    columns and its K/V cache for every position), a block of hidden units (W_gate, W_up rows
    and W_down columns), a vocabulary row of the output head."""
    kv_group: float
    ff_block: float
    vocab_row: float


def costs(gguf, cfg, n_ctx: int, down_block: int) -> Costs:
    def per_value(name):                 # bytes per weight of a tensor (whole blocks: exact)
        t = gguf.tensors[name]
        return t.nbytes / t.n_elements
    D, hd, group = cfg.n_embd, cfg.head_dim, cfg.n_head // cfg.n_head_kv
    kv = ff = 0.0
    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        kv += group * hd * D * (per_value(p + "attn_q.weight") + per_value(p + "attn_output.weight")) \
            + hd * D * (per_value(p + "attn_k.weight") + per_value(p + "attn_v.weight"))
        ff += down_block * D * sum(per_value(p + f"ffn_{r}.weight") for r in ("gate", "up", "down"))
    kv += 2 * cfg.n_layer * n_ctx * hd * 4                                 # float32 K and V, every position
    head = "output.weight" if "output.weight" in gguf.tensors else "token_embd.weight"
    return Costs(kv, ff, D * per_value(head))


def _bounds(n: int, parts: int) -> list[int]:
    """parts + 1 cut points splitting n units as evenly as whole units allow."""
    return [i * n // parts for i in range(parts + 1)]


def _weighted_bounds(n: int, weights) -> list[int]:
    """Cut points splitting n units in proportion to weights, at least one unit per part."""
    total, parts = sum(weights), len(weights)
    cuts, acc = [0], 0.0
    for i, w in enumerate(weights[:-1], start=1):
        acc += w / total if total > 0 else 1 / parts
        cuts.append(min(max(round(acc * n), cuts[-1] + 1), n - (parts - i)))
    return cuts + [n]


def _plan(cfg, n_ranks: int, wo_block: int, down_block: int, cost: Costs | None) -> list[Share]:
    if n_ranks > cfg.n_head_kv:
        raise SplitError(f"it has {cfg.n_head_kv} KV heads and each rank needs at least one")
    ff_blocks = cfg.n_ff // down_block
    if n_ranks > ff_blocks:
        raise SplitError(f"its {cfg.n_ff} hidden units are {ff_blocks} blocks of {down_block} in ffn_down "
                         f"and each rank needs at least one")
    group = cfg.n_head // cfg.n_head_kv
    kv = _bounds(cfg.n_head_kv, n_ranks)
    for r in range(1, n_ranks):
        col = kv[r] * group * cfg.head_dim
        if col % wo_block:
            raise SplitError(f"rank {r}'s heads start at column {col} of attn_output, inside a block of "
                             f"{wo_block} values (a row-parallel slice must start on a block boundary)")
    if cost is None:
        ff = [b * down_block for b in _bounds(ff_blocks, n_ranks)]
        vocab = _bounds(cfg.n_vocab, n_ranks)
    else:
        # heads split unevenly: the hidden units and the vocabulary even out what each rank holds
        held = [(kv[r + 1] - kv[r]) * cost.kv_group for r in range(n_ranks)]
        fair = (sum(held) + ff_blocks * cost.ff_block + cfg.n_vocab * cost.vocab_row) / n_ranks
        want = [max(0.0, fair - h) for h in held]
        ff = [b * down_block for b in _weighted_bounds(ff_blocks, want)]
        vocab = _weighted_bounds(cfg.n_vocab, want)
    return [Share(r, n_ranks, cfg.head_dim, (kv[r], kv[r + 1]), (kv[r] * group, kv[r + 1] * group),
                  (ff[r], ff[r + 1]), (vocab[r], vocab[r + 1])) for r in range(n_ranks)]


def valid_rank_counts(cfg, wo_block: int, down_block: int) -> list[int]:
    ok = []
    for n in range(1, cfg.n_head_kv + 1):
        try:
            _plan(cfg, n, wo_block, down_block, None)
            ok.append(n)
        except SplitError:
            pass
    return ok


def plan(cfg, n_ranks: int, wo_block: int = 1, down_block: int = 1, cost: Costs | None = None) -> list[Share]:
    """Every rank's Share, or SplitError naming the obstacle and the rank counts that work.
    wo_block, down_block: values per block of attn_output and ffn_down (block_values); cost:
    bytes per unit (costs), to even out the ranks' bytes, else every part split evenly."""
    try:
        return _plan(cfg, n_ranks, wo_block, down_block, cost)
    except SplitError as e:
        valid = ", ".join(map(str, valid_rank_counts(cfg, wo_block, down_block)))
        raise SplitError(f"this model cannot be split over {n_ranks} ranks: {e}; valid rank counts: {valid}") from None
