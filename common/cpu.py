"""What the kernels need to know about this CPU: how many cores they may use, which vector
instructions it has and how large its caches are. (The application's machine probe,
app/measure/machine.py, builds the record every measurement carries on top of this.)"""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> set:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def physical_cores() -> int:
    """Physical cores this process may use (hyperthreads counted once)."""
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:
        cpus = set(range(os.cpu_count() or 1))
    cores = set()
    for c in cpus:
        try:
            p = Path(f"/sys/devices/system/cpu/cpu{c}/topology")
            cores.add(((p / "physical_package_id").read_text().strip(), (p / "core_id").read_text().strip()))
        except OSError:
            cores.add((None, c))
    return max(1, len(cores))


def simd_features() -> list[str]:
    """The vector-instruction flags that matter to the kernels, as /proc/cpuinfo names them."""
    wanted = ["sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
              "avx_vnni", "avx512_bf16", "amx_int8", "neon", "asimd"]
    flags = cpu_flags()
    return [f for f in wanted if f in flags]


# Sizes assumed where sysfs does not say (a container without /sys, another OS): a small core's.
CACHE_FALLBACK = {"L1d": 32 << 10, "L2": 512 << 10}


def cache_sizes() -> dict[str, int]:
    """Bytes of each cache level of the first core, from sysfs: {'L1d': .., 'L2': .., 'L3': ..}
    (L1d and L2 per core; CACHE_FALLBACK where sysfs does not say)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    out = dict(CACHE_FALLBACK)
    for idx in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level = (idx / "level").read_text().strip()
            kind = (idx / "type").read_text().strip()
            size = (idx / "size").read_text().strip()
        except OSError:
            continue
        if kind == "Instruction" or not size:
            continue
        n = int(size.rstrip("KMG")) * units.get(size[-1], 1)
        out[f"L{level}" + ("d" if kind == "Data" else "")] = n
    return out
