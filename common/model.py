"""The llama graph, written once against the op surface (common/backend.py).

Nothing here knows about loops, SIMD, numba or CUDA: a stage's backend decides how the
weights are held and how every op runs. What this file knows is the model:

    h = token_embd[tokens]                                     [M, D]
    for each layer:
        x = rms_norm(h) * attn_norm
        q, k, v = x Wq^T, x Wk^T, x Wv^T                       [M, H*hd], [M, Hkv*hd] x2
        q, k = rope(q), rope(k)                                adjacent pairs ('NORM' mode)
        h = h + attention(q, k, v) Wo^T                        causal, grouped KV heads
        x = rms_norm(h) * ffn_norm
        h = h + (silu(x Wgate^T) * (x Wup^T)) Wdown^T
    logits = (rms_norm(h) * output_norm) Wout^T                [M, n_vocab]

One sequence: `forward(tokens, start_pos)`, rows at positions start_pos.., K and V in the
stage's cache. Many: `forward_batch(batch)` (common/batch.py), the same layers over the rows of
several sequences, each at its own position, K and V in the pages of a shared pool.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from common.gguf import GGUFError, GGUFFile
from common.quants import dequantize_tensor
from common.tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES = ("llama",)


@dataclass
class LlamaConfig:
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_base: float
    rope_freq_scale: float       # 1 / linear scaling factor
    eps: float
    n_ctx_train: int
    n_vocab: int

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "LlamaConfig":
        arch = g.architecture
        if arch not in SUPPORTED_ARCHITECTURES:
            raise GGUFError(f"architecture '{arch or '(none)'}' is not supported; this engine runs "
                            f"{', '.join(SUPPORTED_ARCHITECTURES)} models (general.architecture)")

        def key(name, default=None, kind=int):
            full = f"{arch}.{name}"
            if full not in g.metadata:
                if default is None:
                    raise GGUFError(f"required metadata key '{full}' is missing")
                return default
            value = g.metadata[full]
            if isinstance(value, (list, np.ndarray)):       # per-layer arrays: all equal in llama
                values = set(np.asarray(value).tolist())
                if len(values) != 1:
                    raise GGUFError(f"'{full}' varies per layer ({sorted(values)}); not supported")
                value = values.pop()
            try:
                return kind(value)
            except (TypeError, ValueError):
                raise GGUFError(f"'{full}' is {value!r}: not a {kind.__name__}") from None

        def positive(name, value):
            if value <= 0:
                raise GGUFError(f"'{arch}.{name}' is {value}: it must be positive")
            return value

        def positive_number(name, value):
            if not (value > 0 and np.isfinite(value)):
                raise GGUFError(f"'{arch}.{name}' is {value}: it must be a positive number")
            return value

        n_embd = positive("embedding_length", key("embedding_length"))
        n_head = positive("attention.head_count", key("attention.head_count"))
        n_head_kv = positive("attention.head_count_kv", key("attention.head_count_kv", n_head))
        if f"{arch}.attention.key_length" not in g.metadata and n_embd % n_head:
            raise GGUFError(f"embedding_length {n_embd} is not a multiple of head_count {n_head} "
                            f"(and no attention.key_length gives the head dimension)")
        head_dim = positive("attention.key_length", key("attention.key_length", n_embd // n_head))
        if head_dim % 2:
            raise GGUFError(f"head dimension {head_dim} is odd: RoPE rotates pairs of values")
        if key("attention.value_length", head_dim) != head_dim:
            raise GGUFError("attention.value_length differs from key_length; not supported")
        n_rot = key("rope.dimension_count", head_dim)
        if n_rot != head_dim:
            raise GGUFError(f"rope.dimension_count {n_rot} != head dim {head_dim}: llama rotates whole heads")
        if n_head % n_head_kv:
            raise GGUFError(f"head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
        scaling = g.metadata.get(f"{arch}.rope.scaling.type", "linear")
        if scaling not in ("none", "linear"):
            raise GGUFError(f"rope scaling '{scaling}' is not supported (none and linear are)")
        scale_key = "rope.scaling.factor" if f"{arch}.rope.scaling.factor" in g.metadata else "rope.scale_linear"
        factor = key(scale_key, 0.0, float)
        if factor:
            positive_number(scale_key, factor)
        tokens = g.metadata.get("tokenizer.ggml.tokens")
        n_vocab = key("vocab_size", len(tokens) if tokens is not None else 0)
        if n_vocab == 0:
            n_vocab = g.tensors["token_embd.weight"].shape[0] if "token_embd.weight" in g.tensors else 0
        eps = key("attention.layer_norm_rms_epsilon", kind=float)
        if not (eps > 0 and np.isfinite(eps)):
            raise GGUFError(f"'{arch}.attention.layer_norm_rms_epsilon' is {eps}: it must be a positive number")
        return cls(
            n_layer=positive("block_count", key("block_count")), n_embd=n_embd,
            n_ff=positive("feed_forward_length", key("feed_forward_length")),
            n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, n_rot=n_rot,
            rope_base=positive_number("rope.freq_base", key("rope.freq_base", 10000.0, float)),
            rope_freq_scale=1.0 / factor if factor and scaling == "linear" else 1.0,
            eps=eps, n_ctx_train=positive("context_length", key("context_length")),
            n_vocab=positive("vocab_size", n_vocab),
        )


def context_size(cfg: LlamaConfig, requested: int | None = None) -> int:
    """Positions the KV cache and RoPE tables hold: as asked, else min(trained, 2048). Asked for
    more than the model was trained on, it gets it, as llama.cpp gives it (with a warning there):
    positions past the trained ones are ones the model never saw, so its text may degrade; a
    benchmark of long prompts on a model's geometry needs them."""
    return requested or min(cfg.n_ctx_train, 2048)


# The per-layer tensors the graph reads (blk.N.<name>.weight).
LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


def rope_angles(cfg: LlamaConfig, positions: np.ndarray, freq_factors=None) -> np.ndarray:
    """theta[p, i] = p * base^(-2i/n_rot) * freq_scale / factor_i, float64 [len(positions), n_rot/2]."""
    i = np.arange(cfg.n_rot // 2, dtype=np.float64)
    inv_freq = cfg.rope_base ** (-2.0 * i / cfg.n_rot) * cfg.rope_freq_scale
    if freq_factors is not None:
        inv_freq = inv_freq / np.asarray(freq_factors, dtype=np.float64)
    return np.outer(np.asarray(positions, dtype=np.float64), inv_freq)


@dataclass
class LayerWeights:
    attn_norm: object
    wq: object
    wk: object
    wv: object
    wo: object
    ffn_norm: object
    w_gate: object
    w_up: object
    w_down: object


class LlamaModel:
    """A llama model bound to one backend: `forward(tokens, start_pos)` -> logits.

    Stages with a KV cache treat forward(tokens, start_pos) as "these tokens sit at
    positions start_pos..; the cache already holds 0..start_pos-1". Stages without one
    take the whole sequence from position 0 every time.
    """

    def __init__(self, gguf: GGUFFile, backend, n_ctx: int | None = None, progress: bool = False):
        t0 = time.perf_counter()
        self.gguf = gguf
        self.backend = backend
        self.config = cfg = LlamaConfig.from_gguf(gguf)
        self.n_ctx = context_size(cfg, n_ctx)
        self.weight_names = {}     # id(prepared weight) -> tensor name, for per-op profiles
        self._tokenizer = None
        backend.open_model(gguf, cfg, self.n_ctx)
        self._load_weights(progress)
        backend.finish_load(self)
        freq_factors = None
        if "rope_freqs.weight" in gguf.tensors:
            freq_factors = dequantize_tensor(gguf.tensors["rope_freqs.weight"])
        angles = rope_angles(cfg, np.arange(self.n_ctx), freq_factors)
        self.rope_cos = backend.prepare_table(np.cos(angles).astype(np.float32))   # [n_ctx, hd/2]
        self.rope_sin = backend.prepare_table(np.sin(angles).astype(np.float32))
        self.kv = backend.new_kv_cache(cfg.n_layer, self.n_ctx, backend.kv_width(cfg))
        self.load_s = time.perf_counter() - t0

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = Tokenizer.from_gguf(self.gguf)
        return self._tokenizer

    @property
    def uses_kv_cache(self) -> bool:
        return self.kv is not None

    def _tensor(self, name):
        t = self.gguf.tensors.get(name)
        if t is None:
            raise GGUFError(f"tensor '{name}' is missing from {self.gguf.path}")
        return t

    def _load_weights(self, progress: bool):
        cfg, b = self.config, self.backend
        known = {"token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight"}
        for il in range(cfg.n_layer):
            known |= {f"blk.{il}.{n}.weight" for n in LAYER_TENSORS}
        unexpected = sorted(set(self.gguf.tensors) - known)
        if unexpected:
            raise GGUFError(f"tensors this llama graph does not use (biases? fused qkv?): {unexpected[:5]}")

        bar = None
        if progress:
            bar = tqdm(total=cfg.n_layer + 2, desc=f"loading ({b.name})", unit="layer", leave=False)

        def load(prepare, name):
            w = prepare(self._tensor(name))
            self.weight_names[id(w)] = name
            return w

        matrix, vector = b.prepare_matrix, b.prepare_vector
        self.token_embd = load(b.prepare_embedding, "token_embd.weight")
        self.output_norm = load(vector, "output_norm.weight")
        if "output.weight" in self.gguf.tensors:
            self.output = load(matrix, "output.weight")
        else:                                         # tied embeddings (SmolLM2)
            self.output = b.tie_output(self.token_embd, self.gguf.tensors["token_embd.weight"])
            self.weight_names[id(self.output)] = "output.weight (tied to token_embd)"
        if bar:
            bar.update(2)
        self.layers = []
        for il in range(cfg.n_layer):
            p = f"blk.{il}."
            self.layers.append(LayerWeights(
                attn_norm=load(vector, p + "attn_norm.weight"),
                wq=load(matrix, p + "attn_q.weight"), wk=load(matrix, p + "attn_k.weight"),
                wv=load(matrix, p + "attn_v.weight"), wo=load(matrix, p + "attn_output.weight"),
                ffn_norm=load(vector, p + "ffn_norm.weight"),
                w_gate=load(matrix, p + "ffn_gate.weight"), w_up=load(matrix, p + "ffn_up.weight"),
                w_down=load(matrix, p + "ffn_down.weight")))
            if bar:
                bar.update(1)
        if bar:
            bar.close()

    def _weights(self) -> list:
        ws = [self.token_embd, self.output_norm, self.output]
        for layer in self.layers:
            ws += list(vars(layer).values())
        return ws

    def weight_stream_bytes(self) -> int:
        """Bytes of weights one forward pass reads: every matrix and norm once, plus one
        embedding row per token (negligible); the tied output counted once as a matrix."""
        return sum(self.backend.weight_bytes(w) for w in self._weights()[1:])

    def weight_bytes(self) -> int:
        """Bytes the backend holds for the weights (float32 copies for the eager stages)."""
        return self.backend.held_bytes(self._weights())

    # ---- the forward pass ----------------------------------------------------------------
    def hidden(self, tokens, start_pos: int = 0, all_rows: bool = True):
        """The final normed hidden state [M, D] (or its last row) as a backend array."""
        cfg, b = self.config, self.backend
        tokens = np.asarray(tokens, dtype=np.int64)
        n = len(tokens)
        if n == 0:
            raise ValueError("forward() needs at least one token")
        if self.kv is None and start_pos != 0:
            raise ValueError(f"stage '{b.name}' has no KV cache: pass the whole sequence from position 0")
        if start_pos + n > self.n_ctx:
            raise ValueError(f"positions {start_pos}..{start_pos + n - 1} exceed the context of {self.n_ctx}")
        if tokens.min() < 0 or tokens.max() >= cfg.n_vocab:
            raise ValueError(f"token ids must be in 0..{cfg.n_vocab - 1}")
        cos, sin = self.rope_cos, self.rope_sin
        if b.fuses_layers:
            # a backend that compiles the whole stack into one call (the fused stage) takes
            # over here: the same graph, without Python between the ops
            h = b.forward_layers(self, tokens, start_pos)                     # [M, D]
            if not all_rows:
                h = b.last_row(h)
            return b.rms_norm(h, self.output_norm, cfg.eps)

        def rope(x, n_heads):                          # rows at positions start_pos..
            return b.rope(x, cos, sin, start_pos, n_heads)

        def attend(il, q, k, v):
            if self.kv is not None:
                k, v = self.kv.store(il, start_pos, k, v)                    # [start_pos+M, Hkv*hd]
            return b.attention(q, k, v, cfg.n_head, cfg.n_head_kv, start_pos)

        h = self.layer_stack(b.embed(self.token_embd, tokens), rope, attend)  # [M, D]
        if not all_rows:
            h = b.last_row(h)
        return b.rms_norm(h, self.output_norm, cfg.eps)

    def layer_stack(self, h, rope, attend):
        """The layers, written once for one sequence (hidden) and for a batch of them
        (forward_batch): h [M, D] -> [M, D]. rope(x, n_heads) rotates every row at its own
        position; attend(layer, q, k, v) stores the rows' K and V and returns their attention
        over everything their sequence has stored."""
        cfg, b = self.config, self.backend
        for il, L in enumerate(self.layers):
            x = b.rms_norm(h, L.attn_norm, cfg.eps)
            q = rope(b.matmul(x, L.wq), cfg.n_head)                          # [M, H*hd]
            k = rope(b.matmul(x, L.wk), cfg.n_head_kv)                       # [M, Hkv*hd]
            v = b.matmul(x, L.wv)                                            # [M, Hkv*hd]
            a = attend(il, q, k, v)                                          # [M, H*hd]
            h = b.add(h, b.matmul(a, L.wo))
            x = b.rms_norm(h, L.ffn_norm, cfg.eps)
            f = b.swiglu(b.matmul(x, L.w_gate), b.matmul(x, L.w_up))         # [M, n_ff]
            h = b.add(h, b.matmul(f, L.w_down))
        return h

    def forward_batch(self, batch) -> np.ndarray:
        """One step for many sequences (common/batch.py): every row at its own position, each
        attending over its own sequence's pages of the pool. Returns float32 logits
        [len(batch.logit_rows), n_vocab], the rows that asked for them, in segment order.

        The rows arrive padded to the backend's row_block, and the rows whose logits are wanted
        are padded again before the output matrix, so every matmul takes every row down the
        same path: a row's numbers do not depend on the other rows (common/backend.py)."""
        cfg, b = self.config, self.backend
        if batch.pool.n_layer != cfg.n_layer or batch.pool.kv_dim != b.kv_width(cfg):
            raise ValueError("the page pool was made for another model (or another stage: Backend.kv_width)")
        if int(batch.seq_len.max()) > self.n_ctx:
            raise ValueError(f"a sequence would exceed the context of {self.n_ctx}")
        if batch.tokens.min() < 0 or batch.tokens.max() >= cfg.n_vocab:
            raise ValueError(f"token ids must be in 0..{cfg.n_vocab - 1}")
        cos, sin, positions = self.rope_cos, self.rope_sin, batch.positions

        def rope(x, n_heads):
            return b.rope_at(x, cos, sin, positions, n_heads)

        def attend(il, q, k, v):
            return b.attention_paged(q, k, v, cfg.n_head, cfg.n_head_kv, il, batch)

        if b.fuses_layers:
            h = b.forward_layers_batch(self, batch)                                # [M, D]
        else:
            h = self.layer_stack(b.embed(self.token_embd, batch.tokens), rope, attend)
        n = len(batch.logit_rows)
        if n == 0:
            return np.zeros((0, cfg.n_vocab), dtype=np.float32)
        rows = np.zeros(-(-n // batch.row_block) * batch.row_block, dtype=np.int64)
        rows[:n] = batch.logit_rows
        h = b.rms_norm(h[rows], self.output_norm, cfg.eps)                  # padded with copies of row 0
        return b.to_host(b.matmul(h, self.output))[:n]

    def pieces(self, tokens, start_pos: int = 0):
        """[(tokens, start_pos)]: a backend with a `max_batch` (cuda: scratch memory sized for
        that many rows) gets a long prompt in pieces of at most max_batch tokens; the KV cache
        carries the context from one piece to the next."""
        n = self.backend.max_batch
        if not n or self.kv is None or len(tokens) <= n:
            return [(tokens, start_pos)]
        return [(tokens[i:i + n], start_pos + i) for i in range(0, len(tokens), n)]

    def forward(self, tokens, start_pos: int = 0, all_logits: bool = True) -> np.ndarray:
        """float32 logits [len(tokens), n_vocab], or [1, n_vocab] for the last position only."""
        *head, (tokens, start_pos) = self.pieces(tokens, start_pos)
        rows = []
        for t, p in head:
            h = self.hidden(t, p, all_rows=all_logits)
            if all_logits:
                rows.append(self.backend.to_host(self.backend.matmul(h, self.output)))
        h = self.hidden(tokens, start_pos, all_rows=all_logits)
        rows.append(self.backend.to_host(self.backend.matmul(h, self.output)))
        return rows[0] if len(rows) == 1 else np.concatenate(rows)

    def greedy_next(self, tokens, start_pos: int = 0) -> int:
        """The argmax token after `tokens`, computed where the logits live (on the GPU for
        cuda: only the id crosses the bus)."""
        b = self.backend
        *head, (tokens, start_pos) = self.pieces(tokens, start_pos)
        for t, p in head:
            self.hidden(t, p, all_rows=False)
        return int(b.argmax(b.matmul(self.hidden(tokens, start_pos, all_rows=False), self.output)))

    def reset(self):
        """Forget the conversation (empty the KV cache)."""
        if self.kv is not None:
            self.kv.reset()

    def warmup(self):
        """Run every kernel once so that JIT compilation is not timed as inference.
        Returns the seconds it took (numba compiles, or loads its on-disk cache)."""
        t0 = time.perf_counter()
        self.backend.warmup()
        toks = [0, 1]
        if self.kv is not None:
            self.forward(toks, 0, all_logits=True)
            self.greedy_next([2], 2)
            self.reset()
        else:
            self.forward(toks, 0, all_logits=True)
            self.greedy_next(toks, 0)
        return time.perf_counter() - t0

    def kv_bytes(self) -> int:
        return int(self.kv.nbytes) if self.kv is not None else 0


def n_params(cfg: LlamaConfig) -> int:
    per_layer = cfg.n_embd * (cfg.n_head * cfg.head_dim) * 2 + cfg.n_embd * cfg.kv_dim * 2 \
        + 3 * cfg.n_embd * cfg.n_ff + 2 * cfg.n_embd
    return cfg.n_layer * per_layer + cfg.n_vocab * cfg.n_embd + cfg.n_embd


def flops_per_token(cfg: LlamaConfig, context: int) -> float:
    """Multiply-adds x2 of one token's forward pass at a given context length (matmuls +
    attention), the figure the roofline places stages by."""
    matmul = n_params(cfg) - cfg.n_embd * (2 * cfg.n_layer + 1)
    attn = cfg.n_layer * cfg.n_head * cfg.head_dim * context * 2
    return 2.0 * (matmul + attn)



def prompt_matmul_ops(cfg: LlamaConfig, n_prompt: int) -> float:
    """Operations (2 per multiply-add) of a prompt's matmuls: every layer matrix on every prompt
    row, the output matrix on the last row only (the next token's logits). Integer operations in
    the stages that round activations to int8: what the roofline's integer peak bounds."""
    layer_matrices = n_params(cfg) - cfg.n_vocab * cfg.n_embd - cfg.n_embd * (2 * cfg.n_layer + 1)
    return 2.0 * (layer_matrices * n_prompt + cfg.n_vocab * cfg.n_embd)
