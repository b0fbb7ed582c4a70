"""`pipec synth`: search for a schedule from sizes, costs and a memory limit (pipec.synth)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from pipec import options
from pipec.cli.args import Command, cost_args, memory_args, writable, write
from pipec.cli.envelope import Misuse, emit

# pipec synth's sizes: each of p, m, v, and the ops p * v * m * kinds, within what a schedule may have (the
# language's limits: pipec/frontend/evaluate.py's MAX_SIZE and MAX_OPS); -p 1000000000 would run for hours.
SYNTH_MAX = 10_000_000
SYNTH_MAX_OPS = 50_000_000


def _memops(text: str) -> tuple[str, ...]:
    from pipec.synth import memops_of

    try:
        return memops_of(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def synth_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-p", type=options.count(1, SYNTH_MAX), required=True, help="ranks")
    p.add_argument("-m", type=options.count(1, SYNTH_MAX), required=True, help="micro-batches")
    p.add_argument("-v", type=options.count(1, SYNTH_MAX), default=1, help="stages (chunks) per rank (default 1)")
    p.add_argument("--place", choices=("loop", "v"), default=None, help="chunk placement with -v 2 (default: v)")
    p.add_argument("--full-backward", action="store_true", help="ops F, B only (default: split backward F, B, W)")
    cost_args(p)
    memory_args(p)
    p.add_argument("--memory-limit-of", metavar="NAME", help="the limit: this library schedule's peak memory")
    p.add_argument(
        "--memops",
        type=_memops,
        default=("recompute", "offload"),
        metavar="LIST",
        help="memory ops the search may place below 1F1B's memory: recompute, offload, both (default) or none",
    )
    p.add_argument(
        "--dc",
        metavar="NAME=LO..HI",
        type=options.span,
        action="append",
        default=[],
        help="a datacenter of ranks LO..HI-1",
    )
    p.add_argument(
        "--time-limit",
        type=options.finite,
        default=30.0,
        metavar="S",
        help="seconds for the heuristic, then for the solver (default 30 each)",
    )
    solver = p.add_mutually_exclusive_group()
    solver.add_argument("--no-solver", action="store_true", help="the heuristic only")
    solver.add_argument("--solver", action="store_true", help="run the solver even on a large case")
    p.add_argument(
        "--name", type=options.schedule_name, default=None, help="the schedule's name (default: from the output file)"
    )
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

    writable(args.output, "-o")

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
    dcs = args.dc
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
        spec = dataclasses.replace(spec, limit=(args.memory_limit,) * args.p)
    elif args.memory_limit_of:
        spec = dataclasses.replace(spec, limit=(synth.peak_of(spec, args.memory_limit_of),) * args.p)

    def progress(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    name = args.name or (os.path.splitext(os.path.basename(args.output))[0] if args.output else "synth")
    names = args.compare.split(",") if args.compare else None
    rows = synth.library_comparison(spec, names)  # before the search: a stage graph there is E217
    result = synth.synthesize(
        spec,
        args.time_limit,
        use_solver=False if args.no_solver else (True if args.solver else None),
        progress=progress,
    )
    table = synth.comparison_text(result, rows, name)
    command = "pipec " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["synth"] else None
    text = synth.write_pipe(result, name, command, table)
    if args.output:
        write(args.output, text)
    elif not args.json:
        sys.stdout.write(text)
    if args.json:
        emit(args, {**synth.to_json(result, rows, name, args.output), "pipe": None if args.output else text})
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


SYNTH = Command("synth", "search for a schedule from sizes, costs and a memory limit", synth_arguments, cmd_synth)
