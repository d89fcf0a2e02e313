"""Command line: python -m app {run,bench,stages,report,baseline,compile,inspect,model,...} ... (--help on each)."""

from __future__ import annotations

import argparse
import shlex
import sys

from app import compile as compile_command
from app import inspect_gguf, run
from app.measure import baseline, benchmarks, perplexity
from app.models import MODELS, FetchError, fetch, resolve
from app.report import lessons, report
from app.serve import command as serve_command
from common.generate import ContextError, ParameterError
from common.gguf import GGUFError
from common.tokenizer import TokenizerError
from stages import StageError

# Exceptions that mean bad input (a sentence for the user), not a bug (a traceback).
USER_ERRORS = (GGUFError, FetchError, StageError, ContextError, ParameterError, TokenizerError)


def _cmd_inspect(args):
    inspect_gguf.main(resolve(args.model), as_json=args.json, max_tensors=None if args.all else 40)


def _cmd_model(args):
    if args.list:
        for m in MODELS.values():
            print(f"{m.name:<20} {'present' if m.path.exists() else 'missing':<8} {m.about}")
        return
    print(fetch(args.name, force=args.force))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m app",
                                description="A from-scratch llama inference engine, in stages.")
    run.one_line_errors(p)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run.add_commands(sub)
    report.add_commands(sub)
    baseline.add_commands(sub)
    serve_command.add_commands(sub)
    perplexity.add_commands(sub)
    lessons.add_commands(sub)
    compile_command.add_commands(sub)
    benchmarks.add_commands(sub)

    s = sub.add_parser("inspect", help="show a GGUF file's metadata, tensor table and type mix",
                       description="Show a GGUF file's metadata (long arrays abbreviated), tensor table, "
                                   "type mix, parameter count and file size.")
    s.add_argument("model", nargs="?", default=None, help="path or model name (default: the default model)")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    s.add_argument("--all", action="store_true", help="list every tensor (default: the first 40)")
    s.set_defaults(func=_cmd_inspect)

    s = sub.add_parser("model", help="fetch a model into models/ (does nothing if present and valid)")
    s.add_argument("name", nargs="?", default="smollm2",
                   help=f"{', '.join(MODELS)} or vocab (default: smollm2)")
    s.add_argument("--force", action="store_true", help="fetch again even if present")
    s.add_argument("--list", action="store_true", help="list the known models and whether they are present")
    s.set_defaults(func=_cmd_model)
    return p


def main(argv=None) -> int:
    argv = benchmarks.with_default(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
    args.command_line = "python -m app " + shlex.join(argv)        # what a record says measured it
    try:
        code = args.func(args)                      # a benchmark's claims not held: 1; other commands: None
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    return code if isinstance(code, int) else 0
