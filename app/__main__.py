"""`python -m app ...`: numba configured first (app.configure_numba), then the command line."""
import app

app.configure_numba()

from app.cli import main  # noqa: E402

raise SystemExit(main())
