"""The merge loop both BPE flavours share: repeatedly join the adjacent pair of symbols that
ranks best, until no adjacent pair ranks at all. SentencePiece ranks a pair by the score of the
vocabulary entry it forms (spm.py), byte-level BPE by the pair's rank in the merge list
(bpe.py); both break ties by taking the leftmost pair, as llama.cpp does.

A doubly linked list over the symbols and a heap of candidate pairs make it O(n log n): a pair
queued before one of its sides changed is skipped when it comes up.
"""

from __future__ import annotations

import heapq


def merge_pairs(symbols: list[str], rank) -> list[str]:
    """rank(left, right) -> a sortable key (lower merges first) or None if the pair never merges.
    Returns the symbols left, in order."""
    sym = list(symbols)                     # each symbol's text ('' once merged away)
    n = len(sym)
    if n == 0:
        return []
    prev = list(range(-1, n - 1))
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    heap = []

    def push_pair(left, right):
        if left >= 0 and right >= 0:
            key = rank(sym[left], sym[right])
            if key is not None:             # best key first; equal keys: leftmost first
                heapq.heappush(heap, (key, left, right, sym[left] + sym[right]))

    for i in range(1, n):
        push_pair(i - 1, i)
    while heap:
        _, left, right, merged = heapq.heappop(heap)
        if not sym[left] or not sym[right] or sym[left] + sym[right] != merged:
            continue                        # outdated: a side was merged elsewhere since
        sym[left] = merged
        sym[right] = ""
        nxt[left] = nxt[right]
        if nxt[left] >= 0:
            prev[nxt[left]] = left
        push_pair(prev[left], left)
        push_pair(left, nxt[left])
    return [s for s in sym if s]
