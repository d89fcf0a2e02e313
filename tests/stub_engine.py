"""An engine shape for the scheduler's and the server's own tests: no weights, no kernels,
but a sequence's next token depends on every token its KV pages hold, read back through its
page table, so a page lost, shared by mistake, or overwritten changes the text that follows.

Each step writes every row's token id into its slot of layer 0's K (as the real model writes
K), then for each row that asks for logits reads its sequence's K back through the pages and
puts the peak of the logits at a hash of those tokens, with a slope around it, so greedy picks
the peak and a seeded sampler usually picks near it. Given `eos` and `eos_at`, a sequence that
holds eos_at tokens or more is ended: its next token is eos.

StubServer runs the real HTTP server (app/serve/routes.py) over it in this process, with the
default model's tokenizer: the HTTP layer's tests in seconds, no model to compute. Its engine
loop can be parked between two steps (`paused`), so a test reads the server at a moment when
what runs and what waits is known.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import threading
import time

import numpy as np


class StubBackend:
    """What the engine loop reads of a backend: rows not padded, float32 K/V, every KV head kept."""
    row_block = 1
    kv_dtype = np.float32

    @staticmethod
    def kv_width(config) -> int:
        return config.kv_dim


class StubEngine:
    """forward_batch(batch) over a PagePool of n_layer 1, kv_dim 4 (EngineLoop makes it).
    Next tokens are drawn from low..high-1 (ordinary tokens of a real vocabulary, or a tiny
    vocabulary of its own); `fail_on`, a token id that makes a step raise (a planted bug);
    `eos` at `eos_at` tokens (see the module docstring);
    `copies`: text that repeats itself (next_token)."""

    def __init__(self, n_vocab: int = 50, low: int = 0, high: int = 49, n_ctx: int = 4096,
                 fail_on: int | None = None, eos: int | None = None, eos_at: int = 0,
                 copies: int = 0):
        self.config = type("config", (), dict(n_layer=1, kv_dim=4, n_ctx_train=n_ctx, n_vocab=n_vocab))()
        self.backend = StubBackend()
        self.n_ctx, self.low, self.high, self.fail_on = n_ctx, low, high, fail_on
        self.eos, self.eos_at, self.copies = eos, eos_at, copies
        self.threads = []
        self.steps = []                       # rows of each step: [(segment index, position, token)]

    def next_token(self, tokens) -> int:
        """The token after `tokens` (what greedy picks). With `copies` (a period P): where the
        hash of the tokens is not a multiple of 4, the token P back, so the text repeats itself
        in runs that prompt lookup can guess, and still depends on every token before it."""
        if self.eos is not None and len(tokens) >= self.eos_at:
            return self.eos
        h = 7
        for i, t in enumerate(tokens):
            h = (h * 31 + (i + 1) * (int(t) + 3)) % 1_000_003
        if self.copies and len(tokens) >= self.copies and h % 4:
            return int(tokens[-self.copies])
        return self.low + h % (self.high - self.low)

    def reference(self, prompt, n: int, stop=()) -> list[int]:
        """The greedy text a prompt gets alone."""
        out, ctx = [], list(prompt)
        for _ in range(n):
            t = self.next_token(ctx)
            out.append(t)
            ctx.append(t)
            if t in stop:
                break
        return out

    def forward_batch(self, batch):
        self.threads.append(threading.get_ident())
        n = batch.n_rows
        if self.fail_on is not None and self.fail_on in batch.tokens[:n].tolist():
            raise RuntimeError("a planted failure in the forward step")
        self.steps.append(list(zip(batch.row_seq[:n].tolist(), batch.positions[:n].tolist(),
                                   batch.tokens[:n].tolist())))
        k = batch.pool.k[0].reshape(-1, batch.pool.kv_dim)
        k[batch.slots[:n], 0] = batch.tokens[:n]
        out = np.empty((len(batch.logit_rows), self.config.n_vocab), dtype=np.float32)
        slope = -0.5 * np.arange(self.config.n_vocab, dtype=np.float32)
        for j, r in enumerate(batch.logit_rows.tolist()):
            seg, pos = int(batch.row_seq[r]), int(batch.positions[r])
            pages = batch.tables[seg, :pos // batch.pool.page_size + 1]
            held = batch.pool.k[0, pages, :, 0].reshape(-1)[:pos + 1]      # the sequence's tokens 0..pos
            target = self.next_token(held.astype(np.int64))
            out[j] = -np.abs(slope + 0.5 * target)
        return out


@functools.lru_cache(maxsize=None)
def tokenizer(model_path: str):
    """The model's tokenizer, read once per test run (it never changes)."""
    from common.gguf import GGUFFile
    from common.tokenizer import Tokenizer
    with GGUFFile(model_path) as g:
        return Tokenizer.from_gguf(g)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StubServer:
    """`with StubServer(model_path, **settings) as srv:` the server at srv.url, its engine
    (StubEngine: next tokens among ids low..high-1 of the real vocabulary, by default ordinary
    ones), engine loop (with `speculation`, app/serve/speculation.py, if given) and Server; the
    engine loop and uvicorn each in a thread of their own."""

    def __init__(self, model_path, n_ctx: int = 512, kv_pages: int = 64, max_batch: int = 8, max_queue: int = 8,
                 prefill_chunk: int = 64, fail_on: int | None = None, eos: int | None = None,
                 eos_at: int = 0, low: int = 300, high: int = 3000, copies: int = 0, speculation=None, **settings):
        from app.serve.engine_loop import EngineLoop
        from app.serve.server import Server
        tok = tokenizer(str(model_path))
        self.engine = StubEngine(n_vocab=tok.n_vocab, low=low, high=high, n_ctx=n_ctx, fail_on=fail_on,
                                 eos=eos, eos_at=eos_at, copies=copies)
        self.engine.tokenizer = tok
        self.engine.gguf = type("gguf", (), {"path": str(model_path)})()
        self.loop = EngineLoop(self.engine, kv_pages=kv_pages, max_batch=max_batch, max_queue=max_queue,
                               prefill_chunk=prefill_chunk, speculation=speculation)
        self.server = Server(self.engine, "stub", self.loop, "stub-model", **settings)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.closing = False
        self._go, self._parked = threading.Event(), threading.Event()
        self._go.set()

    def keep_going(self) -> bool:
        """The engine loop's condition, asked between steps: here it parks while paused."""
        if not self._go.is_set():
            self._parked.set()
            self._go.wait()
            self._parked.clear()
        return not self.closing

    @contextlib.contextmanager
    def paused(self, timeout: float = 60.0):
        """The engine loop parked between two steps: no step runs, no sequence moves, the
        published state is the state. Requests may still arrive (they wait)."""
        self._go.clear()
        with self.loop.lock:
            self.loop.lock.notify_all()                 # an idle loop asks keep_going at once
        try:
            if not self._parked.wait(timeout):
                raise RuntimeError("the engine loop did not park")
            yield self
        finally:
            self._go.set()

    def idle(self, timeout: float = 60.0) -> dict:
        """Wait until nothing runs or waits and every page is free (cancellations land at a
        step boundary); the stats then. RuntimeError if that does not happen in `timeout` s."""
        def settled(s):
            return (s["running"], s["waiting"], s["kv_pages_free"]) == (0, 0, s["kv_pages_total"])
        if not self.loop.wait_for(settled, timeout):
            raise RuntimeError(f"the server did not settle: {self.loop.stats()}")
        return self.loop.stats()

    def __enter__(self):
        import uvicorn

        from app.serve.routes import create_app
        self.http = uvicorn.Server(uvicorn.Config(create_app(self.server), host="127.0.0.1", port=self.port,
                                                  log_level="warning"))
        self.engine_thread = threading.Thread(target=self.loop.run, kwargs={"keep_going": self.keep_going},
                                              daemon=True)
        self.web = threading.Thread(target=self.http.run, daemon=True)
        self.engine_thread.start()
        self.web.start()
        deadline = time.time() + 60
        while not self.http.started:
            if time.time() > deadline or not self.web.is_alive():
                raise RuntimeError("the stub server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.closing = True
        self._go.set()
        self.loop.stop()
        self.http.should_exit = True
        self.engine_thread.join(timeout=10)
        self.web.join(timeout=10)
