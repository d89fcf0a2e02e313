"""The paged KV cache (common/paged_kv.py) and attention through it.

Pages: taken as a sequence grows, given back when it ends, shared by reference between
sequences with the same full prefix pages, copied before a shared page is written, cached
pages reused least recently released first and only when no never-used page is left, and an
admission that cannot be promised its pages takes nothing. Attention through page tables
(scattered pages, many sequences in one call) gives each row the bits the single-sequence
kernel gives it over contiguous K/V, for the base composite and the threads stage's kernel.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

from common.batch import Batch, Segment
from common.paged_kv import PagePool, PagesExhausted, PageTable
from stages import backend_class
from stages.kernels.threaded import attention_paged_parallel, attention_parallel
from tests.util import attention_numpy, cpu_stages, thread_counts

P = 4                                    # positions per page: small, so a few tokens span pages


def pool(n_pages=8, n_layer=2, kv_dim=6):
    return PagePool(n_layer, kv_dim, n_pages, page_size=P)


def admitted(p, prompt, max_positions=None):
    t = PageTable(p)
    n = t.admit(prompt, max_positions or len(prompt) + 4)
    assert n is not None
    return t, n


def write(table, tokens, value=None):
    """Append tokens and write recognisable K/V (the token id) into their slots, as a step would."""
    slots = table.append_slots(tokens)
    for layer in range(table.pool.n_layer):
        table.pool.k[layer].reshape(-1, table.pool.kv_dim)[slots] = np.asarray(tokens)[:, None] + 1000 * layer
        table.pool.v[layer].reshape(-1, table.pool.kv_dim)[slots] = -np.asarray(tokens)[:, None]
    table.register_full_pages()
    return slots


def test_pages_taken_as_a_sequence_grows_and_returned_when_it_ends():
    p = pool()
    t, n = admitted(p, [5, 6, 7], max_positions=10)        # 3 pages may be needed
    assert n == 0 and p.reserved == 3 and p.n_available == 5
    slots = write(t, [5, 6, 7])
    assert len(t.pages) == 1 and p.n_free == 7 and slots.tolist() == [t.pages[0] * P + i for i in range(3)]
    write(t, [8, 9])                                         # crosses into a second page
    assert len(t.pages) == 2 and p.n_free == 6 and p.reserved == 1
    assert t.pages[0] != t.pages[1]
    t.release()
    assert p.n_free == 8 and p.reserved == 0 and (p.refs == 0).all()


def test_a_sequence_cannot_grow_past_its_reservation():
    p = pool()
    t, _ = admitted(p, [1, 2], max_positions=P)              # one page promised
    write(t, [1, 2, 3, 4])
    with pytest.raises(PagesExhausted):
        t.append_slots([5])


def test_admission_is_refused_whole_when_the_pages_cannot_be_promised():
    p = pool(n_pages=4)
    a, _ = admitted(p, [1, 2, 3], max_positions=3 * P)       # 3 of the 4 pages promised
    b = PageTable(p)
    assert b.admit([9, 9, 9, 9, 9], 2 * P) is None           # needs 2, only 1 can be promised
    assert b.pages == [] and p.reserved == 3
    assert b.admit([9], P) == 0                               # 1 fits
    a.release()
    b.release()
    assert p.n_free == 4 and p.reserved == 0


def test_sequences_with_the_same_prefix_share_its_full_pages():
    p = pool(n_pages=16)
    prompt = list(range(10, 20))                              # 10 tokens: 2 full pages of 4, 2 more
    a, _ = admitted(p, prompt)
    write(a, prompt)
    assert p.n_cached == 2
    b, n = admitted(p, prompt + [99])
    assert n == 2 * P                                         # the 2 full pages need no computing
    assert b.pages == a.pages[:2] and p.n_shared == 2 and (p.refs[a.pages[:2]] == 2).all()
    write(b, (prompt + [99])[n:])
    assert b.pages[2] != a.pages[2]                           # its own page from position 8 on
    assert p.n_free == 16 - 3 - 1                              # a: 3 pages; b: 1 of its own
    k = p.k[1, b.pages[:2]].reshape(-1, p.kv_dim)[:, 0]
    assert k.tolist() == [t + 1000 for t in prompt[:8]]       # b reads a's K/V through its table
    a.release()
    assert p.n_shared == 0 and (p.refs[b.pages[:2]] == 1).all()
    b.release()
    assert p.n_free == 16


def test_a_shared_page_is_copied_before_it_is_written():
    """A prompt entirely cached: its last position is computed again (for its logits), which
    writes into the last shared page, so that page is copied first and the owner's stays intact."""
    p = pool(n_pages=16)
    prompt = list(range(30, 38))                              # exactly 2 full pages
    a, _ = admitted(p, prompt)
    write(a, prompt)
    b, n = admitted(p, prompt, max_positions=len(prompt) + 4)
    assert n == len(prompt) - 1 and b.pages == a.pages and b.reserved == 2   # 1 page to grow + 1 copy
    write(b, [777])                                           # position 7: in the shared page 1
    assert p.copies == 1 and b.pages[0] == a.pages[0] and b.pages[1] != a.pages[1]
    k_a = p.k[0, a.pages[1], :, 0].tolist()
    k_b = p.k[0, b.pages[1], :, 0].tolist()
    assert k_a == [34, 35, 36, 37] and k_b == [34, 35, 36, 777]
    a.release()
    b.release()
    assert p.n_free == 16 and p.reserved == 0


def test_cached_pages_are_reused_last_and_least_recently_released_first():
    p = pool(n_pages=4)
    a, _ = admitted(p, [1, 2, 3, 4], max_positions=P)
    write(a, [1, 2, 3, 4])
    b, _ = admitted(p, [5, 6, 7, 8], max_positions=P)
    write(b, [5, 6, 7, 8])
    first, second = a.pages[0], b.pages[0]
    a.release()
    b.release()
    assert p.n_free == 4 and p.n_cached == 2
    c, _ = admitted(p, [9], max_positions=2 * P)
    write(c, [9, 9, 9, 9, 9])                                 # 2 never-used pages first
    assert first not in c.pages and second not in c.pages and p.n_cached == 3
    d, _ = admitted(p, [8], max_positions=P)
    write(d, [8])                                             # now the least recently released
    assert d.pages == [first] and p.n_cached == 2
    e = PageTable(p)
    assert e.match_prefix([1, 2, 3, 4]) == []                 # its prefix is forgotten
    assert len(e.match_prefix([5, 6, 7, 8])) == 1             # the other one still cached


# ---- attention through pages ---------------------------------------------------------------------

def scattered_batch(rng, n_head_kv, hd, layouts, n_pages=40, n_layer=2):
    """A pool with sequences of the given (cached, new) lengths in shuffled pages, their K/V
    random; the Batch of their new rows, and each sequence's contiguous K/V per layer."""
    p = PagePool(n_layer, n_head_kv * hd, n_pages, page_size=P)
    taken = [p.take() for _ in range(n_pages)]
    for page in rng.permutation(taken).tolist():              # handed out again in a random order
        p.release(page)
    segments, tables = [], []
    for cached, new in layouts:
        t = PageTable(p)
        assert t.admit(list(range(cached + new)), cached + new) is not None
        if cached:
            t.append_slots(list(range(cached)))
        segments.append(Segment(t, list(range(cached, cached + new))))
        tables.append(t)
    batch = Batch(p, segments, row_block=4)
    p.k[:] = rng.standard_normal(p.k.shape).astype(np.float32)
    p.v[:] = rng.standard_normal(p.v.shape).astype(np.float32)
    return batch


@pytest.mark.parametrize("n_head,n_kv,hd", [(9, 3, 64), (4, 4, 16)])
def test_paged_attention_kernel_gives_each_row_its_single_sequence_bits(n_head, n_kv, hd):
    """Three sequences (decode rows at long contexts, a prefill chunk after a cached prefix, a
    fresh prompt) in one call, pages shuffled: every row equals attention_parallel over that
    sequence's contiguous K/V, bit for bit, on 1 thread and on all; padding rows are 0."""
    rng = np.random.default_rng(n_head)
    batch = scattered_batch(rng, n_kv, hd, [(37, 1), (9, 6), (0, 5)])
    layer, scale = 1, np.float32(1.0 / np.sqrt(hd))
    M = len(batch.tokens)
    assert batch.n_rows == 12 and M % 4 == 0
    q = rng.standard_normal((M, n_head * hd)).astype(np.float32)
    results = []
    for threads in thread_counts():
        numba.set_num_threads(threads)
        results.append(attention_paged_parallel(q, batch.pool.k[layer], batch.pool.v[layer], batch.tables,
                                                batch.row_seq, batch.positions, batch.n_rows, n_head, n_kv, scale))
    assert all(np.array_equal(r, results[0]) for r in results)
    got, r = results[0], 0
    for i, m in enumerate(batch.seq_rows.tolist()):
        k, v = batch.seq_kv(layer, i)
        start = int(batch.seq_start[i])
        want = attention_parallel(q[r:r + m], np.ascontiguousarray(k), np.ascontiguousarray(v), n_head, n_kv,
                                  start, scale)
        assert np.array_equal(got[r:r + m], want), f"sequence {i}"
        np.testing.assert_allclose(got[r:r + m], attention_numpy(q[r:r + m], k, v, n_head, n_kv, start),
                                   rtol=1e-4, atol=1e-5)
        r += m
    assert not got[batch.n_rows:].any()


@pytest.mark.parametrize("stage", [s for s in cpu_stages() if backend_class(s)().new_kv_cache(1, 1, 1) is not None])
def test_every_kv_stage_attends_through_pages_as_over_its_own_cache(stage):
    """attention_paged (the stage's own, or the base composite) stores the new rows' K/V in
    their slots and gives every row what the stage's attention gives it over that sequence's
    contiguous K/V, bit for bit."""
    rng = np.random.default_rng(7)
    n_head, n_kv, hd = 6, 2, 16
    batch = scattered_batch(rng, n_kv, hd, [(21, 1), (3, 4), (0, 2)])
    b = backend_class(stage)()
    M, layer = len(batch.tokens), 0
    q = rng.standard_normal((M, n_head * hd)).astype(np.float32)
    k_new = rng.standard_normal((M, n_kv * hd)).astype(np.float32)
    v_new = rng.standard_normal((M, n_kv * hd)).astype(np.float32)
    got = b.to_host(b.attention_paged(q, k_new, v_new, n_head, n_kv, layer, batch))
    r = 0
    for i, m in enumerate(batch.seq_rows.tolist()):
        k, v = batch.seq_kv(layer, i)
        assert np.array_equal(k[-m:], k_new[r:r + m]) and np.array_equal(v[-m:], v_new[r:r + m])
        want = b.to_host(b.attention(q[r:r + m], np.ascontiguousarray(k), np.ascontiguousarray(v), n_head, n_kv,
                                     int(batch.seq_start[i])))
        assert np.array_equal(got[r:r + m], want), f"{stage}: sequence {i}"
        r += m


# ---- the prefix cache's keys, its idle pages, its duplicates; forks; growing -------------------

class KeyIgnoresTokens(PagePool):
    """A planted bug: pages registered and looked up by (parent, how many tokens) alone."""

    def lookup(self, parent, tokens):
        return super().lookup(parent, len(tokens))

    def register(self, parent, tokens, page):
        return super().register(parent, len(tokens), page)


def false_sharing(pool_cls) -> list[str]:
    """Two prompts of the same length, the same first page, different second pages: the second
    shares the first page only, and each reads its own tokens back."""
    p = pool_cls(2, 6, 16, page_size=P)
    one = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    two = [1, 2, 3, 4, 50, 60, 70, 80, 9]
    a, _ = admitted(p, one)
    write(a, one)
    b, n = admitted(p, two)
    problems = []
    if n != P:
        problems.append(f"{n} positions of the second prompt taken from the cache, not {P}")
    write(b, two[n:])
    if b.pages[1] == a.pages[1]:
        problems.append("the second pages are one page")
    for t, prompt in ((a, one), (b, two)):
        k = p.k[0, t.pages].reshape(-1, p.kv_dim)[:len(prompt), 0]
        if k.tolist() != prompt:
            problems.append(f"a sequence reads {k.tolist()} for its prompt {prompt}")
    a.release()
    b.release()
    return problems


def test_prompts_of_equal_length_share_only_the_pages_whose_tokens_match():
    assert false_sharing(PagePool) == []
    assert false_sharing(KeyIgnoresTokens) != [], "the planted key that ignores tokens is seen"


class IdleBlindTable(PageTable):
    """A planted bug: admission that counts the cached pages it takes as still free."""

    def admit(self, prompt, max_positions, use_cache=True, spare=0):
        hits = self.match_prefix(prompt)
        for _, page in hits:                              # as if nobody's pages were idle
            self.pool.refs[page] += 1
        try:
            return super().admit(prompt, max_positions, use_cache, spare)
        finally:
            for _, page in hits:
                self.pool.refs[page] -= 1


def idle_admission(table_cls) -> list[str]:
    """Pool of 4. A prompt of 2 full pages is written and released: its pages are free but
    cached. Another sequence reserves 2 pages. A third whose prompt is the cached one and needs
    1 page more must be refused (taking the 2 cached pages leaves 0 free for the 1 it needs
    beside the 2 promised); admitted anyway, its growth would find no page."""
    p = pool(n_pages=4)
    prompt = list(range(8))
    a, _ = admitted(p, prompt, max_positions=8)
    write(a, prompt)
    a.release()
    other, _ = admitted(p, [99], max_positions=2 * P)
    c = table_cls(p)
    got = c.admit(prompt + [100], 3 * P)
    problems = []
    if got is not None:
        try:
            write(c, [100] * 5)
            write(other, [99] * 8)
        except PagesExhausted as e:
            problems.append(f"admitted, then: {e}")
    return problems


def test_admission_counts_the_cached_pages_nobody_holds_as_taken():
    assert idle_admission(PageTable) == []
    assert idle_admission(IdleBlindTable) != [], "the planted admission that forgets idle pages is seen"
    p = pool(n_pages=5)                                    # and with one page more, it fits
    prompt = list(range(8))
    a, _ = admitted(p, prompt, max_positions=8)
    write(a, prompt)
    a.release()
    admitted(p, [99], max_positions=2 * P)
    assert PageTable(p).admit(prompt + [100], 3 * P) == 2 * P


class RegisterOverwrites(PagePool):
    """A planted bug: register without its duplicate checks (the last page registered wins)."""

    def register(self, parent, tokens, page):
        key = (parent, tokens)
        node = self._next_node
        self._next_node += 1
        self._nodes[key] = (node, page)
        self._node_of_page[page] = (key, node)
        return node


def duplicate_registration(pool_cls) -> list[str]:
    """Two sequences compute the same first page in one step (admitted together, before either
    registered it): the first registered keeps the prefix, the second's page stays its own and
    goes back unregistered; a page holds one prefix at a time."""
    p = pool_cls(2, 6, 8, page_size=P)
    prompt = [1, 2, 3, 4, 5]
    a, b = PageTable(p), PageTable(p)
    assert a.admit(prompt, 8) == 0 and b.admit(prompt, 8) == 0
    a.append_slots(prompt)
    b.append_slots(prompt)
    a.register_full_pages()
    b.register_full_pages()
    problems = []
    hit = PageTable(p).match_prefix(prompt)
    if [page for _, page in hit] != [a.pages[0]]:
        problems.append(f"the prefix points at {hit}, not the first sequence's page")
    if a.nodes != b.nodes:
        problems.append("the two sequences know the prefix under different nodes")
    if p.n_cached != 1:
        problems.append(f"{p.n_cached} pages cached for one prefix")
    if p.register(0, (9, 9, 9, 9), a.pages[0]) != a.nodes[0] or p.lookup(0, (9, 9, 9, 9)) is not None:
        problems.append("a cached page took a second prefix")
    a.release()
    b.release()
    if p.n_free != 8 or len(p.idle_cached_pages()) != 1:
        problems.append(f"after both: {p.n_free} free, {len(p.idle_cached_pages())} cached")
    return problems


def test_register_keeps_the_first_of_two_equal_prefixes_and_one_prefix_per_page():
    assert duplicate_registration(PagePool) == []
    assert duplicate_registration(RegisterOverwrites) != [], "the planted register without its checks is seen"


def test_a_fork_shares_every_page_and_copies_the_partial_one_before_writing():
    p = pool(n_pages=8)
    prompt = [1, 2, 3, 4, 5, 6]                           # a full page and a partial one
    a, _ = admitted(p, prompt)
    write(a, prompt)
    b = a.fork()
    assert b.pages == a.pages and (p.refs[a.pages] == 2).all() and p.n_free == 6
    assert b.reserve_for(1) and b.reserved == 1           # the copy of the shared partial page
    write(b, [70])
    write(a, [7])
    assert b.pages[0] == a.pages[0] and b.pages[1] != a.pages[1] and p.copies == 1
    assert p.k[0, a.pages[1], :3, 0].tolist() == [5, 6, 7] and p.k[0, b.pages[1], :3, 0].tolist() == [5, 6, 70]
    a.release()
    b.release()
    assert p.n_free == 8 and p.reserved == 0 and (p.refs == 0).all()


def test_reserve_for_promises_the_next_steps_pages_or_nothing():
    p = pool(n_pages=3)
    a, _ = admitted(p, [1, 2, 3], max_positions=P)        # 1 page promised
    assert a.pages_to_append(P + 1) == 2 and a.reserve_for(P + 1) and a.reserved == 2
    b = PageTable(p)
    assert b.admit([5], P) == 0                            # the last page
    assert not a.reserve_for(2 * P + 1) and a.reserved == 2 and p.reserved == 3, "refused whole"
    write(a, list(range(P + 1)))
    assert len(a.pages) == 2 and a.reserved == 0
    a.release()
    b.release()
    assert p.n_free == 3 and p.reserved == 0
