"""The counters every run record carries (app/measure/counters.py): the OS's figures match what
the region did, a file evicted from the page cache is read back with major faults, the PMU's
figures are there where the machine has one and, where it has none, the record says why and
carries no figure; and the harness puts them in its records."""

from __future__ import annotations

import errno
import mmap
import os

import pytest

from app.measure import counters as c

PAGE = mmap.PAGESIZE


def touch_fresh_pages(n_pages: int):
    """Map n_pages of anonymous memory (small pages: no transparent huge pages) and write one
    byte in each: exactly one minor fault per page."""
    m = mmap.mmap(-1, n_pages * PAGE)
    m.madvise(mmap.MADV_NOHUGEPAGE)
    for i in range(0, n_pages * PAGE, PAGE):
        m[i] = 1
    m.close()


def test_minor_faults_count_the_pages_touched():
    with c.Counters(pmu=False) as counted:
        touch_fresh_pages(2048)
    r = counted.result
    assert 2048 <= r["minor_faults"] <= 2048 + 200, r
    assert r["major_faults"] == 0
    assert r["faults_per_s"] == pytest.approx((r["minor_faults"] + r["major_faults"]) / (r["wall_ms"] / 1e3))
    assert 0 < r["task_clock_ms"] and r["context_switches"] >= 0
    assert "pmu" not in r


def test_task_clock_follows_the_cpu_not_the_wall():
    """A loop that spins until it has used 150 ms of CPU (however long that takes on a busy
    machine) against a 200 ms sleep, each beside the process's CPU time as another clock
    (CLOCK_PROCESS_CPUTIME_ID) reads it over the same region: the task clock is that, whatever
    else the machine runs, and not the wall time."""
    import time

    def region(work):
        t0 = time.process_time()
        with c.Counters(pmu=False) as counted:
            work()
        return counted.result, (time.process_time() - t0) * 1e3

    def spin():
        t = time.process_time()
        while time.process_time() - t < 0.15:
            pass

    busy, busy_cpu = region(spin)
    idle, idle_cpu = region(lambda: time.sleep(0.2))
    for r, cpu in ((busy, busy_cpu), (idle, idle_cpu)):
        assert cpu - 10 <= r["task_clock_ms"] <= cpu + 1, (r, cpu)    # clock resolution; a few us outside
    assert busy["task_clock_ms"] >= 140 and idle["wall_ms"] >= 200
    assert idle["task_clock_ms"] <= idle_cpu + 1 < idle["wall_ms"] / 2        # sleeping: CPU time is not wall time
    assert idle["voluntary_context_switches"] >= 1                           # it gave the core up


def test_the_eviction_note_names_tmpfs_and_the_mounts_are_read_right():
    """A file on tmpfs (or ramfs) has no disk behind it: evicting it drops nothing, and the record
    says that rather than "another process has it mapped". The file system comes from
    /proc/self/mountinfo: the longest mount point above the path, bind mounts and spaces as
    the kernel writes them."""
    mountinfo = ("22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
                 "23 22 0:20 / /dev/shm rw,nosuid shared:2 - tmpfs tmpfs rw\n"
                 "24 22 0:21 / /scratch rw shared:3 - tmpfs tmpfs rw\n"
                 "25 24 8:1 /data /scratch/on\\040disk rw shared:4 - ext4 /dev/vda rw\n")
    assert c.filesystem("/scratch/x.bin", mountinfo) == "tmpfs"
    assert c.filesystem("/scratch/on disk/x.bin", mountinfo) == "ext4"
    assert c.filesystem("/scratchy/x.bin", mountinfo) == "ext4"                  # a prefix is not a parent
    assert c.filesystem("/home/x.bin", mountinfo) == "ext4"
    memory = c.Eviction("/scratch/x.bin", 1.0, 1.0, filesystem="tmpfs").as_dict()
    assert "tmpfs" in memory["note"] and "no disk" in memory["note"] and memory["filesystem"] == "tmpfs"
    disk = c.Eviction("/home/x.bin", 1.0, 0.0, filesystem="ext4").as_dict()
    assert disk["note"] is None and disk["filesystem"] == "ext4"
    mapped = c.Eviction("/home/x.bin", 1.0, 1.0, filesystem="ext4").as_dict()
    assert "cannot be dropped" in mapped["note"]


def test_an_evicted_file_is_read_back_from_the_disk(tmp_path):
    """Where tmp_path has a disk behind it: the pages are dropped, and the next read faults them
    in from the disk (major faults). Where it is tmpfs, nothing can be dropped: the eviction
    says so, and the reads stay minor faults. Either way the record tells the reader which."""
    path = tmp_path / "cold.bin"
    path.write_bytes(os.urandom(8 << 20))
    os.sync()                                                   # dirty pages cannot be dropped

    def read_all() -> dict:
        with open(path, "rb") as f, c.Counters(pmu=False) as counted:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            sum(m[i] for i in range(0, len(m), PAGE))
            m.close()
        return counted.result

    read_all()
    assert c.resident_fraction(path) == 1.0
    warm = read_all()
    eviction = c.evict(path)
    cold = read_all()
    assert warm["major_faults"] == 0 and eviction.resident_before == 1.0
    assert eviction.filesystem == c.filesystem(path)
    if eviction.filesystem in c.MEMORY_FILESYSTEMS:
        assert eviction.resident_after == 1.0 and "no disk" in eviction.as_dict()["note"], eviction
        assert cold["major_faults"] == 0, cold
    else:
        assert eviction.resident_after < 0.05 and eviction.as_dict()["note"] is None, eviction
        assert cold["major_faults"] >= 1, cold                  # read-ahead turns the rest into minor ones


def test_an_eviction_says_when_pages_stayed(tmp_path):
    path = tmp_path / "mapped.bin"
    path.write_bytes(b"x" * (1 << 20))
    os.sync()
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        sum(m[i] for i in range(0, len(m), PAGE))               # mapped and touched: cannot be dropped
        eviction = c.evict(path).as_dict()
        m.close()
    assert eviction["resident_after"] > 0.9
    assert "cannot be dropped" in eviction["note"]


def test_the_pmu_is_counted_where_there_is_one_and_else_the_record_says_why():
    why = c.pmu_unavailable_reason()
    with c.Counters() as counted:
        sum(i * i for i in range(200_000))
    pmu = counted.result["pmu"]
    if why is None:
        assert pmu["available"] and pmu["instructions"] > 200_000 and pmu["cycles"] > 0
        assert pmu["ipc"] == pytest.approx(pmu["instructions"] / pmu["cycles"])
        assert 0 <= pmu["cache_misses"] <= pmu["cache_references"]
    else:
        assert pmu == {"available": False, "reason": why}           # a reason and no figure
        assert why.startswith("perf_event_open(instructions)")


def test_the_perf_machinery_counts_on_the_software_events_every_kernel_has():
    """The same open/enable/read/scale path as the PMU's, on events a VM has too: its page
    faults agree with the OS's count of the same region."""
    perf = c.PerfCounters(c.SOFTWARE_EVENTS)
    try:
        perf.open()
    except c.PerfUnavailable as e:
        pytest.skip(f"no perf_event_open here at all: {e}")
    perf.start()
    with c.Counters(pmu=False) as counted:
        touch_fresh_pages(1024)
    got = perf.stop()
    perf.close()
    faults = counted.result["minor_faults"] + counted.result["major_faults"]
    assert got["page_faults"] == pytest.approx(faults, rel=0.2), (got, faults)
    assert got["task_clock_ns"] > 0 and not got["multiplexed"]


class RefusingSyscall(c._Syscall):
    def __init__(self, err):
        super().__init__()
        self.err = err

    def unavailable(self):
        return None

    def open(self, kind, config, tid):
        raise OSError(self.err, os.strerror(self.err))


@pytest.mark.parametrize("err, says", [(errno.ENOENT, "no hardware PMU"), (errno.EACCES, "perf_event_paranoid"),
                                       (errno.ENOSYS, "not supported by this kernel")])
def test_a_refused_counter_gives_the_reason_in_words(err, says):
    why = c.pmu_unavailable_reason(RefusingSyscall(err))
    assert says in why and "instructions" in why


def test_multiplexed_counts_are_scaled_and_ipc_derived():
    assert c.scaled(1000, enabled=200, running=100) == 2000
    assert c.scaled(1000, enabled=200, running=0) == 0
    pmu = c.pmu_figures({"instructions": 3e9, "cycles": 2e9, "cache_references": 1e6, "cache_misses": 2.5e5,
                         "multiplexed": True})
    assert pmu["ipc"] == 1.5 and pmu["cache_miss_rate"] == 0.25 and pmu["multiplexed"]


def test_a_benchmark_record_carries_the_counters_and_its_cold_start(default_model_path):
    from app.measure import bench
    rec = bench.bench_stage("quantized", default_model_path, prompt_tokens=4, n_predict=3, cold=True)
    for region in (rec["counters"], rec["cold_start"]["load"], rec["cold_start"]["first_forward"]):
        assert {"wall_ms", "task_clock_ms", "context_switches", "minor_faults", "major_faults",
                "faults_per_s"} <= set(region)
        assert region["pmu"]["available"] == (c.pmu_unavailable_reason() is None)
    timed = rec["counters"]["wall_ms"]
    assert rec["ttft_ms"] + sum(rec["decode_ms_all"]) <= timed <= 2 * (rec["ttft_ms"] + sum(rec["decode_ms_all"])) + 50
    cold = rec["cold_start"]
    assert cold["eviction"]["file"] == default_model_path.name and cold["prompt_tokens"] == 4
    assert cold["layers"] == cold["n_layer"]
    # quantized reads its weights through the file mapping: the first pass after an eviction
    # faults them in (as major faults where no other process keeps the file mapped)
    first = cold["first_forward"]
    assert first["minor_faults"] + first["major_faults"] > 0
