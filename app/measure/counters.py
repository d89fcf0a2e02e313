"""The counters of a timed region: what the operating system counts for every process, and what
the CPU's performance monitoring unit (PMU) counts where the machine exposes one.

    with Counters() as c:
        generate(...)
    c.result     {'wall_ms', 'task_clock_ms', 'context_switches', 'minor_faults', 'major_faults',
                  'faults_per_s', ..., 'pmu': {...}}

OS counters, always there: getrusage(RUSAGE_SELF) before and after, which covers every thread
of the process. Task clock is the CPU time of all threads (user + system), so task clock /
wall time is how many cores the region kept busy. A minor fault maps a page that is already
in memory (a freshly allocated page touched for the first time, or a file page in the page
cache); a major fault waits for the disk.

PMU counters, where there is a PMU: instructions, cycles (-> IPC, instructions per cycle),
cache references and cache misses, through the perf_event_open system call (what `perf stat`
uses), counting user-space work of every thread of the process (one counter per thread that
exists when the region starts, inheriting to threads created inside it). A virtual machine
without PMU passthrough has no hardware events (the call fails with ENOENT) and a kernel with
perf_event_paranoid above 2 refuses them (EACCES): then `pmu` says {'available': False,
'reason': ...} and carries no figure. Never a made-up one.

Cold start, as the article measured it: `evict(path)` drops a file from the page cache without
root (posix_fadvise(POSIX_FADV_DONTNEED)) and says how much of it is still resident afterwards
(mincore): pages that another process has mapped cannot be dropped, and a record must say so.
The next read of an evicted page is a major fault (or, with the kernel's read-ahead, a minor
fault on a page the read-ahead already brought in: both are counted).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import re
import resource
import time
from dataclasses import dataclass
from pathlib import Path

# perf_event_open(2): event types and the hardware events used here.
PERF_TYPE_HARDWARE = 0
PERF_TYPE_SOFTWARE = 1
HARDWARE_EVENTS = {                       # name -> (type, config)
    "instructions": (PERF_TYPE_HARDWARE, 1),
    "cycles": (PERF_TYPE_HARDWARE, 0),
    "cache_references": (PERF_TYPE_HARDWARE, 2),
    "cache_misses": (PERF_TYPE_HARDWARE, 3),
}
SOFTWARE_EVENTS = {                       # the same machinery on events every Linux kernel has
    "task_clock_ns": (PERF_TYPE_SOFTWARE, 1),
    "page_faults": (PERF_TYPE_SOFTWARE, 2),
    "context_switches": (PERF_TYPE_SOFTWARE, 3),
}
PERF_FORMAT_TOTAL_TIME_ENABLED = 1 << 0
PERF_FORMAT_TOTAL_TIME_RUNNING = 1 << 1
# attr.flags bits: disabled, inherit, exclude_kernel, exclude_hv
_FLAG_DISABLED, _FLAG_INHERIT, _FLAG_EXCLUDE_KERNEL, _FLAG_EXCLUDE_HV = 1 << 0, 1 << 1, 1 << 5, 1 << 6
PERF_FLAG_FD_CLOEXEC = 1 << 3
_IOC_ENABLE, _IOC_DISABLE, _IOC_RESET = 0x2400, 0x2401, 0x2403
SYSCALL_NUMBERS = {"x86_64": 298, "aarch64": 241, "arm64": 241, "ppc64le": 319, "riscv64": 241}


class _PerfEventAttr(ctypes.Structure):
    """struct perf_event_attr up to config2 (PERF_ATTR_SIZE_VER1, 72 bytes: every kernel takes it)."""
    _fields_ = [("type", ctypes.c_uint32), ("size", ctypes.c_uint32), ("config", ctypes.c_uint64),
                ("sample_period", ctypes.c_uint64), ("sample_type", ctypes.c_uint64),
                ("read_format", ctypes.c_uint64), ("flags", ctypes.c_uint64),
                ("wakeup_events", ctypes.c_uint32), ("bp_type", ctypes.c_uint32),
                ("config1", ctypes.c_uint64), ("config2", ctypes.c_uint64)]


class PerfUnavailable(OSError):
    """perf_event_open refused an event; the message says why in a reader's words."""


def _why(err: int, event: str) -> str:
    if err == errno.ENOENT or err == errno.EOPNOTSUPP:
        return (f"perf_event_open({event}): {os.strerror(err)}: this machine exposes no hardware PMU "
                f"(a virtual machine without PMU passthrough), so instructions, cycles and cache misses "
                f"cannot be counted here")
    if err in (errno.EACCES, errno.EPERM):
        level = _read("/proc/sys/kernel/perf_event_paranoid")
        return (f"perf_event_open({event}): {os.strerror(err)}: the kernel refuses unprivileged counters "
                f"(perf_event_paranoid = {level}; 2 or less allows counting one's own process)")
    if err == errno.ENOSYS:
        return f"perf_event_open({event}): not supported by this kernel"
    return f"perf_event_open({event}): {os.strerror(err)}"


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "?"


class _Syscall:
    """The perf_event_open system call through libc, or the reason there is none."""

    def __init__(self):
        self.number = SYSCALL_NUMBERS.get(platform.machine())
        self.libc = None
        if platform.system() == "Linux" and self.number is not None:
            self.libc = ctypes.CDLL(None, use_errno=True)
            self.libc.syscall.restype = ctypes.c_long

    def unavailable(self) -> str | None:
        if platform.system() != "Linux":
            return f"perf_event_open is Linux's; this is {platform.system()}"
        if self.libc is None:
            return f"no perf_event_open system call number known for {platform.machine()}"
        return None

    def open(self, kind: int, config: int, tid: int) -> int:
        """A counter of one event for one thread (and the threads it creates), disabled."""
        attr = _PerfEventAttr(type=kind, size=ctypes.sizeof(_PerfEventAttr), config=config,
                              read_format=PERF_FORMAT_TOTAL_TIME_ENABLED | PERF_FORMAT_TOTAL_TIME_RUNNING,
                              flags=_FLAG_DISABLED | _FLAG_INHERIT | _FLAG_EXCLUDE_KERNEL | _FLAG_EXCLUDE_HV)
        fd = self.libc.syscall(ctypes.c_long(self.number), ctypes.byref(attr), ctypes.c_int(tid),
                               ctypes.c_int(-1), ctypes.c_int(-1), ctypes.c_ulong(PERF_FLAG_FD_CLOEXEC))
        if fd < 0:
            raise OSError(ctypes.get_errno(), "perf_event_open")
        return int(fd)

    def ioctl(self, fd: int, request: int):
        self.libc.ioctl(ctypes.c_int(fd), ctypes.c_ulong(request), ctypes.c_int(0))


def _threads() -> list[int]:
    """The ids of this process's threads now (numba's pool included, once started)."""
    try:
        return sorted(int(t) for t in os.listdir("/proc/self/task"))
    except OSError:
        return [0]                                         # 0: the calling thread


def scaled(value: int, enabled: int, running: int) -> float:
    """A counter's value extrapolated over the time it was enabled: when the PMU has more events
    than registers the kernel multiplexes them, and each ran only `running` of `enabled` ns."""
    if running <= 0:
        return 0.0
    return value * (enabled / running)


class PerfCounters:
    """Counters of some perf events over every thread of this process.

    open() raises PerfUnavailable with the reason when any event cannot be opened (then none
    is kept open: a partial set would mix figures from different regions)."""

    def __init__(self, events: dict, syscall: _Syscall | None = None):
        self.events = events
        self.sys = syscall or _Syscall()
        self.fds: dict[str, list[int]] = {}

    def open(self) -> "PerfCounters":
        why = self.sys.unavailable()
        if why:
            raise PerfUnavailable(why)
        tids = _threads()
        try:
            for name, (kind, config) in self.events.items():
                self.fds[name] = []
                for tid in tids:
                    try:
                        self.fds[name].append(self.sys.open(kind, config, tid))
                    except OSError as e:
                        if e.errno == errno.ESRCH:          # the thread ended meanwhile
                            continue
                        raise PerfUnavailable(_why(e.errno, name)) from None
        except PerfUnavailable:
            self.close()
            raise
        return self

    def start(self):
        for fds in self.fds.values():
            for fd in fds:
                self.sys.ioctl(fd, _IOC_RESET)
                self.sys.ioctl(fd, _IOC_ENABLE)

    def stop(self) -> dict:
        """{event: count summed over the threads, scaled for multiplexing}, and 'multiplexed'."""
        out, multiplexed = {}, False
        for fds in self.fds.values():
            for fd in fds:
                self.sys.ioctl(fd, _IOC_DISABLE)
        for name, fds in self.fds.items():
            total = 0.0
            for fd in fds:
                value, enabled, running = (int.from_bytes(os.read(fd, 24)[i:i + 8], "little") for i in (0, 8, 16))
                multiplexed |= running < enabled
                total += scaled(value, enabled, running)
            out[name] = total
        out["multiplexed"] = multiplexed
        return out

    def close(self):
        for fds in self.fds.values():
            for fd in fds:
                os.close(fd)
        self.fds = {}


def pmu_figures(raw: dict) -> dict:
    """Counts -> the record's 'pmu' entry, with IPC and the cache miss rate derived."""
    out = {"available": True, "events": "user space, every thread of the process",
           "multiplexed": bool(raw.get("multiplexed"))}
    for name in HARDWARE_EVENTS:
        out[name] = int(round(raw[name]))
    out["ipc"] = raw["instructions"] / raw["cycles"] if raw["cycles"] else None
    out["cache_miss_rate"] = raw["cache_misses"] / raw["cache_references"] if raw["cache_references"] else None
    return out


_PMU_REASON: list = []          # the reason the PMU is unavailable, found once per process


def pmu_unavailable_reason(syscall: _Syscall | None = None) -> str | None:
    """None if the hardware events can be counted here, else why not (probed once)."""
    if syscall is None and _PMU_REASON:
        return _PMU_REASON[0]
    probe = PerfCounters({"instructions": HARDWARE_EVENTS["instructions"]}, syscall)
    try:
        probe.open()
        probe.close()
        reason = None
    except PerfUnavailable as e:
        reason = str(e)
    if syscall is None:
        _PMU_REASON.append(reason)
    return reason


def _rusage() -> dict:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu_s": r.ru_utime + r.ru_stime, "minor_faults": r.ru_minflt, "major_faults": r.ru_majflt,
            "voluntary_context_switches": r.ru_nvcsw, "involuntary_context_switches": r.ru_nivcsw}


def os_figures(before: dict, after: dict, wall_s: float) -> dict:
    d = {k: after[k] - before[k] for k in before}
    faults = d["minor_faults"] + d["major_faults"]
    return {
        "wall_ms": wall_s * 1e3,
        "task_clock_ms": d["cpu_s"] * 1e3,
        "cpus_utilized": d["cpu_s"] / wall_s if wall_s > 0 else None,
        "context_switches": d["voluntary_context_switches"] + d["involuntary_context_switches"],
        "voluntary_context_switches": d["voluntary_context_switches"],
        "involuntary_context_switches": d["involuntary_context_switches"],
        "minor_faults": d["minor_faults"], "major_faults": d["major_faults"],
        "faults_per_s": faults / wall_s if wall_s > 0 else None,
    }


class Counters:
    """OS counters always, PMU counters where available, of the code inside `with`.

    pmu=False leaves the PMU out (a region nested in another one that counts it)."""

    def __init__(self, pmu: bool = True):
        self.want_pmu = pmu
        self.result: dict = {}
        self._perf: PerfCounters | None = None
        self._pmu_reason: str | None = None

    def __enter__(self):
        if self.want_pmu:
            self._pmu_reason = pmu_unavailable_reason()
            if self._pmu_reason is None:
                try:
                    self._perf = PerfCounters(HARDWARE_EVENTS).open()
                except PerfUnavailable as e:
                    self._pmu_reason = str(e)
        self._before = _rusage()
        if self._perf:
            self._perf.start()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self._t0
        raw = self._perf.stop() if self._perf else None
        after = _rusage()
        self.result = os_figures(self._before, after, wall)
        if self._perf:
            self._perf.close()
            self.result["pmu"] = pmu_figures(raw)
        elif self.want_pmu:
            self.result["pmu"] = {"available": False, "reason": self._pmu_reason}
        return False


# ---- the page cache --------------------------------------------------------------------------

def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def resident_fraction(path) -> float | None:
    """The share of a file's pages in the page cache now (mincore over a fresh mapping, which
    touches nothing), or None where mincore is not available."""
    if platform.system() != "Linux":
        return None
    size = os.path.getsize(path)
    if size == 0:
        return 1.0
    libc = _libc()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            pages = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                return None
            return sum(v & 1 for v in vec) / pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


MEMORY_FILESYSTEMS = {"tmpfs", "ramfs"}        # the page cache is the file's only copy: nothing to drop


def _unescape(field: str) -> str:
    """A mount point as /proc/self/mountinfo writes it: space, tab, newline, backslash as octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def filesystem(path, mountinfo: str | None = None) -> str | None:
    """The type of the file system `path` is on ('ext4', 'tmpfs', ...): the longest mount point
    above it in /proc/self/mountinfo (or the text given), or None where there is none."""
    here = mountinfo is None                     # this machine's mounts: the path as the kernel resolves it
    if here:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    path = os.path.realpath(path) if here else os.path.normpath(os.fspath(path))
    best, kind = -1, None
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        point, fstype = _unescape(fields[4]), fields[fields.index("-", 6) + 1]
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, kind = len(point), fstype
    return kind


@dataclass
class Eviction:
    path: str
    resident_before: float | None
    resident_after: float | None
    method: str = "posix_fadvise(POSIX_FADV_DONTNEED), no root needed"
    filesystem: str | None = None

    def as_dict(self) -> dict:
        note = None
        if self.filesystem in MEMORY_FILESYSTEMS:
            note = (f"the file is on {self.filesystem}, which keeps files in memory with no disk behind them: "
                    f"nothing can be evicted, and no read of it waits for a disk")
        elif self.resident_after is not None and self.resident_after > 0.01:
            note = (f"{self.resident_after:.0%} of the file stayed in the page cache: pages another process "
                    f"has mapped cannot be dropped, and reads of them are not from the disk")
        return {"file": os.path.basename(self.path), "method": self.method, "filesystem": self.filesystem,
                "resident_before": self.resident_before, "resident_after": self.resident_after, "note": note}


def evict(path) -> Eviction:
    """Drop a file's clean pages from the page cache, so that the next reads come from the disk.
    Pages still mapped by any process stay, and a file on tmpfs has no disk to come from:
    resident_after says how many stayed, filesystem and the note say why."""
    path = os.fspath(path)
    before = resident_fraction(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return Eviction(path, before, resident_fraction(path), filesystem=filesystem(path))
