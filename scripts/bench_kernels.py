"""Decode kernel throughput per weight type, one core: the quantized stage's float kernels, the
int8 stage's named instructions and its loops (app/measure/kernel_bench.py says how).

    python scripts/bench_kernels.py [--model smollm2 --model tinyllama-synthetic] [--passes 5]

Writes profiles/bench/kernels.json and the page drawn from it, profiles/bench/kernels.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import app  # noqa: E402

app.configure_numba()

from app.measure.kernel_bench import bench_kernels  # noqa: E402
from app.report.pages import write_record  # noqa: E402

OUT = ROOT / "profiles" / "bench" / "kernels.json"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", help="model name or path (repeatable; default: smollm2, "
                                                    "tinyllama-synthetic)")
    p.add_argument("--passes", type=int, default=5, help="passes per group; the fastest counts (default: %(default)s)")
    args = p.parse_args(argv)
    record = bench_kernels(args.model or ["smollm2", "tinyllama-synthetic"], args.passes,
                           log=lambda m: print(m, file=sys.stderr, flush=True))
    print(write_record(record, OUT))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
