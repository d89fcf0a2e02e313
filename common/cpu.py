"""What the kernels need to know about this CPU: how many cores they may use, which vector
instructions it has and how large its caches are. (The application's machine probe,
app/measure/machine.py, builds the record every measurement carries on top of this.)"""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpuinfo(text: str | None = None) -> dict:
    """The first processor's fields of /proc/cpuinfo ({'vendor_id': 'GenuineIntel', 'cpu family':
    '6', 'model': '106', 'flags': '...', ...}); empty where there is none."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {}
    out = {}
    for line in text.splitlines():
        if not line.strip():
            if out:
                break                               # the first processor's block only
            continue
        key, _, value = line.partition(":")
        out.setdefault(key.strip(), value.strip())
    return out


def cpu_flags(info: dict | None = None) -> set:
    info = cpuinfo() if info is None else info
    return set((info.get("flags") or info.get("Features") or "").split())


SYSFS_CPU = Path("/sys/devices/system/cpu")


def physical_cores(cpus=None, sysfs: Path = SYSFS_CPU) -> int:
    """Physical cores this process may use (hyperthreads counted once): the (package, core) pairs
    of the CPUs it may run on. `cpus` and `sysfs` stand in for its affinity and the kernel's
    topology folder (another machine's, as data)."""
    if cpus is None:
        try:
            cpus = os.sched_getaffinity(0)
        except AttributeError:
            cpus = set(range(os.cpu_count() or 1))
    cores = set()
    for c in cpus:
        try:
            p = sysfs / f"cpu{c}" / "topology"
            cores.add(((p / "physical_package_id").read_text().strip(), (p / "core_id").read_text().strip()))
        except OSError:
            cores.add((None, c))
    return max(1, len(cores))


def simd_features(info: dict | None = None) -> list[str]:
    """The vector-instruction flags that matter to the kernels, as /proc/cpuinfo names them."""
    wanted = ["sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
              "avx_vnni", "avx512_bf16", "amx_int8", "neon", "asimd"]
    flags = cpu_flags(info)
    return [f for f in wanted if f in flags]


# Sizes assumed where sysfs does not say (a container without /sys, another OS): a small core's.
CACHE_FALLBACK = {"L1d": 32 << 10, "L2": 512 << 10}


def sysfs_caches() -> dict[str, str]:
    """The first core's caches as sysfs states them: {'L1d': '48K', 'L1i': '32K', 'L2': '2048K', ...}."""
    out = {}
    for idx in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, kind, size = [(idx / field).read_text().strip() for field in ("level", "type", "size")]
        except OSError:
            continue
        out[f"L{level}" + {"Data": "d", "Instruction": "i"}.get(kind, "")] = size
    return out


def cache_sizes(caches: dict[str, str] | None = None) -> dict[str, int]:
    """Bytes of each data cache level: {'L1d': .., 'L2': .., 'L3': ..} (L1d and L2 per core), from
    sizes as sysfs states them ('48K', '32768K', '1M'): `caches` (a record's machine["caches"]),
    or this machine's first core's, CACHE_FALLBACK where sysfs does not say."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    out = dict(CACHE_FALLBACK) if caches is None else {}
    for name, size in (sysfs_caches() if caches is None else caches).items():
        m = re.fullmatch(r"(\d+)\s*([KMG]?)i?B?", str(size).strip())
        if m and not name.endswith("i"):
            out[name] = int(m.group(1)) * units[m.group(2)]
    return out


def isa_level(features) -> str:
    """The vector level that decides the kernels' speed, from simd_features(): 'avx512vnni' (AVX-512
    with VNNI), 'avx512', 'avxvnni' (AVX2 with the 256-bit VNNI of AVX-VNNI), 'avx2', 'avx', 'sse4',
    'neon', or 'scalar'."""
    f = set(features)
    if {"avx512f", "avx512bw", "avx512vl"} <= f:
        return "avx512vnni" if "avx512_vnni" in f else "avx512"
    if {"avx2", "fma"} <= f:
        return "avxvnni" if "avx_vnni" in f else "avx2"
    for level, flag in (("avx", "avx"), ("sse4", "sse4_2"), ("neon", "asimd"), ("neon", "neon")):
        if flag in f:
            return level
    return "scalar"
