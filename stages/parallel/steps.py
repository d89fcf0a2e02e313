"""A step of many sequences (common/batch.py) as rank 0 sends it to the other ranks: int64 words.

A server runs its scheduler on rank 0 alone: there it admits, preempts and builds each step's
Batch; every rank must then run that same step over its own KV heads, whose pages sit in a pool
of its own, laid out as rank 0's (page p holds the same positions on every rank). What a rank
needs of a step is all integers: the rows' tokens, positions, slots and sequences, each
sequence's page table, first position and length, the rows whose logits are wanted, and the page
copies building the step made (a sequence about to write into a page it shares copies it first,
and every rank holds its share of that page). They travel as one array of words,

    header (HEADER) | tokens positions slots row_seq [M each] | tables [S x W] | seq_start seq_rows [S each]
                    | logit_rows [L] | copies [C x 2]

in one broadcast of HEAD_WORDS words (the header and as much of the rest as fits: a decode step
of a few dozen sequences fits whole) and, for a longer step (a long prompt's chunk), a second
with the rest. `Step` is the array read back: the fields of a Batch that the layers read.
"""

from __future__ import annotations

import numpy as np

HEADER = ("kind", "rows", "n_rows", "row_block", "seqs", "width", "logits", "copies", "n_pages", "page_size")
RUN, END = 1, 0                     # kind: a step to run; no more steps
HEAD_WORDS = 1024                   # words of the first broadcast (8 KiB)


def pack(batch) -> np.ndarray:
    """A Batch as words."""
    M, (S, W) = len(batch.tokens), batch.tables.shape
    head = [RUN, M, batch.n_rows, batch.row_block, S, W, len(batch.logit_rows), len(batch.copies),
            batch.pool.n_pages, batch.pool.page_size]
    return np.concatenate([np.array(head, np.int64), batch.tokens, batch.positions, batch.slots, batch.row_seq,
                           batch.tables.reshape(-1), batch.seq_start, batch.seq_rows, batch.logit_rows,
                           batch.copies.reshape(-1)]).astype(np.int64)


def end() -> np.ndarray:
    """The words that say there are no more steps."""
    return np.array([END] + [0] * (len(HEADER) - 1), np.int64)


def length(words: np.ndarray) -> int:
    """Words of the whole step, read from its header."""
    h = dict(zip(HEADER, words[:len(HEADER)].tolist()))
    return len(HEADER) + 4 * h["rows"] + h["seqs"] * (h["width"] + 2) + h["logits"] + 2 * h["copies"]


class Step:
    """A step read back from its words, on a rank other than 0: the Batch fields the layers read,
    over this rank's pool (`pool`, made by the caller from n_pages and page_size)."""

    def __init__(self, words: np.ndarray, pool):
        h = dict(zip(HEADER, words[:len(HEADER)].tolist()))
        M, S, W = h["rows"], h["seqs"], h["width"]
        fields = [("tokens", M), ("positions", M), ("slots", M), ("row_seq", M), ("tables", S * W),
                  ("seq_start", S), ("seq_rows", S), ("logit_rows", h["logits"]), ("copies", 2 * h["copies"])]
        at = len(HEADER)
        for name, n in fields:
            setattr(self, name, words[at:at + n])
            at += n
        self.tables = self.tables.reshape(S, W)
        self.copies = self.copies.reshape(-1, 2)
        self.n_rows, self.row_block, self.pool = h["n_rows"], h["row_block"], pool

    @property
    def seq_len(self) -> np.ndarray:
        return self.seq_start + self.seq_rows


def geometry(words: np.ndarray) -> tuple[int, int] | None:
    """(n_pages, page_size) of the pool a step runs over, or None if the words say the steps end."""
    h = dict(zip(HEADER, words[:len(HEADER)].tolist()))
    return None if h["kind"] == END else (h["n_pages"], h["page_size"])
