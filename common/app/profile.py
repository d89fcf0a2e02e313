"""Per-op profile of a CPU stage: where the time of a forward pass goes.

    from common.app.profile import OpProfiler
    with OpProfiler(engine) as prof:
        generate(engine, prompt, 16)
    print(prof.table())                 # nvprof-style: op, calls, total, average, share

While active, every op of the engine's backend is wrapped in a timer. Only top-level calls
are timed: the attention composite's own dot/softmax calls count as attention, swiglu's
silu/mul as swiglu. Matmuls are split by the weight they multiply (attn_q, ffn_down,
output, ...). What the wrapped ops do not account for is "python overhead": the graph's own
bookkeeping, the generation loop, sampling on the host.

The timers cost about a microsecond per call, so a profiled run is a little slower than a
timed one: profile to see the shares, benchmark (common/app/bench.py) to get the figures.
GPU stages keep their own profile (CUDA events, see stages/cuda.py).
"""

from __future__ import annotations

import re
import time
from collections import defaultdict

OPS = ("matmul", "add", "mul", "rms_norm", "silu", "rope", "scale", "dot", "softmax", "argmax",
       "embed", "attention", "swiglu")


def weight_group(name: str) -> str:
    """'blk.12.ffn_down.weight' -> 'ffn_down'; 'output.weight (tied...)' -> 'output'."""
    m = re.match(r"(?:blk\.\d+\.)?([a-z_]+)\.weight", name or "")
    return m.group(1) if m else "other"


class OpProfiler:
    def __init__(self, engine):
        self.engine = engine
        self.backend = engine.backend
        self.calls = defaultdict(int)
        self.seconds = defaultdict(float)
        self.wall = 0.0
        self._depth = 0
        self._t0 = None

    def _wrap(self, op, fn):
        names = self.engine.weight_names

        def timed(*args, **kw):
            if self._depth:
                return fn(*args, **kw)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                dt = time.perf_counter() - t0
                self._depth -= 1
                key = f"matmul {weight_group(names.get(id(args[1]), ''))}" if op == "matmul" else op
                self.calls[key] += 1
                self.seconds[key] += dt
        return timed

    def __enter__(self):
        for op in OPS:
            setattr(self.backend, op, self._wrap(op, getattr(self.backend, op)))
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall += time.perf_counter() - self._t0
        for op in OPS:
            self.backend.__dict__.pop(op, None)          # back to the class's methods

    def rows(self) -> list[dict]:
        """[{op, calls, total_ms, avg_us, share}] by total time, python overhead last."""
        total = self.wall or sum(self.seconds.values())
        rows = [{"op": k, "calls": self.calls[k], "total_ms": v * 1e3, "avg_us": v / self.calls[k] * 1e6,
                 "share": v / total if total else 0.0}
                for k, v in sorted(self.seconds.items(), key=lambda kv: -kv[1])]
        rest = max(0.0, total - sum(self.seconds.values()))
        rows.append({"op": "python overhead", "calls": 0, "total_ms": rest * 1e3, "avg_us": 0.0,
                     "share": rest / total if total else 0.0})
        return rows

    def table(self, title: str = "") -> str:
        return format_table(self.rows(), title or f"per-op profile ({self.backend.name})")


def format_table(rows: list[dict], title: str = "") -> str:
    lines = [title] if title else []
    lines.append(f"{'share':>7} {'total ms':>10} {'calls':>7} {'avg us':>9}  op")
    for r in rows:
        lines.append(f"{r['share'] * 100:6.1f}% {r['total_ms']:10.1f} {r['calls']:7d} "
                     f"{r['avg_us']:9.1f}  {r['op']}")
    return "\n".join(lines)
