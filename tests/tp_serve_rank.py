"""Run by tests/test_tp_serve.py under `mpiexec -n N`: `python -m app serve ...` whose rank 1 fails
with an error of its own (a planted RuntimeError) in the first step longer than WARM_ROWS rows:
the first prompt served, past the server's warm-up.

    python tests/tp_serve_rank.py serve --stage tp -m MODEL ...
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import app  # noqa: E402

app.configure_numba()

from app.cli import main  # noqa: E402
from stages.parallel.ranks import world  # noqa: E402
from stages.tp import TensorParallelBackend  # noqa: E402

PLANTED_ERROR = "the planted failure of rank 1, in a step of the first prompt served"
WARM_ROWS = 8              # the warm-up's steps have fewer rows (app/serve/command.py build)


def failing(forward_layers_batch):
    def run(self, model, batch):
        if len(batch.tokens) > WARM_ROWS:
            raise RuntimeError(PLANTED_ERROR)
        return forward_layers_batch(self, model, batch)
    return run


if __name__ == "__main__":
    if world().rank == 1:
        TensorParallelBackend.forward_layers_batch = failing(TensorParallelBackend.forward_layers_batch)
    raise SystemExit(main(sys.argv[1:]))
