"""Which machine a record measured, and which records may speak for this one.

The machine id names a folder of records (profiles/results/ID/): two CPUs that differ in what
decides the speed (vendor, design, vector ISA level, cores) must never share one. `make run`
and `serve` pick their stage from this machine's records, but only from those measured on this
CPU with the code checked out now (app/run.py: recorded_decode_ms)."""

from __future__ import annotations

import json

import pytest

from app import run
from app.measure.machine import cpu_signature, machine_id, machine_info
from app.measure.provenance import provenance
from common.cpu import cpuinfo, isa_level, simd_features

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
    ci = cpuinfo(cpuinfo_text(*KINDS[kind]))
    return {"cpu": ci["model name"], "cpu_signature": cpu_signature(ci), "isa": isa_level(simd_features(ci)),
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


def test_this_machines_id_is_read_from_this_cpu():
    info = machine_info()
    assert machine_id() == machine_id(info)
    assert info["isa"] in machine_id() and f"-{info['physical_cores']}c" in machine_id()


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
    assert run.recorded_decode_ms(folder) == {"kv_cache": 9.0}


def test_a_stale_record_does_not_choose_the_stage(folder, monkeypatch):
    counted = run.recorded_decode_ms
    monkeypatch.setattr(run, "recorded_decode_ms", lambda: counted(folder))
    assert run.fastest_stage() == "kv_cache"
    monkeypatch.setattr(run, "recorded_decode_ms", lambda: {})
    runnable = [s for s in run.runnable_stages() if not run.info(s).ranks]
    assert run.fastest_stage() == runnable[-1]                              # no valid record: the registry


def test_the_planted_stale_record_would_have_won(folder, monkeypatch):
    """The negative control: counted as the old rule counted (every record in the folder), the
    stale records are faster, so the test above would see them win."""
    every = {json.loads(p.read_text())["stage"]: json.loads(p.read_text())["decode_ms"] for p in folder.glob("*.json")}
    monkeypatch.setattr(run, "recorded_decode_ms", lambda: every)
    assert run.fastest_stage() != "kv_cache"
