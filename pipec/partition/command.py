"""`pipec partition`'s command line (pipec.cli.app adds the subcommand with these two functions)."""

from __future__ import annotations

import argparse
import json
import sys

from pipec.errors import error


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="PATH", help="a model file with layers() to profile (needs torch)")
    src.add_argument("--layers-cost", metavar="TABLE.json", help="a layer table (from --save-layers) instead")
    p.add_argument("--save-layers", metavar="OUT.json", help="also write the measured layer table here")
    p.add_argument("--ranks", metavar="DESC", help="speed=1,1,0.5,0.5 mem=16GiB,... or a TOML file with those keys")
    p.add_argument("--memory-limit", metavar="BYTES", help="every rank's memory limit, e.g. 16GiB")
    p.add_argument("--time-limit", type=float, default=10.0, metavar="S", help="search seconds (default 10)")
    p.add_argument("--reps", type=int, default=10, metavar="N", help="timed runs per layer (default 10)")
    p.add_argument("-o", "--output", metavar="OUT.json", help="write the partition file here")
    p.add_argument("--json", action="store_true", help="print the partition file's document as JSON")


def run(args: argparse.Namespace, sched, program, cost_docs) -> int:
    from pipec.formats.partition_files import Ranks, parse_ranks, read_table, write_json
    from pipec.partition import memory_limit, partition, report_lines, to_doc

    ranks = parse_ranks(args.ranks) if args.ranks else Ranks()
    limit = memory_limit(args.memory_limit) if args.memory_limit else None
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
    out = partition(sched, program, table, ranks, limit, cost_docs, args.time_limit)
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
