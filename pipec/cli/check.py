"""`pipec check`, `pipec compile` and `pipec list`."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pipec import options
from pipec.cli.args import Command, compiled, cost_args, dp_json, json_arg, memory_args, schedule_args
from pipec.cli.envelope import Misuse, emit, envelope, stdout
from pipec.frontend import library
from pipec.ir.experts import layers_text

if TYPE_CHECKING:  # the compiler loads when a command compiles (`pipec list` is quick)
    from pipec.passes.compiler import CompiledSchedule


def _experts_json(prog) -> dict:
    """`experts` of the summary, only for a Program with expert parallelism or MoE layers."""
    if prog.experts.size == 1 and not any(prog.moe_layers):
        return {}
    return {"experts": {"ep": prog.experts.size, "experts": prog.experts.num, "moe_layers": list(prog.moe_layers)}}


def summary(c: CompiledSchedule, program_file: bool = False) -> dict:
    """`pipec check --json`'s fields: the schedule's sizes, its Program's, and each rank's memory."""
    s = c.schedule
    return {
        "schedule": s.name,
        "source": s.source.path if s.source else None,
        "input": "program" if program_file else "schedule",
        "params": dict(s.params),
        "stages": s.num_stages,
        "ranks": s.num_ranks,
        "microbatches": s.num_sequences,
        **({"slicing": s.slicing.describe()} if s.slicing else {}),
        "ops": s.num_ops,
        "kinds": list(s.kinds),
        "placement": list(s.placement),
        "instructions": c.program.num_instructions,
        **dp_json(c.program),
        **_experts_json(c.program),
        "memory": [
            {"rank": m.rank, "peak": m.peak, "limit": m.limit, "at": m.at_text}
            | ({"params": m.params, "gathered": list(m.gathered)} if c.program.dp_kind == "fsdp" else {})
            | ({"unit": m.unit} if m.unit == "bytes" else {})  # peaks and limits in bytes (docs/memory.md)
            | ({"host_peak": m.host_peak, "host_limit": m.host_limit} if m.host_op else {})
            for m in c.memory
        ],
    }


def check_arguments(p: argparse.ArgumentParser) -> None:
    schedule_args(p)
    memory_args(p)
    options.add_dp_arguments(p)
    options.add_moe_layers_argument(p)
    p.add_argument("--memory", action="store_true", help="print the per-rank memory table")
    recv_ahead_arg(p, "--memory's buffer plan")
    cost_args(p)  # measured bytes (saved_bytes, ...) put the memory model in bytes
    json_arg(p, "the summary")


def cmd_check(args: argparse.Namespace) -> int:
    """Run every check: each op exactly once, on its owner, in dependency order; memory within the limit;
    no deadlock, even when every send blocks until its receive is posted; and the schedule's own `expect`
    lines, measured under its own cost and memory declarations (E405). A Program file (`pipec compile`'s
    output, JSON or text) is validated and dry-run, and its memory checked."""
    from pipec.driver import check_expectations
    from pipec.passes.memcheck import format_table

    if args.recv_ahead is not None and not args.memory:
        raise Misuse("--recv-ahead is for --memory's buffer plan: give --memory too")
    c, program_file = compiled(args)
    s = c.schedule
    check_expectations(s, c.program)
    if args.json:
        emit(args, summary(c, program_file))
        return 0
    params = " ".join(f"{k}={v}" for k, v in s.params)
    dp = "" if not dp_json(c.program) else f", data parallelism {c.program.dp} x {c.program.dp_kind}"
    e = _experts_json(c.program).get("experts")
    if e:
        dp += f", {e['experts']} experts over {e['ep']} ranks, MoE layers {layers_text(e['moe_layers'])}"
    print(f"{s.name} ({params}): {s.num_stages} stages, {s.num_ranks} ranks, {s.num_ops} ops{dp}: OK")
    if args.memory:
        print(format_table(list(c.memory)))
        _print_plan(c, args)
    return 0


def _print_plan(c: CompiledSchedule, args: argparse.Namespace) -> None:
    """The buffer plan's header and table (pipec.view.report.plan_table): the Program's own plan, else (none
    carried, or one for another `--recv-ahead`) one made here, and the header says which."""
    from pipec.cli.args import memory
    from pipec.passes.bufferplan import live_peak, plan_for
    from pipec.sim.memory import memory_model, resident
    from pipec.view.report import plan_table

    model = memory_model(c.schedule, memory(args))
    own = c.program.buffers
    plan = plan_for(c.program, model, args.recv_ahead)
    whose = " (the Program's)" if plan is own else ""
    if own is not None and plan is not own:
        whose = f" (made here: the Program's is for {own.ahead} receives posted ahead)"
    print(f"buffer plan{whose}" + (f", receives posted {plan.ahead} ahead" if plan.ahead else "") + ":")
    dp = c.program.dp if c.program.dp_kind == "fsdp" else 1
    res = resident(c.program.placement_array, model, c.program.num_ranks, dp)
    print(plan_table(list(c.memory), plan, res.tolist(), live_peak(c.program, plan)))


def _with_buffers(prog, args: argparse.Namespace, sched):
    """`--buffers`: the Program carrying its buffer plan (written as format version 3): its own where it
    carries one for `--recv-ahead` (or none is given), else one made for it."""
    if not args.buffers:
        if args.recv_ahead is not None:
            raise Misuse("--recv-ahead is for --buffers' plan: give --buffers too")
        return prog
    from pipec.cli.args import memory
    from pipec.passes.bufferplan import with_plan
    from pipec.sim.memory import memory_model

    return with_plan(prog, memory_model(sched, memory(args)), args.recv_ahead)


def recv_ahead_arg(p: argparse.ArgumentParser, what: str) -> None:
    """`--recv-ahead N`: the plan for receives posted N ahead of the Program's place, as `pipec run
    --recv-ahead N` posts them on gloo (a received tensor is born where it is posted, so its slot lives
    longer). The runtime takes a carried plan made for at least its own count (docs/runtime.md)."""
    p.add_argument(
        "--recv-ahead",
        type=options.count(0, 10**6),
        default=None,
        metavar="N",
        help=f"{what}: receives posted N ahead of the Program's place, as `pipec run --recv-ahead` posts them on "
        "gloo (default: a Program file's own plan, else 0: where the Program says, as on shared memory and NCCL)",
    )


def compile_arguments(p: argparse.ArgumentParser) -> None:
    schedule_args(p)
    memory_args(p)
    options.add_dp_arguments(p)
    options.add_moe_layers_argument(p)
    p.add_argument(
        "--buffers",
        action="store_true",
        help="plan every buffer (a slot per tensor, reused by lifetime, proven) and carry the plan: format version 3",
    )
    recv_ahead_arg(p, "--buffers")
    p.add_argument("-o", "--output", metavar="OUT", help="write here instead of standard output")
    p.add_argument(
        "--format",
        choices=("text", "json"),
        default=None,
        help="program format (default: json when OUT ends in .json, else text)",
    )
    json_arg(p, "a summary (and, without -o, the program)")


def cmd_compile(args: argparse.Namespace) -> int:
    """Check a schedule and lower it to one instruction stream per rank (see docs/program.md), written
    rank by rank as it is produced. With --json and no -o, the program is the `program` field."""
    import json

    from pipec.formats.program_file import write_json, write_text

    c = compiled(args)[0]
    prog = _with_buffers(c.program, args, c.schedule)
    fmt = args.format or ("json" if args.output and args.output.endswith(".json") else "text")
    if args.json and not args.output and args.format == "text":
        raise Misuse("--json prints the program as JSON; write --format text to a file with -o")
    write = write_json if fmt == "json" else write_text
    doc = {
        "schedule": prog.name,
        "params": dict(prog.params),
        "ranks": prog.num_ranks,
        **dp_json(prog),
        "instructions": prog.num_instructions,
        "output": args.output,
        "format": fmt if args.output else "json" if args.json else fmt,
    }
    if args.output:
        from pipec.files import atomic_write

        try:
            with atomic_write(args.output) as f:  # streamed, and all or nothing
                write(prog, f)
                if fmt == "json":
                    f.write("\n")
        except OSError as e:
            raise Misuse(f"cannot write `{args.output}`: {e.strerror}") from None
        if args.json:
            emit(args, doc)
        else:
            print(f"wrote {prog.num_instructions} instructions for {prog.num_ranks} ranks to {args.output}")
        return 0
    out = stdout()
    if args.json:
        out.write(json.dumps({**envelope("compile", True), **doc})[:-1] + ', "program": ')
        write_json(prog, out)
        out.write("}\n")
    else:
        write(prog, out)
        if fmt == "json":
            out.write("\n")
    return 0


def list_arguments(p: argparse.ArgumentParser) -> None:
    json_arg(p, "the list")


def cmd_list(args: argparse.Namespace) -> int:
    """List the standard library, one line each."""
    names = library.names()
    if args.json:
        emit(args, {"schedules": [{"name": n, "summary": library.summary(n)} for n in names]})
        return 0
    width = max(map(len, names), default=0)
    for name in names:
        print(f"{name.ljust(width)}  {library.summary(name)}")
    return 0


CHECK = Command("check", "parse, evaluate and check a schedule", check_arguments, cmd_check)
COMPILE = Command("compile", "check and lower a schedule to a Program", compile_arguments, cmd_compile)
LIST = Command("list", "list the library schedules", list_arguments, cmd_list)
