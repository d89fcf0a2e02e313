"""Interactive chat: `python -m app run --chat`.

Each turn renders the whole conversation with the model's own chat template, tokenizes it,
and feeds the engine only what its KV cache has not seen yet. Stages with a cache therefore
do work proportional to the new turn, not the conversation; stages without one recompute
everything every token (and it shows).

Commands: /reset forgets the conversation; Ctrl-D (or /exit) leaves.
"""

from __future__ import annotations

import sys

from common.generate import ContextError, Sampler, SamplingParams, Session


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def rewind(session: Session, n: int):
    """Keep only the first n tokens. The cache beyond them is simply overwritten later."""
    session.tokens = session.tokens[:n]
    session.n_cached = min(session.n_cached, n)


def chat_loop(engine, stage: str, args, params: SamplingParams, inp=None, out=None, constraint=None):
    """constraint (common/constrain): every reply must match its grammar, each from the start."""
    inp, out = inp or sys.stdin, out or sys.stdout
    tok = engine.tokenizer
    sampler = Sampler(params, constraint=constraint)
    n_predict = args.n_predict or 256
    special = getattr(args, "special", False)
    messages = []
    session = Session(engine)
    engine.warmup()
    kind = "keeps the conversation in its KV cache" if engine.uses_kv_cache else \
        "has no KV cache: every token recomputes the whole conversation"
    print(f"chat with {stage} ({kind}). /reset forgets, Ctrl-D leaves.", file=sys.stderr)
    while True:
        out.write("\n> ")
        out.flush()
        line = inp.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            out.write("\n")
            return
        text = line.rstrip("\n")
        if text.strip() == "/reset":
            messages.clear()
            session.reset()
            print("(conversation forgotten)", file=sys.stderr)
            continue
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True),
                         add_bos=None, parse_special=True)
        keep = common_prefix(session.tokens, ids)
        rewind(session, keep)
        stream = tok.stream_decoder(skip_special=not special)
        sampler.new_completion()                     # penalties count this reply's tokens; the grammar restarts

        def show(t):
            if t not in tok.eog_ids:
                out.write(stream.push(t))
                out.flush()
        try:
            gen = session.generate(ids[keep:], n_predict, sampler, stop_ids=tok.eog_ids, on_token=show)
        except ContextError as e:
            messages.pop()
            print(f"\n(context full: {e}; /reset to start over)", file=sys.stderr)
            continue
        out.write(stream.flush())
        reply = [t for t in gen.tokens if t not in tok.eog_ids]
        messages.append({"role": "assistant", "content": tok.decode(reply)})
        print(f"\n[{len(ids) - keep} new prompt tokens, TTFT {gen.ttft_ms:.0f} ms, "
              f"{gen.decode_ms_median:.1f} ms/token]", file=sys.stderr)
