"""One forward step for many sequences: how their new tokens are laid out as rows.

A step carries, for every sequence in it, the tokens its KV cache has not seen: one (the
newest sampled token) for a sequence that is decoding, a chunk of its prompt for one that is
being prefilled. They are stacked into the rows of one matrix, so each weight is read once
per step for all of them (M = rows in every matmul), while each row keeps its own position
and attends only to its own sequence's pages (common/paged_kv.py):

    tokens     int64 [M]            the rows' token ids; padding rows hold token 0
    positions  int64 [M]            each row's position in its own sequence (padding: 0)
    slots      int64 [M]            where its K/V go: page * page_size + offset (padding: -1)
    row_seq    int64 [M]            which segment (sequence) the row belongs to (padding: -1)
    tables     int64 [S, max pages] each segment's page table (unused entries: -1)
    seq_start  int64 [S]            position of each segment's first new row
    seq_rows   int64 [S]            its number of new rows
    logit_rows int64 [L]            rows whose logits the step returns (last row of a segment
                                    that asked for them; every row of one with all_logits, as
                                    speculative decoding's verification needs), in segment order
    copies     int64 [C, 2]         (src, dst) of the pages building the step copied (a sequence
                                    writes into a page it shares: copy on write), for a process
                                    that holds another share of the same pages (tp's other ranks)

Rows are padded to a multiple of the backend's `row_block` (common/backend.py says why: the
multi-row kernels must take every row down the same path, or a row's last bits would depend
on how many rows came with it). A sequence's numbers then never depend on its neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.paged_kv import PagePool, PageTable


@dataclass
class Segment:
    """A sequence's part of a step: `tokens` go at positions len(table).. of `table`; the
    logits of its last row (`logits`), or of every row (`all_logits`), come back."""
    table: PageTable
    tokens: list
    logits: bool = True
    all_logits: bool = False         # logits of every row, not only the last


def padded(n: int, block: int) -> int:
    return -(-n // block) * block


class Batch:
    """The row layout of one step (see the module docstring). Building it takes the pages the
    new tokens need (PageTable.append_slots), so build it only for a step that will run."""

    def __init__(self, pool: PagePool, segments: list[Segment], row_block: int = 1):
        if not segments or any(len(s.tokens) == 0 for s in segments):
            raise ValueError("a batch needs at least one segment, each with at least one token")
        self.pool, self.segments = pool, segments
        n = sum(len(s.tokens) for s in segments)
        M = padded(n, row_block)
        self.n_rows = n
        self.tokens = np.zeros(M, dtype=np.int64)
        self.positions = np.zeros(M, dtype=np.int64)
        self.slots = np.full(M, -1, dtype=np.int64)
        self.row_seq = np.full(M, -1, dtype=np.int64)
        self.seq_start = np.empty(len(segments), dtype=np.int64)
        self.seq_rows = np.empty(len(segments), dtype=np.int64)
        logit_rows, r = [], 0
        for i, s in enumerate(segments):
            start, m = len(s.table), len(s.tokens)
            self.slots[r:r + m] = s.table.append_slots(s.tokens)
            self.tokens[r:r + m] = s.tokens
            self.positions[r:r + m] = np.arange(start, start + m)
            self.row_seq[r:r + m] = i
            self.seq_start[i], self.seq_rows[i] = start, m
            if s.all_logits:
                logit_rows.extend(range(r, r + m))
            elif s.logits:
                logit_rows.append(r + m - 1)
            r += m
        width = max(len(s.table.pages) for s in segments)
        self.tables = np.full((len(segments), width), -1, dtype=np.int64)
        for i, s in enumerate(segments):
            self.tables[i, :len(s.table.pages)] = s.table.pages
        self.logit_rows = np.asarray(logit_rows, dtype=np.int64)
        self.row_block = row_block
        self.copies = np.asarray(pool.copied, dtype=np.int64).reshape(-1, 2)
        pool.copied.clear()

    @property
    def seq_len(self) -> np.ndarray:
        """Positions each segment's last row can see (its length after this step)."""
        return self.seq_start + self.seq_rows

    def seq_kv(self, layer: int, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Segment i's K and V of one layer, positions 0 .. seq_len-1, gathered through its
        page table into contiguous arrays [T, kv_dim] (the default attention reads these)."""
        T, P = int(self.seq_len[i]), self.pool.page_size
        pages = self.tables[i, :-(-T // P)]
        k = self.pool.k[layer, pages].reshape(-1, self.pool.kv_dim)[:T]
        v = self.pool.v[layer, pages].reshape(-1, self.pool.kv_dim)[:T]
        return k, v

    def finish(self):
        """After the step has written K/V: register the pages it filled in the prefix cache."""
        for s in self.segments:
            s.table.register_full_pages()
