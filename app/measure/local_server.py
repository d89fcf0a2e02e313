"""A server process on the loopback address, as the load test and the soak start one (ours, or
llama.cpp's llama-server): a free port, then waiting for /health to answer (or for the process
to die, its log shown); its resident memory; and stopping it."""
from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

from app import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 600):
    """Return once GET url/health is 200; SystemExit with the log's end if the process exits
    or `timeout` seconds pass first."""
    import httpx
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server did not get ready in {timeout:.0f} s:\n{log.read_text()[-2000:]}")


class LocalServer:
    """`command` started with `--port` and a free port appended, from the repository's root,
    its output in `log`; ready once /health answers. `name`: what it is (the load test's
    "ours" or "llama-server"); `stop_timeout`: seconds close() waits after SIGTERM (our server
    drains on it) before it kills."""

    def __init__(self, command: list[str], log: Path, name: str = "", stop_timeout: float = 20):
        self.name, self.log, self.stop_timeout = name, log, stop_timeout
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, NUMBA_CACHE_DIR=os.environ.get("NUMBA_CACHE_DIR", str(ROOT / ".numba_cache")))
        with open(log, "w") as out:
            self.proc = subprocess.Popen([*map(str, command), "--port", str(self.port)], cwd=ROOT, env=env,
                                         stdout=out, stderr=subprocess.STDOUT)
        wait_ready(self.url, self.proc, log)

    def rss_mb(self) -> float:
        import psutil
        return psutil.Process(self.proc.pid).memory_info().rss / 2**20

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
