"""Stage 11, tp: the model split across N processes (MPI ranks); what splitting costs.

The lesson: when a model outgrows one machine's memory, or one machine's bandwidth, each layer
is split across devices (Megatron-LM's tensor parallelism: vLLM over NCCL, llama.cpp's RPC
backend), and every layer pays for it in communication. Here the devices are processes started
by `mpiexec -n N`, on one machine's cores or on several machines listed in a host file:

* Column-parallel: a rank's rows of Wq, Wk, Wv are its heads (whole KV groups, with their query
  heads), its rows of W_gate and W_up its share of the hidden units (stages/parallel/split.py):
  its attention reads its own heads' K/V cache and nothing of the others'.
* Row-parallel: Wo and W_down hold the matching columns, so each rank's product is a partial sum
  of the whole [M, D] result; one all-reduce after each (two per layer) adds the partial sums on
  every rank, where the residual stream h is kept whole.
* The output head: a rank's rows of the vocabulary; the logits are gathered once per step, so
  every rank samples the same token from the same numbers.
* A rank maps only its slices of the file and copies its row-parallel ones (stages/parallel/
  shards.py); its KV cache holds its KV heads only. Norms, RoPE tables and the embedding lookup
  are the same on every rank.

Numerics and kernels are those of the stage it builds on (`BaseBackend`, the registry's builds_on:
the fastest CPU stage): its matmul, attention, norms and RoPE on the rank's slices, called per op
from Python (the base stage runs the whole stack in one compiled call, which has no place for an
all-reduce). Wo's and W_down's sums are added in another order (each rank's part, then the parts):
a rounding of a float, which can tip the next layer's int8 rounding of a value, so the logits move
within the base's LOGIT_TOLERANCE and greedy text may differ at near-ties (tests/test_tp.py).

What limits it: two all-reduces per layer and one gather per token, each a round trip whose latency
does not shrink with the message (stages/parallel/ranks.py times them and counts their bytes);
the Python between the ops, which the base stage had removed; unequal heads where N does not
divide the KV heads (split.py evens out the bytes, so not the time: a rank waits for another at
the all-reduce); and what every rank keeps whole:
h, the norms, the interpreter and numba. `scripts/bench_tp.py` measures each of them
(profiles/bench/tp_<model>.md). A collective that waits too long names the rank that did not
come and ends every rank; one sequence at a time (serving a batch across ranks is not built).
"""

from __future__ import annotations

import importlib

import numpy as np

from common.cpu import physical_cores
from stages import StageError, backend_class, info
from stages.parallel.ranks import mpi_missing, world
from stages.parallel.shards import copy_columns, map_rows
from stages.parallel.split import SplitError, block_values, costs, plan

# The stage tp builds on, the one name it inherits through: stages/registry.py's builds_on.
BaseBackend = backend_class(info("tp").builds_on)
# its numerics are tp's: how far they may depart from the float64 reference (tests/test_stages.py)
LOGIT_TOLERANCE = importlib.import_module(BaseBackend.__module__).LOGIT_TOLERANCE

# role of a layer matrix -> the Share range it is split by: rows (column-parallel) or columns
BY_ROWS = {"attn_q": "q_rows", "attn_k": "kv_rows", "attn_v": "kv_rows", "ffn_gate": "ff", "ffn_up": "ff"}
BY_COLUMNS = {"attn_output": "q_rows", "ffn_down": "ff"}
WARMUP_PASSES = 2          # forward passes before the collectives' deadline drops to LLM_TP_TIMEOUT


class VocabShard:
    """The output head on one rank: `local` its vocabulary rows as the base stage prepared them,
    `counts` every rank's number of rows (the gather's layout)."""

    def __init__(self, local, counts):
        self.local, self.counts = local, counts
        self.data = getattr(local, "data", None)
        self.nbytes = int(getattr(local, "nbytes", 0))


class TensorParallelBackend(BaseBackend):
    name = "tp"
    fuses_layers = True

    @staticmethod
    def unavailable_reason() -> str | None:
        return mpi_missing() or BaseBackend.unavailable_reason()

    @staticmethod
    def reporting_process() -> bool:
        return world().rank == 0

    def __init__(self, threads: int | None = None):
        self.ranks = world()
        # the ranks on one host share its cores
        super().__init__(threads or max(1, physical_cores() // self.ranks.local_ranks))
        self.share = self.shares = self.path = None
        self.passes = 0
        self.copied_bytes = 0                  # the row-parallel slices, copied out of the file

    def banner(self) -> str:
        more = "" if self.ranks.size > 1 else \
            " (for N ranks: make stage=tp run np=N, i.e. mpiexec -n N python -m app run --stage tp ...)"
        return f"{self.ranks.banner()}; {self.threads} thread{'s' if self.threads > 1 else ''} each{more}"

    # ---- this rank's slices ---------------------------------------------------------------------------
    def open_model(self, gguf, config, n_ctx):
        down = block_values(gguf, "ffn_down")
        try:
            self.shares = plan(config, self.ranks.size, block_values(gguf, "attn_output"), down,
                               costs(gguf, config, n_ctx, down))
        except SplitError as e:
            raise StageError(f"stage 'tp': {e} (mpiexec -n N sets the ranks)") from None
        self.share, self.path = self.shares[self.ranks.rank], gguf.path

    def prepare_matrix(self, tensor):
        if self.share is None:                  # a weight outside a model (the ops' tests): whole
            return super().prepare_matrix(tensor)
        role = tensor.name.split(".")[-2] if tensor.name.startswith("blk.") else tensor.name.split(".")[0]
        if role in BY_ROWS:
            r0, r1 = getattr(self.share, BY_ROWS[role])
            return super().prepare_matrix(map_rows(self.path, tensor, r0, r1))
        if role in BY_COLUMNS:
            c0, c1 = getattr(self.share, BY_COLUMNS[role])
            whole = (c0, c1) == (0, tensor.shape[1])
            if whole:
                return super().prepare_matrix(map_rows(self.path, tensor, 0, tensor.shape[0]))
            t = copy_columns(self.path, tensor, c0, c1)
            self.copied_bytes += t.nbytes
            return super().prepare_matrix(t)
        if role == "output":
            return self._vocab_shard(tensor)
        return super().prepare_matrix(tensor)

    def tie_output(self, embedding, tensor):
        return self._vocab_shard(tensor) if self.share else super().tie_output(embedding, tensor)

    def _vocab_shard(self, tensor):
        v0, v1 = self.share.vocab
        return VocabShard(super().prepare_matrix(map_rows(self.path, tensor, v0, v1)),
                          [s.vocab[1] - s.vocab[0] for s in self.shares])

    def new_kv_cache(self, n_layer, n_ctx, kv_dim):
        if self.share is not None:
            k0, k1 = self.share.kv_rows
            kv_dim = k1 - k0                   # this rank's KV heads only
        return super().new_kv_cache(n_layer, n_ctx, kv_dim)

    # ---- the layers: the base stage's ops on this rank's slices, an all-reduce after Wo and W_down ----
    def forward_layers(self, model, tokens, start_pos: int):
        cfg, s, ranks = model.config, self.share, self.ranks
        cos, sin, eps = model.rope_cos, model.rope_sin, cfg.eps
        nh, nkv = s.n_heads, s.n_kv_heads
        h = self.embed(model.token_embd, tokens)                                   # [M, D] on every rank
        for il, L in enumerate(model.layers):
            x = self.rms_norm(h, L.attn_norm, eps)
            q = self.rope(self.matmul(x, L.wq), cos, sin, start_pos, nh)           # [M, nh*hd]: this rank's heads
            k = self.rope(self.matmul(x, L.wk), cos, sin, start_pos, nkv)          # [M, nkv*hd]
            k, v = model.kv.store(il, start_pos, k, self.matmul(x, L.wv))          # [start_pos+M, nkv*hd]
            a = self.attention(q, k, v, nh, nkv, start_pos)                        # [M, nh*hd]
            part = self.matmul(a, L.wo)                                            # [M, D]: a partial sum
            h = self.add(h, ranks.allreduce(part, ("the all-reduce after layer {}'s attention", il)))
            x = self.rms_norm(h, L.ffn_norm, eps)
            f = self.swiglu(self.matmul(x, L.w_gate), self.matmul(x, L.w_up))      # [M, this rank's units]
            part = self.matmul(f, L.w_down)
            h = self.add(h, ranks.allreduce(part, ("the all-reduce after layer {}'s feed-forward", il)))
        return h

    def matmul(self, x, w):
        if not isinstance(w, VocabShard):
            return super().matmul(x, w)
        local = super().matmul(x, w.local)                                         # [M, this rank's rows]
        M = local.shape[0]
        flat = self.ranks.allgather(local, [M * c for c in w.counts], "the gather of the logits")
        self.passes += 1
        if self.passes >= WARMUP_PASSES:
            self.ranks.warming = False
        if M == 1 or len(w.counts) == 1:
            return flat.reshape(M, -1)
        out = np.empty((M, sum(w.counts)), dtype=np.float32)                       # rank-major -> [M, n_vocab]
        off = col = 0
        for c in w.counts:
            out[:, col:col + c] = flat[off:off + M * c].reshape(M, c)
            off, col = off + M * c, col + c
        return out

    # ---- a batch of sequences (the server) needs every head on one rank ------------------------------
    def forward_layers_batch(self, model, batch):
        if self.ranks.size > 1:
            raise StageError(f"stage 'tp' over {self.ranks.size} ranks runs one sequence at a time (run, chat): "
                             "serving a batch across ranks is not built; serve with a single-process stage")
        return super().forward_layers_batch(model, batch)          # 1 rank: the whole model, the base's kernels
