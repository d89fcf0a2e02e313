"""Stage 11, tp: the model split across N processes (MPI ranks); what splitting costs.

The lesson: when a model outgrows one machine's memory, or one machine's bandwidth, each layer
is split across devices (Megatron-LM's tensor parallelism: vLLM over NCCL, llama.cpp's RPC
backend), and every layer pays for it in communication. Here the devices are processes started
by `mpiexec -n N`, on one machine's cores or on several machines listed in a host file:

* Column-parallel: a rank's rows of Wq, Wk, Wv are its heads (whole KV groups, with their query
  heads), its rows of W_gate and W_up its share of the hidden units (stages/parallel/split.py):
  its attention reads its own heads' K/V cache and nothing of the others'.
* Row-parallel: Wo and W_down hold the matching columns, so each rank's product is a partial sum
  of the whole [M, D] result, complete only once the ranks' parts are added: a row-parallel
  matmul ends in an all-reduce (nano-vllm's RowParallelLinear), two per layer, after which every
  rank holds the same whole residual stream h.
* The output head: a rank's rows of the vocabulary; the logits are gathered once per step, so
  every rank samples the same token from the same numbers.
* A rank maps only its slices of the file and copies its row-parallel ones (stages/parallel/
  shards.py); the repack stage it builds on lays each slice out for the vector unit, as it lays
  out a whole matrix, and the slices' file pages and copies are let go. Its KV cache holds its
  KV heads only. Norms, RoPE tables and the embedding lookup are the same on every rank.

The layers are the repack stage's compiled stack (stages/kernels/layer_stack.py), the graph as
it is written once for every fused stage, on the rank's slices. That stack runs every phase of
every layer in one parallel region, which has no place for an MPI call; so this stage runs it in
pieces (run_phases), each ending at a row-parallel matmul whose products go into a buffer of
partial sums instead of into h. Between two pieces Python all-reduces the buffer and adds it to h.
Two pieces per layer: their fork and join, and the all-reduce, are what a layer pays.

Numerics are repack's (LOGIT_TOLERANCE). Wo's and W_down's sums are added in another order (each
rank's part, then the parts): a rounding of a float, which can tip the next layer's int8 rounding
of a value, so the logits move within the base's tolerance of the float64 reference and greedy
text may differ at near-ties (tests/test_tp.py). One rank computes the base's bits exactly.

What limits it: two all-reduces per layer and one gather per token, each a round trip whose latency
does not shrink with the message (stages/parallel/ranks.py times them and counts their bytes);
across machines, the link's latency times those round trips; unequal heads where N does not divide
the KV heads (split.py evens out the bytes, so not the time: a rank waits for another at the
all-reduce); and what every rank keeps whole: h, the norms, the interpreter and numba.
`scripts/bench_tp.py` measures each of them (profiles/bench/tp_<model>.md), on one machine and
across a link between two network namespaces. A collective that waits too long names the rank
that did not come and ends every rank; one sequence at a time (serving a batch across ranks is
not built).
"""

from __future__ import annotations

import numpy as np

from common.cpu import physical_cores
from stages import StageError
from stages.kernels.layer_stack import DOWN_OP, OPS_PER_LAYER, PHASES, WO_OP, Span, run_phases
from stages.parallel.ranks import mpi_missing, world
from stages.parallel.shards import copy_columns, map_rows
from stages.parallel.split import SplitError, block_values, costs, plan
from stages.repack import LOGIT_TOLERANCE, RepackBackend, RepackedMatrix

__all__ = ["TensorParallelBackend", "LOGIT_TOLERANCE", "ROW_PARALLEL"]

# role of a layer matrix -> the Share range it is split by: rows (column-parallel) or columns
BY_ROWS = {"attn_q": "q_rows", "attn_k": "kv_rows", "attn_v": "kv_rows", "ffn_gate": "ff", "ffn_up": "ff"}
BY_COLUMNS = {"attn_output": "q_rows", "ffn_down": "ff"}
# The row-parallel matmuls among a layer's phases, and what their all-reduce is called in a message:
# a piece of the stack ends after each (and the last phase of a layer is one).
ROW_PARALLEL = {WO_OP: "the all-reduce after layer {}'s attention",
                DOWN_OP: "the all-reduce after layer {}'s feed-forward"}
WARMUP_PASSES = 2          # forward passes before the collectives' deadline drops to LLM_TP_TIMEOUT


def pieces() -> list[tuple[int, int, str]]:
    """A layer's phases in pieces [(first, last, where)], each ending after a row-parallel matmul."""
    out, first = [], 0
    for op, where in ROW_PARALLEL.items():
        last = PHASES.index(op) + 1
        out.append((first, last, where))
        first = last
    assert first == OPS_PER_LAYER, "a layer's last phase must be a row-parallel matmul"
    return out


PIECES = pieces()


class TensorParallelBackend(RepackBackend):
    name = "tp"

    @staticmethod
    def unavailable_reason() -> str | None:
        return mpi_missing() or RepackBackend.unavailable_reason()

    @staticmethod
    def reporting_process() -> bool:
        return world().rank == 0

    def __init__(self, threads: int | None = None, kv_type: str | None = None):
        self.ranks = world()
        # the ranks on one host share its cores
        super().__init__(threads or max(1, physical_cores() // self.ranks.local_ranks), kv_type)
        self.share = self.shares = self.path = None
        self.head = None                       # the output head: this rank's vocabulary rows
        self.dims = None                       # the stack's shapes on this rank (layer_stack.Dims)
        self.passes = 0
        self.copied_bytes = 0                  # the row-parallel slices copied out of the file (then repacked)

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
            if (c0, c1) == (0, tensor.shape[1]):
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
        self.head = super().prepare_matrix(map_rows(self.path, tensor, v0, v1))
        return self.head

    def finish_load(self, model):
        """Every slice repacked into the one buffer (the repack stage's load); then the slices' own
        mappings and copies are let go: the buffer is all this rank keeps of them."""
        super().finish_load(model)
        if self.share is not None:
            for w in model._weights():
                if isinstance(w, RepackedMatrix) and w.source is not model.token_embd:
                    w.source = w.tensor = None

    def new_kv_cache(self, n_layer, n_ctx, kv_dim):
        if self.share is not None:
            k0, k1 = self.share.kv_rows
            kv_dim = k1 - k0                   # this rank's KV heads only
        return super().new_kv_cache(n_layer, n_ctx, kv_dim)

    # ---- the layers: the compiled stack in pieces, an all-reduce after each row-parallel matmul -----
    def _dims(self, model):
        """The stack's shapes are this rank's: its heads, its KV heads, its hidden units (made once:
        the stack is called 2 x n_layer times a step)."""
        if self.dims is None:
            dims, s = super()._dims(model), self.share
            self.dims = dims if s is None else dims._replace(n_head=s.n_heads, n_head_kv=s.n_kv_heads,
                                                             n_ff=s.ff[1] - s.ff[0])
        return self.dims

    def _run(self, model, tokens, cache, rows):
        """The layer stack over the rows `tokens` [M] -> h [M, D], the same on every rank."""
        h = self.embed(model.token_embd, tokens)
        for il in range(model.config.n_layer):
            for first, last, where in PIECES:
                part = np.zeros_like(h)                              # [M, D]: this rank's partial sums
                self._stack(run_phases, model, h, cache, rows, Span(il * OPS_PER_LAYER + first,
                                                                    il * OPS_PER_LAYER + last, part))
                h += self.ranks.allreduce(part, (where, il))          # the row-parallel matmul, complete
        return h

    def matmul(self, x, w):
        """The output head: this rank's logits, gathered from every rank in vocabulary order."""
        if w is not self.head or self.head is None:
            return super().matmul(x, w)
        local = super().matmul(x, w)                                               # [M, this rank's rows]
        M = local.shape[0]
        counts = [s.vocab[1] - s.vocab[0] for s in self.shares]
        flat = self.ranks.allgather(local, [M * c for c in counts], "the gather of the logits")
        self.passes += 1
        if self.passes >= WARMUP_PASSES:
            self.ranks.warming = False
        if M == 1 or len(counts) == 1:
            return flat.reshape(M, -1)
        out = np.empty((M, sum(counts)), dtype=np.float32)                         # rank-major -> [M, n_vocab]
        off = col = 0
        for c in counts:
            out[:, col:col + c] = flat[off:off + M * c].reshape(M, c)
            off, col = off + M * c, col + c
        return out

    # ---- a batch of sequences (the server) needs every head on one rank ------------------------------
    def forward_layers_batch(self, model, batch):
        if self.ranks.size > 1:
            raise StageError(f"stage 'tp' over {self.ranks.size} ranks runs one sequence at a time (run, chat): "
                             "serving a batch across ranks is not built; serve with a single-process stage")
        return super().forward_layers_batch(model, batch)          # 1 rank: the whole model, the base's kernels
