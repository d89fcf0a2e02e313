"""Speculative decoding in the server's batched step (`serve --spec lookup|draft`): every
decoding sequence may guess its next tokens, and one step verifies all of them.

The guessers, the rule, the step-time model and the planner are common/speculative.py's, the
same that `run --spec` uses over a batch of one; what the server adds is where each part of a
step happens:

    plan      after admission, once every row of the step is known (app/serve/scheduler.py:
              _guess): Speculation.plan over the decoding sequences, told the step's other rows
              (prompt chunks too); then each guessing sequence's guess rows get their pages from
              what the pool has left, or the guesses are dropped (never a reason to preempt)
    run       its rows are [newest token, guesses]: every row of every sequence in the same
              compiled call (rows carry their own positions and page tables: common/batch.py),
              every row's logits back
    settle    the rule on its rows (app/serve/sequence.py: Sequence.take): the kept guesses
              and the model's own token are its new tokens, cut where its text ends; the
              positions of the rest leave its pages (PageTable.truncate) and its grammar's
              matcher (Constraint.rollback); its guesser counts what they did
    observe   the step's time (app/serve/engine_loop.py: StepTime.observe), by which the next
              plan charges the guesses' rows to the sequences that made them

Here: the planner for the flags (`for_server`), and its step times measured on this engine's
batched step before the server takes requests (`calibrate`).
"""

from __future__ import annotations

from common import speculative as sp
from common.paged_kv import PageTable


def for_server(mode: str, engine, draft=None, draft_max: int = sp.DRAFT_MAX, kv_pages: int = 0,
               max_batch: int = 1) -> sp.Speculation | None:
    """The planner for `serve --spec MODE` (lookup | draft, with the loaded draft model | off: None);
    a draft model's pool holds each sequence's context and its guesses."""
    if mode == "off":
        return None
    time = sp.StepTime(row_block=engine.backend.row_block)
    if mode == "lookup":
        return sp.Speculation(engine.n_ctx, draft_max, time)
    pages = kv_pages + max_batch * PageTable.pages_for(draft_max + 1)
    return sp.DraftSpeculation(engine.n_ctx, draft, pages, draft_max, time)


def calibrate(speculation: sp.Speculation, loop, max_batch: int, prefill_chunk: int):
    """What a step of M rows costs on this engine, M up to the most a step can take (every
    sequence with its guesses, and a prompt chunk), through the loop's own forward and pool;
    and a draft model's steps, up to a row per sequence."""
    speculation.time.calibrate_pool(loop.forward, loop.pool, max_batch * (1 + speculation.draft_max) + prefill_chunk)
    speculation.calibrate_draft(max_batch)
