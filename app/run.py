"""`python -m app run`: generate text with one stage (and `stages`: the registry)."""

from __future__ import annotations

import argparse
import json
import math
import sys

from app import stage_files
from app.chat import chat_loop
from app.measure import bench
from app.measure.counters import Counters
from app.models import DEFAULT_MODEL, resolve
from common import speculative
from common.constrain import Constraint, Grammar, ll_tokenizer
from common.generate import (
    ParameterError,
    Sampler,
    SamplingParams,
    Session,
    check_count,
    check_ctx_size,
    check_fits,
    check_n_predict,
    check_threads,
)
from common.gguf import GGUFFile
from common.model import LlamaConfig, context_size
from common.tokenizer import Tokenizer
from stages import (
    REGISTRY,
    STAGES,
    StageError,
    backend_class,
    info,
    load,
    op_owners,
    runnable_stages,
    unavailable_reason,
)


def fastest_stage(serving: bool = False) -> str:
    """The stage `make run` uses: cuda where it can run; else the CPU stage with the best
    decode time in the records `make report` made on this CPU with the code checked out now
    (recorded_decode_ms); else the registry's last CPU stage (measured, not assumed: a later
    stage is not always a faster one, but a record of other code or of another CPU says
    nothing about this one). A stage that runs as several processes (tp, under mpiexec) is run
    by name only. serving: among the stages the server can batch through (on the CPU, with a
    KV cache to hold pages)."""
    runnable = [s for s in runnable_stages() if not info(s).ranks
                and (not serving or (info(s).kv_cache and not info(s).gpu))]
    gpu = [s for s in runnable if info(s).gpu]
    if gpu:
        return gpu[-1]
    recorded = recorded_decode_ms()
    measured = [s for s in runnable if s in recorded]
    if measured:
        return min(measured, key=recorded.get)
    return runnable[-1]


def recorded_decode_ms(folder=None) -> dict:
    """{stage: decode ms/token} from the report records for the default model in this machine's
    folder (`folder` stands in for it), counting only those that measured this CPU (machine_id
    of the record's own machine) and the code checked out now (provenance's code hash)."""
    from app.measure.machine import machine_id
    from app.measure.provenance import provenance
    here, code = machine_id(), provenance()["code_hash"]
    out = {}
    for path in (folder or bench.results_dir(DEFAULT_MODEL.filename)).glob("*.json"):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        decode = rec.get("decode_ms")
        if rec.get("kind") != "stage" or not isinstance(decode, float) or not math.isfinite(decode):
            continue
        machine = rec.get("machine") or {}
        same_cpu = "cpu_signature" in machine and "isa" in machine and machine_id(machine) == here
        if same_cpu and (rec.get("provenance") or {}).get("code_hash") == code:
            out[rec["stage"]] = decode
    return out


def chosen_stage(name: str) -> str:
    """The stage a command runs ('fastest' resolved), or StageError saying why it cannot run here."""
    stage = fastest_stage() if name == "fastest" else name
    reason = unavailable_reason(stage)
    if reason:                                  # said before the model file is touched
        raise StageError(f"stage '{stage}' cannot run here: {reason}")
    return stage


# ---- arguments, checked where they are parsed (common/generate.py's checks, shared with the server) -----

def checked(check, parse=int):
    """An argparse type: parse the text, then apply the engine's check; a bad value becomes
    argparse's error (one line, exit 2: see one_line_errors) before anything is loaded."""
    def convert(text: str):
        try:
            value = parse(text)
        except ValueError:
            kind = "an integer" if parse is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
        try:
            check(value)
        except ParameterError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value
    convert.__name__ = getattr(check, "__name__", "value")
    return convert


def sampling_check(name: str):
    """SamplingParams' own rule for one field."""
    def check(value):
        SamplingParams(**{name: value})
    check.__name__ = name
    return check


def one_line_errors(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """argparse prints its usage (many lines) before an error; here the error alone, then exit 2."""
    def error(message):
        p.exit(2, f"error: {message} (`{p.prog} --help` lists the options)\n")
    p.error = error
    return p


def add_model_args(p: argparse.ArgumentParser):
    p.add_argument("--stage", "-s", default="fastest",
                   help=f"{' | '.join(STAGES)} (default: the fastest this machine can run; "
                        f"`python -m app stages` lists them)")
    p.add_argument("-m", "--model", default=str(DEFAULT_MODEL.path),
                   help="GGUF file or model name (default: %(default)s)")
    p.add_argument("-c", "--ctx-size", type=checked(check_ctx_size), default=None,
                   help="context window in tokens (default: min(model's, 2048))")
    p.add_argument("-t", "--threads", type=checked(check_threads), default=None,
                   help="threads for stages that use several (default: physical cores)")


def add_sampling_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("sampling (llama.cpp's chain: penalties, top-k, top-p, min-p, temperature)")
    def arg(flag, name, parse, default, text):
        g.add_argument(flag, dest=name, type=checked(sampling_check(name), parse), default=default, help=text)
    arg("--temp", "temp", float, 0.0, "temperature; 0 = greedy (default: 0)")
    arg("--top-k", "top_k", int, 40, "keep the k most likely tokens (default: 40; 0 = off)")
    arg("--top-p", "top_p", float, 0.95, "nucleus sampling (default: 0.95; 1 = off)")
    arg("--min-p", "min_p", float, 0.05, "drop tokens below min_p x the best (default: 0.05)")
    arg("--repeat-penalty", "repeat_penalty", float, 1.0, "penalize recent tokens (default: 1.0 = off)")
    arg("--repeat-last-n", "repeat_last_n", int, 64, "window of the repeat penalty (default: 64; -1 = all)")
    arg("--frequency-penalty", "frequency_penalty", float, 0.0,
        "subtract this x the times a token was generated so far from its logit (default: 0 = off)")
    arg("--presence-penalty", "presence_penalty", float, 0.0,
        "subtract this from the logit of every token generated so far (default: 0 = off)")
    arg("--seed", "seed", int, None, "random seed for sampling")
    g.add_argument("--special", action="store_true",
                   help="print control tokens (<|im_end|>, ...) as text, as llama.cpp's --special does "
                        "(default: they end the reply and are not part of it)")


def add_spec_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("speculative decoding (common/speculative.py): guess tokens, verify them in one pass")
    g.add_argument("--spec", choices=("lookup", "draft", "off"), default=None,
                   help="lookup: guess from n-grams earlier in the text; draft: guess with --model-draft; "
                        "off (default; --model-draft alone means draft). Greedy text is plain decoding's, "
                        "sampling keeps its distribution")
    g.add_argument("--draft-max", type=checked(lambda n: check_count("draft_max (--draft-max)", n)),
                   default=speculative.DRAFT_MAX,
                   help="guesses per step at most (default: %(default)s); fewer are made where the measured "
                        "cost of a verify pass and the accept rate say they do not pay")
    g.add_argument("-md", "--model-draft", default=None,
                   help="draft model: a GGUF file with the same vocabulary as -m (a smaller model of its family; "
                        "first_layers() in app/draft_model.py cuts one from a model's first layers)")


def add_constraint_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("constrained decoding (llguidance, common/constrain/): the text must match a JSON "
                             "schema or a grammar; it ends where they are complete")
    x = g.add_mutually_exclusive_group()
    x.add_argument("-j", "--json-schema", metavar="SCHEMA", default=None,
                   help="a JSON schema (json-schema.org) the text must match, e.g. '{\"type\": \"object\"}' "
                        "(`{}`: any JSON value); what llguidance supports: common/constrain/grammar.py")
    x.add_argument("--json-schema-file", metavar="F", default=None, help="the same, read from file F")
    x.add_argument("--grammar", metavar="G", default=None,
                   help="a grammar in llguidance's Lark dialect, not llama.cpp's GBNF: the text is `start: ...` "
                        "(GBNF: `root ::= ...`), a rule is `name: a | b`; UPPERCASE names, \"strings\" and "
                        "/regexes/ are terminals (one lexeme each; GBNF writes character classes bare, [a-z]); "
                        "`%%json {schema}` inlines a JSON schema, `<|im_end|>` names a special token; "
                        "llguidance.gbnf_to_lark converts most GBNF")
    x.add_argument("--grammar-file", metavar="F", default=None, help="the same, read from file F")


def read_flag_file(flag: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ParameterError(f"{flag} {path}: cannot read it: {e}") from None


def constraint_grammar(args) -> Grammar | None:
    """The grammar the flags ask for (None: none), not yet checked against a vocabulary; text
    that is not JSON or a file that cannot be read is refused here, before any file is opened."""
    if getattr(args, "json_schema", None) is not None:
        return Grammar.json_schema(args.json_schema, "--json-schema")
    if getattr(args, "json_schema_file", None) is not None:
        return Grammar.json_schema(read_flag_file("--json-schema-file", args.json_schema_file),
                                   f"--json-schema-file {args.json_schema_file}")
    if getattr(args, "grammar", None) is not None:
        return Grammar.lark(args.grammar, "--grammar")
    if getattr(args, "grammar_file", None) is not None:
        return Grammar.lark(read_flag_file("--grammar-file", args.grammar_file), f"--grammar-file {args.grammar_file}")
    return None


def sampling_params(args) -> SamplingParams:
    return SamplingParams(temp=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n, seed=args.seed,
                          frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty)


def print_stats(rec: dict, out=sys.stderr):
    def f(x, unit=""):
        return "n/a" if x != x else f"{x:.1f}{unit}"          # NaN when only one token was made
    print(f"\n--- {rec['stage']} on {rec['model']}: {rec['n_prompt']} prompt tokens, "
          f"{rec['n_generated']} generated ({rec['stop_reason']})", file=out)
    print(f"TTFT {f(rec['ttft_ms'], ' ms')} | decode {f(rec['decode_ms'], ' ms/token')} median, "
          f"{f(rec['decode_ms_mean'], ' ms')} mean | {f(rec['tokens_per_s'])} tokens/s", file=out)
    print(f"load {rec['load_s']:.2f} s | JIT/warm-up {rec['jit_s']:.2f} s | weights {rec['weights_mb']:.0f} MiB"
          f" | KV cache {rec['kv_cache_mb']:.0f} MiB | peak RSS {rec['peak_rss_mb']:.0f} MiB | page faults "
          f"{rec['minor_faults']} minor, {rec['major_faults']} major | threads {rec['threads']}", file=out)
    if rec.get("spec", "off") != "off":
        share = rec["accepted"] / rec["drafted"] if rec["drafted"] else float("nan")
        print(f"speculative ({rec['spec']}, --draft-max {rec['draft_max']}): {rec['drafted']} tokens guessed, "
              f"{rec['accepted']} accepted ({f(share * 100, '%')}) | {f(rec['tokens_per_s_mean'])} tokens/s "
              f"(tokens after the first / their time) | step costs measured in {rec['spec_calibrate_s']:.2f} s",
              file=out)


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


def spec_mode(args) -> str:
    """--spec as asked: --model-draft alone means draft; contradictions refused before loading."""
    mode = args.spec or ("draft" if args.model_draft else "off")
    if args.model_draft and mode != "draft":
        raise ParameterError(f"--model-draft is for --spec draft (got --spec {mode}): drop one of them")
    if mode == "draft" and not args.model_draft:
        raise ParameterError("--spec draft needs a draft model: give --model-draft FILE (a smaller model with "
                             "the same vocabulary; app/draft_model.py cuts one from the model's first layers)")
    if mode != "off" and getattr(args, "chat", False):
        raise ParameterError("--spec runs with -p, not --chat: drop one of them")
    return mode


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
