"""The `--json` documents every command prints, and the one exception for command-line misuse.

Conventions every subcommand follows (docs/cli.md): exit status 0 on success, 1 on a schedule or input
error (a coded diagnostic), 2 on misuse of the command line; `--json` prints one JSON document on
standard output, `{"version": 1, "command": ..., "ok": ...}` and the command's fields, or on an error
its diagnostics, while the human-readable text goes to standard error.
"""

from __future__ import annotations

import argparse
import sys
from typing import IO

MISUSE = 2
JSON_VERSION = 1  # of the documents `--json` prints; a field renamed or removed bumps it (docs/cli.md)


class Misuse(Exception):
    """Command-line misuse that argparse cannot see (a bad value, a missing extra): `main` prints
    `pipec COMMAND: error: MESSAGE` and exits 2, so no command restates how misuse is reported."""

    def __init__(self, message: str, parser: argparse.ArgumentParser | None = None) -> None:
        super().__init__(message)
        self.parser = parser


def stdout() -> IO[str]:
    """Where a command's output goes: looked up at each write, so tests may redirect sys.stdout."""
    return sys.stdout


def command_of(args: argparse.Namespace) -> str:
    """The command's name in its documents (`simulate` for its alias `compare`)."""
    return args.command_name


def envelope(command: str | None, ok: bool) -> dict:
    return {"version": JSON_VERSION, "command": command, "ok": ok}


def emit(args: argparse.Namespace, doc: dict, ok: bool = True) -> None:
    """A command's --json document: the envelope, then its own fields, on one line of stdout."""
    import json  # `pipec --version` and the text output need none

    out = stdout()
    out.write(json.dumps({**envelope(command_of(args), ok), **doc}) + "\n")
    out.flush()


def fail_json(command: str | None, status: int, diagnostics: list[dict]) -> None:
    """The document of a command that failed: its exit status and diagnostics."""
    import json

    doc = {**envelope(command, False), "exit": status, "diagnostics": diagnostics}
    out = stdout()
    out.write(json.dumps(doc) + "\n")
    out.flush()
