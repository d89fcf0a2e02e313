"""`python -m app bench stage` (`bench --stage S`, `make bench`): one stage or variant measured by
the protocol (app/measure/bench.py) into profiles/results/<machine>/<model>/<stage>.json; what
`make report` runs for every stage, each in a fresh process (bench.stage_in_child)."""

from __future__ import annotations

import json

from app.args import add_model_args, checked, chosen_stage, print_stats
from app.measure import bench
from common.generate import check_count, check_n_predict


def records(args):
    """`python -m app bench stage`: one stage measured by the protocol (app/measure/bench.py); its
    record, and where it goes (None: --no-write), with the cold start when it is written."""
    stage = chosen_stage(args.stage)
    rec = bench.bench_stage(stage, args.model, prompt_tokens=args.prompt_tokens, n_predict=args.n_predict,
                            threads=args.threads, ctx_size=args.ctx_size, profile_n=args.profile_n,
                            cold=not args.no_write)
    if args.json:
        print(json.dumps(rec, default=float))
    else:
        print_stats(rec)
    yield (None if args.no_write else bench.record_path(rec, args.out)), rec


def add_arguments(p):
    p.description = ("Measure one stage (or a variant) on a fixed prompt of exactly --prompt-tokens tokens, greedy, "
                     "generating exactly -n tokens (EOS ignored); JIT warmed up first. Writes one JSON record "
                     "(timings, RSS, page faults, machine, versions, the code that ran). Defaults: `make report`'s "
                     "settings (stages/registry.py).")
    add_model_args(p)
    p.add_argument("--prompt-tokens", type=checked(lambda n: check_count("prompt_tokens (--prompt-tokens)", n)),
                   default=None, help="prompt length in tokens (default: the report's)")
    p.add_argument("-n", "--n-predict", type=checked(check_n_predict), default=None,
                   help="tokens to generate (default: by stage)")
    p.add_argument("--out", default=None, help="folder for the record (default: profiles/results/<machine>/<model>/)")
    p.add_argument("--no-write", action="store_true", help="measure without writing a record")
    p.add_argument("--json", action="store_true", help="print the record (one JSON line) instead of a summary")
    p.add_argument("--profile-n", type=checked(lambda n: check_count("profile_n (--profile-n)", n, minimum=0)),
                   default=0, help="after measuring, profile a run of this many tokens per op and add it to the record")
