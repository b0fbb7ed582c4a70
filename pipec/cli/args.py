"""What several commands share: their common arguments (a schedule, costs, memory, a topology, --json)
and the readers of them (the target a command names, its memory overrides, its data parallelism, its
compiled form). Every value is parsed by pipec.options."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipec import options
from pipec.cli.envelope import Misuse, stdout
from pipec.errors import PipecError, Source, brief, error
from pipec.frontend import library
from pipec.ir.experts import Experts

if TYPE_CHECKING:  # numpy and the compiler load when a command builds something (`pipec --version` is quick)
    from pipec.ir.dataparallel import DataParallel
    from pipec.ir.program import Program
    from pipec.ir.schedule import Schedule
    from pipec.passes.compiler import CompiledSchedule


@dataclass(frozen=True)
class Command:
    """One subcommand in pipec.cli.app's registry: its name, its one-line help, the function that adds
    its arguments and the one that runs it (whose docstring is its --help description)."""

    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    aliases: tuple[str, ...] = ()


def complete_schedule(prefix: str, **_: object) -> list[str]:
    """Shell completion of FILE|NAME: library names and schedule files (argcomplete calls this)."""
    import glob

    files = [f + "/" if os.path.isdir(f) else f for f in glob.glob(prefix + "*")]
    keep = [f for f in files if f.endswith(("/", ".pipe", ".csv", ".json", ".txt"))]
    return [n for n in library.names() if n.startswith(prefix)] + sorted(keep)


def schedule_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "schedule", metavar="FILE|NAME", help="a .pipe file, or the name of a library schedule"
    ).completer = complete_schedule
    options.add_define_argument(p)


def json_arg(p: argparse.ArgumentParser, what: str = "the result") -> None:
    p.add_argument("--json", action="store_true", help=f"print {what} as one JSON document (docs/cli.md)")


def _mem(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    if not sep or name not in ("act", "wact", "ckpt", "params"):
        raise argparse.ArgumentTypeError(f"expected act=X, wact=X, ckpt=X or params=X, got `{brief(text)}`")
    return name, options.amount(value)


def memory_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mem",
        metavar="KEY=VALUE",
        type=_mem,
        action="append",
        default=[],
        help="override the memory model for every stage: act=, wact=, ckpt= or params= (repeatable)",
    )
    p.add_argument(
        "--memory-limit", type=options.amount, default=None, metavar="X", help="per-rank memory limit (80GiB)"
    )
    p.add_argument(
        "--host-memory-limit", type=options.amount, default=None, metavar="X", help="per-rank host memory limit"
    )


def cost_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cost",
        metavar="SPEC",
        action="append",
        default=[],
        help="a cost file (TOML or JSON) or overrides like F=1,B=2,W=1 or latency=40ms (repeatable; later wins)",
    )


def topology_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--topology",
        metavar="FILE|TEXT",
        help="run on this network instead of the schedule's own: a file with a `topology { ... }` block, a .pipe "
        'file whose topology to take, or the items, e.g. \'dc "a" ranks 0 .. 4  dc "b" ranks 4 .. 8\' '
        "(docs/cross-dc.md)",
    )


def target(args: argparse.Namespace, name: str | None = None) -> tuple[Schedule | Program, str | None]:
    """The schedule (evaluated with -D, checked op by op) or the validated Program file a command names."""
    from pipec.driver import target_of

    return target_of(args.schedule if name is None else name, args.defines)


def read_source(name: str) -> Source:
    """A schedule, CSV or Program file by name or path, as library.read gives it, after refusing (E901) a
    path that is no regular file or is too large (`import /dev/zero` read for ever)."""
    from pipec.files import check_input

    check_input(name, "input file")
    return library.read(name)


def build(args: argparse.Namespace) -> Schedule:
    """The Schedule a command works on; of a Program file, the one it executes (pipec.api.schedule_of)."""
    from pipec.ir.program import Program

    obj, where = target(args)
    return program_schedule(obj, where) if isinstance(obj, Program) else obj


def program_schedule(prog: Program, where: str | None) -> Schedule:
    """The Schedule a Program file executes (pipec.driver.schedule_of, which keeps its stage graph: a tool
    that cannot take a graph must see it, E217)."""
    from pipec.driver import schedule_of

    return schedule_of(prog, Source(where or "<program>", ""))


def memory(args: argparse.Namespace, docs: list[dict] | None = None) -> dict[str, float]:
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


def dp(args: argparse.Namespace, program_file: bool = False) -> DataParallel | None:
    """The data-parallel options of the command line (E421 out of range); for a Program file None unless
    given (it was lowered for its own, and must agree with any given: E422)."""
    given = options.dp_of(args)
    return None if program_file and not options.dp_given(args) else given


def experts(args: argparse.Namespace, program_file: bool = False) -> Experts | None:
    """The expert options of the command line (E425 at the command line when out of range); for a Program
    file None unless given (it was compiled for its own, and must agree with any given: E426)."""
    try:
        given = options.experts_of(args)
    except PipecError as e:
        d = e.diagnostics[0]
        raise error(d.code, d.message, source=Source("<command line>", ""), notes=d.notes) from None
    return None if program_file and given == Experts() else given


def moe_layers(args: argparse.Namespace, obj: Schedule | Program, docs: list[dict] | None = None) -> tuple[int, ...]:
    """The MoE layers of each stage: `--moe-layers`, else the cost documents' or the schedule's
    (pipec.driver.moe_layers_of)."""
    from pipec.driver import moe_layers_of
    from pipec.sim.cost_files import cost_spec

    if docs is None:
        docs = [cost_spec(t) for t in getattr(args, "cost", [])]
    return moe_layers_of(obj, docs, getattr(args, "moe_layers", None))


def compiled(args: argparse.Namespace) -> tuple[CompiledSchedule, bool]:
    """Every check but the `expect` lines, then the Program (a Program file: validated and dry-run);
    and whether the input was a Program file."""
    from pipec.driver import check_program
    from pipec.ir.program import Program
    from pipec.passes.compiler import compile_schedule

    obj, where = target(args)
    layers = moe_layers(args, obj)
    if isinstance(obj, Program):
        return check_program(obj, memory(args), where, dp(args, True), experts(args, True), layers), True
    return compile_schedule(obj, memory(args), dp(args), experts(args), layers), False


def dp_json(prog: Program) -> dict:
    """`data_parallel` of a JSON summary, only where the Program has data parallelism (so the documents
    of a Program without it stay as they were)."""
    if (prog.dp, prog.dp_kind) == (1, "ddp"):
        return {}
    return {"data_parallel": {"size": prog.dp, "kind": prog.dp_kind}}


def on_network(args: argparse.Namespace, s: Schedule) -> Schedule:
    """The schedule on the network `--topology` names, if any."""
    if not getattr(args, "topology", None):
        return s
    from pipec.frontend.topology import read_topology, with_topology

    return with_topology(s, read_topology(args.topology, s))


def writable(path: str | None, flag: str) -> None:
    """Misuse, before any work, when `path` (a file a command will write) is a folder or its folder is missing:
    a long search or profile must not end in a file it cannot write."""
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise Misuse(f"{flag} `{path}` is a folder; give a file name")
    if not os.path.isdir(parent):
        raise Misuse(f"{flag} `{path}`: the folder `{parent}` does not exist")


def write(path: str | None, text: str) -> None:
    """Text to a file (atomically), or to standard output without one; a file that cannot be written is
    misuse."""
    from pipec.files import write_text

    if path is None:
        stdout().write(text)
        return
    try:
        write_text(path, text)  # atomically: a failure leaves the old file, never a partial one
    except OSError as e:
        raise Misuse(f"cannot write `{path}`: {e.strerror}") from None
