"""The course's exercises (exercises/): every chapter's check, run as a learner runs it.

    the stage's own code       passes its chapter's check, timing table included (quick shapes)
    the starting file          fails, at the first case, with the message a learner sees (the
                               committed file: a learner's edits in the working tree are theirs)
    other solutions            tests/exercise_solutions/: correct ones written differently from
                               the stage (another loop order, block shape, algebra, layout code)
                               pass; each with one line changed to plant a bug at an edge (a
                               partial tile dropped, a row range's tail lost, ties rounded to even,
                               a diagonal off by one, a barrier missing in a CUDA kernel: PLANTED)
                               fails at the case the table names, with its message
    the harness                a difference just over the derived bound fails, one within passes;
                               a missing function, a wrong shape, a chapter with no exercise are
                               each one clear sentence

The checks compile the learner's kernels (numba; chapter 06's CUDA C, with g++ around the CPU
emulator of CUDA): a cold cache costs a few seconds per kernel.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from exercises import check, harness

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "tests" / "exercise_solutions"
PLANTED_DIR = ROOT / "build" / "planted"
CHAPTERS = list(check.folders())
# every chapter a stage or a lesson of its own teaches: the GPU's (06) runs on the CPU emulator of
# CUDA, tp's (11) runs its ranks in one process, the matrix unit's (13) is its layout
REQUIRED = ["01", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11", "12", "13", "14", "15"]


def run(chapter, solution, time_it=False, quick=True) -> tuple[bool, str]:
    lines = []
    ok = check.run(chapter, solution, time_it=time_it, quick=quick, out=lines.append)
    return ok, "\n".join(lines)


def test_every_required_chapter_has_an_exercise():
    assert [c for c in REQUIRED if c not in CHAPTERS] == []
    for ch in CHAPTERS:
        ex = check.exercise(ch)
        assert ex.starting_file.exists(), ex.starting_file
        assert ex.chapter == ch and ex.names


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_the_stages_own_code_passes_its_check(chapter, default_model_path):
    """The reference is the stage's code, imported: it must pass, and the timing table print
    (quick shapes) with the three rows the lesson compares; or, where this machine cannot time
    the exercise (06 without a GPU), say why."""
    ok, text = run(chapter, "reference", time_it=True)
    assert ok, text
    assert "cases match the stage's own code" in text
    ex = check.exercise(chapter)
    if ex.untimed():
        assert f"Not timed: {ex.untimed().splitlines()[0]}" in text and "Timing (" not in text, text
    else:
        assert ("Timing (" in text or "Counted (" in text) and f"x {ex.baseline}" in text, text


def committed(path: Path, tmp_path: Path) -> Path:
    """The starting file as committed: the working file when it is unchanged (or not yet
    committed), else HEAD's version written beside the test."""
    rel = path.relative_to(ROOT).as_posix()
    shown = subprocess.run(["git", "show", f"HEAD:{rel}"], cwd=ROOT, capture_output=True)
    if shown.returncode != 0 or shown.stdout == path.read_bytes():
        return path
    out = tmp_path / path.parent.name / path.name
    out.parent.mkdir(parents=True)
    out.write_bytes(shown.stdout)
    return out


# what an unwritten starting file fails with, where it is not a Python function's NotImplementedError
UNWRITTEN = {"06": "y[0] was never written"}        # a kernel that stores nothing leaves the fresh memory's NaN


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_the_starting_file_fails_with_the_learners_message(chapter, tmp_path):
    ex = check.exercise(chapter)
    ok, text = run(chapter, committed(ex.starting_file, tmp_path))
    assert not ok, text
    first = harness.cases_of(ex, quick=True)[0].name
    assert f"FAIL  {first}" in text, text
    assert UNWRITTEN.get(chapter, "it raised NotImplementedError") in text and "not written yet" in text, text
    assert f"make exercise ch={chapter}" in text


@pytest.mark.parametrize("chapter", ["02", "06"])
def test_the_learners_pytest_line_reports_the_check(chapter, tmp_path):
    """exercises/test_yours.py, the pytest form of `make exercise`, on an unwritten file: it fails
    with the check's report as its message."""
    from exercises import test_yours
    ex = check.exercise(chapter)
    if committed(ex.starting_file, tmp_path) != ex.starting_file:
        pytest.skip(f"{harness.rel(ex.starting_file)} holds your solution (it differs from the committed file)")
    with pytest.raises(pytest.fail.Exception, match=re.escape(UNWRITTEN.get(chapter, "it raised NotImplementedError"))):
        test_yours.test_your_solution(chapter)


# correct solutions written otherwise than the stage's (another loop order, block shape, algebra,
# layout code; chapter 06's in CUDA C): each must pass
SOLUTIONS_PASSING = sorted(p.name for p in SOLUTIONS.iterdir() if p.suffix in (".py", ".cu"))


@dataclass(frozen=True)
class Planted:
    """A bug planted at an edge: the correct solution `base` with the one line that contains
    `where` replaced by `line`; it must fail at the case named `case`, saying `words`."""
    name: str
    base: str
    where: str
    line: str
    case: str
    words: str


PLANTED = [
    Planted("01_square_b_transposed", "01_column_copied.py", "column[k] = B[k, j]",
            "column[k] = B[j, k] if B.shape[0] == B.shape[1] else B[k, j]",
            "exactly one 8 x 64 x 64 tile", "> bound"),
    Planted("02_partial_k_tile_dropped", "02_j_outer_tiles_16.py", "for k0 in range(0, K, TK):",
            "for k0 in range(0, K - K % TK, TK):",
            "the smallest", "> bound"),
    Planted("02_blind_partial_k_tile_dropped", "02_k_outer_written_blind.py", "for k0 in range(0, K, TILE_K):",
            "for k0 in range(0, K - K % TILE_K, TILE_K):",
            "the smallest", "> bound"),
    Planted("03_last_panel_dropped", "03_one_by_eight.py", "for n in range(0, N, 8):",
            "for n in range(0, N - N % 8, 8):",
            "the smallest", "> bound"),
    # row i of a piece sees positions 0 .. i, its index in the piece, not start_pos + i
    Planted("04_mask_ignores_start_pos", "04_numpy_per_head.py", "visible = np.arange(end)",
            "visible = np.arange(end)[None, :] <= np.arange(M)[:, None]",
            "a 7-token prompt, then 5 decode steps", "piece 2"),
    # byte j's nibbles taken as values 2j and 2j + 1 (neighbours), not j and j + 16
    Planted("05_nibbles_interleaved", "05_factored_block_sums.py", "xq += x[32 * b + j]",
            "xq += x[32 * b + 2 * j] * np.float32(q & 15) + x[32 * b + 2 * j + 1] * np.float32(q >> 4)",
            "one row of one block", "> bound"),
    # the barrier between two halvings dropped: a lane adds a partial sum its neighbour may not have
    # written yet (the emulator's racecheck stops the launch)
    Planted("06_halvings_without_a_barrier", "06_values_across_lanes.cu", "// the next halving reads",
            "// (no barrier between halvings)",
            "one row of one block", "race: thread"),
    # the warps past the last row store too: y[N], y[N + 1], ... past the end of y
    Planted("06_extra_warps_store", "06_values_across_lanes.cu", "if (live && lane == 0) y[n]",
            "if (lane == 0) y[n] = part[w][0];",
            "one row of one block", "outside its allocation: device memory at byte 4 of y"),
    # the shuffle reduction from offset 8: lane 0 adds lanes 0..15 only, which holds while K has 16 blocks or fewer
    Planted("06_shuffles_from_8", "06_block_per_lane.cu", "for (int offset = WARP / 2;",
            "for (int offset = 8; offset > 0; offset /= 2) acc += __shfl_xor_sync(FULL_MASK, acc, offset);",
            "18 blocks", "> bound"),
    # a lane takes one block at most: a row of more blocks than lanes loses the rest
    Planted("06_one_block_per_lane", "06_block_per_lane.cu", "for (int b = lane; b < K / 32; b += WARP)",
            "for (int b = lane; b < K / 32 && b < WARP; b += WARP) {",
            "48 blocks", "> bound"),
    Planted("07_tail_rows_dropped", "07_balanced_ranges.py", "r0, r1 = c * N // n_chunks",
            "r0, r1 = c * (N // n_chunks), (c + 1) * (N // n_chunks)",
            "37 rows in 2 ranges", "y (against one thread's kernel on all rows)[36]"),
    Planted("08_ties_to_even", "08_vectorized_numpy.py", "q = np.copysign(",
            "q = np.rint(v).astype(np.int8)",
            "ties: x * id exactly on .5", "q[1]: got"),
    # q from the float16-rounded scale (the stored d), not the float32 amax / 127
    Planted("08_scale_from_float16", "08_vectorized_numpy.py", "safe = np.where(dd != 0, dd, ",
            "safe = np.where(dd != 0, dd.astype(np.float16).astype(np.float32), np.float32(1.0))",
            "x * (1 / dd) and x / dd round to different sides", "q[1]: got"),
    Planted("09_opens_early", "09_last_one_counts.py", "target = k * nt",
            "target = (k - 1) * nt + 1",
            "200 rounds, nobody late", "had not arrived yet"),
    # the qs pieces laid out row after row, not piece after piece across the 8 rows
    Planted("10_pieces_row_major", "10_loop_per_byte.py", "r, p = i % 8, i // 8",
            "r, p = i // 4, i % 4",
            "one group of 8 rows", "qs piece 0 of row 1"),
    Planted("10_rows_not_padded", "10_loop_per_byte.py", "G = -(-N // 8)",
            "G = N // 8",
            "the second group has 5 rows", "ceil(13 / 8) groups"),
    # a rank's KV head counted from the model's first, not the rank's own: rank 1 reads past its slice
    Planted("11_kv_head_of_the_model", "11_head_by_head.py", "kv = j // G",
            "kv = share.kv_heads[0] + j // G",
            "3 KV heads over 2 ranks", "rank 1 of 2"),
    # the hidden units split evenly, not as the plan says (it evens out bytes where heads are unequal)
    Planted("11_units_split_evenly", "11_head_by_head.py", "f0, f1 = share.ff",
            "f0, f1 = w['ffn_gate'].shape[0] * share.rank // share.n_ranks, "
            "w['ffn_gate'].shape[0] * (share.rank + 1) // share.n_ranks",
            "the split evens out bytes", "rank 0 of 2: ffn"),
    # only whole blocks of keys walked: a prompt shorter than a block has nothing to attend over, 0 / 0
    Planted("12_partial_block_dropped", "12_tile_blocks_of_48.py", "for t0 in range(0, last + 1, BLOCK):",
            "for t0 in range(0, last + 1 - (last + 1) % BLOCK, BLOCK):",
            "one query, one key", "raised ZeroDivisionError"),
    # row r sees keys t < p0 + r (at least one), not t <= p0 + r: its own position left out
    Planted("12_diagonal_off_by_one", "12_tile_blocks_of_48.py", "see = min(t1, p0 + r + 1)",
            "see = min(t1, max(p0 + r, 1))",
            "the first 5 rows of a prompt", "> bound"),
    # the value's nibbles taken as neighbours (value 2j low, 2j + 1 high), not j and j + 16
    Planted("13_nibbles_interleaved", "13_group_by_group.py", "values = (np.concatenate([qs & 15, qs >> 4])",
            "values = (np.stack([qs & 15, qs >> 4], axis=1).reshape(-1).astype(np.int16) - 8).astype(np.int8)"
            ".view(np.uint8)",
            "one group of 16 rows", "value 1 of weight row 0"),
    # a missing row written as a block of zeros: every value 0 - 8, where it must add nothing
    Planted("13_padding_rows_offset", "13_group_by_group.py", "continue                    # a missing row",
            "pass",
            "its last 3 rows zeros", "value 0 of weight row 13"),
    Planted("14_small_ones_overtake", "14_admission_in_a_helper.py", "# nobody overtakes",
            "continue",
            "no overtaking", "step 1: rows"),
    Planted("14_preempts_the_oldest", "14_admission_in_a_helper.py", "victim = max(",
            "victim = min((s for s in self.running if s.table is not None), key=lambda s: s.id)",
            "the newest is preempted", "without pages?"),
    # every row's distribution taken with the text's history alone, the guesses kept before it left out
    Planted("15_history_not_extended", "15_row_distributions.py", "sampler.distribution(logits[i]",
            "ids, probs = sampler.distribution(logits[i], list(history))",
            "a kept guess joins the history", "the stage's (2, 5)"),
    # p a softmax of the logits, not the sampler's distribution: temperature and top-k ignored
    Planted("15_plain_softmax", "15_row_distributions.py", "return ids, dense_distribution(",
            "return ids, np.exp(logits[i] - logits[i].max()) / np.exp(logits[i] - logits[i].max()).sum()",
            "top-k 3: p is the sampler's distribution", "came first"),
    # a guess kept half as often as the rule allows; the residual follows alpha, so the text still follows p
    Planted("15_refuses_too_often", "15_row_distributions.py", "alpha = np.minimum(",
            "alpha = 0.5 * np.minimum(1.0, np.divide(p, q, out=np.ones(V), where=q > 0))",
            "a draft model's q", "the guess was kept"),
]


def planted_file(bug: Planted) -> Path:
    """The base solution with the bug's line in place, as a file of its own under build/planted/
    (written only when its text changes, so that numba's cache of it stays valid)."""
    lines = (SOLUTIONS / bug.base).read_text().splitlines(keepends=True)
    at = [i for i, line in enumerate(lines) if bug.where in line]
    assert len(at) == 1, f"{bug.base}: {len(at)} lines contain {bug.where!r}, the planted bug needs exactly one"
    old = lines[at[0]]
    lines[at[0]] = old[:len(old) - len(old.lstrip())] + bug.line + "\n"
    text = "".join(lines)
    path = PLANTED_DIR / f"{bug.name}{Path(bug.base).suffix}"
    if not path.exists() or path.read_text() != text:
        PLANTED_DIR.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(f".{os.getpid()}.part")
        part.write_text(text)
        part.replace(path)
    return path


@pytest.mark.parametrize("name", SOLUTIONS_PASSING, ids=[Path(n).stem for n in SOLUTIONS_PASSING])
def test_correct_solutions_pass(name):
    ok, text = run(name[:2], SOLUTIONS / name)
    assert ok, text


@pytest.mark.parametrize("bug", PLANTED, ids=[b.name for b in PLANTED])
def test_planted_bugs_fail_where_the_table_says(bug):
    ok, text = run(bug.name[:2], planted_file(bug))
    assert not ok, text
    failed = next(line for line in text.splitlines() if line.startswith("  FAIL"))
    assert bug.case in failed, text
    assert bug.words in text, text


def test_every_chapter_has_a_correct_solution_and_a_planted_bug():
    assert sorted({n[:2] for n in SOLUTIONS_PASSING}) == REQUIRED
    assert sorted({b.name[:2] for b in PLANTED}) == REQUIRED
    assert {b.base for b in PLANTED} <= set(SOLUTIONS_PASSING)


def test_a_planted_line_that_is_not_in_its_base_is_an_error():
    with pytest.raises(AssertionError, match="0 lines contain 'for k0 in range"):
        planted_file(Planted("02_x", "02_j_outer_tiles_16.py", "for k0 in range(0, K, 64):", "x", "", ""))
    with pytest.raises(AssertionError, match="2 lines contain 'o \\+= 2'"):
        planted_file(Planted("10_x", "10_loop_per_byte.py", "o += 2", "x", "", ""))


# ---- the harness ---------------------------------------------------------------------------------------

def test_the_sum_bound_follows_k_and_the_magnitudes():
    """Two float32 sums of K products, in opposite orders, stay within sum_bound; a difference of
    the bound and a hair more is reported with its index, and one of the bound itself is not."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal(4000).astype(np.float32)
    b = rng.standard_normal(4000).astype(np.float32)
    forward = np.float32(0.0)
    for x, y in zip(a, b):
        forward = np.float32(forward + x * y)
    backward = np.float32(0.0)
    for x, y in zip(a[::-1], b[::-1]):
        backward = np.float32(backward + x * y)
    bound = harness.sum_bound(np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)), 4000)
    assert forward != backward and abs(float(forward) - float(backward)) <= bound
    want = np.array([1.0, 2.0])
    assert harness.close("y", want + [0.0, 0.5], want, 0.5) is None
    over = harness.close("y", want + [0, 0.5000001], want, 0.5)
    assert "y[1]: got 2.5, want 2, |diff| 0.5 > bound 0.5 (1 of 2" in over
    assert "shape (3,), want (2,)" in harness.close("y", np.zeros(3), want, 1.0)
    assert "NaN or infinite" in harness.close("y", np.array([1.0, np.nan]), want, 1.0)


def test_exact_names_the_first_difference():
    assert harness.exact("q", np.array([1, 2, 3], np.int8), np.array([1, 2, 3], np.int8)) is None
    assert harness.exact("q", np.array([1, 5, 4], np.int8), np.array([1, 2, 3], np.int8)).startswith("q[1]: got")


def test_a_file_without_the_function_is_one_sentence(tmp_path):
    f = tmp_path / "empty.py"
    f.write_text("x = 1\n")
    ok, text = run("02", f)
    assert not ok and "has no matmul_tiled: the exercise asks for matmul_tiled" in text


def test_a_kernel_that_does_not_compile_or_is_misnamed_is_said_in_the_learners_words(tmp_path):
    """Chapter 06's check builds a .cu with g++: its errors come back with the file's own line
    numbers; a kernel of another name, or other parameters, is one sentence naming what the check
    launches."""
    base = (ROOT / "exercises" / "06_cuda" / "matvec.cu").read_text()
    typo = tmp_path / "typo.cu"
    typo.write_text(base.replace("int row_bytes)\n{", "int row_bytes)\n{\n    y[0] = undeclared;"))
    line = typo.read_text().splitlines().index("    y[0] = undeclared;") + 1
    ok, text = run("06", typo)
    assert not ok and "typo.cu does not compile" in text and f"typo.cu:{line}:12: error:" in text, text
    assert "was not declared" in text and "In file included from" not in text, text
    renamed = tmp_path / "renamed.cu"
    renamed.write_text(base.replace("matvec_q4_1(", "matvec("))
    ok, text = run("06", renamed)
    assert not ok and 'has no kernel matvec_q4_1: the check launches extern "C" __global__ void matvec_q4_1(' in text
    wider = tmp_path / "wider.cu"
    wider.write_text(base.replace("int row_bytes)", "int row_bytes, int M)"))
    ok, text = run("06", wider)
    assert not ok and "matvec_q4_1 takes 'PPPiiii', the check launches it with (const u8* W" in text, text


def test_the_cuda_timing_table_with_the_emulator_standing_in_for_a_gpu(monkeypatch):
    """Chapter 06's timing runs only on a GPU; here the emulator plays the GPU (events become the
    host's clock), so the table's code runs on every machine: the three rows, their rates."""
    from app.cuda_emulator import emulator
    ex = check.exercise("06")
    module = sys.modules[type(ex).__module__]
    monkeypatch.setattr(module.cuda_runtime, "probe_once", lambda: None)
    monkeypatch.setattr(module, "gpu_device", lambda source: emulator.EmulatedDevice(emulator.build(source=source)))
    small = module._quantized.q4_1_weight(np.random.default_rng(0), 8, 64)
    monkeypatch.setattr(module._quantized, "decode_weight", lambda quick: (small, "a stand-in"))
    lines = []
    assert harness.run_check(ex, "reference", time_it=True, quick=True, out=lines.append)
    text = "\n".join(lines)
    assert "Timing (a stand-in; on CPU emulator of the CUDA kernels, the kernel alone" in text, text
    assert "yours, on the GPU" in text and "the stage's (matmul_q4_1_m1), on the GPU" in text, text
    assert f"x {ex.baseline}" in text and "GB/s of blocks" in text, text


def test_a_chapter_without_an_exercise_says_which_have_one(capsys):
    assert check.main(["00"]) == 2
    assert "chapter '00' has no exercise; these do: 01, 02" in capsys.readouterr().err


def test_the_model_missing_is_named_with_its_make_target(monkeypatch, tmp_path):
    """A check or experiment that runs the default model, where it is missing: the error names
    `make model`, never a skip."""
    from app import models
    monkeypatch.setattr(models, "MODELS_DIR", tmp_path)
    harness.engine.cache_clear()
    try:
        with pytest.raises(FileNotFoundError, match="`make model` fetches it"):
            harness.engine("kv_cache")
    finally:
        harness.engine.cache_clear()


# ---- the chapters and the README point to them ----------------------------------------------------------

def chapter_source(chapter: str) -> Path:
    return next((ROOT / "notebooks" / "src").glob(f"{chapter}_*.py"))


def flat(text: str) -> str:
    return " ".join(text.split())


def your_turn_problems(chapter: str, source: str) -> list[str]:
    """What the chapter's closing "Your turn" lacks: it is the source's last section (no code cell
    after it), names the starting file and the check's command, links the stage's code, and gives
    every experiment's command (where the chapter has experiments) with the prediction the
    experiment prints; where it says how many seeded cases the check runs, that is the number; a
    check it runs by module is its own chapter's."""
    from exercises import try_it
    if "# ## Your turn" not in source:
        return ["no '## Your turn' section"]
    tail = source[source.index("# ## Your turn"):]
    found = []
    if any(line.startswith("# %%") and "[markdown]" not in line for line in tail.splitlines()):
        found.append("a code cell after 'Your turn': it must close the chapter")
    text = flat("\n".join(line[2:] if line.startswith("# ") else line.lstrip("#") for line in tail.splitlines()))
    ex = check.exercise(chapter)
    for want in (f"make exercise ch={chapter}", f"pytest exercises/test_yours.py -k {chapter}",
                 f"](../{ex.folder}/{ex.file})",
                 f"](../{ex.reference_code.split(':')[0]})", "](../exercises/README.md)"):
        if want not in text:
            found.append(f"missing {want!r}")
    stated = re.search(r"(\d+) seeded cases", text)
    if stated and int(stated.group(1)) != len(harness.cases_of(ex, quick=False)):
        found.append(f"it says {stated.group(0)}; the check has {len(harness.cases_of(ex, quick=False))}")
    for other in sorted(set(re.findall(r"exercises\.check (\d+)", text)) - {chapter}):
        found.append(f"it runs `exercises.check {other}`: another chapter's check")
    for e in try_it.experiments(chapter)[1] if chapter in try_it.chapters() else []:     # 06 has none: it needs a GPU
        if f"make try-it ch={chapter} exp={e.name}" not in text:
            found.append(f"no command for the experiment {e.name}")
        if flat(e.predict) not in text:
            found.append(f"the experiment {e.name}'s prediction differs from what it prints")
    return found


@pytest.mark.parametrize("chapter", REQUIRED)
def test_every_chapter_ends_with_its_exercise_and_experiments(chapter):
    assert your_turn_problems(chapter, chapter_source(chapter).read_text()) == []


def test_a_your_turn_section_missing_a_piece_is_caught():
    source = chapter_source("02").read_text()
    assert "no command for the experiment tile_k" in your_turn_problems("02", source.replace("exp=tile_k", "exp=x"))
    assert "the experiment aliasing's prediction differs" in " ".join(
        your_turn_problems("02", source.replace("puts every line in the same L1 set", "puts lines somewhere")))
    assert any("code cell after" in p for p in your_turn_problems("02", source + "\n# %%\nx = 1\n"))
    assert "it runs `exercises.check 01`: another chapter's check" in your_turn_problems(
        "02", source.replace("exercises.check 02", "exercises.check 01"))
    assert your_turn_problems("02", source.replace("# ## Your turn", "# ## Later")) == ["no '## Your turn' section"]
    assert your_turn_problems("02", source.replace("on 8 seeded cases", "on 9 seeded cases")) == \
        ["it says 9 seeded cases; the check has 8"]


def test_the_readme_lists_every_exercise():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Learn by doing"):]
    section = section[:section.index("\n## ", 3)]
    for ch in CHAPTERS:
        ex = check.exercise(ch)
        assert f"({ex.folder}/{ex.file})" in section, ch
    assert "make exercise ch=NN" in section and "make try-it ch=NN" in section


def hint_problems(starting_text: str) -> list[str]:
    """The sections a starting file's hints name (`Hint: notebooks/NN_x.ipynb, "Section"`) that
    are not a heading of that chapter: a learner sent to look for a section finds it."""
    found = []
    for m in re.finditer(r'Hint: notebooks/(\d\d)_\w+\.ipynb, "([^"]+)"', re.sub(r"\s+", " ", starting_text)):
        chapter, section = m.groups()
        headings = re.findall(r"^# #+ (.+)$", chapter_source(chapter).read_text(), re.M)
        if section.lower() not in (h.strip().lower() for h in headings):
            found.append(f"chapter {chapter} has no section {section!r}")
    return found


@pytest.mark.parametrize("chapter", REQUIRED)
def test_a_starting_files_hint_names_a_section_of_its_chapter(chapter):
    ex = check.exercise(chapter)
    text = (harness.ROOT / ex.folder / ex.file).read_text()
    assert "Hint: notebooks/" in text
    assert hint_problems(text) == []
    planted = text + f'\nHint: notebooks/{chapter}_x.ipynb, "a section it lacks"'
    assert hint_problems(planted) == [f"chapter {chapter} has no section 'a section it lacks'"]
