"""The tp stage: the split (who owns what, which rank counts work, even bytes), the slices of the
file, 2 real MPI ranks on a tiny model against the stage tp builds on and the float64 reference
(with planted bugs the comparisons must catch), a bad rank count refused with the valid ones,
every way a rank can fail ending the run with a message that names it, never a hang, and 2 ranks
on two hosts: network namespaces joined by a veth pair (tests/tp_ranks.py and tests/tp_model.py
run under mpiexec; app/netns.py makes the hosts)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from common import reference
from common.gguf import GGMLType, GGUFFile
from common.model import LlamaConfig
from common.quants import dequantize
from stages import info, load, logit_tolerance
from stages.kernels.q8 import dequantize_q8, quantize_q8
from stages.kernels.toolkit import BLOCK_VALUES
from stages.parallel import shards, split
from tests.test_quantized import write_tiny_llama
from tests.util import mpiexec_saw_a_rank_killed

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = Path(sys.executable).parent / "mpiexec"
TOKENS = [3, 17, 42, 5, 63, 0, 8, 21, 9, 30]
SPLIT = 6
GREEDY = 8
# The rank runs' model: the K-quants the TinyLlama geometry uses, repacked in slices; Wo in 32-value
# blocks, so that 2 ranks can split its 256 columns (a 256-value block cannot be cut)
RANK_TYPES = {"token_embd": GGMLType.Q8_0, "output": GGMLType.Q6_K, "attn_q": GGMLType.Q4_K,
              "attn_k": GGMLType.Q4_K, "attn_v": GGMLType.Q6_K, "attn_output": GGMLType.Q8_0,
              "ffn_gate": GGMLType.Q4_K, "ffn_up": GGMLType.Q4_K, "ffn_down": GGMLType.Q6_K}
# logits, max |stage - float64 reference|: the contract every stage keeps (stages.logit_tolerance), tp's
# being the base stage's: its numbers are the base's, but for the order of Wo's and W_down's sums
TOLERANCE = logit_tolerance("tp")
NEAR_TIE = 0.25            # logits: where 8-bit rounding may swap the top candidates (as in test_stages)
U = 2.0 ** -24             # float32's unit roundoff
RUN_TIMEOUT_S = 180


def smollm2_like(**kw):
    base = dict(n_layer=2, n_embd=576, n_ff=1536, n_head=9, n_head_kv=3, head_dim=64, n_rot=64, rope_base=1e4,
                rope_freq_scale=1.0, eps=1e-5, n_ctx_train=64, n_vocab=49152)
    return LlamaConfig(**{**base, **kw})


# ---- the split ---------------------------------------------------------------------------------

def test_even_split_gives_every_rank_whole_kv_groups():
    cfg = smollm2_like(n_head=8, n_head_kv=4)
    shares = split.plan(cfg, 2, 32, 32)
    assert [s.kv_heads for s in shares] == [(0, 2), (2, 4)] and [s.heads for s in shares] == [(0, 4), (4, 8)]
    assert [s.ff for s in shares] == [(0, 768), (768, 1536)] and shares[1].vocab == (24576, 49152)
    assert shares[1].q_rows == (256, 512) and shares[1].kv_rows == (128, 256)
    whole = split.plan(cfg, 1, 32, 32)[0]
    assert whole.heads == (0, 8) and whole.ff == (0, 1536) and whole.vocab == (0, 49152)


def test_uneven_heads_are_evened_out_by_the_rest():
    """SmolLM2's 3 KV heads over 2 ranks: 1 and 2; the hidden units and vocabulary rows move to
    the rank with fewer heads until each holds about the same bytes (KV cache included)."""
    cfg = smollm2_like()
    cost = split.Costs(kv_group=37e6, ff_block=1.04e6, vocab_row=612.0)
    shares = split.plan(cfg, 2, 32, 32, cost)
    assert [s.kv_heads for s in shares] == [(0, 1), (1, 3)]
    held = [s.n_kv_heads * cost.kv_group + (s.ff[1] - s.ff[0]) / 32 * cost.ff_block
            + (s.vocab[1] - s.vocab[0]) * cost.vocab_row for s in shares]
    assert abs(held[0] - held[1]) < 0.02 * sum(held)
    plain = split.plan(cfg, 2, 32, 32)                 # the planted twin: without costs, not even
    held = [s.n_kv_heads * cost.kv_group + (s.ff[1] - s.ff[0]) / 32 * cost.ff_block
            + (s.vocab[1] - s.vocab[0]) * cost.vocab_row for s in plain]
    assert abs(held[0] - held[1]) > 0.1 * sum(held)


def test_a_rank_count_that_does_not_split_is_refused_with_the_valid_ones():
    with pytest.raises(split.SplitError, match=r"over 4 ranks: it has 3 KV heads .*valid rank counts: 1, 2, 3$"):
        split.plan(smollm2_like(), 4, 32, 32)
    # rank 1's heads would start at column 128 of attn_output, inside a 256-value block (Q4_K)
    tiny = smollm2_like(n_embd=256, n_ff=512, n_head=4, n_head_kv=2)
    with pytest.raises(split.SplitError, match=r"column 128 of attn_output, inside a block of 256 .*counts: 1$"):
        split.plan(tiny, 2, 256, 256)
    assert len(split.plan(tiny, 2, 32, 256)) == 2      # the twin: 32-value blocks cut there


# ---- the slices of the file --------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tp") / "tiny.gguf",
                            {"token_embd": GGMLType.Q8_0, "output": GGMLType.Q8_0})


def test_slices_are_the_files_bytes_and_nothing_more(tiny):
    t = GGUFFile(tiny).tensors["blk.0.ffn_down.weight"]            # Q8_0 [256, 512]: 16 blocks a row
    rows = shards.map_rows(tiny, t, 3, 7)
    assert np.array_equal(rows.data.reshape(4, -1), t.rows()[3:7]) and rows.shape == (4, 512)
    mapping = rows.data.base
    assert len(mapping) < rows.nbytes + 4096                       # its own mapping: the slice, page-rounded
    cols = shards.copy_columns(tiny, t, 64, 192)
    assert np.array_equal(cols.data.reshape(256, -1), t.rows()[:, 2 * 34:6 * 34]) and cols.shape == (256, 128)
    with pytest.raises(ValueError, match="columns 40..192 cut a Q8_0 block of 32"):
        shards.copy_columns(tiny, t, 40, 192)


# ---- real ranks ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rank_model(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("tp") / "tiny-k.gguf", RANK_TYPES)
    # The ranks below load their kernels from numba's cache: compiled here once, not by two ranks
    # at once inside mpiexec's deadline (a cold cache on a busy machine took longer than RUN_TIMEOUT_S)
    stage_logits(load("tp", path, threads=1))
    return path


def mpirun(n: int, *args, timeout_s: float = 3, launcher=None) -> subprocess.CompletedProcess:
    """mpiexec -n N python ARGS, every collective's deadline timeout_s (the warm-up's stays long);
    launcher: the mpiexec command and its options (default: this machine's, shared memory)."""
    env = {**os.environ, "LLM_TP_TIMEOUT": str(timeout_s)}
    return subprocess.run([*(launcher or [str(MPIEXEC)]), "-n", str(n), sys.executable, *map(str, args)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def stage_logits(engine):
    engine.reset()
    rows = [engine.forward(TOKENS[:SPLIT], 0)] + [engine.forward(TOKENS[i:i + 1], i) for i in range(SPLIT, len(TOKENS))]
    engine.reset()
    return np.concatenate(rows)


@pytest.fixture(scope="module")
def expected(rank_model):
    """The base stage's logits and greedy tokens (one process), and the float64 reference's logits."""
    from tests.tp_model import greedy
    engine = load(info("tp").builds_on, rank_model, threads=1)
    return {"logits": stage_logits(engine), "greedy": greedy(engine, TOKENS, GREEDY),
            "reference": reference.forward(GGUFFile(rank_model), TOKENS), "path": rank_model}


def parting_problem(reference_row, base_pick: int, tp_pick: int) -> str | None:
    """Why two 8-bit stages may not part here (None if they may): where the base and tp pick
    different tokens, the float64 reference must nearly tie the two picks with its best. Each
    stage's rounding moves a logit by up to about NEAR_TIE from the reference (test_stages), so a
    gap read off one of them counts its rounding twice (on the default model, a step where the
    reference's three best were nearly tied read, in the base's own logits, as a gap well past
    NEAR_TIE)."""
    best = reference_row.max()
    behind = {pick: float(best - reference_row[pick]) for pick in (base_pick, tp_pick)}
    far = {pick: round(gap, 3) for pick, gap in behind.items() if gap > NEAR_TIE}
    return None if not far else f"behind the float64 reference's best by {far} (a near-tie is {NEAR_TIE})"


def greedy_departs(got, want) -> str | None:
    """Why greedy tokens `got` are not the base's (None if they are): they part at a step where the
    float64 reference did not nearly tie the two picks (parting_problem)."""
    i = next((i for i, (a, b) in enumerate(zip(got, want["greedy"])) if a != b), None)
    if i is None:
        return None
    row = reference.forward(GGUFFile(want["path"]), TOKENS + list(want["greedy"][:i]))[-1]
    problem = parting_problem(row, want["greedy"][i], got[i])
    return None if problem is None else f"greedy step {i}: token {got[i]}, the base's {want['greedy'][i]}: {problem}"


def departs(got, want) -> str | None:
    """Why logits `got` are not the tp stage's (None if they are): NaN or Inf; farther from the
    float64 reference than TOLERANCE; another greedy token than the base's where the reference did
    not nearly tie the two (parting_problem)."""
    if not np.isfinite(got).all():
        return "NaN or Inf in the logits"
    ref = want["reference"]
    err = np.abs(got - ref).max()
    if err > TOLERANCE:
        return f"max |logit - float64 reference| = {err:.3f} > {TOLERANCE}"
    base = want["logits"].argmax(1)
    for i in np.flatnonzero(got.argmax(1) != base):
        problem = parting_problem(ref[i], int(base[i]), int(got[i].argmax()))
        if problem is not None:
            return f"position {i}: another greedy token than the base's, {problem}"
    return None


def test_one_rank_computes_the_base_stages_bits(rank_model, monkeypatch):
    """One rank runs the base's kernels on whole matrices, in pieces whose partial sums are its
    products exactly (0 + y), added to h as the base adds them: the same bits, tolerance 0. The
    planted twin: one partial sum one ulp off, once, and the bits differ."""
    want = stage_logits(load(info("tp").builds_on, rank_model, threads=1))
    engine = load("tp", rank_model, threads=1)
    assert engine.backend.ranks.size == 1
    assert np.array_equal(stage_logits(engine), want)
    ranks, real = engine.backend.ranks, engine.backend.ranks.allreduce
    calls = []

    def one_ulp_once(x, where):
        calls.append(where)
        return np.nextafter(x, np.inf, out=x) if len(calls) == 1 else real(x, where)
    monkeypatch.setattr(ranks, "allreduce", one_ulp_once)
    assert not np.array_equal(stage_logits(engine), want), "tolerance 0 missed a one-ulp change"


def row_parallel_bound(tensor, x) -> np.ndarray:
    """How far an all-reduce of column slices may be from the whole product x W^T, [M, N]: each
    output is a sum of the same float terms (one per block of the weight row and of x rounded to
    8 bits, computed alike whatever the slice), added in another order (each rank's terms, then
    the ranks' sums): at most 2 n u sum|terms| apart (Higham's gamma_n, twice), n the terms of a
    sum (at most K / 16: Q6_K's sub-blocks) and sum|terms| <= sum_k |w_k| |x^_k|, x^ as rounded."""
    w = dequantize(tensor.data, tensor.ggml_type, tensor.shape).astype(np.float64)
    qk = 256 if BLOCK_VALUES[int(tensor.ggml_type)] == 256 else 32
    q, d, _, _ = quantize_q8(x, qk)
    x_hat = dequantize_q8(q, d, qk).astype(np.float64)
    return 2 * (x.shape[1] // 16 + 1) * U * (np.abs(x_hat) @ np.abs(w).T)


ROW_PARALLEL = {"attn_output": "wo", "ffn_down": "w_down"}       # tensor role -> LayerWeights field


def row_parallel_error(path, got, role: str) -> float:
    """max |all-reduced - whole product| / its bound, for layer 0's `role` (attn_output, ffn_down):
    got[name + "_x"] the activations, got[name + "_sum"] the ranks' all-reduced products."""
    name = {"attn_output": "wo", "ffn_down": "down"}[role]
    x = got[name + "_x"]
    engine = load(info("tp").builds_on, path, threads=1)
    whole = engine.backend.matmul(x, getattr(engine.layers[0], ROW_PARALLEL[role]))
    bound = row_parallel_bound(GGUFFile(path).tensors[f"blk.0.{role}.weight"], x)
    return float((np.abs(got[name + "_sum"] - whole) / bound).max())


def test_two_ranks_give_the_base_stages_numbers(rank_model, expected, tmp_path):
    """Two ranks: each row-parallel matmul, all-reduced, within float32 reassociation of the whole
    product; the logits within the stage's tolerance of the float64 reference, the greedy tokens
    the base's (or a near-tie). Planted: the all-reduces left out, which both checks must catch."""
    out = tmp_path / "tp.npz"
    p = mpirun(2, "tests/tp_model.py", rank_model, out, ",".join(map(str, TOKENS)), SPLIT, "--plant-no-allreduce")
    assert p.returncode == 0, p.stderr[-3000:]
    got = dict(np.load(out))
    for role in ("attn_output", "ffn_down"):
        assert row_parallel_error(rank_model, got, role) <= 1, f"{role}: the ranks' sum is not the whole product"
    assert departs(got["logits"], expected) is None, departs(got["logits"], expected)
    assert departs(got["planted"], expected) is not None, "the comparison missed the planted bug (no all-reduce)"
    one_rank_only = {**got, "wo_sum": got["wo_sum"] / 2}             # the planted twin of the op check:
    assert row_parallel_error(rank_model, one_rank_only, "attn_output") > 1     # a part lost or halved
    cfg = LlamaConfig.from_gguf(GGUFFile(rank_model))
    assert int(got["kv_dim"]) == cfg.kv_dim // 2                   # each rank keeps its KV heads only
    assert "tp: 2 ranks: rank 0 (pid" in p.stderr


def test_a_bad_rank_count_ends_every_rank_with_the_valid_counts(rank_model, tmp_path):
    p = mpirun(3, "tests/tp_model.py", rank_model, tmp_path / "x.npz", "1,2", 1)
    assert p.returncode != 0
    assert "cannot be split over 3 ranks: it has 2 KV heads" in p.stderr and "valid rank counts: 1, 2" in p.stderr


def banner_pids(text: str) -> dict:
    """{rank: pid} from the line `tp: N ranks: rank 0 (pid P on HOST), ...` that rank 0 prints first.
    The ranks share one stderr, so another rank's words may stand before it on the same line."""
    line = next(ln for ln in text.splitlines() if "tp: " in ln and " ranks: " in ln)
    line = line[line.index("tp: "):]
    return {int(r): int(pid) for r, pid in re.findall(r"rank (\d+) \(pid (\d+)", line)}


@pytest.mark.parametrize("scenario", ["healthy", "stall", "leave", "leave-late", "kill", "no-start", "transport"])
def test_every_failure_of_a_rank_ends_the_run_naming_it(scenario):
    p = mpirun(2, "tests/tp_ranks.py", scenario)
    err = p.stderr
    if scenario == "healthy":                                       # the twin: nothing to report
        assert p.returncode == 0, err
        out = json.loads(p.stdout.strip().splitlines()[-1])
        assert out["sum"] == [3.0] * 5 and out["gathered"] == [0.0, 1.0, 1.0]
        assert out["stats"]["allreduce"]["calls"] == 1 and "ending all" not in err
        return
    assert p.returncode != 0
    if scenario == "no-start":                                      # MPI_Init waits for it: the C watchdog
        assert "rank 1: exiting before MPI starts" in err and "_wait_for_every_rank_to_start_mpi" in err
        return
    if scenario == "transport":                                     # every rank there, nothing completes
        assert "although every rank reached it: the MPI's transport between the ranks failed" in err
        assert "did not reach" not in err and "left the run" not in err
        return
    pid = banner_pids(err)[1]
    if scenario == "stall":
        assert f"rank 1 (pid {pid} on" in err and "did not reach the all-reduce after layer 0's attention" in err
    elif scenario in ("leave", "leave-late"):
        assert f"rank 1 (pid {pid} on" in err and "left the run" in err and "transport" not in err
    else:                                                           # mpiexec saw it die and ends the run
        assert mpiexec_saw_a_rank_killed(p.stdout + err, banner_pids(err).values()), p.stdout + err


@pytest.mark.parametrize("then", ["die", "stall", "raise"])
def test_a_rank_lost_during_generation_ends_the_run_naming_it(rank_model, tmp_path, then):
    from tests.tp_model import PLANTED_ERROR
    p = mpirun(2, "tests/tp_model.py", rank_model, tmp_path / "x.npz", ",".join(map(str, TOKENS)), SPLIT,
               "--then", then)
    assert p.returncode != 0 and "the run went on" not in p.stderr
    pid = banner_pids(p.stderr)[1]
    if then == "die":
        assert mpiexec_saw_a_rank_killed(p.stdout + p.stderr, banner_pids(p.stderr).values()), p.stdout + p.stderr
    elif then == "stall":
        assert f"rank 1 (pid {pid} on" in p.stderr and "did not reach the all-reduce after layer 0's attention" \
            in p.stderr
    else:                     # its own traceback, then the others' word on where they waited for it
        assert f"RuntimeError: {PLANTED_ERROR}" in p.stderr
        assert f"rank 1 (pid {pid} on" in p.stderr and "left the run" in p.stderr \
            and "at the all-reduce after layer 1's attention" in p.stderr


def test_a_step_of_many_sequences_runs_over_the_ranks_as_each_alone(rank_model, tmp_path):
    """The server's path over 2 ranks, driven by hand (tests/tp_model.py batch_steps): rank 0 builds
    steps of three sequences (two prompts prefilled together, a fork whose first write copies a
    shared page, decode steps), the other rank runs each from one broadcast of its arrays, over
    its own KV heads' pages. Every row's logits are the bits that sequence gets alone over the
    same ranks: repack computes a row alike in any batch, and the sum of two partial sums is the
    same in either order (tolerance 0). Planted: the following rank skips the page copies."""
    def run(*plant):
        out = tmp_path / f"batch{len(plant)}.npz"
        p = mpirun(2, "tests/tp_model.py", rank_model, out, ",".join(map(str, TOKENS)), SPLIT, "--batch", *plant)
        assert p.returncode == 0, p.stderr[-3000:]
        return dict(np.load(out))
    got = run()
    assert int(got["copies"]) >= 1, "the steps copied no page: the planted case would test nothing"
    assert int(got["broadcasts"]) == 4 + 1, "one broadcast per step (4), one to end them"
    assert np.array_equal(got["batch"], got["single"])
    planted = run("--plant-no-copies")
    assert not np.array_equal(planted["batch"], planted["single"]), "the comparison missed the skipped copies"


# ---- two hosts: network namespaces joined by a veth pair ------------------------------------------

def test_where_namespaces_cannot_be_made_the_skip_says_why(monkeypatch):
    """The machine's properties decide the two-host test's skip (the `ip` command, root), in words
    CI accepts as a machine's (tests/conftest.py EXPECTED_SKIPS)."""
    from app import netns
    from tests.conftest import expected_skip
    monkeypatch.setattr(netns.sys, "platform", "linux")
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert "needs root (this is uid 1000)" in netns.missing()
    monkeypatch.setattr(netns.shutil, "which", lambda name: None)
    why = netns.missing()
    assert "no `ip` command" in why and expected_skip(f"no network namespaces here: {why}")


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    from app import netns
    why = netns.missing()
    if why:
        pytest.skip(f"no network namespaces here: {why}")
    with netns.TwoHosts(tmp_path_factory.mktemp("netns"), prefix=f"llm-tp-test-{os.getpid()}") as hosts:
        yield hosts


def test_two_hosts_give_one_ranks_greedy_text_across_the_link(two_hosts, rank_model, expected, tmp_path):
    """One rank in each namespace, MPICH over TCP through the veth pair: the greedy tokens of one
    process, and the link carried at least the bytes the collectives sent. The planted twin: the
    same run left to MPICH's own choice of transport (shared memory between two processes of one
    machine) sends next to nothing across it, which the byte check catches."""
    def run(transport):
        out = tmp_path / f"{transport}.npz"
        before = two_hosts.link_bytes()
        p = mpirun(2, "tests/tp_model.py", rank_model, out, ",".join(map(str, TOKENS)), SPLIT, "--greedy", GREEDY,
                   launcher=[*two_hosts.mpiexec(transport=transport), "-f", str(two_hosts.hosts)], timeout_s=10)
        assert p.returncode == 0, p.stderr[-3000:]
        after = two_hosts.link_bytes()
        return dict(np.load(out)), min(after[ns] - before[ns] for ns in after)
    got, crossed = run(True)
    assert greedy_departs(got["greedy"].tolist(), expected) is None, greedy_departs(got["greedy"].tolist(), expected)
    worst = int(expected["logits"][-1].argmin())                  # planted: the base's least likely first token
    assert greedy_departs([worst, *got["greedy"][1:].tolist()], expected) is not None
    assert departs(got["logits"], expected) is None, departs(got["logits"], expected)
    # what each rank sends at the least: the hidden states of every row of both runs (the logits'
    # TOKENS, then the greedy run's prompt and steps), two all-reduces a layer, float32; a ring of
    # two ranks sends the whole of each
    cfg = LlamaConfig.from_gguf(GGUFFile(rank_model))
    floor = 4 * cfg.n_embd * 2 * cfg.n_layer * (2 * len(TOKENS) + GREEDY - 1)
    assert crossed >= floor, f"{crossed} bytes crossed the link, less than the collectives' {floor}"
    _, shared = run(False)
    assert shared < floor, "the byte check missed a run that did not cross the link"


def test_make_run_launches_through_the_command_its_host_file_names(tmp_path):
    """`make stage=tp run np=2 hosts=FILE`, dry run: a host file whose first line names the command
    that reaches its hosts (app/netns.py writes one) runs through it; the twin, a plain host file,
    through this checkout's mpiexec."""
    from app.netns import MPIEXEC_LINE
    named, plain = tmp_path / "named", tmp_path / "plain"
    named.write_text(f"{MPIEXEC_LINE}ip netns exec host-a mpiexec -iface tp0\n10.0.0.1:1\n")
    plain.write_text("10.0.0.1:1\n")

    def recipe(hosts):
        p = subprocess.run(["make", "-n", "--no-print-directory", "stage=tp", "run", "np=2", f"hosts={hosts}"],
                           cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        return p.stdout.strip().splitlines()[-1]
    assert recipe(named).startswith(f"ip netns exec host-a mpiexec -iface tp0 -n 2 -f {named} ")
    assert recipe(plain).startswith(f".venv/bin/mpiexec -n 2 -f {plain} ")


# ---- the record ------------------------------------------------------------------------------------

@pytest.mark.parametrize("record", sorted((ROOT / "profiles" / "bench").glob("tp_*.json")), ids=lambda p: p.name)
def test_the_chart_draws_from_the_record(record, tmp_path):
    from app.measure import tp_bench
    rec = json.loads(record.read_text())
    tp_bench.chart(rec, tmp_path / "tp.png")
    assert (tmp_path / "tp.png").stat().st_size > 10_000
    two = tp_bench.summary(rec)[tp_bench.label({"stage": "tp", "n_ranks": 2})]
    assert all(0 <= rk["allreduce_share"] < 1 for rk in two["ranks"])


# ---- the command a reader runs ---------------------------------------------------------------------

def test_the_parting_check_refuses_a_pick_far_behind():
    row = np.array([5.0, 4.9, 4.8, 1.0])
    assert parting_problem(row, 0, 2) is None and parting_problem(row, 1, 2) is None
    assert parting_problem(row, 0, 3) is not None and parting_problem(row, 3, 1) is not None


def test_make_run_np_2_generates_the_base_stages_text_or_a_near_tie(default_model_path):
    """`make stage=tp run np=2` (mpiexec -n 2 python -m app run --stage tp) on the default model:
    the base stage's greedy tokens, or the same up to a step where the float64 reference nearly
    tied the two stages' picks (parting_problem)."""
    def run(launcher):
        stage = ["--stage", "tp"] if launcher else ["--stage", info("tp").builds_on, "-t", "1"]
        p = subprocess.run(launcher + [sys.executable, "-m", "app", "run", "-m", str(default_model_path), "-n", "24",
                                       "--json", *stage], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr
    base, _ = run([])
    tp, err = run([str(MPIEXEC), "-n", "2"])
    assert "tp: 2 ranks: rank 0 (pid" in err and tp["prompt_tokens"] == base["prompt_tokens"]
    same = next((i for i, (a, b) in enumerate(zip(base["tokens"], tp["tokens"])) if a != b), None)
    if same is not None:
        row = reference.forward(GGUFFile(default_model_path), base["prompt_tokens"] + base["tokens"][:same])[-1]
        problem = parting_problem(row, base["tokens"][same], tp["tokens"][same])
        assert problem is None, \
            f"step {same}: the base chose {base['tokens'][same]}, tp {tp['tokens'][same]}: {problem}"
