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
    options.add_fault_arguments(p, "model")


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
    faults = _faults(args)
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
    predictions = [_prediction(args, s, faults) for s in sims]
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
        for res, pred in zip(results, predictions):
            if pred is not None:
                res["family_prediction"] = pred
        emit(args, {"results": results})
        return 0
    print(report.summary_text(sims[0]) if len(sims) == 1 else report.compare_text(sims))
    for sim, pred in zip(sims, predictions):
        if pred is not None:
            print(_prediction_text(sim, pred, len(sims) > 1))
    for line in wrote:
        print(line)
    return 0


def _faults(args: argparse.Namespace):
    """`--straggler`, `--jitter` and `--fault-seed` read as `pipec run` reads them (pipec.sim.faults.faults_of,
    each flag by its parser); a bad value is E811 at the command line, naming the flag."""
    from pipec.sim.faults import faults_of, parse_jitter, parse_straggler

    for flag, value, parse in (
        ("--straggler", args.straggler, parse_straggler),
        ("--jitter", args.jitter, parse_jitter),
    ):
        try:
            if value is not None:
                parse(value)
        except ValueError as e:
            raise error("E811", f"{flag}: {e}", source=Source("<command line>", "")) from None
    return faults_of(args.straggler, args.jitter, args.fault_seed)


def _prediction(args: argparse.Namespace, sim, faults) -> dict | None:
    """The family machine's prediction (pipec.sim.machine.predict) for a schedule with an order family, or
    under faults; None for a static schedule without faults, whose output stays as it was."""
    from pipec.sim.machine import PREDICTED_STEPS, predict

    family = sim.compiled.program.family
    if family is not None and family.is_static:
        family = None
    if family is None and faults is None:
        return None
    s = faults.straggler if faults is not None else None
    if s is not None and s.rank >= sim.schedule.num_ranks:
        raise error(
            "E811",
            f"--straggler: rank {s.rank} is not in 0..{sim.schedule.num_ranks - 1} (`{sim.schedule.name}`'s ranks)",
            source=Source("<command line>", ""),
        )
    pred = predict(sim.schedule, sim.costs, family, faults, static=args.static or family is None)
    what = faults.describe() if faults is not None else "no faults"
    return {"steps": PREDICTED_STEPS, "faults": what, "family": family is not None, **pred}


def _prediction_text(sim, pred: dict, named: bool) -> str:
    """One line: the family machine's static step and, for a family run dynamically, its dynamic step and
    the predicted gain."""
    who = f"{sim.schedule.name}: " if named else ""
    head = f"{who}family machine, mean of {pred['steps']} steps, {pred['faults']}: static step {pred['static']:.6g}"
    if "dynamic" not in pred:
        why = "--static: the compiled order only" if pred["family"] else "no order family: the compiled order"
        return f"{head} ({why})"
    return f"{head}, dynamic step {pred['dynamic']:.6g}, predicted gain {pred['gain']:+.2%}"


SIMULATE = Command(
    "simulate",
    "simulate schedules under a cost model: makespan, bubble, memory, trace, plot",
    simulate_arguments,
    cmd_simulate,
    aliases=("compare",),
)
