"""The tp stage: the split (who owns what, which rank counts work, even bytes), the slices of the
file, 2 real MPI ranks on a tiny model against the stage tp builds on (with a planted bug the
comparison must catch), a bad rank count refused with the valid ones, and every way a rank can
fail ending the run with a message that names it, never a hang (tests/tp_ranks.py and
tests/tp_model.py run under mpiexec)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from common.gguf import GGMLType, GGUFFile
from common.model import LlamaConfig
from stages import info, load
from stages.parallel import shards, split
from tests.test_quantized import write_tiny_llama

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = Path(sys.executable).parent / "mpiexec"
TOKENS = [3, 17, 42, 5, 63, 0, 8, 21, 9, 30]
SPLIT = 6
# logits, max |tp - base| on the tiny model: the all-reduce adds Wo's and W_down's partial sums
# in another order; measured 0 here, and each float ulp can move an int8 rounding step in a later
# layer. The planted bug (no all-reduce) moves them by several logits.
LOGIT_TOLERANCE = 0.1
NEAR_TIE = 0.25
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

def mpirun(n: int, *args, timeout_s: float = 3) -> subprocess.CompletedProcess:
    """mpiexec -n N python ARGS, every collective's deadline timeout_s (the warm-up's stays long)."""
    env = {**os.environ, "LLM_TP_TIMEOUT": str(timeout_s)}
    return subprocess.run([str(MPIEXEC), "-n", str(n), sys.executable, *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def base_logits(path):
    engine = load(info("tp").builds_on, path, threads=1)
    engine.reset()
    rows = [engine.forward(TOKENS[:SPLIT], 0)] + [engine.forward(TOKENS[i:i + 1], i) for i in range(SPLIT, len(TOKENS))]
    return np.concatenate(rows)


def departs(got, want) -> str | None:
    """Why got is not the base stage's logits (None if it is, within the stated bounds)."""
    if not np.isfinite(got).all():
        return "NaN or Inf in the logits"
    err = np.abs(got - want).max()
    if err > LOGIT_TOLERANCE:
        return f"max |logit - base| = {err:.3f} > {LOGIT_TOLERANCE}"
    for i in np.flatnonzero(got.argmax(1) != want.argmax(1)):
        gap = want[i].max() - want[i, got[i].argmax()]
        if gap > NEAR_TIE:
            return f"position {i}: another greedy token, {gap:.3f} below the base's best (not a near-tie)"
    return None


def test_two_ranks_give_the_base_stages_logits(tiny, tmp_path):
    out = tmp_path / "tp.npz"
    p = mpirun(2, "tests/tp_model.py", tiny, out, ",".join(map(str, TOKENS)), SPLIT, "--plant-no-allreduce")
    assert p.returncode == 0, p.stderr[-3000:]
    got = np.load(out)
    want = base_logits(tiny)
    assert departs(got["logits"], want) is None, departs(got["logits"], want)
    assert departs(got["planted"], want) is not None, "the comparison missed the planted bug (no all-reduce)"
    cfg = LlamaConfig.from_gguf(GGUFFile(tiny))
    assert int(got["kv_dim"]) == cfg.kv_dim // 2                   # each rank keeps its KV heads only
    assert "tp: 2 ranks: rank 0 (pid" in p.stderr


def test_a_bad_rank_count_ends_every_rank_with_the_valid_counts(tiny, tmp_path):
    p = mpirun(3, "tests/tp_model.py", tiny, tmp_path / "x.npz", "1,2", 1)
    assert p.returncode != 0
    assert "cannot be split over 3 ranks: it has 2 KV heads" in p.stderr and "valid rank counts: 1, 2" in p.stderr


def banner_pids(text: str) -> dict:
    """{rank: pid} from the line `tp: N ranks: rank 0 (pid P on HOST), ...` that rank 0 prints first.
    The ranks share one stderr, so another rank's words may stand before it on the same line."""
    line = next(ln for ln in text.splitlines() if "tp: " in ln and " ranks: " in ln)
    line = line[line.index("tp: "):]
    return {int(r): int(pid) for r, pid in re.findall(r"rank (\d+) \(pid (\d+)", line)}


@pytest.mark.parametrize("scenario", ["healthy", "stall", "leave", "kill", "no-start"])
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
    pid = banner_pids(err)[1]
    if scenario == "stall":
        assert f"rank 1 (pid {pid} on" in err and "did not reach the all-reduce after layer 0's attention" in err
    elif scenario == "leave":
        assert f"rank 1 (pid {pid} on" in err and "left the run" in err
    else:                                                           # mpiexec saw it die and names its pid
        assert re.search(rf"PID {pid} RUNNING AT", p.stdout + err) and "BAD TERMINATION" in p.stdout + err


@pytest.mark.parametrize("then", ["die", "stall"])
def test_a_rank_lost_during_generation_ends_the_run_naming_it(tiny, tmp_path, then):
    p = mpirun(2, "tests/tp_model.py", tiny, tmp_path / "x.npz", ",".join(map(str, TOKENS)), SPLIT, "--then", then)
    assert p.returncode != 0 and "the run went on" not in p.stderr
    pid = banner_pids(p.stderr)[1]
    if then == "die":
        assert re.search(rf"PID {pid} RUNNING AT", p.stdout + p.stderr)
    else:
        assert f"rank 1 (pid {pid} on" in p.stderr and "did not reach the all-reduce after layer 0's attention" \
            in p.stderr


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

def test_make_run_np_2_generates_the_base_stages_text_or_a_near_tie(default_model_path):
    """`make stage=tp run np=2` (mpiexec -n 2 python -m app run --stage tp) on the default model:
    the base stage's greedy tokens, or the same up to a step where the base's own logits were
    nearly tied between its pick and tp's."""
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
        engine = load(info("tp").builds_on, default_model_path, threads=1)
        row = engine.forward(base["prompt_tokens"] + base["tokens"][:same], 0, all_logits=False)[0]
        gap = row.max() - row[tp["tokens"][same]]
        assert gap <= NEAR_TIE, f"step {same}: tp chose {tp['tokens'][same]}, {gap:.3f} below the base's best"
