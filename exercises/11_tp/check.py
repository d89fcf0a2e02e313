"""Chapter 11's check: your rank's partial sums of a layer against the tp stage's split of the same
layer (stages/tp.py's BY_ROWS and BY_COLUMNS over stages/parallel/split.py's plan, the blocks in the
kv_cache stage's float32 ops), rank by rank, within the bound two float32 computations of them may
differ by; then the all-reduce: the ranks' partial sums added, beside one process's whole layer.
Then the time of one rank's share beside one process's whole layer. No MPI is needed: the ranks
are calls in this process."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from exercises.harness import EXP_ULPS, Case, Exercise, Timing, U, attention_bound, best_seconds, close, sum_bound
from stages.kv_cache import KVCacheBackend
from stages.parallel.split import Costs, plan
from stages.simd import matmul_panels
from stages.tp import BY_COLUMNS, BY_ROWS

BACKEND = KVCacheBackend()


def stage_slices(w, share) -> dict:
    """The rank's slice of each matrix, as the tp stage takes it at load (prepare_matrix)."""
    out = {}
    for role, m in w.items():
        if role in BY_ROWS:
            r0, r1 = getattr(share, BY_ROWS[role])
            out[role] = m[r0:r1]
        else:
            c0, c1 = getattr(share, BY_COLUMNS[role])
            out[role] = np.ascontiguousarray(m[:, c0:c1])
    return out


def stage_blocks(x, s, share) -> SimpleNamespace:
    """The two blocks over the slices s, in the kv_cache stage's ops: q, k, v; a, the attention's
    output before attn_output [M, its heads * hd]; g, silu(gate) * up [M, its units]; and the
    partial sums attn and ffn [M, D]."""
    q, k, v = (matmul_panels(x, s[r]) for r in ("attn_q", "attn_k", "attn_v"))
    a = BACKEND.attention(q, k, v, share.n_heads, share.n_kv_heads, 0)
    g = BACKEND.swiglu(matmul_panels(x, s["ffn_gate"]), matmul_panels(x, s["ffn_up"]))
    return SimpleNamespace(q=q, k=k, v=v, a=a, g=g, attn=matmul_panels(a, s["attn_output"]),
                           ffn=matmul_panels(g, s["ffn_down"]))


def stage_partial(x, w, share):
    b = stage_blocks(x, stage_slices(w, share), share)
    return b.attn, b.ffn


def layer(rng, D, H, Hkv, hd, F) -> dict:
    """A layer's matrices whose products with check_input's rows are exact in float32 (values
    k / 64, |k| <= 3: every product a multiple of 2^-9, every sum far inside 24 bits), so q, k, v,
    gate and up are the same whoever sums them and the bound only has to cover what follows."""
    shapes = {"attn_q": (H * hd, D), "attn_k": (Hkv * hd, D), "attn_v": (Hkv * hd, D), "attn_output": (D, H * hd),
              "ffn_gate": (F, D), "ffn_up": (F, D), "ffn_down": (D, F)}
    out = {}
    for role, shape in shapes.items():
        m = (rng.integers(-3, 4, shape) / 64).astype(np.float32)
        m.flags.writeable = False
        out[role] = m
    return out


def check_input(rng, M, D):
    x = (rng.integers(-3, 4, (M, D)) / 8).astype(np.float32)
    x.flags.writeable = False
    return x


def bounds(b, s, share):
    """How far your (attn, ffn) may lie from the stage's: the attention of each head within
    attention_bound, silu(gate) * up within (EXP_ULPS + 4) u of its size (an exp, an add, a
    division, a multiply) on each side; each carried through the row-parallel matmul (|W| times
    the difference) plus the two sums' own rounding (sum_bound). b: stage_blocks over the slices s."""
    a, g, q, k, v = b.a, b.g, b.q, b.k, b.v
    hd, G = share.head_dim, share.n_heads // share.n_kv_heads
    ea = np.empty(a.shape[1])
    for h in range(share.n_heads):
        kv = h // G
        ea[h * hd:(h + 1) * hd] = attention_bound(q[:, h * hd:(h + 1) * hd], k[:, kv * hd:(kv + 1) * hd],
                                                  v[:, kv * hd:(kv + 1) * hd], 1 / np.sqrt(hd))
    eg = 2 * (EXP_ULPS + 4) * U * np.abs(g.astype(np.float64))
    out = []
    for act, err, wo in ((a, np.broadcast_to(ea, a.shape), s["attn_output"]), (g, eg, s["ffn_down"])):
        W = np.abs(wo.astype(np.float64))
        out.append(err @ W.T + sum_bound((np.abs(act.astype(np.float64)) + err) @ W.T, W.shape[1]))
    return out


class TensorParallel(Exercise):
    chapter = "11"
    title = "tp: one rank's share of a layer, before the all-reduces"
    folder = "exercises/11_tp"
    file = "rank_share.py"
    reference = {"layer_partial": stage_partial}
    reference_code = "stages/tp.py: BY_ROWS, BY_COLUMNS + stages/parallel/split.py: plan, Share"
    baseline = "one process: the whole layer"

    def cases(self, rng, quick):
        # (M rows, D, H, Hkv, hd, F, ranks, down_block, the plan's costs or None for an even split), why
        plans = [
            ((5, 48, 6, 3, 8, 64, 2, 1, None), "3 KV heads over 2 ranks: 1 and 2 groups, 5 rows"),
            ((1, 48, 6, 3, 8, 64, 3, 1, None), "3 ranks of one group each, a single row (a decode step)"),
            ((4, 32, 4, 4, 8, 48, 2, 8, None), "no sharing (G = 1), hidden units cut at blocks of 8"),
            ((3, 32, 12, 3, 4, 96, 2, 16, Costs(kv_group=4000.0, ff_block=1000.0, vocab_row=0.0)),
             "G = 4; the split evens out bytes: the rank with 1 group gets more hidden units"),
            ((6, 48, 6, 3, 8, 64, 1, 1, None), "one rank: the whole layer"),
        ]
        out = []
        for (M, D, H, Hkv, hd, F, n, down_block, cost), why in plans:
            cfg = SimpleNamespace(n_head=H, n_head_kv=Hkv, head_dim=hd, n_ff=F, n_vocab=1)
            shares = plan(cfg, n, 1, down_block, cost)
            spans = " | ".join(f"heads {s.heads[0]}-{s.heads[1] - 1}, units {s.ff[0]}-{s.ff[1] - 1}" for s in shares)
            out.append(Case(f"{why} (ranks: {spans})", {"x": check_input(rng, M, D), "w": layer(rng, D, H, Hkv, hd, F),
                                                 "shares": shares, "whole": plan(cfg, 1)[0]}))
        return out

    def judge(self, sol, case):
        x, w, shares = case.inputs["x"], case.inputs["w"], case.inputs["shares"]
        total = [np.zeros(x.shape, np.float64) for _ in range(2)]          # the all-reduce, in float64
        for share in shares:
            try:
                got = sol.layer_partial(x, w, share)
            except NotImplementedError:
                raise                                     # the starting file: the harness's own message
            except Exception as e:                        # which rank raised: the harness prints the rest
                e.args = (f"rank {share.rank} of {len(shares)}: {e}",)
                raise
            if not (isinstance(got, tuple) and len(got) == 2):
                return "return a tuple (attn, ffn) of two [M, D] arrays", ""
            s = stage_slices(w, share)
            blocks = stage_blocks(x, s, share)
            want = blocks.attn, blocks.ffn
            for i, (name, b) in enumerate(zip(("attn", "ffn"), bounds(blocks, s, share))):
                wrong = close(f"rank {share.rank} of {len(shares)}: {name}", got[i], want[i], b)
                if wrong:
                    return wrong + " (index: row, column of D)", ""
                total[i] += np.asarray(got[i], np.float64)
        whole = stage_partial(x, w, case.inputs["whole"])
        gap = max(float(np.abs(t - wh).max()) for t, wh in zip(total, whole))
        return None, f"your partial sums all-reduced: {gap:.2g} from one process's whole layer"

    def timings(self, sol, quick):
        M, D, H, Hkv, hd, F, n = (4 if quick else 16), 576, 9, 3, 64, 1536, 3       # SmolLM2's layer
        rng = np.random.default_rng(0)
        x, w = check_input(rng, M, D), layer(rng, D, H, Hkv, hd, F)
        cfg = SimpleNamespace(n_head=H, n_head_kv=Hkv, head_dim=hd, n_ff=F, n_vocab=1)
        share, whole = plan(cfg, n)[0], plan(cfg, 1)[0]
        self.timing_note = (f"one layer of SmolLM2's shapes, {M} rows, float32 (the stage's weights are quantized; "
                            f"the split is the same): rank 0 of {n} against one process")
        reps = 3 if quick else 7
        flops = lambda s: 2 * M * D * (2 * (s.q_rows[1] - s.q_rows[0]) + 2 * (s.kv_rows[1] - s.kv_rows[0])
                                      + 3 * (s.ff[1] - s.ff[0]))
        return [Timing(f"yours, rank 0 of {n}", best_seconds(lambda: sol.layer_partial(x, w, share), reps), "yours",
                       (flops(share), "GFLOP/s")),
                Timing(f"the stage's split, rank 0 of {n}", best_seconds(lambda: stage_partial(x, w, share), reps),
                       "stage", (flops(share), "GFLOP/s")),
                Timing("one process: the whole layer", best_seconds(lambda: stage_partial(x, w, whole), reps),
                       "previous", (flops(whole), "GFLOP/s"))]


EXERCISE = TensorParallel()
