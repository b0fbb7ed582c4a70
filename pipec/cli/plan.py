"""`pipec plan`: choose the layers of each stage, the schedule, v, the micro-batches and the memory ops
together under a byte budget (pipec.planner), print the plan beside the baselines a user would pick by
hand, and write what runs it (docs/plan.md)."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys

from pipec import options
from pipec.cli.args import Command, cost_args
from pipec.cli.envelope import Misuse, emit
from pipec.errors import Source, brief, error


def plan_arguments(p: argparse.ArgumentParser) -> None:
    cost_args(p)
    p.add_argument("--model", metavar="PATH", help="a model file with layers() (profiled unless --layers-cost)")
    p.add_argument("--layers-cost", metavar="TABLE.json", help="a layer table (pipec partition --save-layers)")
    p.add_argument("--save-layers", metavar="OUT.json", help="also write the measured layer table here")
    p.add_argument("-p", "--ranks-count", dest="p", type=options.count(1, 4096), metavar="P", help="pipeline ranks")
    p.add_argument("--ranks", metavar="DESC", help="speed=1,1,0.5,0.5 mem=16GiB,... or a TOML file with those keys")
    p.add_argument("--memory-limit", type=options.amount, metavar="BYTES", help="every rank's memory limit, e.g. 16GiB")
    p.add_argument(
        "--global-batch", type=options.count(1, 1 << 40), required=True, metavar="N", help="samples per step"
    )
    p.add_argument("--microbatches", metavar="M,M,...", help="the micro-batch counts to try (default: from the batch)")
    p.add_argument("--schedules", metavar="NAME,...", help="library schedules to try (default: every pipeline one)")
    p.add_argument("--memops", default="recompute,offload", metavar="KINDS", help="recompute,offload or none")
    p.add_argument("--no-synth", action="store_true", help="leave out the synthesized schedule (pipec synth)")
    p.add_argument("--time-limit", type=options.finite, default=30.0, metavar="S", help="search seconds (default 30)")
    p.add_argument("--reps", type=options.count(1, 1_000_000), default=5, metavar="N", help="timed runs per layer")
    p.add_argument("-o", "--output", metavar="DIR", help="write the plan's files (.pipe, partition, picture) here")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON document")


def cmd_plan(args: argparse.Namespace) -> int:
    """Choose together the layers of each stage (uneven; embedding and head where they cost least), the
    schedule (every library schedule), v, the micro-batch count and size, and which stages recompute or
    offload their forwards, under a memory limit; every candidate simulated by pipec's machine and memory
    walk, the answer proven within the limit by the memory check, with a lower bound on every plan. Prints
    it beside Megatron-LM's default and the best library schedule with `pipec partition`'s split, with the
    Pareto front of step time against peak bytes; writes the .pipe, the partition file, the picture and
    the Megatron-LM and torchtitan settings with -o. See docs/plan.md."""
    from pipec.formats.partition_files import Ranks, parse_ranks, write_json
    from pipec.planner import Inputs, microbatch_counts, plan
    from pipec.planner.space import LIBRARY, MEMOPS
    from pipec.sim.cost_files import cost_spec

    if importlib.util.find_spec("ortools") is None:
        raise Misuse("pipec plan needs OR-Tools (the partition search's bounds): pip install 'pipec[synth]'")
    if not args.model and not args.layers_cost:
        raise Misuse("give --model MODEL.py (profiled here) or --layers-cost TABLE.json (or both: the table checked)")
    if args.output is not None:
        _writable_folder(args.output, "-o")
    if args.save_layers is not None:
        _writable_file(args.save_layers, "--save-layers")
    ranks = parse_ranks(args.ranks) if args.ranks else Ranks()
    p = _ranks_count(args, ranks)
    schedules = _names(args.schedules, LIBRARY, "--schedules") if args.schedules is not None else LIBRARY
    memops = () if args.memops.strip() == "none" else _names(args.memops, MEMOPS, "--memops")
    given = _counts(args.microbatches) if args.microbatches is not None else None
    ms = microbatch_counts(args.global_batch, p, given)
    bad = [m for m in ms if args.global_batch % m]
    if bad:
        raise error(
            "E832",
            f"--microbatches {bad[0]} does not divide --global-batch {args.global_batch}",
            notes=("every micro-batch holds global batch / m samples",),
        )
    cost_docs = [cost_spec(t) for t in args.cost]
    for doc in cost_docs:
        taken = sorted(k for k in ("F", "B", "W", "act_bytes", "param_bytes") if k in doc)
        if taken:
            raise error("E803", f"--cost `{taken[0]}`: the plan computes each stage's costs from its layers")
    say = (lambda msg: print(f"pipec plan: {msg}", file=sys.stderr)) if not args.json else (lambda _m: None)
    table = _table(args, ms[len(ms) // 2], p, say)
    if table is None:
        return 1
    if table.microbatches is None:
        raise error(
            "E832",
            "the layer table does not say how many micro-batches it was measured at (`microbatches`)",
            source=Source(args.layers_cost, "") if args.layers_cost else None,
        )
    speed, limit = ranks.speeds(p), ranks.limits(p)
    if args.memory_limit is not None:
        limit = [args.memory_limit if math.isnan(x) else min(x, args.memory_limit) for x in limit]
    inputs = Inputs(
        table,
        p,
        args.global_batch,
        args.global_batch / table.microbatches,
        tuple(float(x) for x in speed),
        tuple(float(x) for x in limit),
        tuple(ms),
        tuple(cost_docs),
        tuple(schedules),
        tuple(memops),
        not args.no_synth,
    )
    # the limit counts from the process's start (the interpreter, the imports, the table: seconds under load);
    # the search takes 80% of what is left, the proof, the why and the files the rest (docs/plan.md)
    result = plan(inputs, 0.8 * max(args.time_limit - _process_age(), 0.0), say)
    from pipec.planner.outputs import Outputs

    out = Outputs(result, inputs, args.model, args.layers_cost)
    try:
        written = out.write(args.output) if args.output else []
    except OSError as e:  # the folder was checked; a disk that fills, or a file made unwritable since
        raise Misuse(f"cannot write the plan's files into `{args.output}`: {e.strerror or e}") from None
    if args.json:
        emit(args, out.to_json(written))
    else:
        print("\n".join(out.lines(written)))
    if args.save_layers and args.model and not args.layers_cost:
        try:
            write_json(args.save_layers, table.to_json())
        except OSError as e:
            raise Misuse(f"cannot write `{args.save_layers}`: {e.strerror or e}") from None
    return 0


def _process_age() -> float:
    """Wall seconds since this process started (Linux's /proc; 0 where it cannot be read)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = float(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after the command's name
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return 0.0


def _ranks_count(args: argparse.Namespace, ranks) -> int:
    """p from -p, or from --ranks when it lists one value per rank; E831 when they disagree."""
    lens = {k: len(v) for k, v in (("speed", ranks.speed), ("mem", ranks.memory)) if v is not None and len(v) > 1}
    where = Source(args.ranks, "") if args.ranks and os.path.isfile(args.ranks) else None
    if len(set(lens.values())) > 1:
        (a, x), (b, y) = sorted(lens.items())
        raise error("E831", f"--ranks gives {x} values for `{a}` but {y} for `{b}`", source=where)
    if args.p is None:
        if not lens:
            raise Misuse("give -p P (the pipeline's ranks), or --ranks with one value per rank")
        return next(iter(lens.values()))
    for key, n in lens.items():
        if n != args.p:
            raise error(
                "E831",
                f"--ranks gives {n} values for `{key}`, but -p is {args.p}: {abs(n - args.p)} "
                f"{'too many' if n > args.p else 'too few'}",
                source=where,
                notes=("give one value per rank, or one value for every rank",),
            )
    return args.p


def _writable_folder(path: str, flag: str) -> None:
    """Misuse unless the plan's files can go into `path` (made if missing), checked before any search: a
    folder, or a new one under a folder this process may write to."""
    if not path.strip():
        raise Misuse(f"{flag}: expected a folder, got an empty path")
    if os.path.exists(path) and not os.path.isdir(path):
        raise Misuse(f"{flag} `{path}` is a file; give a folder")
    _may_write(path, flag)


def _writable_file(path: str, flag: str) -> None:
    """Misuse unless a file can be written at `path` (its folder exists and may be written; not a folder)."""
    if not path.strip() or os.path.isdir(path):
        raise Misuse(f"{flag}: expected a file to write, got `{path}`")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise Misuse(f"cannot write `{path}`: its folder `{folder}` does not exist")
    _may_write(path, flag)


def _may_write(path: str, flag: str) -> None:
    """Misuse unless this process may write `path` (an existing one) or create it in its nearest existing folder."""
    target = os.path.abspath(path)
    here = target
    while not os.path.exists(here):
        here = os.path.dirname(here)
    if here != target and not os.path.isdir(here):
        raise Misuse(f"cannot write {flag} `{path}`: `{here}` is a file, not a folder")
    if not os.access(here, os.W_OK | (os.X_OK if os.path.isdir(here) else 0)):
        raise Misuse(f"cannot write {flag} `{path}`: `{here}` is not writable")


def _names(text: str, allowed, flag: str) -> tuple[str, ...]:
    from pipec.frontend import library

    names = tuple(x.strip() for x in text.split(",") if x.strip())
    known = set(allowed) | (set(library.names()) if flag == "--schedules" else set())
    bad = [x for x in names if x not in known]
    if not names:
        raise Misuse(f"{flag}: expected one or more of {', '.join(sorted(allowed))}, comma-separated, got `{text}`")
    if bad:
        raise Misuse(f"{flag}: `{brief(bad[0])}` is not one of {', '.join(sorted(allowed))}")
    return names


def _counts(text: str) -> list[int]:
    """`--microbatches M,M,...`: at least one count, each an integer >= 1 in ASCII digits (options.count)."""
    parse = options.count(1, 1 << 40)  # at most --global-batch's bound
    parts = [x for x in text.split(",") if x.strip()]
    if not parts or len(parts) > 10_000:
        raise Misuse(f"--microbatches: expected 1 to 10,000 counts like 4,8,16, got `{brief(text)}`")
    try:
        return [parse(x) for x in parts]
    except argparse.ArgumentTypeError as e:
        raise Misuse(f"--microbatches: {e}") from None


def _table(args: argparse.Namespace, m: int, p: int, say):
    """The layer table: read (and, with --model too, checked against the model's layers: E833), or profiled."""
    from pipec.formats.partition_files import read_table

    table = read_table(args.layers_cost) if args.layers_cost else None
    if args.model is None:
        return table
    try:
        from pipec.runtime.errors import PipelineError
        from pipec.runtime.model.contract import load_model
        from pipec.runtime.model.partitioned import layer_list, param_shapes
        from pipec.runtime.profile.layers import profile_layers
    except ImportError as e:
        print(f"pipec plan: error: --model needs torch ({e}); or give --layers-cost alone", file=sys.stderr)
        return None
    try:
        model = load_model(args.model)
        if table is not None:
            layers = [(n, param_shapes(mod)) for n, mod in layer_list(model)]
            _same_model(table, layers, args.layers_cost, args.model)
            return table
        return profile_layers(model, m, reps=args.reps, ranks=p, progress=lambda msg: say(f"{msg} ..."))
    except PipelineError as e:
        print(f"pipec plan: error: {e}", file=sys.stderr)
        return None


def _same_model(table, layers, table_path: str, model_path: str) -> None:
    """E833 unless the table's layers are the model's (names and parameter shapes), naming the first
    that differs."""
    from pipec.formats.partition_files import fingerprint

    if table.fingerprint == fingerprint(layers):
        return
    names = [n for n, _ in layers]
    where = Source(table_path, "")
    for i, (a, b) in enumerate(zip(table.names, names)):
        if a != b:
            raise error(
                "E833",
                f"the layer table is not of `{model_path}`: its layer {i} is `{a}`, the model's `{b}`",
                source=where,
                notes=("profile this model: pipec plan --model ... --save-layers TABLE.json",),
            )
        shapes = dict(layers[i][1])
        mine = dict(table.params[i]) if table.params else {}
        if mine != shapes:
            raise error(
                "E833",
                f"the layer table is not of `{model_path}`: layer `{a}` has other parameter shapes "
                f"({_shapes(mine)} in the table, {_shapes(shapes)} in the model)",
                source=where,
                notes=("profile this model: pipec plan --model ... --save-layers TABLE.json",),
            )
    raise error(
        "E833",
        f"the layer table is not of `{model_path}`: it has {table.num_layers} layers, the model {len(names)}",
        source=where,
        notes=("profile this model: pipec plan --model ... --save-layers TABLE.json",),
    )


def _shapes(d) -> str:
    return ", ".join(f"{k} {'x'.join(map(str, v))}" for k, v in list(d.items())[:3]) or "none"


PLAN = Command(
    "plan",
    "choose layers, schedule, micro-batches and memory ops together under a byte budget",
    plan_arguments,
    cmd_plan,
)
