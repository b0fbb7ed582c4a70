# PYTHON_ARGCOMPLETE_OK
"""The `pipec` command: its parser, made from one registry of subcommands (each in its own module of
pipec.cli), and `main`, which runs one and turns its outcome into the exit status and, under `--json`,
the document (pipec.cli.envelope). pipec.cli is the only package that prints.

Exit statuses (docs/cli.md): 0 on success, 1 on a schedule or input error (a coded diagnostic), 2 on
misuse of the command line.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, NoReturn

from pipec import __version__
from pipec.cli.envelope import MISUSE, Misuse, command_of, fail_json

if TYPE_CHECKING:
    from pipec.cli.args import Command

# Every subcommand, in the order `pipec --help` lists them: its name and aliases, and where its `Command`
# is (a module of pipec.cli, a name in it). A module is imported only when its command is parsed, so
# `pipec --version` imports none and `pipec list` one (`test_import_budget.py`); a test holds each row
# equal to the Command it names.
REGISTRY: tuple[tuple[str, tuple[str, ...], str, str], ...] = (
    ("check", (), "check", "CHECK"),
    ("compile", (), "check", "COMPILE"),
    ("show", (), "show", "SHOW"),
    ("simulate", ("compare",), "simulate", "SIMULATE"),
    ("view", (), "view", "VIEW"),
    ("serve", (), "serve", "SERVE"),
    ("run", (), "run", "RUN"),
    ("profile", (), "run", "PROFILE"),
    ("export", (), "interop", "EXPORT"),
    ("import", (), "interop", "IMPORT"),
    ("synth", (), "synth", "SYNTH"),
    ("partition", (), "partition", "PARTITION"),
    ("plan", (), "plan", "PLAN"),
    ("slice", (), "slice", "SLICE"),
    ("test", (), "test", "TEST"),
    ("list", (), "check", "LIST"),
)


def commands(only: Collection[str] | None = None) -> tuple[Command, ...]:
    """The registry's Commands (those named in `only`, by name or alias; None: all), their modules
    imported now."""
    import importlib

    rows = [r for r in REGISTRY if only is None or {r[0], *r[1]} & set(only)]
    return tuple(getattr(importlib.import_module(f"pipec.cli.{module}"), attr) for _, _, module, attr in rows)


def __getattr__(name: str) -> object:
    """`COMMANDS`, every Command in the registry's order, on first use (PEP 562)."""
    if name == "COMMANDS":
        return commands()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors raised as Misuse so that `main` reports them the one way (with the
    subcommand's own usage, and as JSON under --json)."""

    def error(self, message: str) -> NoReturn:
        raise Misuse(message, self)


def parser(only: Collection[str] | None = None) -> argparse.ArgumentParser:
    """`pipec`'s parser; `commands` maps each subcommand's name (aliases too) to its own parser.

    `only`: the subcommands to add (by name or alias); None: all. Making every subcommand's parser costs
    more than `pipec list` itself takes, so `main` adds only the one that argv runs (`_needed`)."""
    epilog = None
    if only is None:  # the top-level --help, which only the whole parser prints, names the library
        from pipec.frontend import library

        epilog = "Library schedules: " + ", ".join(library.names())
    ap = _Parser(
        prog="pipec", description="Compile, check and show pipeline-parallel training schedules.", epilog=epilog
    )
    ap.add_argument("--version", action="version", version=version())
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in commands(only):
        p = sub.add_parser(cmd.name, aliases=list(cmd.aliases), help=cmd.help, description=_doc(cmd.run))
        cmd.arguments(p)
        p.set_defaults(func=cmd.run, command_name=cmd.name)
    ap.commands = dict(sub.choices)
    return ap


def _doc(fn) -> str:
    return (fn.__doc__ or "").strip()


def _needed(argv: Sequence[str]) -> tuple[str, ...] | None:
    """The subcommands `parser` must hold to parse `argv` as the whole parser would: the one it runs
    (its first word that is no flag: `pipec` itself takes no values), none for `--version` before it,
    and all (None) for `--help`, a missing or unknown command, or a flag argparse might expand."""
    names = {n for name, aliases, _, _ in REGISTRY for n in (name, *aliases)}
    for word in argv:
        if word == "--version":
            return ()
        if not word.startswith("-"):
            return (word,) if word in names else None
        if word not in ("--json",):  # -h, an abbreviation (`--vers`), `--`: as the whole parser has it
            return None
    return None


def version() -> str:
    """What `pipec --version` prints: the package's version and the Program file format's it writes."""
    return f"pipec {__version__} (Program format {program_format()})"


_VERSION_LINE = re.compile(r"^VERSION = (\d+)[ \t]*(?:#.*)?$", re.M)


def program_format() -> int:
    """The Program format version, `pipec.formats.program_file.VERSION`, the one place it is defined: read
    from that module's source, which is quicker than importing it (numpy, the validator), else imported
    (a test holds the two equal)."""
    spec = importlib.util.find_spec("pipec.formats.program_file")
    try:
        with open(spec.origin, encoding="utf-8") as f:  # type: ignore[union-attr, arg-type]
            found = _VERSION_LINE.search(f.read())
    except (OSError, TypeError, AttributeError):  # no source on disk (a zip, bytecode only)
        found = None
    if found:
        return int(found.group(1))
    from pipec.formats.program_file import VERSION

    return VERSION


def main(argv: Sequence[str] | None = None) -> int:
    """Run `pipec ARGV`; return the exit status: 0 done, 1 a schedule or input error (a coded
    diagnostic), 2 misuse of the command line. argparse's own exits (--help, --version, a bad flag)
    raise SystemExit as argparse does, with the same statuses."""
    argv = sys.argv[1:] if argv is None else list(argv)
    as_json = "--json" in argv
    completing = "_ARGCOMPLETE" in os.environ  # the shell asks for completions (docs/cli.md): answer and exit
    ap = parser(None if completing else _needed(argv))
    if completing:
        import argcomplete

        argcomplete.autocomplete(ap)
    try:
        args, extra = ap.parse_known_args(argv)
        if extra:  # reported by the subcommand's parser, with its own usage
            ap.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    except Misuse as e:
        _misuse(e, e.parser or ap, as_json)
        raise SystemExit(MISUSE) from None
    from pipec.errors import PipecError  # loaded by every command module already
    from pipec.options import OptionError

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
