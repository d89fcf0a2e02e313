"""Stage 11, tp: the model split across N processes (MPI ranks); what splitting costs.

The lesson: when a model outgrows one machine's memory, or one machine's bandwidth, each layer
is split across devices (Megatron-LM's tensor parallelism: vLLM over NCCL, llama.cpp's RPC
backend), and every layer pays for it in communication. Here the devices are processes started
by `mpiexec -n N`, on one machine's cores or on several machines listed in a host file:

* Column-parallel: a rank's rows of Wq, Wk, Wv are its heads (whole KV groups), its rows of W_gate
  and W_up its hidden units (stages/parallel/split.py): its attention reads its own K/V only.
* Row-parallel: Wo and W_down hold the matching columns, so a rank's product is a partial sum of
  the whole [M, D] output: a row-parallel matmul ends in an all-reduce (nano-vllm's
  RowParallelLinear), two per layer, after which every rank holds the same residual stream h.
* The output head: a rank's rows of the vocabulary, the logits gathered once per step.
* A rank maps only its slices of the file (stages/parallel/shards.py); the repack stage it builds
  on lays each slice out for the vector unit, then the slice's pages are let go. Its KV cache (or
  page pool) holds its KV heads only; norms, RoPE tables and the embedding are on every rank.

The layers are the repack stage's compiled stack (the graph as every fused stage writes it once),
on the rank's slices. The stack runs in one parallel region, which has no place for an MPI call;
so here it runs in pieces (the stack's run_phases), each ending at a row-parallel matmul that adds
its products into a buffer of partial sums instead of into h; Python all-reduces the buffer and
adds it to h between two pieces. A step of many sequences (the server's) is built on rank 0 and
reaches the others in one broadcast of its arrays (stages/parallel/steps.py; `follow`).

Numerics are repack's (LOGIT_TOLERANCE): one rank computes the base's bits; over N, Wo's and
W_down's sums are added in another order, a float rounding that can tip a later int8 rounding,
so greedy text may differ at near-ties (tests/test_tp.py).

What limits it: per layer two pieces (a fork and join each) and two all-reduces, per token a
gather, each a round trip whose latency does not shrink with the message (ranks.py times them and
counts their bytes); across machines the link's latency times those round trips; unequal heads
where N does not divide the KV heads (a rank waits for another at the all-reduce); and what every
rank keeps whole: h, the norms, the interpreter and numba. `python -m app bench tp` measures each,
through shared memory and across a link between two network namespaces (app/netns.py), into
profiles/bench/tp_<model>.md. A collective that waits too long names the rank that did not come.
"""

from __future__ import annotations

import time

import numpy as np

from common.cpu import physical_cores
from common.paged_kv import PagePool
from stages import StageError
from stages.kernels.layer_stack import DOWN_OP, OPS_PER_LAYER, PHASES, WO_OP, Span
from stages.kernels.sync import ARRIVALS, CLOCK, new_sync
from stages.parallel import steps
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

    def kv_width(self, config) -> int:
        if self.share is None:
            return super().kv_width(config)
        k0, k1 = self.share.kv_rows
        return k1 - k0                         # this rank's KV heads only

    # ---- the layers: the compiled stack in pieces, an all-reduce after each row-parallel matmul -----
    def _dims(self, model):
        """The stack's shapes are this rank's: its heads, its KV heads, its hidden units."""
        dims, s = super()._dims(model), self.share
        return dims if s is None else dims._replace(n_head=s.n_heads, n_head_kv=s.n_kv_heads, n_ff=s.ff[1] - s.ff[0])

    def _run(self, model, tokens, cache, rows):
        """The layer stack over the rows `tokens` [M] -> h [M, D], the same on every rank. (The loop
        is kept lean, its arrays made once: between two pieces the weights have swept the caches,
        so every object a call touches is a miss.)"""
        h = self.embed(model.token_embd, tokens)
        weights, dims, nt = self._compiled(model)
        ops = self._ops(model, rows, cache)                          # repack's steps
        work = self.stack.scratch_for(h, weights, cache, rows, dims, nt, ops)
        part = np.empty_like(h)                                      # [M, D]: this rank's partial sums
        sync = new_sync(phases=OPS_PER_LAYER)                        # with a clock per phase (fused's _ran)
        for il in range(model.config.n_layer):
            for first, last, where in PIECES:
                part[:] = 0
                sync[ARRIVALS] = 0
                sync[CLOCK:] = 0
                t0 = time.perf_counter()
                self.stack.run_phases(h, weights, cache, rows, dims, sync, nt,
                           Span(il * OPS_PER_LAYER + first, il * OPS_PER_LAYER + last, part), ops, *work)
                self._ran(sync, nt, t0)
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

    # ---- a step of many sequences (the server's): rank 0 builds it, every rank runs it --------------
    def forward_layers_batch(self, model, batch):
        """A step over every rank: on rank 0 its arrays go to the others first (the words of
        stages/parallel/steps.py; `follow` runs it there), then each rank runs it over its KV heads'
        pages, as the base runs a step."""
        if self.ranks.size > 1 and self.ranks.rank == 0:
            self._send(steps.pack(batch))
        return super().forward_layers_batch(model, batch)

    def follow(self, model):
        """Ranks other than 0: run every step rank 0 runs (model.forward_batch there) until it calls
        end_steps. This rank's pool is laid out as rank 0's, over its own KV heads; the page copies
        rank 0's step made are made here first."""
        pool = None
        while True:
            head = self.ranks.broadcast(np.empty(steps.HEAD_WORDS, np.int64), "the next step", forever=True)
            shape = steps.geometry(head)
            if shape is None:
                return
            n = steps.length(head)
            rest = np.empty(max(0, n - steps.HEAD_WORDS), np.int64)
            if len(rest):                                          # a step longer than the first message
                self.ranks.broadcast(rest, "the rest of the step")
            if pool is None or (pool.n_pages, pool.page_size) != shape:
                pool = PagePool(model.config.n_layer, self.kv_width(model.config), *shape, self.kv_dtype)
            step = steps.Step(np.concatenate([head, rest])[:n], pool)
            pool.copy_pages(step.copies.tolist())
            model.forward_batch(step)

    def end_steps(self):
        """Rank 0: the ranks that follow its steps stop following."""
        if self.ranks.size > 1:
            self._send(steps.end())

    def _send(self, words):
        head = np.zeros(steps.HEAD_WORDS, np.int64)
        head[:min(len(words), steps.HEAD_WORDS)] = words[:steps.HEAD_WORDS]
        self.ranks.broadcast(head, "the next step")
        if len(words) > steps.HEAD_WORDS:
            self.ranks.broadcast(np.ascontiguousarray(words[steps.HEAD_WORDS:]), "the rest of the step")
