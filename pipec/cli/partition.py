"""`pipec partition`: profile a model file's layers (or read a layer table), choose each stage's layers
(pipec.partition) and write the partition file `pipec run --partition` reads."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

from pipec import options
from pipec.cli.args import Command, build, cost_args, schedule_args, writable
from pipec.cli.envelope import Misuse
from pipec.errors import error


def partition_arguments(p: argparse.ArgumentParser) -> None:
    schedule_args(p)
    cost_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="PATH", help="a model file with layers() to profile (needs torch)")
    src.add_argument("--layers-cost", metavar="TABLE.json", help="a layer table (from --save-layers) instead")
    p.add_argument("--save-layers", metavar="OUT.json", help="also write the measured layer table here")
    p.add_argument("--ranks", metavar="DESC", help="speed=1,1,0.5,0.5 mem=16GiB,... or a TOML file with those keys")
    p.add_argument("--memory-limit", type=options.amount, metavar="BYTES", help="every rank's memory limit, e.g. 16GiB")
    p.add_argument("--time-limit", type=options.finite, default=10.0, metavar="S", help="search seconds (default 10)")
    p.add_argument(
        "--reps", type=options.count(1, 1_000_000), default=10, metavar="N", help="timed runs per layer (default 10)"
    )
    p.add_argument("-o", "--output", metavar="OUT.json", help="write the partition file here")
    p.add_argument("--json", action="store_true", help="print the partition file's document as JSON")


def cmd_partition(args: argparse.Namespace) -> int:
    """Profile a model file's layers (or read a layer table) and choose the contiguous layers of each stage
    that minimise the schedule's simulated step under per-rank memory limits and speeds; print it beside
    the uniform split and write the partition file `pipec run --partition` reads. See docs/partition.md."""
    from pipec.formats.partition_files import Ranks, parse_ranks, read_table, write_json
    from pipec.partition import partition, report_lines, to_doc
    from pipec.partition.problem import refuse_graph_for_partition
    from pipec.passes.compiler import compile_schedule
    from pipec.sim.cost_files import cost_spec

    if importlib.util.find_spec("ortools") is None:  # before any profiling: the search's bounds need it
        raise Misuse("pipec partition needs OR-Tools (its bounds and E806's closest split): pip install 'pipec[synth]'")
    writable(args.output, "-o")
    writable(args.save_layers, "--save-layers")
    sched = build(args)
    refuse_graph_for_partition(sched, tool="pipec partition")  # E217 before compiling or profiling
    program = compile_schedule(sched).program
    refuse_graph_for_partition(sched, program, "pipec partition")  # a Program file's own graph
    cost_docs = [cost_spec(t) for t in args.cost]
    ranks = parse_ranks(args.ranks) if args.ranks else Ranks()
    for doc in cost_docs:
        given = sorted(k for k in ("F", "B", "W", "T_F", "T_B", "T_W", "act_bytes", "param_bytes") if k in doc)
        if given:
            raise error("E803", f"--cost `{given[0]}`: the partition computes each stage's costs from its layers")
    if args.layers_cost:
        table = read_table(args.layers_cost)
    else:
        table = _profile(args, sched.num_microbatches, sched.num_ranks)
        if table is None:
            return 1
        if args.save_layers:
            write_json(args.save_layers, table.to_json())
    if table.microbatches not in (None, sched.num_microbatches):
        print(
            f"pipec partition: note: the layer table was measured on micro-batches of 1/{table.microbatches} of "
            f"the batch; this schedule makes {sched.num_microbatches}",
            file=sys.stderr,
        )
    out = partition(sched, program, table, ranks, args.memory_limit, cost_docs, args.time_limit)
    doc = to_doc(out)
    if args.output:
        write_json(args.output, doc)
    if args.json:
        sys.stdout.write(json.dumps(doc) + "\n")
    else:
        print("\n".join(report_lines(out)))
        if args.output:
            print(f"wrote {args.output}; run with: pipec run ... --partition {args.output}")
    return 0


def _profile(args: argparse.Namespace, m: int, ranks: int):
    """The layer table of `--model`, measured (None after saying why it could not be)."""
    try:
        from pipec.runtime.errors import PipelineError
        from pipec.runtime.model.contract import load_model
        from pipec.runtime.profile.layers import profile_layers
    except ImportError as e:
        print(f"pipec partition: error: profiling needs torch ({e}); or give --layers-cost", file=sys.stderr)
        return None
    try:
        model = load_model(args.model)
        return profile_layers(
            model,
            m,
            reps=args.reps,
            ranks=ranks,
            progress=lambda msg: print(f"pipec partition: {msg} ...", file=sys.stderr),
        )
    except PipelineError as e:
        print(f"pipec partition: error: {e}", file=sys.stderr)
        return None


PARTITION = Command(
    "partition", "choose each stage's layers for the shortest simulated step", partition_arguments, cmd_partition
)
