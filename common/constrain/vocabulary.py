"""Our vocabulary as llguidance sees it: one byte string per token, which tokens are special,
which end the text; built from the tokenizer (common/tokenizer/) alone, and checked token for
token once llguidance has built its token trie from it.

A token's bytes are what our decoder writes for it (Tokenizer.token_piece, llama.cpp's
token_to_piece): GPT-2's byte alphabet undone, SentencePiece's "▁" a space, a byte token such as
<0x0A> its one byte. Special tokens are those our decoder writes only when asked for special
text (control and unknown tokens: <|im_end|>, <s>, <unk>): llguidance keeps them apart from text
(a leading 0xFF byte marks them in its trie) and allows one only where a grammar names it, as
`<|im_end|>` in Lark, never as the letters of its name. The end tokens are every token that ends
generation (Tokenizer.eog_ids, the EOS first): a grammar that is complete allows them.

One departure, checked like the rest: a token whose own bytes begin with 0xFF (SentencePiece's
byte token <0xFF>) would read as that marker. 0xFF never occurs in UTF-8, so no grammar over text
can use such a token; it is handed over empty, and an empty token is in no mask.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import llguidance

from common.generate import ParameterError

MARKER = 0xFF                       # llguidance's special-token marker (TokTrie::SPECIAL_TOKEN_MARKER)


class LLTokenizerMismatch(ParameterError):
    """llguidance sees a token otherwise than our tokenizer does: the message names the first one."""


@dataclass
class Vocabulary:
    """What llguidance is told (llguidance.TokenizerWrapper reads these names): token id ->
    bytes, the special ids, the end ids (EOS first), BOS, and `__call__`, our encoder (text
    bytes -> ids), which llguidance calls when it tokenizes text itself."""
    tokens: list
    special_token_ids: list
    eos: list
    bos_token_id: int | None
    tokenizer: object

    @property
    def eos_token_id(self) -> int:
        return self.eos[0]

    def __call__(self, text: bytes) -> list:
        return self.tokenizer.encode(text, add_bos=False, add_eos=False)


def expected_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes llguidance must see for a token: our piece, empty where it begins with 0xFF."""
    piece = tokenizer.token_piece(token_id, special=True)
    return b"" if piece[:1] == bytes([MARKER]) else piece


def is_special(tokenizer, token_id: int) -> bool:
    """Written only as special text: control and unknown tokens (never an unused, empty one)."""
    return tokenizer.token_piece(token_id, special=False) == b"" and tokenizer.token_piece(token_id) != b""


def end_ids(tokenizer) -> list:
    """Every token that ends generation, the tokenizer's EOS first (llguidance's main one)."""
    eos = tokenizer.eos_id
    return sorted(tokenizer.eog_ids, key=lambda t: (t != eos, t))


def shown_empty(token_id: int) -> bytes:
    """How llguidance writes a token with no bytes (one that is in no mask) when it decodes it."""
    return f"<[{token_id}]>".encode()


def handed_over(tokenizer, n_vocab: int | None = None) -> Vocabulary:
    """The vocabulary to hand to llguidance. n_vocab: the model's logits per row, when it has
    more than the tokenizer has tokens (the extra ids are empty: never allowed)."""
    n = tokenizer.n_vocab
    n_vocab = n if n_vocab is None else n_vocab
    if n_vocab < n:
        raise ValueError(f"the model has {n_vocab} logits for {n} tokens")
    if not tokenizer.eog_ids:
        raise LLTokenizerMismatch(f"{tokenizer.source}: the vocabulary has no end-of-generation token, which a "
                                  "grammar needs to end the text")
    tokens = [expected_bytes(tokenizer, i) for i in range(n)] + [b""] * (n_vocab - n)
    special = [i for i in range(n) if is_special(tokenizer, i)]
    return Vocabulary(tokens, special, end_ids(tokenizer), tokenizer.bos_id, tokenizer)


def build(vocab: Vocabulary) -> llguidance.LLTokenizer:
    """llguidance's tokenizer (its token trie and the slices that speed up masks) from `vocab`."""
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab), eos_token=list(vocab.eos))


def check_ll_tokenizer(ll: llguidance.LLTokenizer, tokenizer, n_vocab: int | None = None):
    """Raise LLTokenizerMismatch unless llguidance sees every token as our tokenizer writes it:
    the same bytes (expected_bytes), special exactly where ours is (is_special), the same end
    tokens, and no more ids than the model has logits."""
    n = tokenizer.n_vocab
    n_vocab = n if n_vocab is None else n_vocab
    where = f"llguidance's view of {tokenizer.source}"
    if ll.vocab_size != n_vocab:
        raise LLTokenizerMismatch(f"{where}: {ll.vocab_size} tokens for a model of {n_vocab} logits")
    if sorted(ll.eos_tokens) != sorted(tokenizer.eog_ids) or ll.eos_token != tokenizer.eos_id:
        raise LLTokenizerMismatch(f"{where}: end tokens {ll.eos_tokens} (main {ll.eos_token}), ours "
                                  f"{end_ids(tokenizer)} (EOS {tokenizer.eos_id})")
    for i in range(n_vocab):
        want = expected_bytes(tokenizer, i) if i < n else b""
        got = ll.decode_bytes([i])
        if got != (want or shown_empty(i)):
            raise LLTokenizerMismatch(f"{where}: token {i} is {bytes(got)!r} there, {want!r} here")
        special = i < n and is_special(tokenizer, i)
        if ll.is_special_token(i) != special:
            raise LLTokenizerMismatch(f"{where}: token {i} ({want!r}) is {'' if special else 'not '}special here, "
                                      f"{'not ' if special else ''}there")


_built: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()      # tokenizer -> {n_vocab: LLTokenizer}


def ll_tokenizer(tokenizer, n_vocab: int | None = None) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for ours, built once per tokenizer and model width, and checked
    (check_ll_tokenizer) before it is first used: a fraction of a second, a trie of the vocabulary."""
    n_vocab = tokenizer.n_vocab if n_vocab is None else n_vocab
    per = _built.setdefault(tokenizer, {})
    if n_vocab not in per:
        ll = build(handed_over(tokenizer, n_vocab))
        check_ll_tokenizer(ll, tokenizer, n_vocab)
        per[n_vocab] = ll
    return per[n_vocab]
