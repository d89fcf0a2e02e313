"""Which cache the group kernels' software prefetch should fill, and how far ahead, on this machine:
repack's decode kernel over a matrix larger than the caches, once per choice, one thread and two
(app/measure/prefetch_bench.py says how; stages/kernels/repacked.py: GROUP_PREFETCH, the choice by
the CPU's maker).

    python scripts/bench_prefetch.py [--mib 128] [--rounds 9]

Writes profiles/bench/prefetch/MACHINE.json (MACHINE: app/measure/machine.py's machine_id) and the
page drawn from it beside it. A benchmark, not a test: a few minutes, on a quiet machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import app  # noqa: E402

app.configure_numba()

from app.measure.machine import machine_id  # noqa: E402
from app.measure.prefetch_bench import bench_prefetch  # noqa: E402
from app.report.pages import write_record  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=128, help="each matrix's size, larger than the caches "
                                                      "(default: %(default)s)")
    p.add_argument("--rounds", type=int, default=9, help="alternating rounds (default: %(default)s)")
    args = p.parse_args(argv)
    record = bench_prefetch(args.mib, args.rounds, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(write_record(record, ROOT / "profiles" / "bench" / "prefetch" / f"{machine_id(record['machine'])}.json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
