"""`pipec simulate` (alias `compare`): schedules under a cost model, one or several side by side."""

from __future__ import annotations

import argparse

from pipec import options
from pipec.cli.args import (
    Command,
    complete_schedule,
    cost_args,
    dp,
    experts,
    json_arg,
    memory,
    memory_args,
    moe_layers,
    read_source,
    topology_arg,
)
from pipec.cli.envelope import Misuse, emit
from pipec.errors import Source, error


def simulate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "schedule", metavar="FILE|NAME", nargs="+", help="one schedule, or several to compare"
    ).completer = complete_schedule
    options.add_define_argument(
        p, "set a schedule parameter (repeatable); with several schedules, each takes those it declares"
    )
    cost_args(p)
    topology_arg(p)
    memory_args(p)
    options.add_dp_arguments(p)
    options.add_moe_layers_argument(p)
    p.add_argument(
        "--no-overlap",
        action="store_true",
        help="run each overlapped pair (F & B) one op after the other: what overlapping its all-to-alls gains",
    )
    json_arg(p, "every figure")
    p.add_argument("--trace", metavar="OUT.json", help="write a Chrome/Perfetto trace (one schedule)")
    p.add_argument("--plot", metavar="OUT.png", help="draw a Gantt chart (.png, .svg or .pdf), one panel per schedule")
    p.add_argument("--no-memory", action="store_true", help="leave the memory curves out of --plot")


def cmd_simulate(args: argparse.Namespace) -> int:
    """Simulate schedules under one cost model (see docs/simulate.md): makespan, Zero Bubble's bubble rate,
    per-rank busy and idle time and peak memory; with several schedules, a table side by side. Costs come
    from the schedule's declarations, cost files and overrides (`--cost F=1,B=2,W=1` per stage, `T_F=1,...`
    per rank); by default T_F = T_B = T_W = 1 for each rank's share of the model, a full backward costs
    T_B + T_W, and communication is free. A Program file is simulated as it stands."""
    from pipec.driver import param_names, simulation, target_of
    from pipec.ir.program import Program
    from pipec.sim.cost_files import cost_spec
    from pipec.view import report

    if len(args.schedule) > 1 and args.trace:
        raise Misuse("--trace takes one schedule")
    if args.plot and not args.plot.lower().endswith((".png", ".svg", ".pdf")):
        raise Misuse(f"--plot writes .png, .svg or .pdf, not `{args.plot}`")
    docs = [cost_spec(t) for t in args.cost]
    overrides = memory(args, docs)
    sims, used = [], set()
    for name in args.schedule:
        defines = args.defines
        if len(args.schedule) > 1:
            known = set(param_names(read_source(name)))
            defines = [(k, v) for k, v in args.defines if k in known]
            used |= known
        obj, where = target_of(name, defines)
        is_prog = isinstance(obj, Program)
        layers = moe_layers(args, obj, docs)
        ep = experts(args, is_prog)
        sims.append(
            simulation(obj, docs, overrides, args.topology, where, dp(args, is_prog), ep, layers, not args.no_overlap)
        )
    unused = [k for k, _ in args.defines if len(args.schedule) > 1 and k not in used]
    if unused:
        takes = "; ".join(f"{n}: {', '.join(param_names(read_source(n))) or 'none'}" for n in args.schedule)
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
        emit(args, {"results": results})
        return 0
    print(report.summary_text(sims[0]) if len(sims) == 1 else report.compare_text(sims))
    for line in wrote:
        print(line)
    return 0


SIMULATE = Command(
    "simulate",
    "simulate schedules under a cost model: makespan, bubble, memory, trace, plot",
    simulate_arguments,
    cmd_simulate,
    aliases=("compare",),
)
