"""Which machine a record measured, and which records may speak for this one.

The machine id names a folder of records (profiles/results/ID/): two CPUs that differ in what
decides the speed (vendor, design, vector ISA level, cores) must never share one. `make run`
and `serve` pick their stage from this machine's records, but only from those measured on this
CPU with the code checked out now (app/args.py: recorded_decode_ms)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from app import args
from app.measure.machine import cpu_signature, machine_id, machine_info
from app.measure.provenance import provenance
from common.cpu import cpuinfo, isa_level, physical_cores, simd_features

BASE = "fpu vme de pse tsc msr sse sse2 ssse3 sse4_1 sse4_2 popcnt aes xsave avx"
AVX2 = BASE + " avx2 fma f16c bmi2"
AVX512 = AVX2 + " avx512f avx512dq avx512cd avx512bw avx512vl"
# /proc/cpuinfo's first block, as the three kinds of CPU the project has met print it
KINDS = {
    "icelake": ("GenuineIntel", 6, 106, "Intel(R) Xeon(R) Processor @ 2.60GHz", AVX512 + " avx512_vnni"),
    "zen4": ("AuthenticAMD", 25, 17, "AMD EPYC", AVX512 + " avx512_vnni avx512_bf16"),
    "zen3": ("AuthenticAMD", 25, 1, "AMD EPYC", AVX2 + " sha_ni vaes"),
}


def cpuinfo_text(vendor, family, model, name, flags) -> str:
    block = (f"processor\t: {{n}}\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\n"
             f"model name\t: {name}\nflags\t\t: {flags}\n\n")
    return block.format(n=0) + block.format(n=1)


def info_of(kind: str, cores: int = 2) -> dict:
    """machine_info()'s fields that the id reads, for a made-up CPU of one kind."""
    return info_from(cpuinfo_text(*KINDS[kind]), cores)


def info_from(text: str, cores: int = 2, isa=isa_level) -> dict:
    """The same fields from a /proc/cpuinfo text (`isa`: the rule for the vector level)."""
    ci = cpuinfo(text)
    return {"cpu": ci.get("model name", ""), "cpu_signature": cpu_signature(ci), "isa": isa(simd_features(ci)),
            "physical_cores": cores}


def test_the_three_kinds_of_cpu_get_three_ids():
    ids = {kind: machine_id(info_of(kind)) for kind in KINDS}
    assert ids == {"icelake": "intel-xeon-f6m106-avx512vnni-2c", "zen4": "amd-epyc-f25m17-avx512vnni-2c",
                   "zen3": "amd-epyc-f25m1-avx2-2c"}
    assert machine_id(info_of("zen3", cores=4)) != ids["zen3"]


def test_the_isa_level_follows_the_flags():
    assert [isa_level(f.split()) for f in (BASE, AVX2, AVX2 + " avx_vnni", AVX512, AVX512 + " avx512_vnni")] == \
        ["avx", "avx2", "avxvnni", "avx512", "avx512vnni"]
    assert isa_level(["asimd"]) == "neon" and isa_level([]) == "scalar"


def this_cpu_problems(found: str) -> list[str]:
    """An id against this machine read without the probe: its vendor and design from
    /proc/cpuinfo's first block, its cores from the kernel's sibling lists (one list per
    physical core) of the CPUs this process may use."""
    text = Path("/proc/cpuinfo").read_text()
    first = dict((k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in text.split("\n\n")[0].splitlines()))
    if "vendor_id" in first:
        vendor = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(first["vendor_id"], first["vendor_id"].lower())
        design = f"f{first['cpu family']}m{first['model']}"
    else:
        vendor = None
        design = "i{}p{}".format(first.get("CPU implementer"), first.get("CPU part")).lower().replace("0x", "")
    siblings = set()
    for c in os.sched_getaffinity(0):
        listed = Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list")
        siblings.add(listed.read_text().strip() if listed.exists() else f"cpu{c}")
    problems = []
    if vendor and not found.startswith(vendor + "-"):
        problems.append(f"{found}: not made by {vendor}")
    if f"-{design}-" not in found:
        problems.append(f"{found}: not design {design}")
    if not found.endswith(f"-{len(siblings)}c"):
        problems.append(f"{found}: not {len(siblings)} cores")
    return problems


def test_this_machines_id_is_read_from_this_cpu():
    assert this_cpu_problems(machine_id()) == []
    here = machine_info()
    other = info_of("zen3" if here["isa"] != "avx2" else "icelake", cores=here["physical_cores"] + 1)
    assert this_cpu_problems(machine_id(other)) != [], "the twin: another CPU's id"


# ---- CPUs this machine is not: fed to the probe as data --------------------------------------------

# An ARM server's /proc/cpuinfo (arm64 Linux): no vendor_id, family or model name; the design is
# the implementer and part (0x41 Arm: 0xd0c Neoverse N1, as in AWS Graviton2; 0xd40 Neoverse V1, Graviton3)
ARM = ("processor\t: {n}\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics "
       "fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs\nCPU implementer\t: 0x41\nCPU architecture: 8\n"
       "CPU variant\t: 0x3\nCPU part\t: {part}\nCPU revision\t: 1\n\n")


def arm_text(part: str) -> str:
    return ARM.format(n=0, part=part) + ARM.format(n=1, part=part)


def arm_problems(make_id) -> list[str]:
    """Two ARM designs with the same features and cores: two ids, each a plain folder name,
    each naming its implementer and part, vector level neon."""
    n1, v1 = (make_id(info_from(arm_text(part))) for part in ("0xd0c", "0xd40"))
    problems = [] if n1 != v1 else [f"Neoverse N1 and V1 share {n1}"]
    for found, part in ((n1, "d0c"), (v1, "d40")):
        if not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", found) or f"-i41p{part}-" not in found or "-neon-" not in found:
            problems.append(f"{found}: not a folder name with its design i41p{part} and neon")
    return problems


def test_an_arm_cpu_gets_an_id_of_its_own_design():
    assert arm_problems(machine_id) == []
    # planted: the design read from x86's family and model only (an ARM part never reaches the id)
    assert arm_problems(lambda info: machine_id(dict(info, cpu_signature={
        k: v for k, v in info["cpu_signature"].items() if k != "part"}))) != []


# Sapphire Rapids (6/143): AVX-512 with VNNI, AVX-VNNI too, and the AMX tiles
SAPPHIRE_RAPIDS = ("GenuineIntel", 6, 143, "Intel(R) Xeon(R) Platinum 8480+",
                   AVX512 + " avx512_vnni avx512_bf16 avx_vnni amx_bf16 amx_tile amx_int8")


def avx_vnni_first(features) -> str:
    """A WRONG rule, planted: AVX-VNNI looked for before AVX-512."""
    return "avxvnni" if "avx_vnni" in features else isa_level(features)


def amx_problems(isa) -> list[str]:
    """An Intel with AMX: its vector level is AVX-512 VNNI (AVX-VNNI beside it changes nothing),
    its id is its own (not Ice Lake's), and the record's vector features name AMX."""
    text = cpuinfo_text(*SAPPHIRE_RAPIDS)
    found = machine_id(info_from(text, isa=isa))
    problems = [] if found == "intel-xeon-platinum-8480-f6m143-avx512vnni-2c" else [f"id {found}"]
    if found == machine_id(info_of("icelake")):
        problems.append("the id of an Ice Lake")
    if "amx_int8" not in simd_features(cpuinfo(text)):
        problems.append("the record's features do not name AMX")
    return problems


def test_an_intel_with_amx_is_avx512_vnni_and_its_record_names_amx():
    assert amx_problems(isa_level) == []
    assert amx_problems(avx_vnni_first) != []


def topology(root: Path, cpus: dict) -> Path:
    """A sysfs cpu folder: {cpu: (package, core)}, or None for a CPU without topology files (a container)."""
    for c, place in cpus.items():
        d = root / f"cpu{c}" / "topology"
        d.mkdir(parents=True)
        if place is not None:
            (d / "physical_package_id").write_text(f"{place[0]}\n")
            (d / "core_id").write_text(f"{place[1]}\n")
    return root


def logical_cpus(cpus, sysfs) -> int:
    """A WRONG rule, planted: every hyperthread a core."""
    return len(cpus)


def core_ids_only(cpus, sysfs) -> int:
    """A WRONG rule, planted: cores told apart by core_id alone (two sockets' core 0 are one)."""
    ids = [sysfs / f"cpu{c}" / "topology" / "core_id" for c in cpus]
    return len({p.read_text() if p.exists() else p for p in ids})


def topology_problems(cores, tmp_path) -> list[str]:
    """Hyperthreads (Linux numbers a core's second thread after every core's first: cpu0 and
    cpu2 share a core), two sockets whose cores have the same ids, and a container's CPUs
    without topology files; an affinity mask that holds both threads of one core."""
    smt = topology(tmp_path / "smt", {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1)})
    sockets = topology(tmp_path / "sockets", {0: (0, 0), 1: (1, 0), 2: (0, 1), 3: (1, 1)})
    bare = topology(tmp_path / "bare", {0: None, 1: None, 2: None})
    cases = [("2 cores, 4 threads", {0, 1, 2, 3}, smt, 2), ("both threads of core 0", {0, 2}, smt, 1),
             ("one thread of each core", {0, 1}, smt, 2), ("2 sockets, 2 cores each", {0, 1, 2, 3}, sockets, 4),
             ("no topology: every CPU", {0, 1, 2}, bare, 3)]
    return [f"{what}: {got} cores, not {want}" for what, cpus, root, want in cases
            if (got := cores(cpus, root)) != want]


@pytest.mark.parametrize("cores", [physical_cores, logical_cpus, core_ids_only], ids=lambda f: f.__name__)
def test_physical_cores_count_each_core_once_on_any_topology(cores, tmp_path):
    assert (topology_problems(cores, tmp_path) == []) == (cores is physical_cores)


# ---- which records choose the stage --------------------------------------------------------------

def stage_record(stage: str, decode_ms: float, machine: dict, code_hash: str) -> dict:
    return {"kind": "stage", "stage": stage, "decode_ms": decode_ms, "machine": machine,
            "provenance": {"commit": "0" * 40, "dirty": False, "code_hash": code_hash}}


@pytest.fixture
def folder(tmp_path):
    here, code = machine_info(), provenance()["code_hash"]
    other_cpu = info_of("zen3" if here["isa"] != "avx2" else "icelake")
    legacy = {k: v for k, v in here.items() if k not in ("cpu_signature", "isa")}     # an id that said less
    records = [stage_record("kv_cache", 9.0, here, code),                   # the one valid record
               stage_record("quantized", 1.0, here, "f" * 16),                # faster, but other code
               stage_record("threads", 1.0, dict(here, **other_cpu), code),   # faster, but another CPU
               stage_record("int8", 1.0, legacy, code)]                       # faster, CPU not known
    for r in records:
        (tmp_path / f"{r['stage']}.json").write_text(json.dumps(r))
    return tmp_path


def test_only_records_of_this_cpu_and_this_code_are_counted(folder):
    assert args.recorded_decode_ms(folder) == {"kv_cache": 9.0}


def cpu_only(monkeypatch):
    """fastest_stage as on a machine without a GPU: where cuda runs it wins before any record is
    read, and these checks are about the records."""
    cpu = [s for s in args.runnable_stages() if not args.info(s).gpu]
    monkeypatch.setattr(args, "runnable_stages", lambda: cpu)
    return cpu


def with_cuda(monkeypatch):
    """runnable_stages as on a machine that can run the cuda stage."""
    from stages import STAGES
    here = set(args.runnable_stages()) | {"cuda"}
    monkeypatch.setattr(args, "runnable_stages", lambda: [s for s in STAGES if s in here])


@pytest.mark.parametrize("gpu", [False, True], ids=["this machine", "a machine that runs cuda"])
def test_a_stale_record_does_not_choose_the_stage(folder, monkeypatch, gpu):
    if gpu:
        with_cuda(monkeypatch)
        assert args.fastest_stage() == "cuda", "the scene: cuda wins before any record is read"
    cpu = cpu_only(monkeypatch)
    counted = args.recorded_decode_ms
    monkeypatch.setattr(args, "recorded_decode_ms", lambda: counted(folder))
    assert args.fastest_stage() == "kv_cache"
    monkeypatch.setattr(args, "recorded_decode_ms", lambda: {})
    assert args.fastest_stage() == [s for s in cpu if not args.info(s).ranks][-1]    # no valid record: the registry


def test_the_planted_stale_record_would_have_won(folder, monkeypatch):
    """The negative control: counted as the old rule counted (every record in the folder), the
    stale records are faster, so the test above would see them win."""
    cpu_only(monkeypatch)
    every = {json.loads(p.read_text())["stage"]: json.loads(p.read_text())["decode_ms"] for p in folder.glob("*.json")}
    monkeypatch.setattr(args, "recorded_decode_ms", lambda: every)
    assert args.fastest_stage() != "kv_cache"
