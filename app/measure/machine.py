"""What machine a measurement ran on: every benchmark record carries this."""

from __future__ import annotations

import os
import platform
import re
import resource
import sys
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from common.cpu import cpu_model, cpuinfo, isa_level, physical_cores, simd_features, sysfs_caches


def versions(*names) -> dict:
    names = names or ("numpy", "numba", "llvmlite", "llama_cpp_python", "pycuda")
    out = {"python": platform.python_version()}
    for n in names:
        try:
            out[n] = metadata.version(n.replace("_", "-"))
        except metadata.PackageNotFoundError:
            pass
    return out


@lru_cache(maxsize=1)
def machine_info() -> dict:
    mem = None
    try:
        m = re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text())
        mem = int(m.group(1)) * 1024 if m else None
    except OSError:
        pass
    info = cpuinfo()
    return {
        "cpu": cpu_model(),
        "cpu_signature": cpu_signature(info),
        "isa": isa_level(simd_features(info)),
        "arch": platform.machine(),
        "logical_cpus": os.cpu_count(),
        "physical_cores": physical_cores(),
        "caches": sysfs_caches(),
        "simd": simd_features(),
        "memory_bytes": mem,
        "os": f"{platform.system()} {platform.release()}",
        "versions": versions(),
    }


VENDORS = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}


def cpu_signature(info: dict) -> dict:
    """Who made the CPU and which design it is: x86's vendor, family and model numbers (one
    family/model is one microarchitecture: Ice Lake server is 6/106, Zen 3 25/1, Zen 4 25/17),
    or an ARM core's implementer and part."""
    if "vendor_id" in info:
        return {"vendor": info["vendor_id"], "family": info.get("cpu family"), "model": info.get("model")}
    return {"vendor": info.get("CPU implementer"), "part": info.get("CPU part")}


def machine_id(info: dict | None = None) -> str:
    """The folder name of this machine's records: what decides the speed, so that two CPUs that
    differ there never share a folder: vendor, the product name, family/model (the design),
    the vector ISA level and the cores, e.g. intel-xeon-f6m106-avx512vnni-2c (Ice Lake server),
    amd-epyc-f25m1-avx2-2c (Zen 3). `info` stands in for machine_info() (tests)."""
    info = info or machine_info()
    sig = info.get("cpu_signature") or {}
    vendor = VENDORS.get(sig.get("vendor"), re.sub(r"[^a-z0-9]+", "", str(sig.get("vendor") or "cpu").lower()))
    name = re.sub(r"\(R\)|\(TM\)|\bCPU\b|Processor|@.*|\d+-Core|\bIntel\b|\bAMD\b", "", info["cpu"])
    name = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower() or "cpu"
    design = f"f{sig['family']}m{sig['model']}" if sig.get("family") is not None else \
        f"i{sig.get('vendor')}p{sig.get('part')}".lower().replace("0x", "")
    return f"{vendor}-{name}-{design}-{info['isa']}-{info['physical_cores']}c"


def _vm_hwm_bytes() -> int | None:
    """Linux: this process's own peak RSS. (ru_maxrss survives fork + exec, so a child of a
    big process would report its parent's peak.)"""
    try:
        m = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
        return int(m.group(1)) * 1024 if m else None
    except OSError:
        return None


def rusage() -> dict:
    """Peak RSS and page faults of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    peak = _vm_hwm_bytes()
    if peak is None:
        peak = r.ru_maxrss * (1 if sys.platform == "darwin" else 1024)   # bytes on macOS, KiB elsewhere
    return {"peak_rss_mb": peak / 2**20, "minor_faults": r.ru_minflt, "major_faults": r.ru_majflt}
