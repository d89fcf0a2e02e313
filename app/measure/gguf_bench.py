"""How long does it take to open a GGUF model, and what does touching its weights cost?

    python -m app bench gguf [-m MODEL] [--runs 7] [--gguf-py-runs 3] [--out PATH]

For our reader (common.gguf.GGUFFile) and gguf-py's GGUFReader, in the same process:

  open    open + mmap + parse the header, metadata and tensor table. Ours also reports the
          bare open + mmap alone ("map"), so parse = open - map.
  touch   read one byte of every 4 KiB page of every tensor, through the reader's own views.
          Nothing is mapped until touched; each fault maps a run of cached pages at once
          (fault-around), so expect far fewer faults than pages. Faults come from getrusage:
          minor if the page was in the page cache, major if the fault waited for the disk.

"cold-ish" is the first run after asking the kernel to drop the file from the page cache
(posix_fadvise DONTNEED: advisory, no root needed; pages another process has mapped, say a
running engine, stay cached). Readahead brings most pages in before they are faulted on, so
even a truly cold run shows few major faults: the touch time tells cold from warm better.
"warm" is the median of the runs after it. Results go to
profiles/bench/gguf_open.json (machine, versions, every figure) and are printed.
"""

from __future__ import annotations

import gc
import mmap
import os
import resource
import statistics
import time
from pathlib import Path

import numpy as np

from app import ROOT
from app.measure.machine import versions
from app.measure.protocol import BENCH_DIR, add_options, header
from app.models import resolve
from common.generate import ParameterError
from common.gguf import GGUFFile

PAGE = 4096


def _faults() -> tuple[int, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt, r.ru_majflt


def drop_from_page_cache(path: Path) -> None:
    """Ask the kernel to forget the file's cached pages (clean pages no one maps go)."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def touch_pages(arrays) -> int:
    """Read one byte per page of each uint8 view; returns a checksum so nothing is optimized away."""
    total = 0
    for a in arrays:
        total += int(a[::PAGE].sum(dtype=np.uint64))
    return total


def measure(open_fn, views_fn, path: Path, cold: bool) -> dict:
    """One run: open, then touch every tensor page; times and page faults of each phase."""
    gc.collect()        # the previous run's garbage (gguf-py's: ~300k small arrays) is not ours to time
    if cold:
        drop_from_page_cache(path)
    f0 = _faults()
    t0 = time.perf_counter()
    reader = open_fn(path)
    t1 = time.perf_counter()
    f1 = _faults()
    views = views_fn(reader)
    t2 = time.perf_counter()
    checksum = touch_pages(views)
    t3 = time.perf_counter()
    f2 = _faults()
    return {"open_s": t1 - t0, "open_minor_faults": f1[0] - f0[0], "open_major_faults": f1[1] - f0[1],
            "touch_s": t3 - t2, "touch_minor_faults": f2[0] - f1[0], "touch_major_faults": f2[1] - f1[1],
            "touched_bytes": sum(v.nbytes for v in views), "checksum": checksum}


def map_only(path: Path) -> float:
    """open + mmap + close with no parsing: the floor under any mmap-based reader."""
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    m.close()
    return time.perf_counter() - t0


def ours_open(path):
    return GGUFFile(path)


def ours_views(g):
    return [t.data for t in g.tensors.values()]


def gguf_py_open(path):
    from gguf import GGUFReader
    return GGUFReader(path)


def gguf_py_views(r):
    # gguf-py hands out typed memmaps (float32, float16, or uint8 blocks); look at them as bytes
    return [np.asarray(t.data).reshape(-1).view(np.uint8) for t in r.tensors]


def series(open_fn, views_fn, path: Path, runs: int) -> dict:
    cold = measure(open_fn, views_fn, path, cold=True)
    warm = [measure(open_fn, views_fn, path, cold=False) for _ in range(max(1, runs - 1))]
    med = {k: statistics.median(r[k] for r in warm) for k in warm[0] if k != "checksum"}
    return {"cold_ish": cold, "warm_median": med, "warm_runs": warm}


def add_arguments(p):
    add_options(p, out=BENCH_DIR / "gguf_open.json")
    p.add_argument("--runs", type=int, default=7, help="runs of our reader (first cold-ish, rest warm)")
    p.add_argument("--gguf-py-runs", type=int, default=3, help="runs of gguf-py (0 to skip; ~5 s each)")


def records(args):
    args.model = resolve(args.model)
    if not args.model.exists():
        raise ParameterError(f"no model at {args.model}: run `make model`")

    ours = series(ours_open, ours_views, args.model, args.runs)
    map_s = statistics.median(map_only(args.model) for _ in range(max(1, args.runs)))
    ours["warm_median"]["map_s"] = map_s
    ours["warm_median"]["parse_s"] = ours["warm_median"]["open_s"] - map_s
    with GGUFFile(args.model) as g:
        model = {"path": os.path.relpath(args.model, ROOT), "file_size": g.file_size, "version": g.version,
                 "metadata_keys": len(g.metadata), "tensors": len(g.tensors),
                 "tensor_bytes": sum(t.nbytes for t in g.tensors.values())}

    result = {"kind": "gguf_open", "benchmark": "gguf_open", "model": model, "versions": versions("numpy", "gguf"),
              "page_size": PAGE, "ours": ours, **header(command=args.command_line)}
    if args.gguf_py_runs > 0:
        theirs = series(gguf_py_open, gguf_py_views, args.model, args.gguf_py_runs)
        result["gguf_py"] = theirs
        if theirs["cold_ish"]["checksum"] != ours["cold_ish"]["checksum"]:
            raise RuntimeError("the two readers touched different bytes")
        result["open_speedup_warm"] = theirs["warm_median"]["open_s"] / ours["warm_median"]["open_s"]

    mi = result["machine"]
    print(f"{model['path']}: {model['file_size'] / 2**20:.1f} MiB, {model['tensors']} tensors, "
          f"{model['metadata_keys']} metadata keys")
    print(f"machine: {mi['cpu']}, {mi['logical_cpus']} logical CPUs; numpy {result['versions'].get('numpy')}, "
          f"gguf-py {result['versions'].get('gguf', 'absent')}")
    print(f"{'':24}{'open ms':>10}{'faults':>14}{'touch ms':>10}{'minor':>8}{'major':>8}")
    rows = [("ours", ours)] + ([("gguf-py", result["gguf_py"])] if "gguf_py" in result else [])
    for name, s in rows:
        for label, r in (("cold-ish", s["cold_ish"]), ("warm (median)", s["warm_median"])):
            print(f"{name + ' ' + label:24}{r['open_s'] * 1e3:10.1f}"
                  f"{int(r['open_minor_faults']):>8}/{int(r['open_major_faults']):<5}"
                  f"{r['touch_s'] * 1e3:10.1f}{int(r['touch_minor_faults']):>8}{int(r['touch_major_faults']):>8}")
    print(f"ours, warm: map {map_s * 1e3:.2f} ms + parse {ours['warm_median']['parse_s'] * 1e3:.1f} ms")
    if "open_speedup_warm" in result:
        print(f"gguf-py takes {result['open_speedup_warm']:.1f}x as long to open (warm medians)")
    yield args.out, result
