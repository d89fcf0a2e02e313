"""A correct admit-or-preempt written otherwise than the server's: the reservation tries each
sequence's pages in one loop that either plans it or preempts the newest, and admission asks a
helper whether the first waiting sequence gets its pages."""
from app.serve.scheduler import HEADROOM_PAGES, Scheduler
from common.paged_kv import PageTable


class AdmitOrPreempt(Scheduler):
    def _reserve(self, rows, may_preempt):
        planned, preempted = [], []
        for seq, n in sorted(rows, key=lambda rn: rn[0].id):
            while seq.table is not None:
                if seq.table.reserve_for(n):
                    planned.append((seq, n))
                    break
                if not may_preempt:
                    break
                victim = max((s for s in self.running if s.table is not None), key=lambda s: s.id)
                self._preempt(victim)
                preempted.append(victim)
        return planned, preempted

    def _admit(self):
        admitted = []
        for seq in list(self.waiting):
            group = [seq, *seq.followers]
            if len(self.running) + len(group) > self.max_batch or not self._pages_for(seq):
                break                                   # nobody overtakes the oldest waiting
            self.waiting.remove(seq)
            self.running.extend(group)
            admitted.extend(group)
        self.running.sort(key=lambda s: s.id)
        return admitted

    def _pages_for(self, seq) -> bool:
        """Give seq a page table with room for its context and HEADROOM_PAGES pages to grow into
        (never more than it can ever need), if the pool can promise it."""
        table = PageTable(self.pool)
        most = len(seq.ask.prompt) + max(seq.ask.max_tokens, 1)
        cached = table.admit(seq.context, min(most, len(seq.context) + HEADROOM_PAGES * self.pool.page_size),
                             use_cache=not seq.scoring, spare=len(seq.followers))
        if cached is None:
            return False
        seq.table = table
        if seq.cached_tokens is None:
            seq.cached_tokens = min(cached, len(seq.ask.prompt))
        return True
