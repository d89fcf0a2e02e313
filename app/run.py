"""`python -m app run`: generate text with one stage (and `stages`: the registry)."""

from __future__ import annotations

import json
import sys

from app import stage_files
from app.args import (
    add_constraint_args,
    add_model_args,
    add_sampling_args,
    add_spec_args,
    checked,
    chosen_stage,
    constraint_grammar,
    one_line_errors,
    print_stats,
    sampling_params,
    spec_mode,
)
from app.chat import chat_loop
from app.measure import bench
from app.measure.counters import Counters
from app.models import resolve
from common import speculative
from common.constrain import Constraint, ll_tokenizer
from common.generate import ParameterError, Sampler, Session, check_fits, check_n_predict
from common.gguf import GGUFFile
from common.model import LlamaConfig, context_size
from common.tokenizer import Tokenizer
from stages import REGISTRY, STAGES, backend_class, info, load, op_owners


def check_prompt_fits(args, stage: str, g: GGUFFile, tokenizer: Tokenizer) -> tuple[list, int]:
    """Tokenize the prompt and check it fits the context before the weights are loaded:
    (prompt ids, n_predict), or ContextError. The file is open once: the model loads from `g`."""
    cfg = LlamaConfig.from_gguf(g)
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
        raise ParameterError("the prompt is empty (no tokens): give -p some text")
    n_predict = check_n_predict(args.n_predict if args.n_predict is not None else info(stage).tokens.run)
    check_fits(len(prompt), n_predict, context_size(cfg, args.ctx_size), cfg.n_ctx_train)
    return prompt, n_predict


def load_draft(args, stage: str, g: GGUFFile):
    """The draft model's file opened and its vocabulary checked against the target's before
    either model's weights are read; then loaded on the same stage."""
    d = GGUFFile(resolve(args.model_draft))
    speculative.check_vocabulary(g, d)
    return load(stage, d, n_ctx=args.ctx_size, threads=args.threads, progress=True)


def cmd_run(args):
    stage = chosen_stage(args.stage)
    lead = backend_class(stage).reporting_process()   # tp: rank 0 prints, the other ranks compute
    params = sampling_params(args)              # bad values refused before anything loads
    mode = spec_mode(args)
    grammar = constraint_grammar(args)
    g = GGUFFile(resolve(args.model))           # opened once: tokenized and checked, then loaded
    n_vocab = LlamaConfig.from_gguf(g).n_vocab  # the model's shape first, then its vocabulary
    vocabulary = Tokenizer.from_gguf(g)
    if not args.chat:
        prompt, n_predict = check_prompt_fits(args, stage, g, vocabulary)
    constraint = None
    if grammar is not None:                     # compiled for this vocabulary before the weights load
        ll = ll_tokenizer(vocabulary, n_vocab)
        constraint = Constraint(grammar.checked(ll), ll)
    draft = load_draft(args, stage, g) if mode == "draft" else None
    engine = load(stage, g, n_ctx=args.ctx_size, threads=args.threads, progress=lead)
    tok = engine.tokenizer
    if lead and engine.backend.banner():
        print(engine.backend.banner(), file=sys.stderr)
    if args.chat:
        return chat_loop(engine, stage, args, params, constraint=constraint)
    session = Session(engine)
    jit_s = engine.warmup()
    stream = tok.stream_decoder(skip_special=not args.special)      # control tokens are not text
    echo = lead and not args.json

    def on_token(t):
        if echo:
            sys.stdout.write(stream.push(t))
            sys.stdout.flush()

    if echo:
        sys.stdout.write(args.prompt)
        sys.stdout.flush()
    profiler = engine.backend.profiler(engine) if args.profile else None
    if profiler:
        profiler.start()
    spec = speculative.from_flags(mode, args.draft_max, draft, engine)
    if spec:
        if draft is not None:
            jit_s += draft.warmup()
        spec.prepare(session)                   # the step costs, measured before the timed region
    with Counters() as counted:
        gen = session.generate(prompt, n_predict, Sampler(params, constraint=constraint), stop_ids=tok.eog_ids,
                               on_token=on_token, ignore_eos=args.ignore_eos, step=spec)
    if profiler:
        profiler.stop()
    if echo:
        sys.stdout.write(stream.flush() + "\n")
    if grammar is None:
        text = tok.decode(gen.tokens, skip_special=not args.special)
    else:   # the bytes the grammar matched: the pieces as they are (decode's clean-up could change them)
        text = b"".join(tok.token_piece(t, special=args.special) for t in gen.tokens).decode("utf-8", "replace")
    rec = bench.run_record(engine, stage, gen, text, jit_s, counted.result)
    rec.update(spec=mode, drafted=gen.drafted, accepted=gen.accepted,
               constraint=grammar.kind if grammar is not None else None)
    if spec:
        rec.update(draft_max=args.draft_max, model_draft=draft.gguf.path.split("/")[-1] if draft else None,
                   spec_calibrate_s=spec.speculation.time.calibrate_s,
                   tokens_per_s_mean=1000.0 / gen.decode_ms_mean if gen.decode_ms else float("nan"))
    if profiler:
        rec["profile"] = profiler.rows()
    if not lead:
        return
    if args.json:
        rec.pop("decode_ms_all")
        print(json.dumps(rec))
    else:
        print_stats(rec)
        if profiler:
            print("\n" + profiler.table(), file=sys.stderr)


def cmd_stages(args):
    if args.ops:
        if args.json:
            print(json.dumps(op_owners()))
        else:
            from app.report.charts import ops_table
            print(ops_table(), end="")
        return
    counts = {s: (stage_files.lines(stage_files.own_files(s)), stage_files.lines(stage_files.reads(s)))
              for s in REGISTRY}
    if args.json:
        print(json.dumps([vars(s) | {"tokens": vars(s.tokens), "own_lines": counts[s.name][0],
                                     "lines_read": counts[s.name][1]} for s in REGISTRY.values()]))
        return
    for s in REGISTRY.values():
        after = f"a variant of {s.variant_of}" if s.variant_of else \
            f"builds on {s.builds_on}" if s.builds_on else "the start"
        kind = "KV cache" if s.kv_cache else "recomputes the text"
        gpu = ", GPU" if s.gpu else ""
        own, read = counts[s.name]
        print(f"{s.number}  {s.name:<10} {s.lesson}\n   {'':<10} ({after}; {kind}{gpu}; "
              f"{s.path}; notebooks/{s.chapter}.ipynb)\n   {'':<10} {own:,} lines of its own "
              f"({', '.join(f.removeprefix('stages/') for f in stage_files.own_files(s.name))}), "
              f"{read:,} with what it builds on")


def add_commands(sub):
    run_tokens = ", ".join(f"{s} {info(s).tokens.run}" for s in STAGES)
    p = one_line_errors(sub.add_parser(
        "run", help="generate text with one stage, then print its timings",
        description="Generate a completion with one stage, streaming the text, then print TTFT, "
                    "decode ms/token, tokens/s, load and JIT time, peak RSS and page faults."))
    add_model_args(p)
    p.add_argument("-p", "--prompt", default="The meaning of life is", help="prompt text")
    p.add_argument("-n", "--n-predict", type=checked(check_n_predict), default=None,
                   help=f"tokens to generate (default, by stage: {run_tokens})")
    p.add_argument("--chat", action="store_true",
                   help="interactive chat with the model's template (stages with a KV cache); /reset, Ctrl-D")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate exactly -n tokens: an end-of-generation token does not end the text (llama.cpp's "
                        "flag; a benchmark on a prompt the model would answer in a word needs it)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    p.add_argument("--profile", action="store_true",
                   help="time every op (matmul by weight, attention, norms, ...) and print an nvprof-style table")
    add_sampling_args(p)
    add_spec_args(p)
    add_constraint_args(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("stages", help="list the stages: number, lesson, what each builds on",
                       description="The stage registry (stages/registry.py), which every command reads.")
    p.add_argument("--json", action="store_true", help="print the registry as JSON")
    p.add_argument("--ops", action="store_true",
                   help="which stage defines which op of the surface (common/backend.py), and where the others "
                        "come from (read from the classes)")
    p.set_defaults(func=cmd_stages)
