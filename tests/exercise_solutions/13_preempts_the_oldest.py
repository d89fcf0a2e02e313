"""Planted bug: when the pool is short, the OLDEST running sequence is preempted (it holds the
most pages), where the server preempts the newest."""
from app.serve.scheduler import Scheduler


class AdmitOrPreempt(Scheduler):
    def _reserve(self, rows, may_preempt):
        out, preempted = [], []
        for seq, n in sorted(rows, key=lambda rn: rn[0].id):
            while seq.table is not None and not seq.table.reserve_for(n) and may_preempt:
                oldest = min((s for s in self.running if s.table is not None), key=lambda s: s.id)
                self._preempt(oldest)
                preempted.append(oldest)
            if seq.table is not None and seq.table.reserve_for(n):
                out.append((seq, n))
        return out, preempted
