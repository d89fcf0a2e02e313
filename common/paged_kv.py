"""The paged KV cache: one pool of fixed-size pages shared by many sequences.

The single-sequence arena (stages/kv_cache.py) reserves K and V for every position of the
context up front: fine for one user, wasteful for many, since most sequences are short. Here
memory is cut into pages of PAGE_SIZE positions, each holding K and V of every layer:

    k, v   float32 [n_layer, n_pages, PAGE_SIZE, kv_dim]     page p = k[:, p], v[:, p]
    SmolLM2-135M: 2 x 30 x 16 x 192 x 4 bytes = 720 KiB per page

A sequence owns a page table (`PageTable`): position t lives in page table[t // PAGE_SIZE], slot
t % PAGE_SIZE. It takes a page when it grows into one and gives its pages back when it ends,
so the pool holds what the running sequences use, not what they might use.

Prefix sharing. A page whose PAGE_SIZE positions are all written holds K and V that depend
only on the tokens up to its end, so it is registered under (its parent's node, its tokens):
a later sequence whose prompt starts with the same full pages takes them by reference (a
reference count per page) instead of computing them again. Pages are read-only while shared:
a sequence that must write into a page someone else also references first copies it (copy on
write; it happens when a prompt is entirely cached and its last position is computed again for
its logits). A registered page nobody references any longer stays cached, counted as free,
and is reused, least recently released first, only when no never-used page is left.

Reservations: `PagePool.reserve(n)` succeeds only if n pages are free beyond what running
sequences have reserved, and a sequence takes pages only out of its own reservation, so no
sequence can take a page another one was promised. A sequence is admitted with what it needs
now (`PageTable.admit`) and asks for more before each step (`PageTable.reserve_for`); when the
pool cannot promise them, the scheduler (app/serve/scheduler.py) preempts a sequence.

Forks: `PageTable.fork` gives a second sequence every page of the first by reference, its
partial last page too (n choices of one prompt hold the prompt once); each copies a shared
page before writing into it, as above.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

PAGE_SIZE = 16


class PagesExhausted(RuntimeError):
    """A page was asked for beyond the reservations: a bug in the caller's accounting, never
    a user's error (admission control refuses what cannot fit)."""


class PagePool:
    """K/V pages for every layer, their reference counts and the cache of full prefix pages."""

    def __init__(self, n_layer: int, kv_dim: int, n_pages: int, page_size: int = PAGE_SIZE, dtype=np.float32):
        if n_pages < 1 or page_size < 1:
            raise ValueError(f"a page pool needs at least one page of at least one position "
                             f"(asked for {n_pages} pages of {page_size})")
        self.n_layer, self.kv_dim, self.n_pages, self.page_size = n_layer, kv_dim, n_pages, page_size
        # np.zeros: the OS hands out zeroed pages as they are first written, so an idle pool
        # costs address space, not resident memory
        self.k = np.zeros((n_layer, n_pages, page_size, kv_dim), dtype=dtype)     # dtype: the backend's kv_dtype
        self.v = np.zeros((n_layer, n_pages, page_size, kv_dim), dtype=dtype)
        self.refs = np.zeros(n_pages, dtype=np.int64)
        self._never_used = list(range(n_pages - 1, -1, -1))     # a stack: page 0 is handed out first
        self._idle_cached = OrderedDict()                       # page -> None, least recently released first
        self._nodes = {}                                        # (parent node, tokens) -> (node, page)
        self._node_of_page = {}                                 # page -> (key, node)
        self._next_node = 1                                     # node 0: the empty prefix
        self.reserved = 0
        self.copies = 0                                         # copy-on-write events, for the curious
        self.copied = []                                        # (src, dst) of the copies no step has taken yet

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def page_bytes(self) -> int:
        return self.nbytes // self.n_pages

    # ---- counting --------------------------------------------------------------------------
    @property
    def n_free(self) -> int:
        """Pages no sequence references (never used, or cached and idle)."""
        return len(self._never_used) + len(self._idle_cached)

    @property
    def n_cached(self) -> int:
        """Registered full prefix pages, referenced or idle."""
        return len(self._node_of_page)

    @property
    def n_shared(self) -> int:
        """Pages more than one sequence references right now."""
        return int((self.refs > 1).sum())

    def idle_cached_pages(self) -> list[int]:
        """Free pages that still hold a registered prefix (reused last)."""
        return list(self._idle_cached)

    @property
    def n_available(self) -> int:
        """Free pages not promised to an admitted sequence."""
        return self.n_free - self.reserved

    def reserve(self, n: int) -> bool:
        if n > self.n_available:
            return False
        self.reserved += n
        return True

    def unreserve(self, n: int):
        assert 0 <= n <= self.reserved, (n, self.reserved)
        self.reserved -= n

    # ---- pages -----------------------------------------------------------------------------
    def take(self) -> int:
        """A free page with reference count 1 (its old contents are garbage to be overwritten)."""
        if self._never_used:
            page = self._never_used.pop()
        elif self._idle_cached:
            page, _ = self._idle_cached.popitem(last=False)
            self._forget(page)
        else:
            raise PagesExhausted(f"all {self.n_pages} KV pages are in use")
        self.refs[page] = 1
        return page

    def share(self, page: int):
        if self.refs[page] == 0:
            self._idle_cached.pop(page)
        self.refs[page] += 1

    def release(self, page: int):
        assert self.refs[page] > 0, f"page {page} released more often than taken"
        self.refs[page] -= 1
        if self.refs[page] == 0:
            if page in self._node_of_page:
                self._idle_cached[page] = None
            else:
                self._never_used.append(page)

    def copy(self, src: int) -> int:
        """A private copy of page src (all layers, K and V)."""
        dst = self.take()
        self.copy_pages([(src, dst)])
        self.copies += 1
        self.copied.append((src, dst))
        return dst

    def copy_pages(self, pairs):
        """K and V of page src into page dst, for each (src, dst): the copies a step made, repeated by
        a process that holds another share of the same pages (the tp stage's other ranks)."""
        for src, dst in pairs:
            self.k[:, dst] = self.k[:, src]
            self.v[:, dst] = self.v[:, src]

    # ---- the prefix cache ------------------------------------------------------------------
    def lookup(self, parent: int, tokens: tuple) -> tuple[int, int] | None:
        """(node, page) registered for these page tokens after the prefix `parent`, or None."""
        return self._nodes.get((parent, tokens))

    def register(self, parent: int, tokens: tuple, page: int) -> int:
        """Record that `page` holds the K/V of `tokens` after prefix node `parent`; its node id.
        A prefix already registered (two sequences computed the same page) keeps the first."""
        key = (parent, tokens)
        if key in self._nodes:
            return self._nodes[key][0]
        if page in self._node_of_page:                       # a page holds one prefix at a time
            return self._node_of_page[page][1]
        node = self._next_node
        self._next_node += 1
        self._nodes[key] = (node, page)
        self._node_of_page[page] = (key, node)
        return node

    def unregister(self, page: int):
        """Take a page out of the prefix cache (its K/V are about to stop matching its key)."""
        if page in self._node_of_page:
            self._forget(page)

    def _forget(self, page: int):
        key, _ = self._node_of_page.pop(page)
        del self._nodes[key]        # its descendants become unreachable and age out the same way


class PageTable:
    """One sequence's pages: position t is page pages[t // page_size], slot t % page_size.

    `tokens` are the ids whose K/V are written (or about to be, in the current step); pages
    are registered in the prefix cache as they fill."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.pages: list[int] = []
        self.tokens: list[int] = []
        self.nodes: list[int] = []          # prefix node of each full, registered page
        self.reserved = 0                   # pages promised by admission, not yet taken

    def __len__(self) -> int:
        return len(self.tokens)

    @staticmethod
    def pages_for(n_positions: int, page_size: int = PAGE_SIZE) -> int:
        return -(-n_positions // page_size)

    def match_prefix(self, prompt) -> list[tuple[int, int]]:
        """(node, page) of the cached pages holding the K/V of the prompt's leading full pages."""
        P, parent, found = self.pool.page_size, 0, []
        for i in range(len(prompt) // P):
            hit = self.pool.lookup(parent, tuple(prompt[i * P:(i + 1) * P]))
            if hit is None:
                break
            parent = hit[0]
            found.append(hit)
        return found

    def admit(self, prompt, max_positions: int, use_cache: bool = True, spare: int = 0) -> int | None:
        """Take the cached prefix pages of `prompt` by reference and reserve every page the
        sequence needs to reach max_positions; None (and nothing taken) if the pool cannot
        promise them, and `spare` pages more beside them. Returns how many prompt positions need
        no computing: at most len(prompt) - 1, since the last one is always computed, for its
        logits (when the whole prompt is cached, that write lands in a shared page: one copy,
        reserved here too). use_cache=False takes nothing cached: every position is computed
        (a caller that wants every position's logits)."""
        assert not self.pages, "a sequence is admitted once"
        P, pool = self.pool.page_size, self.pool
        hits = self.match_prefix(prompt) if use_cache else []
        n_cached = min(len(hits) * P, len(prompt) - 1)
        copy = 1 if hits and n_cached < len(hits) * P else 0
        need = max(0, self.pages_for(max_positions, P) - len(hits)) + copy
        idle = sum(1 for _, page in hits if pool.refs[page] == 0)     # free now, not once shared
        if need + idle + spare > pool.n_available or not pool.reserve(need):
            return None
        for node, page in hits:
            pool.share(page)
            self.pages.append(page)
            self.nodes.append(node)
        self.reserved = need
        self.tokens = list(prompt[:n_cached])
        return n_cached

    def pages_to_append(self, n_new: int) -> int:
        """Pages that appending n_new tokens takes: new pages, and copies of the shared pages
        the new positions fall in."""
        P, pool = self.pool.page_size, self.pool
        start, end = len(self.tokens), len(self.tokens) + n_new
        grow = max(0, self.pages_for(end, P) - len(self.pages))
        copies = sum(1 for i in range(start // P, min(len(self.pages), self.pages_for(end, P)))
                     if pool.refs[self.pages[i]] > 1)
        return grow + copies

    def reserve_for(self, n_new: int) -> bool:
        """Make the reservation cover appending n_new tokens (the pages the next step takes);
        False, and nothing reserved, if the pool cannot promise them."""
        short = self.pages_to_append(n_new) - self.reserved
        if short <= 0:
            return True
        if not self.pool.reserve(short):
            return False
        self.reserved += short
        return True

    def fork(self) -> "PageTable":
        """A second sequence with this one's tokens: every page shared by reference (the
        partial last one too: whichever writes into it first copies it), nothing reserved."""
        other = PageTable(self.pool)
        for page in self.pages:
            self.pool.share(page)
        other.pages, other.tokens, other.nodes = list(self.pages), list(self.tokens), list(self.nodes)
        return other

    def append_slots(self, new_tokens) -> np.ndarray:
        """Make room for new_tokens at the next positions (taking pages, copying a shared one
        before writing into it); their flat slots in the pool (page * page_size + offset)."""
        P, pool = self.pool.page_size, self.pool
        start = len(self.tokens)
        end = start + len(new_tokens)
        while len(self.pages) * P < end:
            self._take_reserved()
            self.pages.append(pool.take())
        first = start // P
        for i in range(first, self.pages_for(end, P)):
            if pool.refs[self.pages[i]] > 1:              # shared: copy before writing
                self._take_reserved()
                src = self.pages[i]
                self.pages[i] = pool.copy(src)
                pool.release(src)
                del self.nodes[i:]                       # the copy is not registered
        self.tokens.extend(int(t) for t in new_tokens)
        pos = np.arange(start, end)
        return np.asarray(self.pages, dtype=np.int64)[pos // P] * P + pos % P

    def register_full_pages(self):
        """After a step has written K/V: register every newly full page in the prefix cache."""
        P = self.pool.page_size
        while len(self.nodes) < len(self.tokens) // P:
            i = len(self.nodes)
            parent = self.nodes[-1] if self.nodes else 0
            self.nodes.append(self.pool.register(parent, tuple(self.tokens[i * P:(i + 1) * P]), self.pages[i]))

    def truncate(self, n: int):
        """Forget positions n.. (speculative decoding: the guesses the model rejected). Pages past
        the new end go back to the pool and their promise back to this sequence's reservation, so
        it can grow into them again. A page that held a rejected token leaves the prefix cache
        unless another sequence shares it: its slots are about to be written with other tokens
        (a page still shared is copied before that, as append_slots does for any shared page).
        Call it before Batch.finish, so that no page full of rejected guesses is registered."""
        P, pool = self.pool.page_size, self.pool
        if not 0 <= n <= len(self.tokens):
            raise ValueError(f"cannot truncate a sequence of {len(self.tokens)} positions to {n}")
        if n == len(self.tokens):
            return
        keep = self.pages_for(n, P)
        for page in self.pages[keep:]:
            if pool.refs[page] == 1:
                pool.unregister(page)
            pool.release(page)
            if pool.reserve(1):                   # a page freed just now: always available
                self.reserved += 1
        del self.pages[keep:]
        if n % P and pool.refs[self.pages[-1]] == 1:
            pool.unregister(self.pages[-1])       # the partial last page: rejected slots in it
        del self.nodes[n // P:]
        del self.tokens[n:]

    def _take_reserved(self):
        if self.reserved <= 0:
            raise PagesExhausted("a sequence grew beyond the pages reserved for it")
        self.reserved -= 1
        self.pool.unreserve(1)

    def release(self):
        """Give every page back (and what is left of the reservation)."""
        for page in self.pages:
            self.pool.release(page)
        self.pool.unreserve(self.reserved)
        self.pages, self.nodes, self.tokens, self.reserved = [], [], [], 0
