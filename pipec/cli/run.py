"""`pipec run` (train a model file on a schedule, pipec.runtime.job.run) and `pipec profile` (measure a
model's costs, pipec.runtime.profile): the commands that need torch, imported only when they run."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from pipec import options
from pipec.cli.args import Command, build, dp, experts, json_arg, schedule_args, target, topology_arg, write
from pipec.cli.envelope import Misuse, emit, stdout
from pipec.options import RunOptions

if TYPE_CHECKING:  # numpy and the compiler load when a command runs (`pipec --version` is quick)
    from pipec.ir.program import Program

MAX_THREADS = 4096  # torch threads per process: more than the largest hosts have cores


def run_arguments(p: argparse.ArgumentParser) -> None:
    schedule_args(p)
    RunOptions.add_arguments(p)
    topology_arg(p)
    json_arg(p, "the per-step losses and times")


def cmd_run(args: argparse.Namespace) -> int:
    """Train a model file on a schedule (or a Program file): N local processes through torchrun (gloo on
    CPU, nccl on CUDA), or every rank in this process with --local. Prints a line per step; --check
    compares the loss, gradients and parameters with a single-process run; --json gives each step's loss
    and seconds. See docs/runtime.md."""
    from pipec.runtime.job.program import run_program

    opts = RunOptions.from_args(args)
    c = run_program(*target(args), opts)  # the Program every worker builds alike (--dp, --ep, --topology)
    program, sched = c.program, c.schedule
    _check_faults(opts, program)
    links = None
    if opts.emulate_links:
        try:
            from pipec.runtime.exec.links import links_of

            links = links_of(sched, opts.link_scale, program.dp)
        except ValueError as e:
            raise Misuse(str(e)) from None
        except ImportError:
            pass  # reported just below
    try:
        from pipec.runtime.job.run import run
    except ImportError as e:
        raise Misuse(f"the runtime needs torch ({e}); install pipec[runtime]") from None
    if not args.json:
        return run(opts, program, links, sched)  # --memory predicts for `sched`
    import tempfile

    from pipec.runtime.job.report import read_records

    with tempfile.TemporaryDirectory(prefix="pipec-records-") as folder:
        records = os.path.join(folder, "records.jsonl")
        with _captured_stdout() as text:
            status = run(dataclasses.replace(opts, records=records), program, links, sched)
        sys.stderr.write(text[0])  # the run's own lines, for whoever watches
        doc = read_records(records)
    _emit_run(args, program, status, doc)
    return status


def _check_faults(opts: RunOptions, program: Program) -> None:
    """--straggler and --jitter read as pipec.sim.faults does (a Misuse otherwise), before torch loads."""
    from pipec.sim.faults import faults_of

    try:
        faults = faults_of(opts.straggler, opts.jitter, opts.fault_seed)
    except ValueError as e:
        raise Misuse(str(e)) from None
    if faults is not None and faults.straggler is not None and faults.straggler.rank >= program.num_ranks:
        raise Misuse(f"--straggler: rank {faults.straggler.rank} is not in 0..{program.num_ranks - 1}")


def _emit_run(args: argparse.Namespace, program: Program, status: int, doc: dict) -> None:
    emit(args, {"schedule": program.name, "params": dict(program.params), "exit": status, **doc}, ok=status == 0)


@contextmanager
def _captured_stdout() -> Iterator[list[str]]:
    """Everything written to standard output inside the block, by this process (sys.stdout) and by the
    processes it starts (file descriptor 1, which torchrun's workers inherit), so that the one JSON
    document is all that standard output gets."""
    import io
    import tempfile

    got = [""]
    stdout().flush()
    sys.stdout.flush()
    buf, saved = io.StringIO(), sys.stdout
    with tempfile.TemporaryFile() as tmp:
        fd = os.dup(1)
        os.dup2(tmp.fileno(), 1)
        sys.stdout = buf
        try:
            yield got
        finally:
            sys.stdout = saved
            os.dup2(fd, 1)
            os.close(fd)
            tmp.seek(0)
            got[0] = buf.getvalue() + tmp.read().decode("utf-8", "replace")


def profile_arguments(p: argparse.ArgumentParser) -> None:
    schedule_args(p)
    p.add_argument("--model", required=True, metavar="PATH", help="the model file (see docs/runtime.md)")
    p.add_argument("-o", "--output", metavar="OUT", help="write the cost file here (.toml, or .json); default: print")
    p.add_argument(
        "--reps",
        type=options.count(1, 1_000_000),
        default=20,
        metavar="N",
        help="timed runs per op (default 20; medians)",
    )
    p.add_argument(
        "--warmup", type=options.count(0, 1_000_000), default=3, metavar="N", help="untimed runs first (default 3)"
    )
    p.add_argument(
        "--threads",
        type=options.count(1, MAX_THREADS),
        default=None,
        metavar="N",
        help="torch threads (default: a rank's share)",
    )
    p.add_argument("--device", type=options.device, default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument(
        "--seed", type=options.integer, default=0, help="weights are seeded by (seed, stage), as in pipec run"
    )
    p.add_argument("--no-comm", dest="comm", action="store_false", help="skip the link measurement (gloo)")
    p.add_argument(
        "--one-process",
        dest="concurrent",
        action="store_false",
        default=None,
        help="time the ops in this process alone (default on CPUs: one process per rank, all at once)",
    )
    p.add_argument(
        "--in-situ",
        action="store_true",
        help="take F, B, W and the overhead from --reps steps of the schedule run on its gloo processes",
    )
    p.add_argument(
        "--slices",
        type=options.integer,  # its range is the profiler's (2 or more), with its own message
        default=None,
        metavar="N",
        help="also time token slices at whole N-ths of the sequence and fit the cost keys attn and op_fixed "
        "(docs/terapipe.md)",
    )
    p.add_argument("--json", action="store_true", help="print the measurements as JSON")
    options.add_dp_arguments(p)


def cmd_profile(args: argparse.Namespace) -> int:
    """Measure T_F, T_B, T_W per stage (and the full backward, and the optimizer step) and the message
    sizes of a model file on this machine, the way the runtime runs them, plus a gloo link's latency and
    bandwidth, and with --dp the data-parallel collectives (each stage's, and the DP link's latency and
    bandwidth); write the cost file `pipec simulate --cost` reads. See docs/runtime.md."""
    try:
        import torch

        from pipec.runtime.errors import PipelineError
        from pipec.runtime.model.contract import load_model
        from pipec.runtime.profile.stages import profile, summary_lines
    except ImportError as e:
        raise Misuse(f"profiling needs torch ({e}); install pipec[runtime]") from None
    _check_device(torch, args.device)
    _check_size(*_sizes(args), options.dp_of(args).size)  # before the whole schedule is evaluated
    sched = build(args)
    _check_size(sched.num_ranks, sched.num_stages, options.dp_of(args).size)
    from pipec.passes.compiler import compile_schedule
    from pipec.sim.cost_files import dump_costs

    program = compile_schedule(sched, None, dp(args), experts(args)).program  # --dp, --ep: collectives too

    try:
        model = load_model(args.model)
        prof = profile(
            program,
            model,
            reps=args.reps,
            warmup=args.warmup,
            threads=args.threads,
            device=args.device,
            seed=args.seed,
            comm=args.comm,
            in_situ=args.in_situ,
            concurrent=args.concurrent,
            slices=args.slices,
            progress=lambda msg: print(f"pipec profile: {msg} ...", file=sys.stderr, flush=True),
        )
    except PipelineError as e:
        print(f"pipec profile: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # the model's own code failed: its traceback, then one line
        import traceback

        traceback.print_exc()
        print(f"pipec profile: error: {args.model}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    as_json = bool(args.output) and not args.output.endswith(".toml")
    text = dump_costs(prof.cost_doc(), toml=not as_json)
    if args.json:
        emit(args, {"costs": prof.cost_doc(), "output": args.output})
    if args.output:
        write(args.output, text)
        if not args.json:
            print("\n".join(summary_lines(prof)))
            defines = "".join(f" -D {k}={v}" for k, v in args.defines)
            if program.dp > 1 or program.dp_kind != "ddp":
                defines += f" --dp {program.dp} --dp-kind {program.dp_kind}"
            if program.experts.size > 1:
                defines += f" --ep {program.experts.size} --experts {program.experts.num}"
            print(f"wrote {args.output}; simulate with: pipec simulate {args.schedule}{defines} --cost {args.output}")
    elif not args.json:
        sys.stdout.write(text)
    return 0


def _check_device(torch, device: str) -> None:
    """Misuse unless this machine has `--device` (before any work: torch's own refusal is a traceback)."""
    if not device.startswith("cuda"):
        return
    if not torch.cuda.is_available():
        raise Misuse(f"--device {device}: this machine has no CUDA device (torch.cuda.is_available() is False)")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise Misuse(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def _sizes(args: argparse.Namespace) -> tuple[int, int]:
    """The ranks and stages a schedule has, from its rank 0 alone (seconds for a million ranks, where the whole
    schedule takes minutes and gigabytes); (0, 0) for a Program file or a schedule whose rank 0 does not
    evaluate, which the full build then reports."""
    from pipec.cli.args import read_source
    from pipec.driver import build as build_source
    from pipec.errors import PipecError
    from pipec.formats.program_file import is_program_text

    try:
        source = read_source(args.schedule)
        if is_program_text(source.text):
            return 0, 0  # its sizes are bounded when it is read
        first = build_source(source, args.defines, check=False, ranks=[0])
    except PipecError:
        return 0, 0
    return first.num_ranks, first.num_stages


def _check_size(ranks: int, stages: int, dp_size: int) -> None:
    """Misuse for a profile larger than this machine can hold, before it is compiled: profiling builds every
    stage of the model here and runs a process per rank (times --dp), each importing torch, so more than
    `pipec run`'s local bound (LOCAL_PROCESSES_PER_CPU per CPU) is a typo in -D p or --dp."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    bound = options.LOCAL_PROCESSES_PER_CPU * max(cpus, 1)
    worst = max(stages, ranks * dp_size)
    if worst > bound:
        raise Misuse(
            f"this profile builds {stages:,} stages and runs {ranks * dp_size:,} processes ({ranks:,} ranks x dp "
            f"{dp_size}), more than {options.LOCAL_PROCESSES_PER_CPU} per CPU on this machine's {cpus}: check -D p "
            "and --dp (profile a smaller pipeline: the costs are per stage)"
        )


RUN = Command("run", "train a model on a schedule: torchrun processes, or --local", run_arguments, cmd_run)
PROFILE = Command("profile", "measure a model's per-stage costs and write a cost file", profile_arguments, cmd_profile)
