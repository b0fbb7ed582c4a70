# PYTHON_ARGCOMPLETE_OK
"""The `pipec` command: its parser, made from one registry of subcommands (each in its own module of
pipec.cli), and `main`, which runs one and turns its outcome into the exit status and, under `--json`,
the document (pipec.cli.envelope). pipec.cli is the only package that prints.

Exit statuses (docs/cli.md): 0 on success, 1 on a schedule or input error (a coded diagnostic), 2 on
misuse of the command line.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from pipec import __version__
from pipec.cli import check, interop, partition, plan, run, serve, show, simulate, slice, synth, test, view
from pipec.cli.args import Command
from pipec.cli.envelope import MISUSE, Misuse, command_of, fail_json
from pipec.errors import PipecError
from pipec.frontend import library
from pipec.options import OptionError

# Every subcommand, in the order `pipec --help` lists them.
COMMANDS: tuple[Command, ...] = (
    check.CHECK,
    check.COMPILE,
    show.SHOW,
    simulate.SIMULATE,
    view.VIEW,
    serve.SERVE,
    run.RUN,
    run.PROFILE,
    interop.EXPORT,
    interop.IMPORT,
    synth.SYNTH,
    partition.PARTITION,
    plan.PLAN,
    slice.SLICE,
    test.TEST,
    check.LIST,
)


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors raised as Misuse so that `main` reports them the one way (with the
    subcommand's own usage, and as JSON under --json)."""

    def error(self, message: str) -> NoReturn:
        raise Misuse(message, self)


def parser() -> argparse.ArgumentParser:
    """`pipec`'s parser; `commands` maps each subcommand's name (aliases too) to its own parser."""
    ap = _Parser(
        prog="pipec",
        description="Compile, check and show pipeline-parallel training schedules.",
        epilog="Library schedules: " + ", ".join(library.names()),
    )
    ap.add_argument("--version", action="version", version=f"pipec {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, aliases=list(cmd.aliases), help=cmd.help, description=_doc(cmd.run))
        cmd.arguments(p)
        p.set_defaults(func=cmd.run, command_name=cmd.name)
    ap.commands = dict(sub.choices)
    return ap


def _doc(fn) -> str:
    return (fn.__doc__ or "").strip()


def main(argv: Sequence[str] | None = None) -> int:
    """Run `pipec ARGV`; return the exit status: 0 done, 1 a schedule or input error (a coded
    diagnostic), 2 misuse of the command line. argparse's own exits (--help, --version, a bad flag)
    raise SystemExit as argparse does, with the same statuses."""
    argv = sys.argv[1:] if argv is None else list(argv)
    as_json = "--json" in argv
    ap = parser()
    if "_ARGCOMPLETE" in os.environ:  # the shell asks for completions (docs/cli.md): answer and exit
        import argcomplete

        argcomplete.autocomplete(ap)
    try:
        args, extra = ap.parse_known_args(argv)
        if extra:  # reported by the subcommand's parser, with its own usage
            ap.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    except Misuse as e:
        _misuse(e, e.parser or ap, as_json)
        raise SystemExit(MISUSE) from None
    try:
        return args.func(args)
    except (Misuse, OptionError) as e:
        return _misuse(e, ap.commands[args.command], args.json)
    except PipecError as e:
        for d in e.diagnostics:
            print(d.format(), file=sys.stderr)
        if args.json:
            fail_json(command_of(args), 1, [d.to_json() for d in e.diagnostics])
        return 1
    except BrokenPipeError:  # `pipec show ... | head`
        return 0


def _misuse(e: Exception, parser: argparse.ArgumentParser, as_json: bool) -> int:
    """Misuse as argparse reports it: the (sub)command's usage, then `PROG: error: MESSAGE`."""
    text = f"{parser.prog}: error: {e}"
    sys.stderr.write(parser.format_usage() + text + "\n")
    if as_json:
        command = parser.prog.split(" ", 1)[1] if " " in parser.prog else None
        command = {"compare": "simulate"}.get(command, command)
        blank = {"path": None, "line": None, "col": None, "end_line": None, "end_col": None, "notes": []}
        fail_json(command, MISUSE, [{"code": None, "severity": "error", "message": str(e), **blank, "text": text}])
    return MISUSE


if __name__ == "__main__":
    sys.exit(main())
