"""The CPU emulator of the CUDA kernels (app/cuda_emulator/) against bugs planted on purpose.

Each kernel of tests/fixtures/cuda_emulator_planted.cu holds one bug a GPU shows and a plain CPU run
hides (threads run one at a time, memory starts zeroed), beside its correct version. The emulator
must fail every buggy kernel, with a message that says what is wrong, under every schedule, and
run every correct one to the right values. The AddressSanitizer build runs here too, on the cuda
stage's own kernel tests and on a read past an allocation.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from app.cuda_emulator import emulator as ce

ROOT = Path(__file__).resolve().parent.parent
PLANTED = ROOT / "tests" / "fixtures" / "cuda_emulator_planted.cu"
THREADS = 128
SCHEDULES = [("forward", 0, 0.0), ("reverse", 0, 0.0), ("random", 1, 0.2), ("random", 2, 0.2), ("random", 3, 0.0)]
SCHEDULE_IDS = ["forward", "reverse", "random1", "random2", "random3-no-preempt"]
RACE, UNINITIALIZED = "race: ", "that nothing has written"


@pytest.fixture(scope="module")
def lib_path():
    if ce.compiler() is None:
        pytest.skip("no g++ to build the CUDA emulator")
    return ce.build(source=PLANTED)


@pytest.fixture
def device(lib_path):
    d = ce.EmulatedDevice(lib_path)
    yield d
    d.set_schedule("forward")
    d.set_checks(True)


def upload(device, a):
    a = np.ascontiguousarray(a, np.float32)
    _, ptr = device.alloc(a.nbytes)
    device.htod(ptr, a)
    return ptr


def output(device, n):
    _, ptr = device.alloc(4 * n)
    return ptr


def download(device, ptr, n):
    host = np.empty(n, np.float32)
    device.dtoh(host, ptr)
    return host


def run(device, name, x, n_out, grid=1, block=THREADS):
    """Launch kernel(x, out) and return out [n_out]; EmulatorError if the emulator refuses it."""
    out = output(device, n_out)
    device.function(name, "PP")((grid,), (block,), upload(device, x), out)
    return download(device, out, n_out)


X = np.arange(1, THREADS + 1, dtype=np.float32)

# (buggy kernel, what the emulator must say, its correct twin, what the twin computes from X)
PLANTED_BUGS = {
    "lost update": ("sum_racy", RACE, "sum_atomic", lambda x: x.sum(keepdims=True)),
    "unwritten shared": ("read_unwritten", UNINITIALIZED, "read_written", lambda x: np.roll(x, -1)),
    "missing barrier": ("broadcast_unsynced", f"{RACE}|{UNINITIALIZED}", "broadcast_synced",
                        lambda x: np.full_like(x, 2 * x[0])),
    "write after read": ("rotate_unsynced", RACE, "rotate_synced", lambda x: np.roll(x, -1)),
}


@pytest.mark.parametrize("schedule", SCHEDULES, ids=SCHEDULE_IDS)
@pytest.mark.parametrize("bug", list(PLANTED_BUGS))
def test_a_planted_bug_is_caught_and_its_fix_passes(device, bug, schedule):
    buggy, message, fixed, want = PLANTED_BUGS[bug]
    device.set_schedule(*schedule)
    with pytest.raises(ce.EmulatorError, match=message) as caught:
        run(device, buggy, X, THREADS)
    assert "__shared__ memory at '" in str(caught.value)          # names the variable
    got = run(device, fixed, X, THREADS)
    np.testing.assert_array_equal(got[:len(want(X))], want(X))


def test_the_issues_kernel_fails_where_it_used_to_pass(device):
    """Every thread does acc += x[t] on a shared value, then reads a shared table nobody wrote:
    in forward and reverse order, on zeroed memory, that gave the exact sum and 0.0. Now the
    checker names the race; with the checks off, interleaved threads lose updates and the table
    reads as poison (NaN), which is what a GPU does to this kernel (a lost update, garbage)."""
    ones = np.ones(THREADS, np.float32)
    for schedule in SCHEDULES:
        device.set_schedule(*schedule)
        with pytest.raises(ce.EmulatorError, match=RACE):
            run(device, "sum_then_unwritten", ones, 1 + THREADS)
    device.set_checks(False)
    sums = []
    for seed in range(1, 6):
        device.set_schedule("random", seed, 0.3)
        out = run(device, "sum_then_unwritten", ones, 1 + THREADS)
        sums.append(out[0])
        assert np.isnan(out[1:]).all(), "the unwritten table must read as poison, not zeros"
    assert min(sums) < THREADS, f"no update was lost in 5 interleavings: {sums}"
    device.set_schedule("forward")
    assert run(device, "sum_then_unwritten", ones, 1 + THREADS)[0] == THREADS   # one thread at a time: exact


def test_the_schedules_are_different_interleavings(device):
    """Each thread takes a ticket from an atomic counter: forward and reverse give the two
    orders, every random seed another permutation."""
    orders = {}
    for schedule in SCHEDULES:
        device.set_schedule(*schedule)
        orders[schedule] = tuple(run(device, "arrival_order", X, THREADS).astype(int))
    assert all(sorted(o) == list(range(THREADS)) for o in orders.values())
    assert orders[SCHEDULES[0]] == tuple(range(THREADS)) and orders[SCHEDULES[1]] == tuple(range(THREADS))[::-1]
    assert len(set(orders.values())) == len(SCHEDULES)


def test_two_blocks_writing_one_output_is_a_race(device):
    x = np.arange(4 * THREADS, dtype=np.float32)
    with pytest.raises(ce.EmulatorError, match="race: .* another block of this launch also wrote"):
        run(device, "blocks_share_output", x, THREADS, grid=4)
    np.testing.assert_array_equal(run(device, "blocks_own_output", x, 4 * THREADS, grid=4), x)


def test_device_memory_nothing_wrote_is_uninitialized(device):
    kernel = device.function("read_written", "PP")
    _, never_written = device.alloc(4 * THREADS)
    with pytest.raises(ce.EmulatorError, match=f"reads device memory at byte 0 .* {UNINITIALIZED}"):
        kernel((1,), (THREADS,), never_written, output(device, THREADS))
    device.htod(never_written, X)                                   # a copy from the host initializes it
    out = output(device, THREADS)
    kernel((1,), (THREADS,), never_written, out)
    np.testing.assert_array_equal(download(device, out, THREADS), np.roll(X, -1))


def test_fresh_memory_is_poison_not_zeros(device):
    buf, ptr = device.alloc(64)
    assert (download(device, ptr, 16).view(np.uint32) == 0xFFFFFFFF).all()
    assert np.isnan(download(device, ptr, 16)).all()
    assert (device.pinned(3, np.int32) == -1).all()


def test_a_read_past_the_end_is_caught(device):
    x = upload(device, X)
    with pytest.raises(ce.EmulatorError, match=r"thread \(127,0,0\) .* reads 4 bytes outside its allocation: "
                                               r"device memory at byte 512 of the allocation"):
        device.function("read_past_end", "PPi")((1,), (THREADS,), x, output(device, THREADS), THREADS)
    device.function("read_in_bounds", "PPi")((1,), (THREADS,), x, output(device, THREADS), THREADS)


def test_a_launch_beyond_the_launch_bound_is_refused(device):
    assert device.launch_bound("bounded_64") == 64 and device.launch_bound("sum_racy") == THREADS
    with pytest.raises(ce.EmulatorError,
                       match=r"128 threads per block, more than the kernel's __launch_bounds__\(64\)"):
        run(device, "bounded_64", X, THREADS)
    np.testing.assert_array_equal(run(device, "bounded_64", X, 64, block=64), X[:64])


def test_a_barrier_some_threads_never_reach_is_a_deadlock(device):
    with pytest.raises(ce.EmulatorError, match="deadlock: .* waits at __shfl_xor_sync"):
        run(device, "shuffle_in_branch", X, THREADS)


@pytest.mark.parametrize("schedule", SCHEDULES[:3], ids=SCHEDULE_IDS[:3])
def test_a_shuffle_with_a_lane_that_returned_is_refused(device, schedule):
    device.set_schedule(*schedule)
    with pytest.raises(ce.EmulatorError, match="__shfl_xor_sync"):
        run(device, "shuffle_after_return", X, THREADS)


def test_arguments_must_match_the_kernels_signature(device):
    with pytest.raises(ce.EmulatorError, match="launched with argument types 'PPf', the kernel takes 'PPd'"):
        device.function("scale_by", "PPf")
    out = output(device, THREADS)
    device.function("scale_by", "PPd")((1,), (THREADS,), upload(device, X), out, 0.5)
    np.testing.assert_array_equal(download(device, out, THREADS), X * 0.5)


def test_every_kernel_needs_a_launch_bound(tmp_path):
    source = tmp_path / "unbounded.cu"
    source.write_text('extern "C" __global__ void __launch_bounds__(32) fine(float* x) { x[0] = 1; }\n'
                      'extern "C" __global__ void no_bound(float* x) { x[0] = 1; }\n')
    with pytest.raises(ce.EmulatorError, match="kernels without __launch_bounds__: no_bound"):
        ce.build(tmp_path, source=source)


@pytest.mark.timeout(600, method="thread")
def test_the_address_sanitizer_build(tmp_path):
    """CUDA_EMULATOR_ASAN=1: the cuda stage's kernel tests pass under AddressSanitizer (a read past
    an allocation anywhere in them would abort the run), and a planted read past the end is
    reported by it, which the guard bytes of the other builds cannot see for reads."""
    libasan = subprocess.run([ce.compiler() or "g++", "-print-file-name=libasan.so"], capture_output=True,
                             text=True).stdout.strip()
    if not os.path.isabs(libasan):
        pytest.skip("this g++ has no AddressSanitizer runtime (libasan)")
    env = dict(os.environ, CUDA_EMULATOR_ASAN="1", LD_PRELOAD=libasan, ASAN_OPTIONS="detect_leaks=0",
               PYTHONPATH=str(ROOT))
    kernels = ("emulator and (matmul_every_type or embed_every_type or rms_norm or rope or attention or elementwise "
               "or argmax or kv_store or tiny_model_logits)")
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py",
                            "-k", kernels], cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-3000:]
    assert " passed" in tests.stdout and "AddressSanitizer" not in tests.stderr
    script = tmp_path / "past_the_end.py"
    script.write_text(
        "import numpy as np\nfrom app.cuda_emulator import emulator as ce\n"
        f"d = ce.EmulatedDevice(ce.build(source=ce.Path({str(PLANTED)!r}), asan=True))\n"
        "_, x = d.alloc(512)\nd.htod(x, np.ones(128, np.float32))\n_, out = d.alloc(512)\n"
        "d.function('read_past_end', 'PPi')((1,), (128,), x, out, 128)\nprint('not caught')\n")
    planted = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=120)
    assert planted.returncode != 0 and "not caught" not in planted.stdout
    assert "AddressSanitizer: heap-buffer-overflow" in planted.stderr and "in read_past_end" in planted.stderr
