"""Planted bug: admission skips a waiting sequence that does not fit and admits those behind it."""
from app.serve.scheduler import HEADROOM_PAGES, Scheduler
from common.paged_kv import PageTable


class AdmitOrPreempt(Scheduler):
    def _admit(self):
        admitted = []
        for seq in list(self.waiting):
            group = [seq, *seq.followers]
            if len(self.running) + len(group) > self.max_batch:
                break
            table = PageTable(self.pool)
            room = min(len(seq.context) + HEADROOM_PAGES * self.pool.page_size,
                       len(seq.ask.prompt) + max(seq.ask.max_tokens, 1))
            n_cached = table.admit(seq.context, room, use_cache=not seq.scoring, spare=len(seq.followers))
            if n_cached is None:
                continue
            self.waiting.remove(seq)
            seq.table = table
            if seq.cached_tokens is None:
                seq.cached_tokens = min(n_cached, len(seq.ask.prompt))
            self.running.extend(group)
            admitted.extend(group)
        self.running.sort(key=lambda s: s.id)
        return admitted
