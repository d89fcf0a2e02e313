"""One sequence's constraint: where it stands in its grammar, and which tokens may come next.

    mask      int32 [ceil(n_vocab / 32)]   bit t of word t // 32 set: token t allowed
              (llguidance's layout, little-endian bits; 1,536 words for SmolLM2)
    allowed   bool [n_vocab]               the mask unpacked
    apply     logits [n_vocab] -> the logits with every forbidden token at -inf

`apply` runs once per sampled token, so it is made cheap: each byte of the mask looks up its 8
additive terms (0 where allowed, -inf where not) in a table of 256 rows (BYTE_TERMS), and the
logits are added to them, in a buffer the constraint keeps: two passes over the row whatever
the mask holds, no allocation. (np.where over the unpacked mask costs several times that and
more where allowed and forbidden tokens alternate, as in the middle of a number.)

A mask is computed once per position, when first asked for (or for a whole batch at once by
`fill_masks`, llguidance's threads computing the rows side by side), and forgotten when the
sequence moves: `consume` (a token taken), `rollback` (the last k taken back: speculative
decoding's guesses past the end of the text), `reset`. `fork` copies the state (the n choices of
one prompt); `Constraint(grammar, ll, tokens)` rebuilds it from the tokens a sequence holds (one
preempted and recomputed). `ended`: the grammar was complete and an end token was taken.
"""

from __future__ import annotations

import llguidance
import numpy as np

from common.constrain.grammar import ConstraintError, Grammar, one_line

NEG_INF = np.float32(-np.inf)
# BYTE_TERMS[b, i]: 0 where bit i of byte b is set (little-endian bits, as the mask's), else -inf
BYTE_TERMS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
                      np.float32(0), NEG_INF).astype(np.float32)


class Constraint:
    """A grammar followed token by token (an llguidance matcher) over one vocabulary (an
    llguidance tokenizer: common/constrain/vocabulary.py). `tokens`: what it has taken."""

    def __init__(self, grammar: Grammar, ll: llguidance.LLTokenizer, tokens=()):
        self.grammar, self.ll = grammar, ll
        self.n_vocab = ll.vocab_size
        self.end = frozenset(ll.eos_tokens)
        self.matcher = llguidance.LLMatcher(ll, grammar.text, log_level=0)
        if self.matcher.is_error():
            raise ConstraintError(f"{grammar.what}: llguidance refuses it: {one_line(self.matcher.get_error())}",
                                  grammar.what)
        self.tokens: list[int] = []
        self._over: list[bool] = []            # per token taken: the text was over after it
        self._kept: list[bool] = []            # per token taken: llguidance recorded it (below)
        self._mask = None
        self._out = None                       # apply's buffer: float32 [32 * mask words]
        for t in tokens:
            self.consume(t)

    # ---- the mask ------------------------------------------------------------------------------
    def mask(self) -> np.ndarray:
        """This position's mask (the module docstring's layout), computed once."""
        if self._mask is None:
            words = np.empty((self.n_vocab + 31) // 32, dtype=np.int32)
            self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
            self._mask = words
        return self._mask

    def allowed(self) -> np.ndarray:
        """bool [n_vocab]: which tokens may come next."""
        return np.unpackbits(self.mask().view(np.uint8), count=self.n_vocab, bitorder="little").view(np.bool_)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """float32 [n_vocab] logits -> the logits with the forbidden tokens at -inf, the
        allowed ones as they were (the module docstring says how). The result lives in this
        constraint's buffer: it holds until the next apply."""
        words = self.mask()
        if self._out is None:
            self._out = np.empty(words.size * 32, dtype=np.float32)
        np.take(BYTE_TERMS, words.view(np.uint8), axis=0, out=self._out.reshape(-1, 8))
        out = self._out[:self.n_vocab]
        np.add(out, logits, out=out)
        return out

    # ---- moving along --------------------------------------------------------------------------
    def consume(self, token: int):
        """Take a token. One the grammar does not allow here raises ConstraintError (a sampler
        never draws one; a forced or replayed token might) and leaves the state as it was."""
        token = int(token)
        # an end token taken where the text was already over changes nothing, and llguidance does
        # not record it (a rollback counts only what it recorded)
        kept = not (token in self.end and self.matcher.is_stopped())
        if not self.matcher.consume_token(token):
            error = self.matcher.get_error()
            self._restart()
            raise ConstraintError(f"{self.grammar.what}: token {token} "
                                  f"({self.ll.decode_bytes([token])!r}) is not allowed after "
                                  f"{len(self.tokens)} tokens: {one_line(error)}", self.grammar.what)
        self.tokens.append(token)
        self._over.append(token in self.end and self.matcher.is_stopped())
        self._kept.append(kept)
        self._mask = None

    def rollback(self, k: int):
        """Take back the last k tokens."""
        if not 0 <= k <= len(self.tokens):
            raise ValueError(f"cannot roll back {k} of {len(self.tokens)} tokens")
        cut = len(self.tokens) - k
        recorded = sum(self._kept[cut:])
        if recorded and not self.matcher.rollback(recorded):
            error = self.matcher.get_error()
            self._restart()
            raise ConstraintError(f"{self.grammar.what}: llguidance cannot roll back {k} tokens: "
                                  f"{one_line(error)}", self.grammar.what)
        del self.tokens[cut:], self._over[cut:], self._kept[cut:]
        self._mask = None

    def reset(self):
        """Back to the start (a chat's next reply)."""
        self.matcher.reset()
        self.tokens, self._over, self._kept, self._mask = [], [], [], None

    def fork(self) -> Constraint:
        """An independent copy at the same place."""
        twin = object.__new__(Constraint)
        twin.__dict__.update(self.__dict__, matcher=self.matcher.deep_copy(), tokens=list(self.tokens),
                             _over=list(self._over), _kept=list(self._kept), _out=None)
        return twin

    def _restart(self):
        """A fresh matcher fed the tokens taken (an llguidance matcher in error stays there)."""
        self.matcher = llguidance.LLMatcher(self.ll, self.grammar.text, log_level=0)
        if self.tokens and not self.matcher.consume_tokens(self.tokens):
            raise ConstraintError(f"{self.grammar.what}: replaying {len(self.tokens)} tokens failed: "
                                  f"{one_line(self.matcher.get_error())}", self.grammar.what)
        self._mask = None

    @property
    def ended(self) -> bool:
        """The grammar was complete and an end token was taken: the text is over. (An end token
        a grammar names inside its text, as `<|im_end|>`, ends nothing.)"""
        return bool(self._over) and self._over[-1]

    def ended_at(self, k: int) -> int | None:
        """Among the last k tokens taken, the index of the one that ended the text, or None
        (speculative decoding emits nothing after it)."""
        recent = self._over[len(self._over) - k:]
        return recent.index(True) if True in recent else None


_executor = None


def fill_masks(constraints) -> None:
    """Compute the masks of many sequences' positions at once (one step of a batch): llguidance
    works through them on its own threads, without Python's lock. Each constraint then has its
    mask ready for `apply`."""
    global _executor
    todo = [c for c in constraints if c._mask is None]
    if not todo:
        return
    if _executor is None:
        _executor = llguidance.LLExecutor()
    if any(c.n_vocab != todo[0].n_vocab for c in todo):
        raise ValueError("fill_masks: constraints over vocabularies of different sizes")
    words = np.empty((len(todo), (todo[0].n_vocab + 31) // 32), dtype=np.int32)
    _executor.unsafe_compute_mask_ptr([(c.matcher, i) for i, c in enumerate(todo)], words.ctypes.data,
                                      words.shape[1] * 4, len(todo))
    for i, c in enumerate(todo):
        c._mask = words[i]
