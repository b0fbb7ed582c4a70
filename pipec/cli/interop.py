"""`pipec export` and `pipec import`: torch.distributed.pipelining's CSV and torchtitan's settings."""

from __future__ import annotations

import argparse
import sys

from pipec import options
from pipec.cli.args import (
    Command,
    compiled,
    complete_schedule,
    json_arg,
    memory_args,
    read_source,
    schedule_args,
    write,
)
from pipec.cli.envelope import Misuse, emit


def export_arguments(p: argparse.ArgumentParser) -> None:
    schedule_args(p)
    memory_args(p)
    p.add_argument(
        "--to",
        choices=("torch-csv", "torchtitan"),
        default="torch-csv",
        help="the format (default torch-csv); torchtitan: the compute-only CSV and torchtitan's settings (TOML)",
    )
    p.add_argument("--comms", action="store_true", help="the compute+communication format (default: compute only)")
    p.add_argument(
        "--microbatch-size",
        type=options.integer,
        default=1,
        metavar="B",
        help="--to torchtitan: samples per micro-batch",
    )
    p.add_argument(
        "--drop-memops", action="store_true", help="leave out RECOMPUTE/OFFLOAD/RELOAD, which torch has no action for"
    )
    p.add_argument("-o", "--output", metavar="OUT.csv", help="write here instead of standard output")
    options.add_dp_arguments(p)
    json_arg(p, "a summary (and, without -o, the CSV)")


def import_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "csv", metavar="FILE.csv", help="a torch schedule CSV (compute-only or compute+comms)"
    ).completer = complete_schedule
    p.add_argument("-o", "--output", metavar="OUT.pipe", help="write here instead of standard output")
    json_arg(p, "a summary (and, without -o, the .pipe text)")


def cmd_export(args: argparse.Namespace) -> int:
    """Check a schedule (every check of `pipec check`) and write it as torch.distributed.pipelining's
    action CSV (torch 2.13), one row per rank: compute-only, which torch's `_load_csv` lowers itself, or
    with --comms the compute+communication format, with pipec's proven placement of sends and receives
    (and, with --dp-kind fsdp, the lowering's UNSHARD/RESHARD windows); with --to torchtitan -o OUT, the
    compute-only OUT.csv and torchtitan's settings OUT.toml. What does not translate is an error, never
    dropped silently (see docs/interop.md)."""
    from pipec.formats.torch_csv_writer import export_csv, refuse_graph_for_torch

    if args.to == "torchtitan":
        return _export_torchtitan(args)
    if options.dp_given(args) and not args.comms:
        raise Misuse("the data-parallel options place collectives in the compute+comms CSV: add --comms")
    c = compiled(args)[0]
    s = c.schedule
    refuse_graph_for_torch(s, c.program)  # E217: a Program file's graph too (its schedule is its computes)
    text = export_csv(s, c.program if args.comms else None, drop_memops=args.drop_memops)
    if args.output or not args.json:
        write(args.output, text)
    declared = (("cost", s.costs), ("memory", s.memory), ("topology", s.topology), ("expect", s.expects))
    dropped = [k for k, v in declared if v]
    note = f"note: torch's CSV has no place for {', '.join(dropped)} declarations; they are not in it"
    fmt = "compute+comms" if args.comms else "compute-only"
    if args.json:
        doc = {"schedule": s.name, "params": dict(s.params), "ranks": s.num_ranks, "format": f"torch-csv {fmt}"}
        emit(args, {**doc, "dropped": dropped, "output": args.output, "csv": None if args.output else text})
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
    from pipec.formats.torch_csv_writer import refuse_graph_for_torch
    from pipec.formats.torchtitan import export_torchtitan, output_paths

    if options.dp_given(args):
        raise Misuse("--to torchtitan: torchtitan sets data parallelism itself (its data_parallel_* settings)")
    if not args.output:
        raise Misuse("--to torchtitan writes two files: give -o OUT (OUT.csv and OUT.toml)")
    if args.microbatch_size < 1:
        raise Misuse(f"--microbatch-size must be at least 1, not {args.microbatch_size}")
    c = compiled(args)[0]
    s = c.schedule
    refuse_graph_for_torch(s, c.program, "the torchtitan export")  # E217, a Program file's graph too
    csv_path, toml_path = output_paths(args.output)
    out = export_torchtitan(
        s, csv_path, comms=args.comms, microbatch_size=args.microbatch_size, drop_memops=args.drop_memops
    )
    write(csv_path, out.csv)
    write(toml_path, out.toml)
    if args.json:
        doc = {"schedule": s.name, "params": dict(s.params), "ranks": s.num_ranks, "format": "torchtitan"}
        emit(args, {**doc, "schedule_class": out.schedule_class, "csv": csv_path, "toml": toml_path})
    else:
        print(f"wrote {s.num_ranks} ranks of {s.name} to {csv_path} and torchtitan's settings to {toml_path}")
        print(f"  pipeline_parallel_schedule = {out.schedule_class!r} (the placement style of the schedule)")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    """Turn a torch.distributed.pipelining schedule CSV (compute-only or compute+comms) into a .pipe file
    with the same per-rank orders, written as loops where they repeat. The CSV is then checked like any
    schedule; `pipec check/show/compile/simulate FILE.csv` also read a CSV directly."""
    from pipec.driver import build
    from pipec.formats.torch_csv_reader import is_torch_csv, to_pipe
    from pipec.passes.compiler import compile_schedule

    source = read_source(args.csv)
    if not is_torch_csv(source):
        raise Misuse(f"expected a .csv file, got `{args.csv}`")
    s = build(source, check=False)
    text = to_pipe(s, source.path)
    if args.output or not args.json:
        write(args.output, text)
    sizes = f"{s.num_stages} stages on {s.num_ranks} ranks, {s.num_microbatches} micro-batches, {s.num_ops} ops"
    if args.output and not args.json:
        print(f"wrote {args.output}: {sizes}")
    compile_schedule(build(source))  # every check, reported after the file is written
    if args.json:
        doc = {"csv": source.path, "stages": s.num_stages, "ranks": s.num_ranks, "microbatches": s.num_microbatches}
        emit(args, {**doc, "ops": s.num_ops, "output": args.output, "pipe": None if args.output else text})
    elif args.output:
        print(f"{source.path}: OK")
    return 0


EXPORT = Command(
    "export", "write a checked schedule as torch.distributed.pipelining's CSV", export_arguments, cmd_export
)
IMPORT = Command("import", "turn a torch.distributed.pipelining CSV into a .pipe file", import_arguments, cmd_import)
