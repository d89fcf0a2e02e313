"""The ranks of a split model and what they say to each other: MPI, through mpi4py.

The MPI is MPICH from PyPI (requirements.txt installs its wheel and mpi4py); `mpiexec -n N`
starts the ranks, on one machine or, with a host file, on several. Each rank runs the same
program (SPMD): the same tokens, the same sampler, the same logits after the gather.

A collective waits for every rank, so one rank that dies or stalls would leave the others
waiting for ever. Every collective here is started non-blocking and waited for with a deadline
(LLM_TP_TIMEOUT seconds; during the warm-up, while numba may still be compiling, at least
JIT_TIMEOUT_S), and the ranks send each other two kinds of notice, point to point, which never
mix with the collectives:

    leaving   a rank that exits (after an error, or at the end) tells the others; one still waiting
              for it at a collective ends the run, naming it
    waiting   a rank whose deadline passes says where it waits and listens for the others: those
              it does not hear from are named (they died or stalled), and the run ends (MPI_Abort)

A rank killed outright (a signal) is seen by mpiexec, which ends every rank and names the
process by its pid; `banner()` maps pids to ranks. MPI_Init itself waits for every rank to
start, with no deadline of its own: a C watchdog (faulthandler) ends a rank stuck there.

Time and bytes: the seconds spent in each kind of collective, and the bytes each rank sends as
ring algorithms send them (an all-reduce of n bytes: 2 (N-1)/N x n; an all-gather: n less the piece of the
next rank, the last it receives), modelled from the message sizes, not counted on the wire.
A rank waiting at a collective polls it (as MPI's blocking calls do), yielding its core after
SPINS tests: where other processes share the cores, a spinning rank would otherwise hold the
core the rank it waits for needs; past IDLE_S it sleeps between tests (a server's ranks waiting
for the next step would otherwise keep their cores busy while nobody asks anything).
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import math
import os
import socket
import sys
import time

import numpy as np

TIMEOUT_ENV = "LLM_TP_TIMEOUT"
TIMEOUT_S = 60.0          # any collective after the warm-up; MPI_Init and the start's handshake
JIT_TIMEOUT_S = 900.0     # during the warm-up, a rank may be compiling while another waits
GRACE_S = 2.0             # how long a rank that timed out listens for the others' notices
FORWARD_S = 0.5           # how long the rank that says why the run ends waits before it ends it
TAG_LEAVING, TAG_WAITING = 7101, 7102
SPINS = 1000              # tests of a collective before a waiting rank starts yielding its core
IDLE_S, IDLE_SLEEP_S = 0.05, 0.001    # past this wait a rank sleeps between tests (an idle server's ranks)
# The variables launchers set in each rank's environment (MPICH's hydra, Open MPI, PMIx)
LAUNCHER_RANK = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
LAUNCHER_SIZE = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")


def _env_int(names) -> int | None:
    for name in names:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


def launched_as() -> str:
    """'rank R of N on HOST' from the launcher's environment (before MPI starts), else ''."""
    r, n = _env_int(LAUNCHER_RANK), _env_int(LAUNCHER_SIZE)
    return f"rank {r} of {n} on {socket.gethostname()}" if r is not None and n and n > 1 else ""


def mpi_missing() -> str | None:
    """None if mpi4py and an MPI library load here (MPI not started), else what to install."""
    try:
        import mpi4py
        mpi4py.rc.initialize = False          # started by Ranks, with a watchdog, not by the import
        mpi4py.rc.finalize = False            # ended by Ranks, after its last notices
        from mpi4py import MPI
        MPI.Get_library_version()
    except (ImportError, RuntimeError, OSError) as e:
        where = launched_as()
        return (f"{where + ': ' if where else ''}it needs mpi4py and an MPI library ({type(e).__name__}: {e}); "
                f"`make setup` installs both (pip install -r requirements.txt)")
    return None


def timeout_s() -> float:
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV}={text!r}: it must be a number of seconds > 0")
    return value


class Ranks:
    """This process's place among the ranks (rank, size, hosts, pids) and the collectives."""

    def __init__(self):
        reason = mpi_missing()
        if reason:
            raise RuntimeError(reason)
        from mpi4py import MPI
        self.MPI = MPI
        self.timeout = timeout_s()
        self.warming = True            # the caller clears it once its kernels are compiled
        if not MPI.Is_initialized():
            self._wait_for_every_rank_to_start_mpi(MPI)
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.seq = 0                   # collectives so far: the same count on every rank
        self.gone, self.heard = {}, {}  # rank -> when it said it leaves; rank -> (seq, where) it waits at
        self.stats = {}                # kind -> [calls, seconds, payload bytes, bytes sent]
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.hosts, self.pids = [self.host], [self.pid]
        if self.size > 1:
            self._handshake()
        atexit.register(self._leave)

    @staticmethod
    def _wait_for_every_rank_to_start_mpi(MPI):
        n = _env_int(LAUNCHER_SIZE) or 1
        if n > 1:
            # MPI_Init returns only when every rank has called it, holding the interpreter's lock;
            # a rank that never starts would hold this one here for ever, so a C watchdog ends it
            # (its message is the stack below this line, then the launcher's own)
            faulthandler.dump_traceback_later(timeout_s(), exit=True, file=sys.stderr)
        MPI.Init_thread(MPI.THREAD_SERIALIZED)
        if n > 1:
            faulthandler.cancel_dump_traceback_later()

    def _handshake(self):
        """Every rank's host and pid, gathered once: the first collective, with the start's deadline."""
        mine = np.zeros(72, dtype=np.uint8)
        name = self.host.encode()[:63]
        mine[:len(name)] = np.frombuffer(name, np.uint8)
        mine[64:72] = np.frombuffer(np.int64(self.pid).tobytes(), np.uint8)
        every = np.zeros((self.size, 72), dtype=np.uint8)
        self._wait(self.comm.Iallgather(mine, every), "the start (every rank's host and pid)", self.timeout)
        self.hosts = [bytes(r[:64]).rstrip(b"\0").decode(errors="replace") for r in every]
        self.pids = [int(np.frombuffer(bytes(r[64:72]), np.int64)[0]) for r in every]

    # ---- who is where ---------------------------------------------------------------------------
    @property
    def local_ranks(self) -> int:
        """Ranks on this rank's host (they share its cores)."""
        return sum(h == self.host for h in self.hosts)

    def describe(self, r: int) -> str:
        return f"rank {r} (pid {self.pids[r]} on {self.hosts[r]})"

    def banner(self) -> str:
        return f"tp: {self.size} rank{'s' if self.size > 1 else ''}: " + ", ".join(map(self.describe, range(self.size)))

    # ---- the collectives --------------------------------------------------------------------------
    def allreduce(self, x: np.ndarray, where) -> np.ndarray:
        """x (C-contiguous float32) summed over the ranks, in place: every rank gets the sum."""
        if self.size == 1:
            return x
        t0 = time.perf_counter()
        self._wait(self.comm.Iallreduce(self.MPI.IN_PLACE, x, op=self.MPI.SUM), where)
        self._count("allreduce", t0, x.nbytes, 2 * (self.size - 1) / self.size * x.nbytes)
        return x

    def allgather(self, x: np.ndarray, counts, where) -> np.ndarray:
        """Every rank's x (float32, counts[r] values from rank r) -> one flat array, in rank order."""
        if self.size == 1:
            return x.reshape(-1)
        t0 = time.perf_counter()
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty(int(sum(counts)), dtype=np.float32)
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist()
        req = self.comm.Iallgatherv(x, [out, (list(map(int, counts)), displs), self.MPI.FLOAT])
        self._wait(req, where)
        # a ring passes every piece on but the one it receives last: the next rank's
        self._count("gather", t0, out.nbytes, (sum(counts) - counts[(self.rank + 1) % self.size]) * 4)
        return out

    def broadcast(self, x: np.ndarray, where, forever: bool = False) -> np.ndarray:
        """x (C-contiguous) from rank 0 to every rank, in place. forever: no deadline (a rank that
        waits for the next step of a server idle for hours), though a rank that leaves still ends it."""
        if self.size == 1:
            return x
        t0 = time.perf_counter()
        self._wait(self.comm.Ibcast(x, root=0), where, math.inf if forever else None)
        self._count("broadcast", t0, x.nbytes, x.nbytes if self.rank == 0 else 0)
        return x

    def barrier(self, where):
        if self.size > 1:
            self._wait(self.comm.Ibarrier(), where)

    def allgather_json(self, obj, where) -> list:
        """Every rank's JSON-able obj, on every rank (for results, outside any timed region)."""
        if self.size == 1:
            return [obj]
        mine = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)
        sizes = np.zeros(self.size, dtype=np.int64)
        self._wait(self.comm.Iallgather(np.array([mine.size], np.int64), sizes), where)
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int).tolist()
        self._wait(self.comm.Iallgatherv(mine, [out, (sizes.astype(int).tolist(), displs), self.MPI.BYTE]), where)
        return [json.loads(bytes(out[d:d + n])) for d, n in zip(displs, sizes.tolist())]

    def _count(self, kind: str, t0: float, payload: int, sent: float):
        s = self.stats.setdefault(kind, [0, 0.0, 0, 0.0])
        s[0] += 1
        s[1] += time.perf_counter() - t0
        s[2] += payload
        s[3] += sent

    def snapshot(self) -> dict:
        """{kind: {calls, seconds, payload_bytes, sent_bytes}} so far (subtract two for a span)."""
        return {k: dict(zip(("calls", "seconds", "payload_bytes", "sent_bytes"), v)) for k, v in self.stats.items()}

    # ---- waiting with a deadline ------------------------------------------------------------------
    def _wait(self, req, where, limit: float | None = None):
        self.seq += 1
        if req.Test():
            return
        limit = limit or (max(self.timeout, JIT_TIMEOUT_S) if self.warming else self.timeout)
        start = time.monotonic()
        n = 0
        while not req.Test():
            n += 1
            if n > SPINS:                      # a rank that waits lets a busy core run the rank it waits for,
                if time.monotonic() - start > IDLE_S:
                    time.sleep(IDLE_SLEEP_S)   # and one that waits long lets it rest
                else:
                    os.sched_yield()
            if n & 255:
                continue
            now = time.monotonic()
            self._read_notices()
            if self.gone and (now - min(self.gone.values()) > GRACE_S or now - start > limit):
                self._left(where)                  # it left, and this collective still lacks it
            if now - start > limit:
                self._timed_out(where, limit)

    def _left(self, where):
        r = min(self.gone, key=self.gone.get)
        self._end(f"{self.describe(r)} left the run while {self.describe(self.rank)} waited for it at {_text(where)} "
                  f"(collective {self.seq}); its own message, if it gave one, is above", culprits=[r])

    def _read_notices(self):
        MPI = self.MPI
        status = MPI.Status()
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
            tag, src = status.Get_tag(), status.Get_source()
            msg = self.comm.recv(source=src, tag=tag)
            if tag == TAG_LEAVING:
                self.gone.setdefault(src, time.monotonic())
            elif tag == TAG_WAITING:
                self.heard[src] = msg

    def _notify(self, tag, msg, wait_s: float):
        reqs = [self.comm.isend(msg, dest=r, tag=tag) for r in range(self.size) if r != self.rank]
        deadline = time.monotonic() + wait_s
        while reqs and time.monotonic() < deadline:
            reqs = [q for q in reqs if not q.Test()]
            time.sleep(0.001)

    def _timed_out(self, where, limit: float):
        self._notify(TAG_WAITING, (self.seq, _text(where)), 0.5)
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:
            self._read_notices()
            time.sleep(0.01)
        if self.gone:                              # one that left while this rank listened
            self._left(where)
        silent = [r for r in range(self.size) if r != self.rank and r not in self.heard and r not in self.gone]
        if silent:
            who = ", ".join(map(self.describe, silent))
            self._end(f"{who} did not reach {_text(where)} (collective {self.seq}) within {limit:g} s: "
                      f"{'it' if len(silent) == 1 else 'they'} died or stalled, or the network to "
                      f"{'it' if len(silent) == 1 else 'them'} failed ({TIMEOUT_ENV} sets the deadline)",
                      culprits=silent)
        self._end(f"{_text(where)} (collective {self.seq}) did not complete within {limit:g} s although every "
                  f"rank reached it: the MPI's transport between the ranks failed", culprits=[])

    def _end(self, message: str, culprits):
        """Print the message (from the lowest rank still in the run) and end every rank."""
        alive = [r for r in range(self.size) if r not in culprits and r not in self.gone]
        if not alive or self.rank == min(alive):
            print(f"\ntp {self.describe(self.rank)}: {message}; ending all {self.size} ranks", file=sys.stderr,
                  flush=True)
            time.sleep(FORWARD_S)      # the launcher forwards a rank's output; MPI_Abort may overtake it
        else:
            time.sleep(GRACE_S)        # the lowest rank speaks; then, or if it cannot, this one ends it
        self.comm.Abort(1)

    def _leave(self):
        """At exit: tell the others this rank is gone, then end MPI here. At the end of a run every
        rank leaves: each reads the others' notices first (for up to GRACE_S), since a message
        left unread is an error at MPI_Finalize over some transports (UCX over TCP)."""
        MPI = self.MPI
        if MPI.Is_finalized():
            return
        if self.size > 1:
            self._notify(TAG_LEAVING, self.rank, 1.0)
            deadline = time.monotonic() + GRACE_S
            while len(self.gone) < self.size - 1 and time.monotonic() < deadline:
                self._read_notices()
                time.sleep(0.001)
        MPI.Finalize()


def _text(where) -> str:
    """where: a sentence, or (template, *args) formatted only when a message needs it."""
    return where if isinstance(where, str) else where[0].format(*where[1:])


_world: Ranks | None = None


def world() -> Ranks:
    """The ranks of this run (MPI started on the first call, its handshake done)."""
    global _world
    if _world is None:
        _world = Ranks()
    return _world
