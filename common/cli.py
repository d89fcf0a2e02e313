"""Command line: python -m common {inspect,model,run,bench} ... (--help on each)."""

from __future__ import annotations

import argparse
import sys


def _cmd_inspect(args):
    from common import inspect_gguf
    from common.models import resolve
    inspect_gguf.main(resolve(args.model), as_json=args.json, max_tensors=None if args.all else 40)


def _cmd_model(args):
    from common.models import MODELS, fetch
    if args.list:
        for m in MODELS.values():
            print(f"{m.name:<20} {'present' if m.path.exists() else 'missing':<8} {m.about}")
        return
    print(fetch(args.name, force=args.force))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m common",
                                description="A from-scratch llama inference engine, in stages.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("inspect", help="show a GGUF file's metadata, tensor table and type mix",
                       description="Show a GGUF file's metadata (long arrays abbreviated), tensor table, "
                                   "type mix, parameter count and file size.")
    s.add_argument("model", nargs="?", default=None, help="path or model name (default: the default model)")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    s.add_argument("--all", action="store_true", help="list every tensor (default: the first 40)")
    s.set_defaults(func=_cmd_inspect)

    s = sub.add_parser("model", help="fetch a model into models/ (does nothing if present and valid)")
    s.add_argument("name", nargs="?", default="smollm2",
                   help="smollm2 (default), tinyllama, tinyllama-synthetic, or vocab")
    s.add_argument("--force", action="store_true", help="fetch again even if present")
    s.add_argument("--list", action="store_true", help="list the known models and whether they are present")
    s.set_defaults(func=_cmd_model)

    from common import report, run_cli
    run_cli.add_commands(sub)
    report.add_commands(sub)
    return p


def user_errors() -> tuple:
    """Exceptions that mean bad input (a sentence for the user), not a bug (a traceback)."""
    from common.generate import ContextError
    from common.gguf import GGUFError
    from common.models import FetchError
    from stages import StageError
    errors = [GGUFError, FetchError, StageError, ContextError]
    try:
        from common.tokenizer import TokenizerError
        errors.append(TokenizerError)
    except ImportError:
        pass
    return tuple(errors)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except user_errors() as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    return 0
