"""SentencePiece BPE as llama.cpp runs it (tokenizer.ggml.model == "llama"): spaces are "▁",
the text is split into characters, and the adjacent pair whose concatenation is the
highest-scoring vocabulary entry is merged, again and again."""

from __future__ import annotations

from common.tokenizer.merges import merge_pairs

SPACE_MARK = "\u2581"          # "▁": SentencePiece's visible space


def spm_merge(text: str, ids: dict, scores: list) -> list[str]:
    """The symbols left when no adjacent pair forms a vocabulary entry any more, in order: the
    pair whose entry scores highest merges first. A symbol that is not in the vocabulary (a
    character it lacks) is the caller's to spell in byte tokens."""
    def rank(left, right):
        token_id = ids.get(left + right)
        return None if token_id is None else -scores[token_id]
    return merge_pairs(list(text), rank)
