"""Byte-level BPE as llama.cpp runs it (tokenizer.ggml.model == "gpt2"): each pre-tokenized
word's UTF-8 bytes are spelled with GPT-2's printable byte alphabet ("Ġ" is a space) and merged
by rank, lowest rank first."""

from __future__ import annotations

from common.tokenizer.merges import merge_pairs

# ---- GPT-2's byte alphabet: every byte gets a printable stand-in character ---------------------

def _byte_alphabet() -> list[str]:
    """byte -> character. Printable Latin-1 bytes stand for themselves; the other 68 bytes, in
    increasing order, take U+0100, U+0101, ... (so ' ' is 'Ġ' and '\\n' is 'Ċ')."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(0x100 + extra)
            extra += 1
    return [table[b] for b in range(256)]


BYTE_TO_CHAR = _byte_alphabet()
CHAR_TO_BYTE = {c: b for b, c in enumerate(BYTE_TO_CHAR)}
# latin-1 code point (= byte value) -> stand-in, for str.translate
_BYTE_ENCODE_TABLE = {b: c for b, c in enumerate(BYTE_TO_CHAR)}


def byte_encode(word: str) -> str:
    """A word's UTF-8 bytes spelled in the byte alphabet ("a b" -> "aĠb")."""
    return word.encode("utf-8").decode("latin-1").translate(_BYTE_ENCODE_TABLE)


def raw_bytes(s: str) -> bytes:
    """A vocabulary string back to the bytes the GGUF held (it was decoded with surrogateescape)."""
    return s.encode("utf-8", "surrogateescape")


def bpe_word(word: str, ids: dict, ranks: dict, ignore_merges: bool) -> tuple:
    """Token ids of one pre-tokenized word spelled in the byte alphabet: merge adjacent pairs by
    their rank in the merge list, lowest first. ignore_merges: a word that is already a token is
    that token. A leftover symbol not in the vocabulary becomes its one-byte tokens."""
    if ignore_merges and word in ids:
        return (ids[word],)
    result = []
    for s in merge_pairs(list(word), lambda left, right: ranks.get((left, right))):
        token_id = ids.get(s)
        if token_id is not None:
            result.append(token_id)
        else:
            # not in the vocabulary: each UTF-8 byte as a one-byte token, where one exists
            for b in s.encode("utf-8"):
                token_id = ids.get(bytes([b]).decode("utf-8", "surrogateescape"))
                if token_id is not None:
                    result.append(token_id)
    return tuple(result)
