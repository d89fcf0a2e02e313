"""`serve --stage tp` under `mpiexec -n 2` (app/serve/ranks.py), through the official openai client:
the greedy texts `serve --stage repack` gives in one process (or the same up to a near-tie, the
rule of tests/test_tp.py), two requests at once among them; SIGTERM to mpiexec drains rank 0 and
every rank exits 0; a rank lost mid-request: stalled (SIGSTOP) or failed with an error of its own,
its clients' errors name it and the server exits non-zero, never hangs; killed (SIGKILL), mpiexec
ends every rank and says one was killed. On a tiny made-up model carrying the default model's tokenizer
and chat template."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from common.gguf import GGMLType, GGUFFile
from tests.test_quantized import write_tiny_llama
from tests.test_tp import MPIEXEC, NEAR_TIE, RANK_TYPES, ROOT
from tests.tp_serve_rank import PLANTED_ERROR
from tests.util import mpiexec_saw_a_rank_killed

NEEDS_BY_FIXTURE = {"chat_model": "model"}          # its tokenizer is the default model's
N_CTX = 256
MAX_TOKENS = 10
TOP = 5                    # top log-probabilities asked for at each position (the near-tie rule reads them)
TIMEOUT_S = 3              # LLM_TP_TIMEOUT of the failure runs: a collective's deadline after the warm-up
# the most a lost rank's server may take to end: the deadline, the grace the waiting rank listens for
# the others' notices (stages/parallel/ranks.py GRACE_S), the last events' 5 s (app/serve/command.py),
# and slack for a loaded machine
END_S = TIMEOUT_S + 2 + 5 + 20
CHAT = [{"role": "user", "content": "Name a colour."}]
PROMPT = "The meaning of life is"
AT_ONCE = ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a story."}],
           "Once upon a time")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from app.models import DEFAULT_MODEL
    # the head in Q8_0, not tests/test_tp.py's Q6_K: quantizing a vocabulary of 49152 rows to Q6_K
    # in numpy costs half a minute (the head's split is the same whatever its type)
    return write_tiny_llama(tmp_path_factory.mktemp("tp-serve") / "tiny-chat.gguf",
                            {**RANK_TYPES, "output": GGMLType.Q8_0}, vocab=GGUFFile(DEFAULT_MODEL.path), n_ctx=N_CTX)


def start(model, log, ranks: int = 0, planted: bool = False):
    """`serve --stage repack` in one process, or `serve --stage tp` under mpiexec -n RANKS; ready.
    planted: rank 1 fails with an error of its own in the first prompt (tests/tp_serve_rank.py)."""
    from app.measure.local_server import LocalServer
    launcher = [str(MPIEXEC), "-n", str(ranks)] if ranks else []
    stage = "tp" if ranks else "repack"
    app = ["tests/tp_serve_rank.py"] if planted else ["-m", "app"]
    return LocalServer([*launcher, sys.executable, *app, "serve", "--stage", stage, "-m", model,
                        "--ctx-size", N_CTX], log, name=stage)


def client(server):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def chat(server, messages) -> list:
    """[(token, {token: logprob} of the TOP best)] of a greedy chat completion."""
    r = client(server).chat.completions.create(model="tiny-chat", messages=messages, max_tokens=MAX_TOKENS,
                                               temperature=0, logprobs=True, top_logprobs=TOP)
    return [(c.token, {t.token: t.logprob for t in c.top_logprobs}) for c in r.choices[0].logprobs.content]


def text(server, prompt) -> list:
    """The same, of a greedy text completion."""
    r = client(server).completions.create(model="tiny-chat", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          logprobs=TOP)
    lp = r.choices[0].logprobs
    return list(zip(lp.tokens, lp.top_logprobs))


def replies(server) -> dict:
    """Every request's tokens: one chat and one text completion alone, then one of each at once."""
    out = {"chat": chat(server, CHAT), "text": text(server, PROMPT)}
    both = {}
    threads = [threading.Thread(target=lambda: both.__setitem__("chat at once", chat(server, AT_ONCE[0]))),
               threading.Thread(target=lambda: both.__setitem__("text at once", text(server, AT_ONCE[1])))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {**out, **both}


def departs(got: list, want: list) -> str | None:
    """Why tokens `got` are not `want`'s (None if they are): they part where want's own best did
    not nearly tie got's token (tests/test_tp.py NEAR_TIE, in logits: log-probabilities of one
    distribution differ as its logits do)."""
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a[0] != b[0]), None)
    if i is None:
        return None if len(got) == len(want) else f"{len(got)} tokens, not {len(want)}"
    top = want[i][1]
    gap = max(top.values()) - top.get(got[i][0], -float("inf"))
    return None if gap <= NEAR_TIE else f"token {i}: {got[i][0]!r}, {gap:.3f} below the best {want[i][0]!r}"


def rank_pids(log) -> dict:
    """{rank: pid} from rank 0's line `serving over N MPI ranks (tp: N ranks: rank 0 (pid P on HOST), ...`."""
    line = next(ln for ln in log.read_text().splitlines() if "serving over" in ln)
    return {int(r): int(p) for r, p in re.findall(r"rank (\d+) \(pid (\d+)", line)}


def test_tp_over_two_ranks_serves_repacks_greedy_texts_and_ends_every_rank(chat_model, tmp_path):
    repack = start(chat_model, tmp_path / "repack.log")
    try:
        want = replies(repack)
    finally:
        repack.close()
    tp = start(chat_model, tmp_path / "tp.log", ranks=2)
    try:
        got = replies(tp)
        assert "serving over 2 MPI ranks (tp: 2 ranks: rank 0 (pid" in (tmp_path / "tp.log").read_text()
    finally:
        tp.proc.terminate()                               # mpiexec passes SIGTERM on: rank 0 drains
        code = tp.proc.wait(timeout=60)
    log = (tmp_path / "tp.log").read_text()
    assert code == 0, log[-3000:]
    assert "drained; exiting" in log and "ending all" not in log
    for name in want:
        assert departs(got[name], want[name]) is None, f"{name}: {departs(got[name], want[name])}"
    planted = [("not a token of the vocabulary", {}), *got["chat"][1:]]     # the rule must catch a departure
    assert departs(planted, want["chat"]) is not None


def stream_until_lost(server, pid: int, how: int | None) -> Exception:
    """A streamed chat completion; at its first token `how` (a signal, if any) is sent to `pid`;
    the exception that ends the stream."""
    import openai
    stream = client(server).chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=N_CTX // 2,
                                                    temperature=0, stream=True)
    with pytest.raises((openai.APIError, openai.APIConnectionError)) as e:
        for i, _ in enumerate(stream):
            if i == 1 and how is not None:
                os.kill(pid, how)
    return e.value


@pytest.mark.parametrize("how", ["stall", "raise", "kill"])
def test_a_rank_lost_mid_request_ends_the_request_and_the_server(chat_model, tmp_path, monkeypatch, how):
    """Stalled (SIGSTOP): after the collectives' deadline rank 0 names it in the client's error,
    says the server cannot go on and ends every rank. Failed with an error of its own: the same,
    once it says it leaves. Killed (SIGKILL): mpiexec ends every rank at once and says a rank was
    killed (any rank's pid: tests/util.py says why); the client's connection closes. None hangs."""
    log = tmp_path / "tp.log"
    monkeypatch.setenv("LLM_TP_TIMEOUT", str(TIMEOUT_S))
    tp = start(chat_model, log, ranks=2, planted=how == "raise")
    try:
        pids = rank_pids(log)
        pid = pids[1]
        t0 = time.monotonic()
        error = stream_until_lost(tp, pid, {"stall": signal.SIGSTOP, "kill": signal.SIGKILL}.get(how))
        code = tp.proc.wait(timeout=END_S)
        took = time.monotonic() - t0
    finally:
        if tp.proc.poll() is None:
            tp.proc.kill()
    text = log.read_text()
    assert code != 0 and took < END_S, text[-3000:]
    if how in ("stall", "raise"):
        said = "did not reach" if how == "stall" else "left the run"
        assert f"rank 1 (pid {pid} on" in str(error) and said in str(error), str(error)
        assert "the server cannot go on" in str(error) and "the server cannot go on" in text
        assert how == "stall" or PLANTED_ERROR in text                    # its own traceback
    else:
        assert mpiexec_saw_a_rank_killed(text, pids.values()), text[-3000:]
        assert "rank 1" not in str(error)        # the stall's check's twin: a closed connection names nobody


def test_make_serve_launches_over_ranks_as_make_run_does(tmp_path):
    """`make serve stage=tp np=2 [hosts=FILE]`, dry run: mpiexec with the host file, as `make run`."""
    hosts = tmp_path / "plain"
    hosts.write_text("10.0.0.1:1\n")

    def recipe(*extra):
        p = subprocess.run(["make", "-n", "--no-print-directory", "serve", "stage=tp", *extra], cwd=ROOT,
                           capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 0, p.stderr
        return p.stdout.strip().splitlines()[-1]
    assert recipe("np=2", f"hosts={hosts}").startswith(f".venv/bin/mpiexec -n 2 -f {hosts} ")
    assert " -m app serve --stage tp " in recipe("np=2")
    assert recipe().startswith(".venv/bin/python -m app serve --stage tp ")      # the twin: one process
