"""A server process on the loopback address, as the load test and the soak start one:
a free port, then waiting for /health to answer (or for the process to die, its log shown)."""
from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path


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
