"""The command line's shared pieces: which stage, the model and sampling flags, the checks every
command's flags go through, and the summary a run prints. `run` (app/run.py), `serve`
(app/serve/command.py) and the benchmarks (app/measure/) build their parsers from these, so a
flag means the same and is refused the same way in each."""

from __future__ import annotations

import argparse
import json
import math
import sys

from app.models import DEFAULT_MODEL
from common import speculative
from common.constrain import Grammar
from common.generate import ParameterError, SamplingParams, check_count, check_ctx_size, check_threads
from stages import STAGES, StageError, info, runnable_stages, unavailable_reason


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
    # The records are the harness's (app/measure, which imports this module): read from here,
    # when 'fastest' is resolved, so that this module stays below app/measure and app/serve.
    from app.measure import bench
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


def add_model_args(p: argparse.ArgumentParser, stage_help: str | None = None):
    """--stage, -m, -c, -t. stage_help: --stage's help where a command narrows the stages
    (serve: those with a KV cache on the CPU)."""
    p.add_argument("--stage", "-s", default="fastest",
                   help=stage_help or f"{' | '.join(STAGES)} (default: the fastest this machine can run; "
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
