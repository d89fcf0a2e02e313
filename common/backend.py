"""The op surface: everything the llama graph asks of a stage.

The graph (common/model.py) is written once against this class. A stage is a subclass that
overrides only what its optimization changes, and inherits the rest from the stage before it:

    primitives   matmul add mul rms_norm silu rope scale dot softmax argmax   (the article's ten)
                 embed                                                       (row lookup)
    composites   attention swiglu                    default compositions of the primitives below
    batches      rope_at attention_paged store_kv    many sequences in one step (common/batch.py):
                 row_block                           RoPE at per-row positions, attention through
                                                     each sequence's pages
    weights      prepare_matrix prepare_embedding prepare_vector   how a stage holds its weights
                 tie_output prepare_table weight_bytes held_bytes  (RoPE tables; what they cost)
    memory       new_kv_cache                                      None: no KV cache
                 kv_width                                          K/V values kept per position
                 to_host last_row                                  backend array -> numpy; a row
    hooks        unavailable_reason                                what this machine lacks, or None
                 open_model                                        the file and shapes, before any weight
                 reporting_process banner                          which process prints a run; its note
                 finish_load                                       after every weight is prepared
                 fuses_layers forward_layers                       the whole layer stack in one call,
                 forward_layers_batch                              for one sequence or a batch
                 kv_dtype                                          how K and V are stored
                 max_batch                                         rows one forward call may take
                 profiler                                          per-op timing (common/profile.py)
                 warmup                                            compile before anything is timed

Every hook is declared here with its default, so common/model.py calls methods and reads
attributes of this class only: what a stage may change is this file.

Arrays are whatever the stage computes on: numpy float32 for the CPU stages, device
buffers for cuda. Shapes below use M = rows being computed (tokens), D = n_embd,
T = positions attended over, H/Hkv = query/KV heads, hd = head dim.
"""

from __future__ import annotations

import numpy as np

from common.profile import OpProfiler, Profiler

# Logits, max |stage - float64 reference| (common/reference.py): what float32 arithmetic in another
# order costs. A stage that rounds its activations more coarsely says its own (logit_tolerance).
FLOAT_TOLERANCE = 5e-3


class Backend:
    name = "base"
    logit_tolerance = FLOAT_TOLERANCE    # the bound this stage's logits keep to the float64 reference

    def __init__(self, threads: int | None = None):
        self.threads = threads or 1

    # ---- weights: a stage decides how it holds them ------------------------------------
    def prepare_matrix(self, tensor):
        """A [out, in] weight (TensorInfo) -> whatever `matmul` takes as its second operand."""
        raise NotImplementedError

    def prepare_embedding(self, tensor):
        """token_embd [n_vocab, D] -> whatever `embed` takes."""
        raise NotImplementedError

    def prepare_vector(self, tensor):
        """A 1-D weight (norms) -> array."""
        raise NotImplementedError

    def tie_output(self, embedding, tensor):
        """The output matrix when the model ties it to token_embd (no output.weight)."""
        return self.prepare_matrix(tensor)

    def prepare_table(self, table: np.ndarray):
        """A constant float32 table the graph indexes by position (RoPE's cos and sin)."""
        return table

    def new_kv_cache(self, n_layer: int, n_ctx: int, kv_dim: int):
        """An object with .store(layer, start_pos, k, v) -> (k_all, v_all) and .reset(), or
        None: then every step recomputes the whole sequence (the article's baseline)."""
        return None

    def kv_width(self, config) -> int:
        """K/V values this process keeps per position and layer: the width of its KV cache and of
        a page pool's pages (common/paged_kv.py), every KV head's (the tp stage: its own heads')."""
        return config.kv_dim

    def weight_bytes(self, weight) -> int:
        """Bytes of one prepared weight as this stage holds it: float32 copies for the eager
        stages (the RAM balloon), the mapped ggml blocks for the quantized ones."""
        return int(getattr(weight, "nbytes", 0))

    def held_bytes(self, weights) -> int:
        """Bytes held for a list of prepared weights, each storage counted once (a tied output
        may wrap the embedding's own array)."""
        seen, total = set(), 0
        for w in weights:
            inner = getattr(w, "data", None)
            key = id(inner) if isinstance(inner, np.ndarray) else id(w)
            if key not in seen:
                seen.add(key)
                total += self.weight_bytes(w)
        return total

    def to_host(self, x) -> np.ndarray:
        return x

    def last_row(self, x):
        """x [M, D] -> [1, D]: the only row the logits need when all_logits=False."""
        return x[-1:]

    # ---- the ten primitives -------------------------------------------------------------
    def matmul(self, x, w):
        """x [M, K] @ W^T -> [M, N], W the prepared [N, K] weight: y[m, n] = sum_k x[m, k] W[n, k]."""
        raise NotImplementedError

    def add(self, a, b):
        raise NotImplementedError

    def mul(self, a, b):
        raise NotImplementedError

    def rms_norm(self, x, weight, eps: float):
        """x [M, D] -> x / sqrt(mean(x^2) + eps) * weight, per row."""
        raise NotImplementedError

    def silu(self, x):
        """x * sigmoid(x)."""
        raise NotImplementedError

    def rope(self, x, cos, sin, start_pos: int, n_heads: int):
        """x [M, n_heads*hd] for positions start_pos..; rotate adjacent pairs (x[2i], x[2i+1])
        of every head by angle i of its position, cos/sin being tables [n_ctx, hd/2]
        (llama's 'NORM' RoPE mode)."""
        raise NotImplementedError

    def scale(self, x, s: float):
        raise NotImplementedError

    def dot(self, a, b):
        """a [M, d], b [T, d] -> [M, T]: every row of a dotted with every row of b."""
        raise NotImplementedError

    def softmax(self, x, causal_offset: int | None = None):
        """Row-wise softmax of x [M, T]. With causal_offset c, row i sees columns 0..c+i only
        (the rest become 0): query i sits at position c+i and may not look ahead."""
        raise NotImplementedError

    def argmax(self, x) -> int:
        """x [N] or [1, N] -> index of the largest value (the first on ties)."""
        raise NotImplementedError

    def embed(self, table, ids):
        """ids [M] -> [M, D] rows of the embedding table."""
        raise NotImplementedError

    # ---- composites: default compositions of the primitives ----------------------------
    def swiglu(self, gate, up):
        """The llama FFN's gate: silu(gate) * up, both [M, n_ff]."""
        return self.mul(self.silu(gate), up)

    def attention(self, q, k, v, n_head: int, n_head_kv: int, start_pos: int):
        """Causal multi-head attention with grouped KV heads.

        q [M, H*hd] for positions start_pos..start_pos+M-1; k, v [T, Hkv*hd] for positions
        0..T-1 (T = start_pos + M). Query head h reads KV head h // (H/Hkv): consecutive
        query heads share one KV head. Returns [M, H*hd].

        Composed as the article does: scores = dot(q_h, k_h) * 1/sqrt(hd), softmax over the
        visible positions, then the probability-weighted sum of the value rows, which is
        itself a dot: p [M, T] against v_h^T [hd, T].
        """
        hd = q.shape[1] // n_head
        group = n_head // n_head_kv
        out = np.empty_like(q)
        for h in range(n_head):
            kvh = h // group
            q_h = q[:, h * hd:(h + 1) * hd]
            k_h = k[:, kvh * hd:(kvh + 1) * hd]
            v_h = v[:, kvh * hd:(kvh + 1) * hd]
            scores = self.scale(self.dot(q_h, k_h), 1.0 / np.sqrt(hd))
            p = self.softmax(scores, causal_offset=start_pos)
            out[:, h * hd:(h + 1) * hd] = self.dot(p, v_h.T)
        return out

    # ---- many sequences in one step (common/batch.py, common/paged_kv.py) ----------------
    # The CPU stages' multi-row matmul (simd's 4 x 4 register block, which quantized, threads
    # and int8 reuse for prompt rows) takes rows four at a time and the rows left over one at a
    # time, and the two paths sum a row's products in different orders. A batch padded to a
    # multiple of row_block sends every row down the four-row path, so a row's result is the
    # same whatever else is in the batch: a sequence's tokens never depend on its neighbours.
    row_block = 4

    def rope_at(self, x, cos, sin, positions, n_heads: int):
        """rope for rows at arbitrary positions: x [M, n_heads*hd], positions int [M]. The
        stage's own rope over the tables' rows gathered at those positions, so the arithmetic
        is the stage's."""
        return self.rope(x, cos[positions], sin[positions], 0, n_heads)

    def store_kv(self, pool, layer: int, slots, k, v):
        """Write rows k, v [n, kv_dim] into the pool's flat slots [n] (page * page_size + offset)."""
        pool.k[layer].reshape(-1, pool.kv_dim)[slots] = k
        pool.v[layer].reshape(-1, pool.kv_dim)[slots] = v

    def attention_paged(self, q, k, v, n_head: int, n_head_kv: int, layer: int, batch):
        """Store the batch's new rows k, v [M, Hkv*hd] in their pages, then causal attention of
        every row over its own sequence's positions -> [M, H*hd] (padding rows: 0).

        Composed from the single-sequence op: each sequence's K/V gathered through its page
        table into contiguous arrays (a copy per sequence and layer), then `attention`, so a
        stage's numbers are its own. A stage with a fused kernel reads the pages in place."""
        n = batch.n_rows
        self.store_kv(batch.pool, layer, batch.slots[:n], k[:n], v[:n])
        out = np.zeros_like(q)
        r = 0
        for i, m in enumerate(batch.seq_rows.tolist()):
            kk, vv = batch.seq_kv(layer, i)
            out[r:r + m] = self.attention(q[r:r + m], kk, vv, n_head, n_head_kv, int(batch.seq_start[i]))
            r += m
        return out

    # ---- hooks: what a stage may change besides the ops, each with its default ---------------
    @staticmethod
    def unavailable_reason() -> str | None:
        """None if this machine can run the stage, else a sentence saying what is missing
        (asked before anything is loaded)."""
        return None

    def open_model(self, gguf, config, n_ctx: int):
        """The model's file (GGUFFile), shapes (LlamaConfig) and context, once, before any weight is prepared."""

    @staticmethod
    def reporting_process() -> bool:
        """True where this process prints a run's text and figures (of tp's ranks, rank 0 only)."""
        return True

    def banner(self) -> str | None:
        """A line `run` prints on stderr before it generates, or None (tp: its ranks, hosts and pids)."""
        return None

    def finish_load(self, model):
        """Called once every weight is prepared, before the KV cache is made: a stage that lays
        all its weights out anew (the repack stage) does it here, so load time includes it."""

    # True: forward_layers runs every layer in one call, and the graph of common/model.py is not
    # walked op by op (the fused stage: no Python between the ops).
    fuses_layers = False

    def forward_layers(self, model, tokens, start_pos: int):
        """With fuses_layers: the layer stack for one sequence, tokens [M] at positions
        start_pos.., K and V into model.kv -> h [M, D] before the final norm."""
        raise NotImplementedError(f"stage '{self.name}' does not run the layer stack in one call")

    def forward_layers_batch(self, model, batch):
        """With fuses_layers: the layer stack for a step of many sequences (common/batch.py),
        each row at its own position, K and V into the pages of batch.pool -> h [M, D]."""
        raise NotImplementedError(f"stage '{self.name}' does not run the layer stack in one call")

    # How the KV cache stores K and V (the arena and the page pool): float32, or float16 (half
    # the bytes attention reads; llama.cpp's default), for the kernels that read it.
    kv_dtype = np.float32

    # Rows one forward call may take (cuda: its scratch memory is sized for them); a longer
    # prompt goes in pieces. None: any number.
    max_batch: int | None = None

    def profiler(self, model) -> Profiler:
        """A per-op profiler for runs of this model (common/profile.py): every op timed."""
        return OpProfiler(model)

    def warmup(self):
        """Compile (or load from numba's cache) every kernel before anything is timed."""
