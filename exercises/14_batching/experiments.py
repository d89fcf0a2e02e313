"""Chapter 14's experiments (run: make try-it ch=14)."""

from __future__ import annotations

from exercises.harness import best_seconds, load_file
from exercises.try_it import engine, experiment

check = load_file(__file__.replace("experiments", "check"))


@experiment("the rows of one forward pass: 1 to 32 (the batch of a server's step)", model=True)
def batch_rows(quick):
    """a decode step reads every weight once whatever the rows; while the rows stay under the ridge
    point (peak FLOP/s over bandwidth, in multiply-adds per byte) a pass of 8 rows costs about one
    of 1, so 8 users are served for the price of one; past it, each row adds its own time"""
    from app.args import fastest_stage
    stage = fastest_stage(serving=True)
    model = engine(stage, n_ctx=160)
    model.reset()
    model.forward([5] * 64, 0, all_logits=False)                # a context to attend over
    rows = []
    for m in ((1, 8) if quick else (1, 2, 4, 8, 16, 32)):
        s = best_seconds(lambda: model.forward([7] * m, 64, all_logits=False), 3 if quick else 9)
        rows.append((f"{stage}: a pass of {m} row(s)", s * 1e3, "ms"))
    model.reset()
    rows.append((f"{rows[-1][0].split('of ')[1]} over 1 row", rows[-1][1] / rows[0][1], "x"))
    return {"rows": rows, "note": "one sequence's rows stand in for a batch's: the same weights read once per pass"}


@experiment("the page pool's size (the server's --kv-pages) against the requests' worst case")
def pool_pages(quick):
    """pages are held only by the sequences running at once (8 here), so a pool with room for 8 worst
    cases serves as fast as one with room for all; below that fewer run at once, sequences outgrow
    their pages and the newest is preempted (its context computed again), and the steps climb
    towards serving one request at a time"""
    arrivals = check.traffic(13, 8 if quick else 32, (20, 60), (16, 48), 0)
    worst = sum(-(-(p + t) // 16) for _, p, t in arrivals)
    one = max(-(-(p + t) // 16) for _, p, t in arrivals)           # the largest request's worst case
    rows = []
    for label, pages in (("every request's worst case", worst), ("8 running requests' worst case", one * 8),
                         ("4 running requests'", one * 4), ("1 request's", one)):
        log, _, _ = check.simulate(check.Scheduler, arrivals, pages)
        pre = sum(len(p) for _, p, _ in log)
        rows.append((f"{pages} pages ({label}): steps", len(log), "steps"))
        rows.append(("  preemptions", pre, ""))
    return {"rows": rows, "note": f"{len(arrivals)} requests at once, 8 at a time, pages of 16 positions"}
