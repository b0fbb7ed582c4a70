"""`pipec show`: the step-by-rank grid of a schedule, or with --timeline its simulated Gantt chart."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pipec import options
from pipec.cli.args import (
    Command,
    cost_args,
    dp,
    dp_json,
    experts,
    json_arg,
    moe_layers,
    on_network,
    program_schedule,
    schedule_args,
    target,
    topology_arg,
)
from pipec.cli.envelope import Misuse, emit
from pipec.errors import brief
from pipec.ir.experts import Experts

if TYPE_CHECKING:  # numpy and the compiler load when the command runs (`pipec list` is quick)
    from pipec.ir.program import Program
    from pipec.ir.schedule import Schedule


def show_arguments(p: argparse.ArgumentParser) -> None:
    schedule_args(p)
    p.add_argument("--ranks", type=str, default=None, help="only these ranks, e.g. 0,3")
    p.add_argument("--timeline", action="store_true", help="simulate and draw a text Gantt chart instead of the grid")
    cost_args(p)
    topology_arg(p)
    p.add_argument(
        "--width", type=options.count(1, 100_000), default=None, help="columns for --timeline (default: the terminal's)"
    )
    options.add_dp_arguments(p)
    options.add_moe_layers_argument(p)
    json_arg(p, "the grid (and with --timeline the simulated spans)")


def cmd_show(args: argparse.Namespace) -> int:
    """Print the schedule as a grid: one row per step, one column per rank; `F3&B1` marks an overlapped pair.
    A Program file shows the schedule it executes."""
    from pipec.driver import check_program
    from pipec.ir.program import Program
    from pipec.passes.compiler import compile_schedule
    from pipec.view.grid import cells, format_grid, grid_title

    obj, where = target(args)
    s = program_schedule(obj, where) if isinstance(obj, Program) else obj
    prog = None  # with data parallelism: the Program whose collectives are shown under the grid
    if isinstance(obj, Program) and dp_json(obj):
        prog = check_program(obj, None, where, dp(args, True)).program
    elif isinstance(obj, Program) and options.dp_given(args):
        prog = check_program(obj, None, where, dp(args, True)).program  # E422: it has none
    elif options.dp_given(args) or experts(args) != Experts():  # experts: the all-to-alls under --timeline
        prog = compile_schedule(obj, None, dp(args), experts(args), moe_layers(args, obj)).program
    ranks = None
    if args.ranks:
        try:
            ranks = [options.integer(x) for x in args.ranks.split(",")]
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
            doc |= dp_json(prog) | {"collectives": [c for c in _collectives(prog) if c["rank"] in shown]}
        elif s.collectives:
            doc["collectives"] = [c for c in _placed(s) if c["rank"] in shown]
        emit(args, doc)
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


def _show_timeline(args: argparse.Namespace, s: Schedule, ranks: list[int] | None, prog: Program | None = None) -> int:
    import shutil

    from pipec.driver import simulation
    from pipec.ir.schedule import unit_json
    from pipec.sim.cost_files import cost_spec
    from pipec.view import report
    from pipec.view.render import text_gantt

    docs = [cost_spec(t) for t in args.cost]
    if prog is None:
        sim = simulation(on_network(args, s), docs)
    else:  # the Program with its collectives, as lowered for the data parallelism asked for
        sim = simulation(prog, docs, None, getattr(args, "topology", None))
    if args.json:
        shown = list(range(s.num_ranks)) if ranks is None else ranks
        spans = [
            {"rank": r, "op": op, **unit_json(s.slicing, mb), "stage": st, "start": a, "end": b}
            for r in shown
            for op, mb, st, a, b in sim.timeline.rank_events(r)
        ]
        emit(args, {**s.head(), "makespan": sim.stats.makespan, "spans": spans})
        return 0
    width = args.width or shutil.get_terminal_size((120, 24)).columns
    print(report.panel_title(sim))
    print(text_gantt(sim.timeline, width, ranks))
    return 0


SHOW = Command("show", "print the step-by-rank grid of a schedule", show_arguments, cmd_show)
