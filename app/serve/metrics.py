"""`/metrics`: the server in Prometheus' text format (prometheus-client), for an operator's dashboards.

    llm_requests_total{outcome}             requests answered: stop, length, cancelled, error, timeout,
                                            bad_request, unauthorized, too_large, busy, draining
    llm_prompt_tokens_total                 prompt tokens of the requests admitted
    llm_generated_tokens_total              tokens generated (every choice)
    llm_time_to_first_token_seconds         histogram: request received -> its first token
    llm_time_between_tokens_seconds         histogram: one token of a choice -> its next
    llm_batch_rows                          histogram: rows in each engine step
    llm_preemptions_total                   sequences preempted for pages (app/serve/scheduler.py)
    llm_requests_running, llm_requests_waiting, llm_kv_pages_used, llm_kv_pages_free   gauges

One registry per server (not prometheus-client's global one), so that several servers in one
process (the tests) each count their own. The engine thread observes steps and preemptions;
the HTTP thread the rest; prometheus-client's metrics are safe to update from both.
"""

from __future__ import annotations

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
OUTCOMES = ("stop", "length", "cancelled", "error", "timeout", "bad_request", "unauthorized", "too_large",
            "busy", "draining")


class Metrics:
    """The server's counters, histograms and gauges; the engine loop's `observer` is this."""

    def __init__(self, loop):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        r = self.registry = CollectorRegistry()
        self.requests = Counter("llm_requests", "Requests answered, by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:                     # every series exists from the start, at 0
            self.requests.labels(outcome)
        self.prompt_tokens = Counter("llm_prompt_tokens", "Prompt tokens of the requests admitted", registry=r)
        self.generated_tokens = Counter("llm_generated_tokens", "Tokens generated, every choice", registry=r)
        self.ttft = Histogram("llm_time_to_first_token_seconds", "From a request's arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tbt = Histogram("llm_time_between_tokens_seconds", "Between two tokens of one choice",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.rows = Histogram("llm_batch_rows", "Rows in each engine step (decoding tokens and prompt chunks)",
                              buckets=ROW_BUCKETS, registry=r)
        self.preemptions = Counter("llm_preemptions", "Sequences preempted because the KV pages ran out",
                                   registry=r)
        gauges = {"llm_requests_running": ("Sequences in the running batch", lambda s: s["running"]),
                  "llm_requests_waiting": ("Sequences in the wait queue", lambda s: s["waiting"]),
                  "llm_kv_pages_used": ("KV pages held by sequences",
                                        lambda s: s["kv_pages_total"] - s["kv_pages_free"]),
                  "llm_kv_pages_free": ("KV pages free (cached prefix pages included)", lambda s: s["kv_pages_free"])}
        for name, (text, read) in gauges.items():
            Gauge(name, text, registry=r).set_function(lambda read=read: read(loop.stats()))

    # the engine loop's observer interface (engine thread)
    def step(self, rows: int):
        self.rows.observe(rows)

    def preempted(self):
        self.preemptions.inc()

    def outcome(self, name: str):
        self.requests.labels(name).inc()

    def text(self) -> tuple[bytes, str]:
        """The exposition and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
