"""`pipec view`: a schedule, Program, simulation or measured run as one self-contained interactive HTML file."""

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
    topology_arg,
)
from pipec.cli.envelope import Misuse, emit


def view_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "schedule", metavar="FILE|NAME", help="a .pipe file, library name, Program file or trace (.json)"
    ).completer = complete_schedule
    options.add_define_argument(p, "set a schedule parameter (repeatable); with --compare, each takes its own")
    cost_args(p)
    topology_arg(p)
    memory_args(p)
    options.add_dp_arguments(p)
    options.add_moe_layers_argument(p)
    p.add_argument("--compare", metavar="FILE|NAME", help="a second schedule, drawn on the same time axis")
    p.add_argument("--measured", metavar="TRACE.json", help="a run's trace (`pipec run --trace`) over the simulation")
    json_arg(p, "what was written")
    p.add_argument("-o", "--output", metavar="OUT.html", default="view.html", help="the file to write (view.html)")


def cmd_view(args: argparse.Namespace) -> int:
    """Write one HTML file that opens offline in a browser (docs/view.md): a lane per rank for compute, one
    for sends and receives (arrows from each send to its receive), collectives, the host link and the
    all-to-alls of expert parallelism; the memory
    of both pools with the limit; hover for an op's micro-batch, stage, times and source line; wheel to zoom,
    drag to pan; the critical path in red and each idle gap attributed to what it waited for. A schedule
    refused for a deadlock is drawn with its chain of waits."""
    from pipec.files import write_text
    from pipec.sim.cost_files import cost_spec
    from pipec.view.html import is_trace_file, op_count, page, view_document

    if not args.output.lower().endswith((".html", ".htm")):
        raise Misuse(f"-o writes an .html file, not `{args.output}`")
    if is_trace_file(args.schedule) and (args.compare or args.measured):
        raise Misuse("a trace is drawn as it is: --compare and --measured take a schedule")
    docs = [cost_spec(t) for t in args.cost]
    doc = view_document(
        args.schedule,
        args.defines,
        docs,
        memory(args, docs),
        args.topology,
        dp(args),
        args.compare,
        args.measured,
        experts(args),
        args.moe_layers,
    )
    text = page(doc)
    try:
        write_text(args.output, text)
    except OSError as e:
        raise Misuse(f"cannot write `{args.output}`: {e.strerror}") from None
    n = op_count(doc)
    size = len(text.encode())
    if args.json:
        kinds = [p["kind"] for p in doc["panels"]]
        emit(args, {"output": args.output, "ops": n, "bytes": size, "panels": kinds})
        return 0
    print(f"wrote {args.output}: {n:,} ops, {size / 1e6:.2f} MB ({size / max(n, 1):.1f} bytes per op)")
    return 0


VIEW = Command(
    "view", "write an interactive HTML view of a schedule, simulation or measured run", view_arguments, cmd_view
)
