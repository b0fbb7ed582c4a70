"""`pipec slice`: choose the token slice lengths of a sliced schedule by TeraPipe's dynamic program
(pipec.slicing), print them beside uniform slicing, and write the schedule with them."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from pipec import options
from pipec.cli.args import Command, complete_schedule, cost_args, json_arg, read_source, write
from pipec.cli.envelope import emit


def slice_arguments(p: argparse.ArgumentParser) -> None:
    from pipec.slicing import DEFAULT_POSITIONS

    p.add_argument(
        "schedule", metavar="FILE|NAME", nargs="?", default="terapipe", help="a sliced schedule (default terapipe)"
    ).completer = complete_schedule
    options.add_define_argument(p, "set a schedule parameter (repeatable), e.g. -D p=4 -D L=2048")
    cost_args(p)
    p.add_argument(
        "--granularity",
        type=options.count(1, 10**12),
        default=None,
        metavar="TOKENS",
        help=f"slice lengths are multiples of this (default: the least that keeps {DEFAULT_POSITIONS} steps)",
    )
    p.add_argument(
        "--max-slices",
        type=options.count(1, 10**12),
        default=None,
        metavar="N",
        help="at most N slices (default: any)",
    )
    p.add_argument("-o", "--output", metavar="OUT.pipe", help="write the schedule with the chosen slices here")
    json_arg(p, "the slices and the comparison")


def cmd_slice(args: argparse.Namespace) -> int:
    """Choose the token slice lengths of a sliced schedule (default: the library's terapipe) by TeraPipe's
    dynamic program under the cost model (`attn`, `op_fixed`: `pipec profile --slices`), print them with
    the simulated step beside uniform slicing and the unsliced run, and write the schedule with them (-o).
    See docs/terapipe.md, "Choosing the slices"."""
    from pipec.sim.cost_files import cost_spec
    from pipec.slicing import report_lines, slice_schedule

    source = read_source(args.schedule)
    docs = [cost_spec(t) for t in args.cost]
    say = None if args.json else (lambda msg: print(f"pipec slice: {msg} ...", file=sys.stderr, flush=True))
    res = slice_schedule(source, args.defines, docs, args.granularity, args.max_slices, say, args.output)
    if args.output:
        write(args.output, res.text)
    if args.json:
        emit(args, {**res.to_json(), "output": args.output})
        return 0
    for e in res.unmet:  # the file is written: what `pipec check` will say of it
        for d in e.diagnostics:
            print(dataclasses.replace(d, severity="warning").format(), file=sys.stderr)
    print("\n".join(report_lines(res)))
    if args.output:
        costs = "".join(f" --cost {c}" for c in args.cost)
        print(f"wrote {args.output}; simulate with: pipec simulate {args.output}{costs}")
    return 0


SLICE = Command("slice", "choose token slice lengths by TeraPipe's dynamic program", slice_arguments, cmd_slice)
