"""Chapter 15's experiments (run: make try-it ch=15)."""

from __future__ import annotations

from exercises.harness import best_seconds, load_file
from exercises.try_it import engine, experiment

check = load_file(__file__.replace("experiments", "check"))


def _copy_prompt(model):
    from app.measure.speculative import prompt_sets
    from common.tokenizer import Tokenizer
    return Tokenizer.from_gguf(model.gguf).encode(prompt_sets()["copy"][0], add_bos=True)


@experiment("--draft-max K: how many guesses a verify pass may check", model=True)
def draft_max(quick):
    """on text that copies its prompt, prompt lookup's guesses are mostly right: each pass of K + 1
    rows, costing about one step, yields up to K + 1 tokens. Tokens/s should rise from K = 0 and
    flatten once the guesses run past what the text repeats or the pass's rows pass the ridge"""
    from app.args import fastest_stage
    from app.measure.speculative import run_ours
    from common.speculative import accept
    stage = fastest_stage()
    model = engine(stage)
    ids = _copy_prompt(model)
    n = 16 if quick else 96
    rows = []
    for k in ((0, 8) if quick else (0, 2, 4, 8, 16)):
        spec = check.lookup(accept, k) if k else None
        r = min((run_ours(model, ids, n, spec) for _ in range(1 if quick else 3)), key=lambda r: r["decode_s"])
        kept = f", {r['accepted']} of {r['drafted']} guesses kept" if k else ""
        rows.append((f"--draft-max {k}{' (plain decoding)' if not k else ''}{kept}", r["tokens_per_s"], "tokens/s"))
    return {"rows": rows, "note": f"{stage} stage, {n} tokens of an answer that copies its prompt, greedy"}


@experiment("the rows of a verify pass: 1 to 17", model=True)
def verify_cost(quick):
    """under the ridge point a pass of m rows reads the same weights as one row: about 1 step for m up
    to a handful, then rising by a step per few rows as the multiply-adds take over"""
    from app.args import fastest_stage
    stage = fastest_stage()
    model = engine(stage)
    model.reset()
    model.forward(_copy_prompt(model)[:32], 0, all_logits=False)     # a context the pass attends over
    ms = {}
    for m in ((1, 3, 5) if quick else (1, 2, 3, 5, 9, 17)):          # m rows at positions 32.., as verify runs
        ms[m] = best_seconds(lambda: model.forward([7] * m, 32, all_logits=True), 3 if quick else 9) * 1e3
    model.reset()
    rows = [(f"a pass of {m} rows, in one-row steps", t / ms[1], "steps") for m, t in ms.items()]
    rows.append(("one row", ms[1], "ms"))
    return {"rows": rows, "note": f"{stage} stage; the chapter's chart draws the roofline's prediction beside it"}
