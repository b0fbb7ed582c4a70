# PYTHON_ARGCOMPLETE_OK
"""The `pipec` command. The only module that prints.

Conventions every subcommand follows (docs/cli.md): exit status 0 on success, 1 on a schedule or input
error (a coded diagnostic), 2 on misuse of the command line; `--json` prints one JSON document on
standard output, `{"version": 1, "command": ..., "ok": ...}` and the command's fields, or on an error
its diagnostics, while the human-readable text goes to standard error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import IO, NoReturn

from pipec import __version__
from pipec import slicing as slice_command
from pipec.errors import Diagnostic, PipecError, Source, brief, error
from pipec.frontend import library
from pipec.ir import dataparallel as dpopts
from pipec.ir.program import Program
from pipec.ir.schedule import Schedule
from pipec.partition import command as partition_command
from pipec.passes.compiler import CompiledSchedule, compile_schedule
from pipec.sim.memory import format_table

MISUSE = 2
# pipec synth's sizes: each of p, m, v, and the ops p * v * m * kinds, within what a schedule may have (the
# language's limits: pipec/frontend/evaluate.py's MAX_SIZE and MAX_OPS); -p 1000000000 would run for hours.
SYNTH_MAX = 10_000_000
SYNTH_MAX_OPS = 50_000_000
JSON_VERSION = 1  # of the documents `--json` prints; a field renamed or removed bumps it (docs/cli.md)


class Misuse(Exception):
    """Command-line misuse that argparse cannot see (a bad value, a missing extra): `main` prints
    `pipec COMMAND: error: MESSAGE` and exits 2, so no command restates how misuse is reported."""

    def __init__(self, message: str, parser: argparse.ArgumentParser | None = None) -> None:
        super().__init__(message)
        self.parser = parser


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors raised as Misuse so that `main` reports them the one way (with the
    subcommand's own usage, and as JSON under --json)."""

    def error(self, message: str) -> NoReturn:
        raise Misuse(message, self)


def _stdout() -> IO[str]:
    """Where a command's output goes: looked up at each write, so tests may redirect sys.stdout."""
    return sys.stdout


def _name(args: argparse.Namespace) -> str:
    return args.func.__name__.removeprefix("cmd_")


def _envelope(command: str | None, ok: bool) -> dict:
    return {"version": JSON_VERSION, "command": command, "ok": ok}


def _emit(args: argparse.Namespace, doc: dict, ok: bool = True) -> None:
    """A command's --json document: the envelope, then its own fields, on one line of stdout."""
    out = _stdout()
    out.write(json.dumps({**_envelope(_name(args), ok), **doc}) + "\n")
    out.flush()


def diagnostic_json(d: Diagnostic) -> dict:
    """A diagnostic as --json reports it: its code, place and text (`text` is what stderr shows)."""
    sp = d.span
    return {
        "code": d.code,
        "severity": d.severity,
        "message": d.message,
        "path": d.source.path if d.source else None,
        "line": sp.line if sp else None,
        "col": sp.col if sp else None,
        "end_line": sp.end_line if sp else None,
        "end_col": sp.end_col if sp else None,
        "notes": list(d.notes),
        "text": d.format(),
    }


def _fail_json(command: str | None, status: int, diagnostics: list[dict]) -> None:
    doc = {**_envelope(command, False), "exit": status, "diagnostics": diagnostics}
    out = _stdout()
    out.write(json.dumps(doc) + "\n")
    out.flush()


def _define(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got `{text}`")
    return name.strip(), value.strip()


def _define_arg(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("-D", dest="defines", metavar="NAME=VALUE", type=_define, action="append", default=[], help=help)


def _complete_schedule(prefix: str, **_: object) -> list[str]:
    """Shell completion of FILE|NAME: library names and schedule files (argcomplete calls this)."""
    import glob

    files = [f + "/" if os.path.isdir(f) else f for f in glob.glob(prefix + "*")]
    keep = [f for f in files if f.endswith(("/", ".pipe", ".csv", ".json", ".txt"))]
    return [n for n in library.names() if n.startswith(prefix)] + sorted(keep)


def _schedule_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "schedule", metavar="FILE|NAME", help="a .pipe file, or the name of a library schedule"
    ).completer = _complete_schedule
    _define_arg(p, "set a schedule parameter (repeatable), e.g. -D p=4 -D m=8")


def _json_arg(p: argparse.ArgumentParser, what: str = "the result") -> None:
    p.add_argument("--json", action="store_true", help=f"print {what} as one JSON document (docs/cli.md)")


_FLOAT = None  # the compiled pattern of a command-line number, made on first use


def _finite(text: str) -> float:
    """A number given on the command line: ASCII digits, an optional sign, point and exponent (float()
    would also take `1_0`, `٤`, `nan` and `inf`), finite and >= 0."""
    import math
    import re

    global _FLOAT
    if _FLOAT is None:
        _FLOAT = re.compile(r"\+?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
    text = text.strip()
    if not _FLOAT.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected a number >= 0 (ASCII digits), got `{brief(text)}`")
    value = float(text)
    if not math.isfinite(value) or value > 1e300:
        raise argparse.ArgumentTypeError(f"`{brief(text)}` is out of range")
    return value


def _count(lo: int, hi: int):
    """An integer option between lo and hi, in ASCII digits (int() would also take `1_0` and `٤`)."""

    def parse(text: str) -> int:
        t = text.strip()
        digits = t[1:] if t[:1] in "+-" else t
        if not (digits.isascii() and digits.isdigit()):
            raise argparse.ArgumentTypeError(f"expected an integer (ASCII digits), got `{brief(text)}`")
        if len(digits) > 12 or not lo <= int(t) <= hi:
            raise argparse.ArgumentTypeError(f"expected an integer from {lo:,} to {hi:,}, got {brief(t)}")
        return int(t)

    parse.__name__ = "integer"  # argparse names the type in its messages
    return parse


def _mem(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    if not sep or name not in ("act", "wact", "ckpt", "params"):
        raise argparse.ArgumentTypeError(f"expected act=X, wact=X, ckpt=X or params=X, got `{brief(text)}`")
    return name, _amount(value)


def _amount(text: str) -> float:
    """A memory amount: a number (as `_finite` reads it), or bytes with a unit (`80GiB`;
    pipec.sim.cost_files.quantity)."""
    from pipec.sim.cost_files import quantity

    if not text.strip()[-1:].isalpha() or text.strip().lower() in ("nan", "inf", "infinity"):
        return _finite(text)  # no unit: a plain number, with its messages
    try:
        return quantity(text, "bytes", "memory")
    except PipecError as e:
        raise argparse.ArgumentTypeError(e.diagnostics[0].message) from None


def _memory_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mem",
        metavar="KEY=VALUE",
        type=_mem,
        action="append",
        default=[],
        help="override the memory model for every stage: act=, wact=, ckpt= or params= (repeatable)",
    )
    p.add_argument("--memory-limit", type=_amount, default=None, metavar="X", help="per-rank memory limit (80GiB)")
    p.add_argument("--host-memory-limit", type=_amount, default=None, metavar="X", help="per-rank host memory limit")


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="pipec",
        description="Compile, check and show pipeline-parallel training schedules.",
        epilog="Library schedules: " + ", ".join(library.names()),
    )
    ap.add_argument("--version", action="version", version=f"pipec {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("check", help="parse, evaluate and check a schedule", description=_doc(cmd_check))
    _schedule_args(p)
    _memory_args(p)
    dpopts.add_dp_options(p)
    p.add_argument("--memory", action="store_true", help="print the per-rank memory table")
    _cost_args(p)  # measured bytes (saved_bytes, ...) put the memory model in bytes
    _json_arg(p, "the summary")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("compile", help="check and lower a schedule to a Program", description=_doc(cmd_compile))
    _schedule_args(p)
    _memory_args(p)
    dpopts.add_dp_options(p)
    p.add_argument("-o", "--output", metavar="OUT", help="write here instead of standard output")
    p.add_argument(
        "--format",
        choices=("text", "json"),
        default=None,
        help="program format (default: json when OUT ends in .json, else text)",
    )
    _json_arg(p, "a summary (and, without -o, the program)")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("show", help="print the step-by-rank grid of a schedule", description=_doc(cmd_show))
    _schedule_args(p)
    p.add_argument("--ranks", type=str, default=None, help="only these ranks, e.g. 0,3")
    p.add_argument("--timeline", action="store_true", help="simulate and draw a text Gantt chart instead of the grid")
    _cost_args(p)
    _topology_arg(p)
    p.add_argument(
        "--width", type=_count(1, 100_000), default=None, help="columns for --timeline (default: the terminal's)"
    )
    dpopts.add_dp_options(p)
    _json_arg(p, "the grid (and with --timeline the simulated spans)")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser(
        "simulate",
        aliases=["compare"],
        help="simulate schedules under a cost model: makespan, bubble, memory, trace, plot",
        description=_doc(cmd_simulate),
    )
    p.add_argument(
        "schedule", metavar="FILE|NAME", nargs="+", help="one schedule, or several to compare"
    ).completer = _complete_schedule
    _define_arg(p, "set a schedule parameter (repeatable); with several schedules, each takes those it declares")
    _cost_args(p)
    _topology_arg(p)
    _memory_args(p)
    dpopts.add_dp_options(p)
    _json_arg(p, "every figure")
    p.add_argument("--trace", metavar="OUT.json", help="write a Chrome/Perfetto trace (one schedule)")
    p.add_argument("--plot", metavar="OUT.png", help="draw a Gantt chart (.png, .svg or .pdf), one panel per schedule")
    p.add_argument("--no-memory", action="store_true", help="leave the memory curves out of --plot")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser(
        "run", help="train a model on a schedule: torchrun processes, or --local", description=_doc(cmd_run)
    )
    _schedule_args(p)
    _run_args(p)
    _json_arg(p, "the per-step losses and times")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser(
        "profile", help="measure a model's per-stage costs and write a cost file", description=_doc(cmd_profile)
    )
    _schedule_args(p)
    _profile_args(p)
    dpopts.add_dp_options(p)
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser(
        "export", help="write a checked schedule as torch.distributed.pipelining's CSV", description=_doc(cmd_export)
    )
    _schedule_args(p)
    _memory_args(p)
    p.add_argument(
        "--to",
        choices=("torch-csv", "torchtitan"),
        default="torch-csv",
        help="the format (default torch-csv); torchtitan: the compute-only CSV and torchtitan's settings (TOML)",
    )
    p.add_argument("--comms", action="store_true", help="the compute+communication format (default: compute only)")
    p.add_argument(
        "--microbatch-size", type=int, default=1, metavar="B", help="--to torchtitan: samples per micro-batch"
    )
    p.add_argument(
        "--drop-memops", action="store_true", help="leave out RECOMPUTE/OFFLOAD/RELOAD, which torch has no action for"
    )
    p.add_argument("-o", "--output", metavar="OUT.csv", help="write here instead of standard output")
    dpopts.add_dp_options(p)
    _json_arg(p, "a summary (and, without -o, the CSV)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "import", help="turn a torch.distributed.pipelining CSV into a .pipe file", description=_doc(cmd_import)
    )
    p.add_argument(
        "csv", metavar="FILE.csv", help="a torch schedule CSV (compute-only or compute+comms)"
    ).completer = _complete_schedule
    p.add_argument("-o", "--output", metavar="OUT.pipe", help="write here instead of standard output")
    _json_arg(p, "a summary (and, without -o, the .pipe text)")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser(
        "synth", help="search for a schedule from sizes, costs and a memory limit", description=_doc(cmd_synth)
    )
    _synth_args(p)
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser(
        "partition", help="choose each stage's layers for the shortest simulated step", description=_doc(cmd_partition)
    )
    _schedule_args(p)
    _cost_args(p)
    partition_command.add_arguments(p)
    p.set_defaults(func=cmd_partition)

    p = sub.add_parser(
        "slice", help="choose token slice lengths by TeraPipe's dynamic program", description=_doc(cmd_slice)
    )
    slice_command.add_arguments(p)
    p.set_defaults(func=cmd_slice)

    p = sub.add_parser("test", help="property-test schedules over their parameter space", description=_doc(cmd_test))
    _test_args(p)
    p.set_defaults(func=cmd_test)

    p = sub.add_parser("list", help="list the library schedules", description=_doc(cmd_list))
    _json_arg(p, "the list")
    p.set_defaults(func=cmd_list)
    ap.commands = {name: parser for name, parser in sub.choices.items()}  # each subcommand's parser, aliases too
    return ap


def _doc(fn) -> str:
    return (fn.__doc__ or "").strip()


def _target(args: argparse.Namespace, name: str | None = None) -> tuple[Schedule | Program, str | None]:
    """The schedule (evaluated with -D, checked op by op) or the validated Program file a command names."""
    from pipec.driver import target_of

    return target_of(args.schedule if name is None else name, args.defines)


def _read_source(name: str) -> Source:
    """A schedule, CSV or Program file by name or path, as library.read gives it, after refusing (E901) a
    path that is no regular file or is too large (`import /dev/zero` read for ever)."""
    from pipec.files import check_input

    check_input(name, "input file")
    return library.read(name)


def _build(args: argparse.Namespace) -> Schedule:
    """The Schedule a command works on; of a Program file, the one it executes (pipec.driver.schedule_of)."""
    from pipec.driver import schedule_of

    obj, where = _target(args)
    return schedule_of(obj, Source(where, "")) if isinstance(obj, Program) else obj


def _memory(args: argparse.Namespace, docs: list[dict] | None = None) -> dict[str, float]:
    """The memory overrides of the command line, over the measured bytes of its cost documents (`docs`,
    when the caller has read them already; else read from `--cost`)."""
    from pipec.driver import memory_overrides
    from pipec.sim.cost_files import cost_spec

    if docs is None:
        docs = [cost_spec(t) for t in getattr(args, "cost", [])]
    overrides = memory_overrides(docs, dict(args.mem))
    if args.memory_limit is not None:
        overrides["limit"] = args.memory_limit
    if getattr(args, "host_memory_limit", None) is not None:
        overrides["host_limit"] = args.host_memory_limit
    return overrides


def _dp(args: argparse.Namespace, program_file: bool = False) -> dpopts.DataParallel | None:
    """The data-parallel options of the command line (E421 out of range); for a Program file None unless
    given (it was lowered for its own, and must agree with any given: E422)."""
    dp = dpopts.from_args(args)
    return None if program_file and not dpopts.given(args) else dp


def _compile(args: argparse.Namespace) -> tuple[CompiledSchedule, bool]:
    """Every check but the `expect` lines, then the Program (a Program file: validated and dry-run);
    and whether the input was a Program file."""
    from pipec.driver import check_program

    obj, where = _target(args)
    if isinstance(obj, Program):
        return check_program(obj, _memory(args), where, _dp(args, True)), True
    return compile_schedule(obj, _memory(args), _dp(args)), False


def _summary(c: CompiledSchedule, program_file: bool = False) -> dict:
    s = c.schedule
    return {
        "schedule": s.name,
        "source": s.source.path if s.source else None,
        "input": "program" if program_file else "schedule",
        "params": dict(s.params),
        "stages": s.num_stages,
        "ranks": s.num_ranks,
        "microbatches": s.num_sequences,
        **({"slicing": s.slicing.describe()} if s.slicing else {}),
        "ops": s.num_ops,
        "kinds": list(s.kinds),
        "placement": list(s.placement),
        "instructions": c.program.num_instructions,
        **_dp_json(c.program),
        "memory": [
            {"rank": m.rank, "peak": m.peak, "limit": m.limit, "at": m.at_text}
            | ({"params": m.params, "gathered": list(m.gathered)} if c.program.dp_kind == "fsdp" else {})
            | ({"unit": m.unit} if m.unit == "bytes" else {})  # peaks and limits in bytes (docs/memory.md)
            | ({"host_peak": m.host_peak, "host_limit": m.host_limit} if m.host_op else {})
            for m in c.memory
        ],
    }


def _dp_json(prog: Program) -> dict:
    """`data_parallel` of a JSON summary, only where the Program has data parallelism (so the documents
    of a Program without it stay as they were)."""
    if (prog.dp, prog.dp_kind) == (1, "ddp"):
        return {}
    return {"data_parallel": {"size": prog.dp, "kind": prog.dp_kind}}


def _collectives(prog: Program) -> list[dict]:
    """Each rank's data-parallel instructions with the op they come before, as `Schedule.collectives`
    counts them: `before` is the index in the rank's op order of the next compute (its count of ops
    after the last one)."""
    import numpy as np

    from pipec.ir.opcodes import IS_COMPUTE, OPCODES, REDUCE_GRAD, RESHARD, UNSHARD

    out = []
    for r, rp in enumerate(prog.ranks):
        done = np.cumsum(IS_COMPUTE[rp.op]) - IS_COMPUTE[rp.op]  # computes before each instruction
        for j in np.flatnonzero(np.isin(rp.op, [REDUCE_GRAD, UNSHARD, RESHARD])).tolist():
            out.append({"rank": r, "op": OPCODES[int(rp.op[j])], "stage": int(rp.stage[j]), "before": int(done[j])})
    return out


def cmd_check(args: argparse.Namespace) -> int:
    """Run every check: each op exactly once, on its owner, in dependency order; memory within the limit;
    no deadlock, even when every send blocks until its receive is posted; and the schedule's own `expect`
    lines, measured under its own cost and memory declarations (E405). A Program file (`pipec compile`'s
    output, JSON or text) is validated and dry-run, and its memory checked."""
    from pipec.driver import check_expectations

    c, program_file = _compile(args)
    s = c.schedule
    check_expectations(s, c.program)
    if args.json:
        _emit(args, _summary(c, program_file))
        return 0
    params = " ".join(f"{k}={v}" for k, v in s.params)
    dp = "" if not _dp_json(c.program) else f", data parallelism {c.program.dp} x {c.program.dp_kind}"
    print(f"{s.name} ({params}): {s.num_stages} stages, {s.num_ranks} ranks, {s.num_ops} ops{dp}: OK")
    if args.memory:
        print(format_table(list(c.memory)))
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    """Check a schedule and lower it to one instruction stream per rank (see docs/program.md), written
    rank by rank as it is produced. With --json and no -o, the program is the `program` field."""
    from pipec.formats.program_file import write_json, write_text

    prog = _compile(args)[0].program
    fmt = args.format or ("json" if args.output and args.output.endswith(".json") else "text")
    if args.json and not args.output and args.format == "text":
        raise Misuse("--json prints the program as JSON; write --format text to a file with -o")
    write = write_json if fmt == "json" else write_text
    summary = {
        "schedule": prog.name,
        "params": dict(prog.params),
        "ranks": prog.num_ranks,
        **_dp_json(prog),
        "instructions": prog.num_instructions,
        "output": args.output,
        "format": fmt if args.output else "json" if args.json else fmt,
    }
    if args.output:
        from pipec.files import atomic_write

        try:
            with atomic_write(args.output) as f:  # streamed, and all or nothing
                write(prog, f)
                if fmt == "json":
                    f.write("\n")
        except OSError as e:
            raise Misuse(f"cannot write `{args.output}`: {e.strerror}") from None
        if args.json:
            _emit(args, summary)
        else:
            print(f"wrote {prog.num_instructions} instructions for {prog.num_ranks} ranks to {args.output}")
        return 0
    out = _stdout()
    if args.json:
        out.write(json.dumps({**_envelope("compile", True), **summary})[:-1] + ', "program": ')
        write_json(prog, out)
        out.write("}\n")
    else:
        write(prog, out)
        if fmt == "json":
            out.write("\n")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    """Print the schedule as a grid: one row per step, one column per rank; `F3&B1` marks an overlapped pair.
    A Program file shows the schedule it executes."""
    from pipec.driver import check_program, schedule_of
    from pipec.view.grid import cells, format_grid, grid_title

    obj, where = _target(args)
    s = schedule_of(obj, Source(where, "")) if isinstance(obj, Program) else obj
    prog = None  # with data parallelism: the Program whose collectives are shown under the grid
    if isinstance(obj, Program) and _dp_json(obj):
        prog = check_program(obj, None, where, _dp(args, True)).program
    elif isinstance(obj, Program) and dpopts.given(args):
        prog = check_program(obj, None, where, _dp(args, True)).program  # E422: it has none
    elif dpopts.given(args):
        prog = compile_schedule(obj, None, _dp(args)).program
    ranks = None
    if args.ranks:
        try:
            ranks = [_count(-(10**9), 10**9)(x) for x in args.ranks.split(",")]
        except argparse.ArgumentTypeError:
            raise Misuse(f"--ranks expects numbers like 0,3, got `{brief(args.ranks)}`") from None
        bad = [r for r in ranks if not 0 <= r < s.num_ranks]
        if bad:
            raise Misuse(f"rank {bad[0]} is not in 0..{s.num_ranks - 1}")
    if args.timeline:
        return _show_timeline(args, s, ranks, prog)
    shown = list(range(s.num_ranks)) if ranks is None else ranks
    if args.json:
        doc = {**s.head(), "grid": [{"rank": r, "cells": cells(s, r)} for r in shown]}
        if prog is not None:
            doc |= _dp_json(prog) | {"collectives": [c for c in _collectives(prog) if c["rank"] in shown]}
        elif s.collectives:
            doc["collectives"] = [c for c in _placed(s) if c["rank"] in shown]
        _emit(args, doc)
        return 0
    print(grid_title(s))
    print(format_grid(s, ranks))
    if prog is not None:
        print(_collectives_text(s, f"data parallelism {prog.dp} x {prog.dp_kind}", _collectives(prog), shown))
    elif s.collectives:
        print(_collectives_text(s, "collectives placed by the schedule (lowered under --dp)", _placed(s), shown))
    return 0


def _placed(s) -> list[dict]:
    """The collectives a schedule places itself, in the shape `_collectives` gives a Program's."""
    return [
        {"rank": r, "op": c.op, "stage": c.stage, "before": c.before} for r, cs in enumerate(s.collectives) for c in cs
    ]


def _collectives_text(s, header: str, items: list[dict], ranks: list[int]) -> str:
    """Under the grid: each rank's collectives at the step of the op they are issued before (`end`: after
    its last op; the two ops of an overlapped pair share a step)."""
    import numpy as np

    lines = [f"{header}: collectives at the step they are issued before"]
    for r in ranks:
        ops = s.ranks[r]
        second = np.r_[False, ops.paired[:-1]] if len(ops) else np.zeros(0, dtype=bool)
        steps = int((~second).sum())
        step_of = np.r_[np.cumsum(~second) - 1, steps]  # op index -> its step; len(ops) -> the end
        width = max(len(str(steps - 1)), 2)
        mine = [c for c in items if c["rank"] == r]
        at = ["end" if c["before"] >= len(ops) else f"{int(step_of[c['before']]):0{width}d}" for c in mine]
        cells = [f"{c['op']} {c['stage']} @{a}" for c, a in zip(mine, at)]
        lines.append(f"Rank {r}: " + (", ".join(cells) or "-"))
    return "\n".join(lines)


def _cost_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cost",
        metavar="SPEC",
        action="append",
        default=[],
        help="a cost file (TOML or JSON) or overrides like F=1,B=2,W=1 or latency=40ms (repeatable; later wins)",
    )


def _topology_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--topology",
        metavar="FILE|TEXT",
        help="run on this network instead of the schedule's own: a file with a `topology { ... }` block, a .pipe "
        'file whose topology to take, or the items, e.g. \'dc "a" ranks 0 .. 4  dc "b" ranks 4 .. 8\' '
        "(docs/cross-dc.md)",
    )


def _on_network(args: argparse.Namespace, s: Schedule) -> Schedule:
    """The schedule on the network `--topology` names, if any."""
    if not getattr(args, "topology", None):
        return s
    from pipec.frontend.topology import read_topology, with_topology

    return with_topology(s, read_topology(args.topology, s))


def _show_timeline(args: argparse.Namespace, s: Schedule, ranks: list[int] | None, prog: Program | None = None) -> int:
    import shutil

    from pipec.driver import simulation
    from pipec.ir.schedule import unit_json
    from pipec.sim.cost_files import cost_spec
    from pipec.view import report
    from pipec.view.render import text_gantt

    docs = [cost_spec(t) for t in args.cost]
    if prog is None:
        sim = simulation(_on_network(args, s), docs)
    else:  # the Program with its collectives, as lowered for the data parallelism asked for
        sim = simulation(prog, docs, None, getattr(args, "topology", None))
    if args.json:
        shown = list(range(s.num_ranks)) if ranks is None else ranks
        spans = [
            {"rank": r, "op": op, **unit_json(s.slicing, mb), "stage": st, "start": a, "end": b}
            for r in shown
            for op, mb, st, a, b in sim.timeline.rank_events(r)
        ]
        _emit(args, {**s.head(), "makespan": sim.stats.makespan, "spans": spans})
        return 0
    width = args.width or shutil.get_terminal_size((120, 24)).columns
    print(report.panel_title(sim))
    print(text_gantt(sim.timeline, width, ranks))
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    """Simulate schedules under one cost model (see docs/simulate.md): makespan, Zero Bubble's bubble rate,
    per-rank busy and idle time and peak memory; with several schedules, a table side by side. Costs come
    from the schedule's declarations, cost files and overrides (`--cost F=1,B=2,W=1` per stage, `T_F=1,...`
    per rank); by default T_F = T_B = T_W = 1 for each rank's share of the model, a full backward costs
    T_B + T_W, and communication is free. A Program file is simulated as it stands."""
    from pipec.driver import param_names, simulation, target_of
    from pipec.sim.cost_files import cost_spec
    from pipec.view import report

    if len(args.schedule) > 1 and args.trace:
        raise Misuse("--trace takes one schedule")
    if args.plot and not args.plot.lower().endswith((".png", ".svg", ".pdf")):
        raise Misuse(f"--plot writes .png, .svg or .pdf, not `{args.plot}`")
    docs = [cost_spec(t) for t in args.cost]
    memory = _memory(args, docs)
    sims, used = [], set()
    for name in args.schedule:
        defines = args.defines
        if len(args.schedule) > 1:
            known = set(param_names(_read_source(name)))
            defines = [(k, v) for k, v in args.defines if k in known]
            used |= known
        obj, where = target_of(name, defines)
        sims.append(simulation(obj, docs, memory, args.topology, where, _dp(args, isinstance(obj, Program))))
    unused = [k for k, _ in args.defines if len(args.schedule) > 1 and k not in used]
    if unused:
        takes = "; ".join(f"{n}: {', '.join(param_names(_read_source(n))) or 'none'}" for n in args.schedule)
        raise error(
            "E205",
            f"no schedule here takes parameter `{unused[0]}`",
            source=Source("<command line>", ""),
            notes=(f"they take {takes}",),
        )
    wrote = []
    try:
        if args.trace:
            from pipec.formats.trace import write_trace

            write_trace(sims[0].timeline, args.trace, report.curves_of(sims[0]))
            wrote.append(f"wrote trace to {args.trace} (open it at https://ui.perfetto.dev)")
        if args.plot:
            from pipec.view.render import plot_timelines

            plot_timelines([report.panel(s, not args.no_memory) for s in sims], args.plot)
            wrote.append(f"wrote plot to {args.plot}")
    except OSError as e:
        raise Misuse(f"cannot write `{e.filename}`: {e.strerror}") from None
    if args.json:
        results = [{**report.to_json(s), "trace": args.trace, "plot": args.plot} for s in sims]
        _emit(args, {"results": results})
        return 0
    print(report.summary_text(sims[0]) if len(sims) == 1 else report.compare_text(sims))
    for line in wrote:
        print(line)
    return 0


def _run_args(p: argparse.ArgumentParser) -> None:
    from pipec.runtime.job.launch import add_run_options  # stdlib only: no torch until `pipec run` runs

    add_run_options(p)
    p.add_argument(
        "--nproc",
        type=_count(1, 1_000_000),
        default=None,
        metavar="N",
        help="processes (default: the schedule's ranks)",
    )
    p.add_argument(
        "--partition", metavar="PART.json", help="stages from the model's layers(), as `pipec partition` split them"
    )
    p.add_argument("--local", action="store_true", help="run every rank in this process (in-memory messages)")
    p.add_argument(
        "--memory",
        action="store_true",
        help="measure each rank's peak saved activation bytes and print them against the memory model's",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="--local: where to run (default cpu)")
    p.add_argument(
        "--emulate-links",
        action="store_true",
        help="hold back each message between datacenters, and with --dp each collective between replica "
        "datacenters, by its link's latency and bandwidth (docs/cross-dc.md)",
    )
    p.add_argument(
        "--link-scale",
        type=_finite,
        default=1.0,
        metavar="X",
        help="--emulate-links: latencies times X, bandwidths divided by X (default 1)",
    )
    _topology_arg(p)


def cmd_run(args: argparse.Namespace) -> int:
    """Train a model file on a schedule (or a Program file): N local processes through torchrun (gloo on
    CPU, nccl on CUDA), or every rank in this process with --local. Prints a line per step; --check
    compares the loss, gradients and parameters with a single-process run; --json gives each step's loss
    and seconds. See docs/runtime.md."""
    from pipec.driver import check_program

    obj, where = _target(args)
    if isinstance(obj, Program):
        program = obj
        sched = _on_network(args, check_program(obj, None, where, _dp(args, True)).schedule)
    else:
        sched = _on_network(args, obj)
        program = compile_schedule(sched, None, _dp(args)).program  # --dp etc. when `run` has them
    args.links = None
    if args.emulate_links:
        try:
            from pipec.runtime.exec.links import links_of

            args.links = links_of(sched, args.link_scale, program.dp)
        except ValueError as e:
            raise Misuse(str(e)) from None
        except ImportError:
            pass  # reported just below
    args.memory_schedule = sched  # --memory: what the prediction is made for
    try:
        from pipec.runtime.job.run import run
    except ImportError as e:
        raise Misuse(f"the runtime needs torch ({e}); install pipec[runtime]") from None
    if not args.json:
        return run(args, program)
    with _captured_stdout() as text:
        status = run(args, program)
    sys.stderr.write(text[0])  # the run's own lines, for whoever watches
    doc = run_json(text[0])
    if status == MISUSE:
        lines = [ln.split(": error: ", 1)[-1] for ln in doc["log"] if ": error: " in ln]
        raise Misuse(lines[-1] if lines else "see the messages above")
    _emit(args, {"schedule": program.name, "params": dict(program.params), "exit": status, **doc}, ok=status == 0)
    return status


@contextmanager
def _captured_stdout() -> Iterator[list[str]]:
    """Everything written to standard output inside the block, by this process (sys.stdout) and by the
    processes it starts (file descriptor 1, which torchrun's workers inherit): the run prints its own lines."""
    import io
    import tempfile

    got = [""]
    out = _stdout()
    out.flush()
    sys.stdout.flush()
    buf, saved = io.StringIO(), sys.stdout
    with tempfile.TemporaryFile() as tmp:
        fd = os.dup(1)
        os.dup2(tmp.fileno(), 1)
        sys.stdout = buf
        try:
            yield got
        finally:
            sys.stdout = saved
            os.dup2(fd, 1)
            os.close(fd)
            tmp.seek(0)
            got[0] = buf.getvalue() + tmp.read().decode("utf-8", "replace")


_STEP = None  # the compiled pattern of a step line, made on first use


def run_json(text: str) -> dict:
    """`pipec run`'s printed lines as data: each step's loss and seconds (and, with --check, its relative
    errors against the reference), the --check verdict, and every other line as it was printed."""
    import re

    global _STEP
    if _STEP is None:
        num = r"([-+0-9.eE]+|inf|nan|-)"
        _STEP = re.compile(
            rf"step\s+(\d+)/(\d+): loss {num}, {num} s"
            rf"(?:\s+\|\s+rel err vs reference: loss {num}, grads {num}, params {num})?\s*$"
        )

    def value(x: str | None) -> float | None:
        return None if x in (None, "-") else float(x)

    steps, log = [], []
    for line in text.splitlines():
        m = _STEP.match(line.strip())
        if not m:
            log.append(line)
            continue
        step, _, loss, seconds, le, ge, pe = m.groups()
        errs = None if le is None else {"loss": value(le), "grads": value(ge), "params": value(pe)}
        steps.append({"step": int(step), "loss": value(loss), "seconds": value(seconds), "rel_err": errs})
    return {"steps": steps, "log": log}


def _profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="PATH", help="the model file (see docs/runtime.md)")
    p.add_argument("-o", "--output", metavar="OUT", help="write the cost file here (.toml, or .json); default: print")
    p.add_argument("--reps", type=int, default=20, metavar="N", help="timed runs per op (default 20; medians)")
    p.add_argument("--warmup", type=int, default=3, metavar="N", help="untimed runs first (default 3)")
    p.add_argument("--threads", type=int, default=None, metavar="N", help="torch threads (default: a rank's share)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--seed", type=int, default=0, help="weights are seeded by (seed, stage), as in pipec run")
    p.add_argument("--no-comm", dest="comm", action="store_false", help="skip the link measurement (gloo)")
    p.add_argument(
        "--one-process",
        dest="concurrent",
        action="store_false",
        default=None,
        help="time the ops in this process alone (default on CPUs: one process per rank, all at once)",
    )
    p.add_argument(
        "--in-situ",
        action="store_true",
        help="take F, B, W and the overhead from --reps steps of the schedule run on its gloo processes",
    )
    p.add_argument(
        "--slices",
        type=int,
        default=None,
        metavar="N",
        help="also time token slices at whole N-ths of the sequence and fit the cost keys attn and op_fixed "
        "(docs/terapipe.md)",
    )
    p.add_argument("--json", action="store_true", help="print the measurements as JSON")


def cmd_profile(args: argparse.Namespace) -> int:
    """Measure T_F, T_B, T_W per stage (and the full backward, and the optimizer step) and the message
    sizes of a model file on this machine, the way the runtime runs them, plus a gloo link's latency and
    bandwidth, and with --dp the data-parallel collectives (each stage's, and the DP link's latency and
    bandwidth); write the cost file `pipec simulate --cost` reads. See docs/runtime.md."""
    program = compile_schedule(_build(args), None, _dp(args)).program  # with --dp: the collectives too
    if args.reps < 1 or args.warmup < 0:
        raise Misuse("--reps must be at least 1 and --warmup at least 0")
    try:
        from pipec.runtime.errors import PipelineError
        from pipec.runtime.model.contract import load_model
        from pipec.runtime.profile.stages import profile, summary_lines
    except ImportError as e:
        raise Misuse(f"profiling needs torch ({e}); install pipec[runtime]") from None
    from pipec.sim.cost_files import dump_costs

    try:
        model = load_model(args.model)
        prof = profile(
            program,
            model,
            reps=args.reps,
            warmup=args.warmup,
            threads=args.threads,
            device=args.device,
            seed=args.seed,
            comm=args.comm,
            in_situ=args.in_situ,
            concurrent=args.concurrent,
            slices=args.slices,
            progress=lambda msg: print(f"pipec profile: {msg} ...", file=sys.stderr, flush=True),
        )
    except PipelineError as e:
        print(f"pipec profile: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # the model's own code failed: its traceback, then one line
        import traceback

        traceback.print_exc()
        print(f"pipec profile: error: {args.model}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    as_json = bool(args.output) and not args.output.endswith(".toml")
    text = dump_costs(prof.cost_doc(), toml=not as_json)
    if args.json:
        _emit(args, {"costs": prof.cost_doc(), "output": args.output})
    if args.output:
        _write(args.output, text)
        if not args.json:
            print("\n".join(summary_lines(prof)))
            defines = "".join(f" -D {k}={v}" for k, v in args.defines)
            if program.dp > 1 or program.dp_kind != "ddp":
                defines += f" --dp {program.dp} --dp-kind {program.dp_kind}"
            print(f"wrote {args.output}; simulate with: pipec simulate {args.schedule}{defines} --cost {args.output}")
    elif not args.json:
        sys.stdout.write(text)
    return 0


def _write(path: str | None, text: str) -> None:
    """Text to a file (atomically), or to standard output without one; a file that cannot be written is
    misuse."""
    from pipec.files import write_text

    if path is None:
        _stdout().write(text)
        return
    try:
        write_text(path, text)  # atomically: a failure leaves the old file, never a partial one
    except OSError as e:
        raise Misuse(f"cannot write `{path}`: {e.strerror}") from None


def cmd_export(args: argparse.Namespace) -> int:
    """Check a schedule (every check of `pipec check`) and write it as torch.distributed.pipelining's
    action CSV (torch 2.13), one row per rank: compute-only, which torch's `_load_csv` lowers itself, or
    with --comms the compute+communication format, with pipec's proven placement of sends and receives
    (and, with --dp-kind fsdp, the lowering's UNSHARD/RESHARD windows); with --to torchtitan -o OUT, the
    compute-only OUT.csv and torchtitan's settings OUT.toml. What does not translate is an error, never
    dropped silently (see docs/interop.md)."""
    from pipec.formats.torch_csv import export_csv

    if args.to == "torchtitan":
        return _export_torchtitan(args)
    if dpopts.given(args) and not args.comms:
        raise Misuse("the data-parallel options place collectives in the compute+comms CSV: add --comms")
    c = _compile(args)[0]
    s = c.schedule
    text = export_csv(s, c.program if args.comms else None, drop_memops=args.drop_memops)
    if args.output or not args.json:
        _write(args.output, text)
    declared = (("cost", s.costs), ("memory", s.memory), ("topology", s.topology), ("expect", s.expects))
    dropped = [k for k, v in declared if v]
    note = f"note: torch's CSV has no place for {', '.join(dropped)} declarations; they are not in it"
    fmt = "compute+comms" if args.comms else "compute-only"
    if args.json:
        doc = {"schedule": s.name, "params": dict(s.params), "ranks": s.num_ranks, "format": f"torch-csv {fmt}"}
        _emit(args, {**doc, "dropped": dropped, "output": args.output, "csv": None if args.output else text})
        return 0
    if args.output:
        print(f"wrote {s.num_ranks} ranks of {s.name} to {args.output} (torch {fmt} CSV)")
        if dropped:
            print(note)
    elif dropped:
        print(note, file=sys.stderr)
    return 0


def _export_torchtitan(args: argparse.Namespace) -> int:
    """`pipec export --to torchtitan -o OUT`: OUT.csv and OUT.toml (pipec.formats.torchtitan)."""
    from pipec.formats.torchtitan import export_torchtitan, output_paths

    if dpopts.given(args):
        raise Misuse("--to torchtitan: torchtitan sets data parallelism itself (its data_parallel_* settings)")
    if not args.output:
        raise Misuse("--to torchtitan writes two files: give -o OUT (OUT.csv and OUT.toml)")
    if args.microbatch_size < 1:
        raise Misuse(f"--microbatch-size must be at least 1, not {args.microbatch_size}")
    s = _compile(args)[0].schedule
    csv_path, toml_path = output_paths(args.output)
    out = export_torchtitan(
        s, csv_path, comms=args.comms, microbatch_size=args.microbatch_size, drop_memops=args.drop_memops
    )
    _write(csv_path, out.csv)
    _write(toml_path, out.toml)
    if args.json:
        doc = {"schedule": s.name, "params": dict(s.params), "ranks": s.num_ranks, "format": "torchtitan"}
        _emit(args, {**doc, "schedule_class": out.schedule_class, "csv": csv_path, "toml": toml_path})
    else:
        print(f"wrote {s.num_ranks} ranks of {s.name} to {csv_path} and torchtitan's settings to {toml_path}")
        print(f"  pipeline_parallel_schedule = {out.schedule_class!r} (the placement style of the schedule)")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    """Turn a torch.distributed.pipelining schedule CSV (compute-only or compute+comms) into a .pipe file
    with the same per-rank orders, written as loops where they repeat. The CSV is then checked like any
    schedule; `pipec check/show/compile/simulate FILE.csv` also read a CSV directly."""
    from pipec.driver import build
    from pipec.formats.torch_csv import is_torch_csv, to_pipe

    source = _read_source(args.csv)
    if not is_torch_csv(source):
        raise Misuse(f"expected a .csv file, got `{args.csv}`")
    s = build(source, check=False)
    text = to_pipe(s, source.path)
    if args.output or not args.json:
        _write(args.output, text)
    sizes = f"{s.num_stages} stages on {s.num_ranks} ranks, {s.num_microbatches} micro-batches, {s.num_ops} ops"
    if args.output and not args.json:
        print(f"wrote {args.output}: {sizes}")
    compile_schedule(build(source))  # every check, reported after the file is written
    if args.json:
        doc = {"csv": source.path, "stages": s.num_stages, "ranks": s.num_ranks, "microbatches": s.num_microbatches}
        _emit(args, {**doc, "ops": s.num_ops, "output": args.output, "pipe": None if args.output else text})
    elif args.output:
        print(f"{source.path}: OK")
    return 0


def _memops(text: str) -> tuple[str, ...]:
    from pipec.synth import memops_of

    try:
        return memops_of(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _synth_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-p", type=_count(1, SYNTH_MAX), required=True, help="ranks")
    p.add_argument("-m", type=_count(1, SYNTH_MAX), required=True, help="micro-batches")
    p.add_argument("-v", type=_count(1, SYNTH_MAX), default=1, help="stages (chunks) per rank (default 1)")
    p.add_argument("--place", choices=("loop", "v"), default=None, help="chunk placement with -v 2 (default: v)")
    p.add_argument("--full-backward", action="store_true", help="ops F, B only (default: split backward F, B, W)")
    _cost_args(p)
    _memory_args(p)
    p.add_argument("--memory-limit-of", metavar="NAME", help="the limit: this library schedule's peak memory")
    p.add_argument(
        "--memops",
        type=_memops,
        default=("recompute", "offload"),
        metavar="LIST",
        help="memory ops the search may place below 1F1B's memory: recompute, offload, both (default) or none",
    )
    p.add_argument("--dc", metavar="NAME=LO..HI", action="append", default=[], help="a datacenter of ranks LO..HI-1")
    p.add_argument("--time-limit", type=_finite, default=30.0, metavar="S", help="solver seconds (default 30)")
    solver = p.add_mutually_exclusive_group()
    solver.add_argument("--no-solver", action="store_true", help="the heuristic only")
    solver.add_argument("--solver", action="store_true", help="run the solver even on a large case")
    p.add_argument("--name", default=None, help="the schedule's name (default: from the output file)")
    p.add_argument("-o", "--output", metavar="OUT.pipe", help="write the schedule here (default: standard output)")
    p.add_argument("--compare", metavar="A,B,...", default=None, help="library schedules to compare against")
    p.add_argument("--json", action="store_true", help="print the figures as JSON (the file still goes to -o)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")


def cmd_synth(args: argparse.Namespace) -> int:
    """Search for the schedule with the smallest simulated makespan (then bubble) for p ranks and m
    micro-batches under the costs (`--cost`, as in simulate) and a per-rank memory limit: a grid over
    policies (docs/language.md, `order`) list-scheduled under the cost model, then, for small cases, an
    exact improvement with OR-Tools CP-SAT warm-started from it. Writes a .pipe file with the per-rank
    orders and prints a comparison with the library schedules. See docs/synth.md."""
    import os
    import shlex

    from pipec import synth
    from pipec.sim.cost_files import cost_spec

    if args.p < 1 or args.m < 1 or args.v < 1:
        raise Misuse("-p, -m and -v must be at least 1")
    ops = args.p * args.v * args.m * (2 if args.full_backward else 3)
    if ops > SYNTH_MAX_OPS:
        raise Misuse(f"-p {args.p} -v {args.v} -m {args.m} make {ops:,} ops, above the limit of {SYNTH_MAX_OPS:,}")
    from pipec.files import require_ops_fit

    require_ops_fit(ops, f"synth -p {args.p} -v {args.v} -m {args.m}")
    place = args.place or ("v" if args.v > 1 else "loop")
    if place == "v" and args.v not in (1, 2):
        raise Misuse("--place v takes -v 2")
    dcs = []
    for text in args.dc:
        name, sep, rng = text.partition("=")
        lo, dots, hi = rng.partition("..")
        if not (sep and dots and lo.strip().isdigit() and hi.strip().isdigit() and name):
            raise Misuse(f"--dc expects NAME=LO..HI, got `{text}`")
        dcs.append((name, int(lo), int(hi)))
    if dcs and not all(0 <= lo < hi <= args.p for _, lo, hi in dcs):
        raise Misuse(f"--dc ranges must lie within 0..{args.p}")
    memory = dict(args.mem)
    spec = synth.Spec(
        p=args.p,
        m=args.m,
        v=args.v,
        placement=place,
        split=not args.full_backward,
        cost_docs=tuple(cost_spec(t) for t in args.cost),
        memory=memory,
        topology=synth.topology_of(dcs),
        host_limit=None if args.host_memory_limit is None else (args.host_memory_limit,) * args.p,
        memops=args.memops,
    )
    if args.memory_limit is not None and args.memory_limit_of:
        raise Misuse("give --memory-limit or --memory-limit-of, not both")
    if args.memory_limit is not None:
        spec = synth.replace(spec, limit=(args.memory_limit,) * args.p)
    elif args.memory_limit_of:
        spec = synth.replace(spec, limit=(synth.peak_of(spec, args.memory_limit_of),) * args.p)

    def progress(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    name = args.name or (os.path.splitext(os.path.basename(args.output))[0] if args.output else "synth")
    result = synth.synthesize(
        spec,
        args.time_limit,
        use_solver=False if args.no_solver else (True if args.solver else None),
        progress=progress,
    )
    names = args.compare.split(",") if args.compare else None
    rows = synth.library_comparison(spec, names)
    table = synth.comparison_text(result, rows, name)
    command = "pipec " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["synth"] else None
    text = synth.write_pipe(result, name, command, table)
    if args.output:
        _write(args.output, text)
    elif not args.json:
        sys.stdout.write(text)
    if args.json:
        _emit(args, {**synth.to_json(result, rows, name, args.output), "pipe": None if args.output else text})
        return 0
    if result.solver_note and result.solver_status == "unavailable":
        print(f"note: {result.solver_note}; the heuristic's schedule stands", file=sys.stderr)
    if args.output:
        f = result.figures
        print(
            f"wrote {args.output}: makespan {f.makespan:.6g}, bubble {f.bubble:.2%}, "
            f"peak memory {max(f.peak):.6g} (solver: {result.solver_status})"
        )
        print(table)
    return 0


def _test_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", metavar="PATH", nargs="+", help=".pipe files, directories to search, or library names")
    p.add_argument(
        "--budget",
        type=_duration,
        default=None,
        metavar="TIME",
        help="time per file, e.g. 30s, 2m, 500ms (default 30s; 5s where CI=true)",
    )
    p.add_argument("--examples", type=int, default=None, metavar="N", help="at most N parameter sets per file")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default 0): runs are reproducible")
    p.add_argument("--json", action="store_true", help="print the results and coverage as JSON")
    p.add_argument(
        "--range",
        dest="ranges",
        metavar="NAME=LO..HI",
        action="append",
        default=[],
        help="values of a parameter to try: LO..HI (half-open, as in `for`) or a list A,B,C (repeatable)",
    )
    _define_arg(p, "fix a parameter to one value (repeatable)")
    p.add_argument("--runtime", action="store_true", help="also run small cases on the runtime (--local, needs torch)")


def _duration(text: str) -> float:
    """`pipec test --budget`: seconds, with an optional unit (ms, s, m)."""
    from pipec.testing.files import parse_budget

    try:
        return parse_budget(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _test_ranges(specs: list[str]) -> dict[str, list]:
    out: dict[str, list] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        lo, dots, hi = value.partition("..")
        try:
            if not sep or not name.strip():
                raise ValueError
            if dots:
                out[name.strip()] = list(range(int(lo), int(hi)))
            else:
                out[name.strip()] = [_number(x) for x in value.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"--range expects NAME=LO..HI or NAME=A,B,C, got `{spec}`") from None
        if not out[name.strip()]:
            raise argparse.ArgumentTypeError(f"--range `{spec}` has no values")
    return out


def _number(text: str) -> int | float | bool:
    text = text.strip()
    if text in ("true", "false"):
        return text == "true"
    try:
        return int(text)
    except ValueError:
        return float(text)


def cmd_test(args: argparse.Namespace) -> int:
    """Property-test schedules: every .pipe file under the paths (or library names) over its parameter
    space (p 1..32, m 1..max(12, 4p), v 1..4 and so on, within the schedule's `require`s; --range changes
    it), for --budget each (30 s; 5 s where CI=true): small sets first, boundaries (m < p, m = p, m = 2p - 1,
    p = 1, the edges of the `require`s) early, p = 32 within seconds. Each parameter set must pass `pipec
    check`, pipec.testing's independent checks and the schedule's own `expect`s; a failure is shrunk to the
    smallest failing parameter set and printed with a `pipec check` command that reproduces it, and the
    values each parameter took are listed. Exit status 1 when any file fails. See docs/testing.md."""
    import time

    try:
        from pipec.testing import check_file, find_schedule_files
        from pipec.testing.files import default_budget
    except ImportError as e:
        raise Misuse(str(e)) from None
    if args.examples is not None and args.examples < 1:
        raise Misuse("--examples must be at least 1")
    budget = args.budget if args.budget is not None or args.examples is not None else default_budget()
    if args.runtime:
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            raise Misuse("--runtime needs torch: pip install 'pipec[runtime]'")
    try:
        ranges = _test_ranges(args.ranges)
    except argparse.ArgumentTypeError as e:
        raise Misuse(str(e)) from None
    files = find_schedule_files(args.paths)
    if not files:
        raise Misuse(f"no .pipe files under {' '.join(args.paths)}")
    # --range and -D apply to the files that declare the parameter; each must name one of some file.
    from pipec.frontend.load import compile_source

    declared: dict[str, set[str]] = {}
    for target in files:
        try:
            declared[target] = {prm.name for prm in compile_source(_read_source(target)).params}
        except PipecError as e:
            if e.code == "E000":
                raise
            declared[target] = set()  # reported when the file is tested
    known = set().union(*declared.values())
    for name in [*ranges, *(k for k, _ in args.defines)]:
        if name not in known:
            raise Misuse(f"no schedule here has a parameter `{name}`")
    tty = sys.stderr.isatty()
    failed = 0
    results = []
    of = f" of {budget:g}" if budget is not None else ""
    for n, target in enumerate(files, 1):
        last = [time.monotonic()]

        def progress(done: int, seconds: float, target=target, n=n, last=last) -> None:
            now = time.monotonic()
            sets = f"{done} parameter set{'s' if done != 1 else ''}, {seconds:.0f}{of} s"
            if tty:
                print(f"\r\033[K[{n}/{len(files)}] {target}: {sets}", end="", file=sys.stderr, flush=True)
            elif now - last[0] >= 5.0:  # long runs: a line now and then
                print(f"  ... {target}: {sets}", file=sys.stderr, flush=True)
                last[0] = now

        try:
            res = check_file(
                target,
                args.examples,
                args.seed,
                budget=budget,
                bounds={k: v for k, v in ranges.items() if k in declared[target]},
                fixed={k: v for k, v in args.defines if k in declared[target]},
                runtime=args.runtime,
                progress=progress,
            )
        except ValueError as e:
            raise Misuse(f"{target}: {e}") from None
        finally:
            if tty:
                print("\r\033[K", end="", file=sys.stderr, flush=True)
        results.append(res)
        failed += not res.ok
        if args.json:
            continue
        what = res.sets_text
        if res.runtime_checked:
            what += f", {res.runtime_checked} on the runtime"
        if res.ok:
            print(f"{target}: ok ({what}, {res.seconds:.1f} s)")
            for note in res.notes:
                print(f"  note: {note}")
        else:  # a failure is a diagnostic: the whole report of it goes to stderr, as `pipec check`'s
            f = res.failure
            sys.stdout.flush()
            err = sys.stderr
            found = f"smallest of {res.failing} failing; {what}, {res.seconds:.1f} s"
            print(f"{target}: FAILED at {f.params_text} ({found})", file=err)
            if f.kind == "invariant":
                print(f"  pipec and the independent checks disagree: {f.message}", file=err)
            elif f.kind == "runtime":
                print(f"  {f.message}", file=err)
            elif f.kind == "crash":
                print("  pipec crashed: " + f.message.replace("\n", "\n  "), file=err)
            for line in f.message.splitlines() if f.kind not in ("invariant", "runtime", "crash") else ():
                print(f"  {line}", file=err)
            print(f"  reproduce: {f.command}", file=err)
        if res.coverage is not None and res.examples:
            print(f"  tried: {res.coverage.text()}", file=sys.stdout if res.ok else sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
    ok = len(files) - failed
    if args.json:
        _emit(args, {"files": [r.to_json() for r in results], "passed": ok, "failed": failed}, ok=not failed)
    else:
        print(f"{len(files)} file{'s' if len(files) != 1 else ''}: {ok} ok, {failed} failed")
    return 1 if failed else 0


def cmd_partition(args: argparse.Namespace) -> int:
    """Profile a model file's layers (or read a layer table) and choose the contiguous layers of each stage
    that minimise the schedule's simulated step under per-rank memory limits and speeds; print it beside
    the uniform split and write the partition file `pipec run --partition` reads. See docs/partition.md."""
    from pipec.sim.cost_files import cost_spec

    sched = _build(args)
    program = compile_schedule(sched).program
    return partition_command.run(args, sched, program, [cost_spec(t) for t in args.cost])


def cmd_slice(args: argparse.Namespace) -> int:
    """Choose the token slice lengths of a sliced schedule (default: the library's terapipe) by TeraPipe's
    dynamic program under the cost model (`attn`, `op_fixed`: `pipec profile --slices`), print them with
    the simulated step beside uniform slicing and the unsliced run, and write the schedule with them (-o).
    See docs/terapipe.md, "Choosing the slices"."""
    return slice_command.run(args)


def cmd_list(args: argparse.Namespace) -> int:
    """List the standard library, one line each."""
    names = library.names()
    if args.json:
        _emit(args, {"schedules": [{"name": n, "summary": library.summary(n)} for n in names]})
        return 0
    width = max(map(len, names), default=0)
    for name in names:
        print(f"{name.ljust(width)}  {library.summary(name)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run `pipec ARGV`; return the exit status: 0 done, 1 a schedule or input error (a coded
    diagnostic), 2 misuse of the command line. argparse's own exits (--help, --version, a bad flag)
    raise SystemExit as argparse does, with the same statuses."""
    argv = sys.argv[1:] if argv is None else list(argv)
    as_json = "--json" in argv
    ap = _parser()
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
    except Misuse as e:
        return _misuse(e, ap.commands[args.command], args.json)
    except PipecError as e:
        for d in e.diagnostics:
            print(d.format(), file=sys.stderr)
        if args.json:
            _fail_json(_name(args), 1, [diagnostic_json(d) for d in e.diagnostics])
        return 1
    except BrokenPipeError:  # `pipec show ... | head`
        return 0


def _misuse(e: Misuse, parser: argparse.ArgumentParser, as_json: bool) -> int:
    """Misuse as argparse reports it: the (sub)command's usage, then `PROG: error: MESSAGE`."""
    text = f"{parser.prog}: error: {e}"
    sys.stderr.write(parser.format_usage() + text + "\n")
    if as_json:
        command = parser.prog.split(" ", 1)[1] if " " in parser.prog else None
        command = {"compare": "simulate"}.get(command, command)
        blank = {"path": None, "line": None, "col": None, "end_line": None, "end_col": None, "notes": []}
        _fail_json(command, MISUSE, [{"code": None, "severity": "error", "message": str(e), **blank, "text": text}])
    return MISUSE


if __name__ == "__main__":
    sys.exit(main())
