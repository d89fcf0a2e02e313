"""Per-op profiles: where the time of a forward pass goes, one interface for every stage.

    prof = engine.backend.profiler(engine)      # the stage's own kind of profiler
    with prof:                                  # start() ... stop()
        generate(engine, prompt, 16)
    prof.rows()                                 # [{op, calls, total_ms, avg_us, share}], by time
    print(prof.table())                         # nvprof-style: share, total, calls, average, op

The CPU stages use `OpProfiler` (the default of Backend.profiler): while active, every op of
the backend is wrapped in a timer. Only top-level calls are timed: the attention composite's
own dot/softmax calls count as attention, swiglu's silu/mul as swiglu. Matmuls are split by
the weight they multiply (attn_q, ffn_down, output, ...). A stage that runs the whole layer
stack in one compiled call (Backend.fuses_layers) shows it as one op, `forward_layers`. What
the wrapped ops do not account for is "python overhead": the graph's own bookkeeping, the
generation loop, sampling on the host. The cuda stage times its kernels with CUDA events
instead (stages/cuda.py), behind the same interface.

The timers cost about a microsecond per call, so a profiled run is a little slower than a
timed one: profile to see the shares, benchmark (app/measure/bench.py) to get the figures.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict

OPS = ("matmul", "add", "mul", "rms_norm", "silu", "rope", "scale", "dot", "softmax", "argmax",
       "embed", "attention", "swiglu", "forward_layers", "forward_layers_batch")


def weight_group(name: str) -> str:
    """'blk.12.ffn_down.weight' -> 'ffn_down'; 'output.weight (tied...)' -> 'output'."""
    m = re.match(r"(?:blk\.\d+\.)?([a-z_]+)\.weight", name or "")
    return m.group(1) if m else "other"


class Profiler:
    """What every stage's profiler does; a context manager around start() and stop()."""

    def start(self):
        raise NotImplementedError

    def stop(self):
        raise NotImplementedError

    def rows(self) -> list[dict]:
        """[{op, calls, total_ms, avg_us, share}] by total time."""
        raise NotImplementedError

    def table(self, title: str = "") -> str:
        return format_table(self.rows(), title)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()


class OpProfiler(Profiler):
    """Every op of the engine's backend wrapped in a timer while active (see the module docstring)."""

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

    def start(self):
        for op in OPS:
            setattr(self.backend, op, self._wrap(op, getattr(self.backend, op)))
        self._t0 = time.perf_counter()

    def stop(self):
        self.wall += time.perf_counter() - self._t0
        for op in OPS:
            self.backend.__dict__.pop(op, None)          # back to the class's methods

    def rows(self) -> list[dict]:
        """By total time, python overhead last."""
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
