"""Running `pipec` in-process from tests."""

from __future__ import annotations

from contextlib import redirect_stderr, redirect_stdout
from io import StringIO

from pipec.cli.app import main


def run_cli(*argv: str) -> tuple[int, str, str]:
    """Run `pipec ARGV` in-process: (exit status, stdout, stderr). argparse's exits count as statuses."""
    out, err = StringIO(), StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    return rc, out.getvalue(), err.getvalue()
