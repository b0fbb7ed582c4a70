"""`pipec run`: compile a schedule, then run it on N local processes through torchrun, or in-process
with --local. Called lazily from pipec/cli/app.py, so the rest of the CLI never imports torch."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile

from pipec.formats.program_file import write_json
from pipec.ir.program import Program

SHUTDOWN_S = 3  # seconds a rank has to answer SIGTERM (ours take about one) before SIGKILL

# Waits for its standard input to close, which happens however `pipec run` ends (a SIGKILL included),
# then removes the run's temporary folder if it is still there.
_REAPER = "import shutil, sys; sys.stdin.buffer.read(); shutil.rmtree(sys.argv[1], ignore_errors=True)"


def run(args: argparse.Namespace, program: Program) -> int:

    if args.steps < 1:
        return _misuse(f"--steps must be at least 1, got {args.steps}")
    if (args.checkpoint_every is not None or args.resume) and not args.checkpoint:
        return _misuse("--checkpoint-every and --resume need --checkpoint DIR")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        return _misuse(f"--checkpoint-every must be at least 1, got {args.checkpoint_every}")
    if args.checkpoint and args.local:
        return _misuse("--checkpoint needs the distributed runtime (torch.distributed.checkpoint), not --local")
    from pipec.runtime.job.launch import dp_problem, with_dp

    try:
        program = with_dp(program, args)
    except ValueError as e:
        return _misuse(str(e))
    if program.dp > 1:
        if args.local:
            return _misuse(
                f"--dp {program.dp} needs the distributed runtime (a DeviceMesh of {program.num_ranks} x "
                f"{program.dp} processes); --local runs one pipeline in one process"
            )
        problem = dp_problem(program, args, args.nproc)
        if problem:
            return _misuse(problem)
        if getattr(args, "dp_unit", "stage") != "stage" and program.dp_kind != "fsdp":
            return _misuse("--dp-unit block shards per block: it needs --dp-kind fsdp")
    elif not args.local and args.nproc is not None and args.nproc != program.num_ranks:
        from pipec.runtime.errors import wrong_world_size

        return _misuse(wrong_world_size(program, args.nproc))
    from pipec.runtime.errors import PipelineError
    from pipec.runtime.model.contract import load_model

    try:
        model = load_model(args.model)  # a bad model file is reported once, before any process starts
        if getattr(args, "partition", None):  # stages from the model's layers() as the file splits them
            from pipec.errors import PipecError
            from pipec.runtime.model.partitioned import use_partition

            try:
                model = use_partition(args, model, program.num_stages, program.name)
            except PipecError as e:
                print("\n".join(d.format() for d in e.diagnostics), file=sys.stderr)
                return 1
    except PipelineError as e:
        print(f"pipec run: error: {e}", file=sys.stderr)
        return 1
    if args.local:
        try:
            return run_local(args, program, model)
        except PipelineError as e:
            print(f"pipec run: error: {e}", file=sys.stderr)
            return 1
    return run_torchrun(args, program, program.num_ranks * program.dp)


def _misuse(message: str) -> int:
    print(f"pipec run: error: {message}", file=sys.stderr)
    return 2


def worker_args(args: argparse.Namespace, program_path: str) -> list[str]:
    out = [program_path, "--model", args.model, "--steps", str(args.steps), "--timeout", str(args.timeout)]
    out += ["--backend", args.backend, "--seed", str(args.seed), "--cpu-bind", args.cpu_bind]
    if args.check:
        out.append("--check")
    if args.tol is not None:
        out += ["--tol", repr(args.tol)]
    if args.trace:
        out += ["--trace", os.path.abspath(args.trace)]
    if args.loss_scale is not None:
        out += ["--loss-scale", repr(args.loss_scale)]
    if args.recv_ahead is not None:
        out += ["--recv-ahead", str(args.recv_ahead)]
    if getattr(args, "dp", 1) != 1 or getattr(args, "dp_kind", "ddp") != "ddp":
        out += ["--dp", str(args.dp), "--dp-kind", args.dp_kind, "--prefetch", str(args.prefetch)]
        if args.max_gathered is not None:
            out += ["--max-gathered", str(args.max_gathered)]
    if getattr(args, "dp_unit", "stage") != "stage":
        out += ["--dp-unit", args.dp_unit]
    if args.checkpoint:
        out += ["--checkpoint", os.path.abspath(args.checkpoint)]
        if args.checkpoint_every:
            out += ["--checkpoint-every", str(args.checkpoint_every)]
        if args.resume:
            out.append("--resume")
    if getattr(args, "memory", False):
        out += ["--memory-out", os.path.join(os.path.dirname(program_path), "memory.json")]
    if getattr(args, "links", None) is not None:
        links_path = os.path.join(os.path.dirname(program_path), "links.json")
        with open(links_path, "w") as f:
            f.write(args.links.to_json())
        out += ["--links", links_path]
    return out


def run_torchrun(args: argparse.Namespace, program: Program, nproc: int) -> int:
    """torchrun --standalone --nproc-per-node N -m pipec.runtime.job.launch PROGRAM ... (in this process)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    tmp = tempfile.mkdtemp(prefix="pipec-run-")
    with _reaper(tmp):  # removes tmp when this block ends, or when this process is killed
        path = os.path.join(tmp, "program.json")
        with open(path, "w") as f:
            write_json(program, f)
        # A rank that does not answer SIGTERM (stopped, or stuck in C code) is killed SHUTDOWN_S seconds
        # later instead of torchrun's default 30.
        targv = ["--standalone", "--nproc-per-node", str(nproc), "--shutdown-timeout", str(SHUTDOWN_S)]
        targv += ["--module", "pipec.runtime.job.launch"]
        try:
            with _stop_within_shutdown_timeout():
                torchrun(get_args_parser().parse_args(targv + worker_args(args, path)))
        except ChildFailedError as e:
            print(f"pipec run: failed: {failure_summary(e.failures)}", file=sys.stderr)
            return 1
        except SignalException as e:  # Ctrl-C or a kill of `pipec run`: torchrun has stopped the workers
            print(f"pipec run: stopped by {e.sigval.name}", file=sys.stderr)
            return 128 + int(e.sigval)
        if getattr(args, "memory", False):
            import json

            from pipec.runtime.exec.saved import Peaks

            with open(os.path.join(tmp, "memory.json")) as f:
                per_rank = json.load(f)
            # the pipeline of replica 0: global ranks 0, dp, 2 dp, ... (pipec.runtime.exec.replicas)
            measured = [Peaks(**per_rank[r * program.dp]) for r in range(program.num_ranks)]
            print("\n".join(memory_lines(args, program, measured)), flush=True)
    return 0


def memory_lines(args: argparse.Namespace, program: Program, measured: list) -> list[str]:
    """`pipec run --memory`: each rank's measured peak saved bytes (pipec.runtime.exec.saved) in the last step,
    against pipec's memory model (`program_memory`, device and host pools) fed with the bytes `pipec
    profile` counts for this model (`stage_bytes`), when the run knows its Schedule."""
    from pipec.driver import memory_overrides
    from pipec.ir.units import fmt_bytes
    from pipec.runtime.model.contract import load_model
    from pipec.runtime.profile.stages import stage_bytes
    from pipec.sim.memory import program_memory

    sched = getattr(args, "memory_schedule", None)
    predicted = None
    if sched is not None:
        dev = args.device or ("cuda" if args.backend == "nccl" else "cpu")
        counted = stage_bytes(program, load_model(args.model), device=dev, seed=args.seed, loss_scale=args.loss_scale)
        predicted = program_memory(program, sched, memory_overrides([counted]))
    b = lambda x: fmt_bytes(float(x))  # noqa: E731
    err = lambda p, m: "-" if not p else f"{(m - p) / p:+.1%}"  # noqa: E731
    head = ["rank", "device predicted", "measured", "error", "host predicted", "measured", "error"]
    rows = []
    for r, got in enumerate(measured):
        if predicted is None:
            rows.append([str(r), "-", b(got.device), "-", "-", b(got.host), "-"])
            continue
        rep = predicted[r]
        dev_p, host_p = rep.peak - rep.params, rep.host_peak
        rows.append([str(r), b(dev_p), b(got.device), err(dev_p, got.device), b(host_p), b(got.host)])
        rows[-1].append(err(host_p, got.host))
    if any(got.cuda is not None for got in measured):
        head.append("cuda max allocated")
        for row, got in zip(rows, measured):
            row.append("-" if got.cuda is None else b(got.cuda))
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    fmt = lambda row: "  ".join(x.rjust(w) for x, w in zip(row, widths))  # noqa: E731
    how = "pipec's memory model on the bytes pipec profile counts" if predicted else "no Schedule to predict from"
    return [f"peak saved activations per rank, last step (predicted: {how}):", fmt(head), *map(fmt, rows)]


class _stop_within_shutdown_timeout:
    """torch 2.13's agent waits its default 30 s before it SIGKILLs a worker that ignores SIGTERM (a
    stopped rank) wherever it stops workers after a failure (`SubprocessContext._poll` and
    `LocalElasticAgent._stop_workers` call `close()` without the --shutdown-timeout it was given), so a
    stopped rank held the job 30 s. Within this block, closing waits SHUTDOWN_S seconds at most."""

    def __enter__(self) -> None:
        from torch.distributed.elastic.multiprocessing.api import PContext

        self.cls, self.orig = PContext, PContext.__dict__.get("close")
        if self.orig is None:
            return  # another torch: leave it as it is
        orig = self.orig

        def close(ctx, death_sig=None, timeout: int = SHUTDOWN_S) -> None:
            orig(ctx, death_sig, min(timeout, SHUTDOWN_S))

        PContext.close = close

    def __exit__(self, *exc: object) -> None:
        if self.orig is not None:
            self.cls.close = self.orig


class _reaper:
    """A small process that removes `folder` when the block ends or this process dies, however it dies."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def __enter__(self) -> _reaper:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _REAPER, self.folder], stdin=subprocess.PIPE, start_new_session=True
        )
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def failure_summary(failures: dict) -> str:
    """Which ranks failed, and which only stopped because of them (exit status STOPPED)."""
    from pipec.runtime.job.monitor import STOPPED

    def how(f) -> str:
        return f"was killed by {f.signal_name()}" if f.exitcode < 0 else f"exited with status {f.exitcode}"

    culprits = sorted(r for r, f in failures.items() if f.exitcode != STOPPED)
    stopped = sorted(r for r, f in failures.items() if f.exitcode == STOPPED)
    parts = [f"rank {r} {how(failures[r])}" for r in culprits]
    if stopped:
        parts.append(f"rank{'s' if len(stopped) > 1 else ''} {', '.join(map(str, stopped))} stopped because of it")
    return "; ".join(parts)


def run_local(args: argparse.Namespace, program: Program, model) -> int:
    """Every rank in this process (pipec.runtime.local): for debugging, or the CUDA path on one GPU."""
    import torch

    from pipec.runtime.exec.microbatch import batch_of
    from pipec.runtime.job.launch import default_tol
    from pipec.runtime.job.measure import timeline
    from pipec.runtime.job.report import CheckStats, header, show, step_line
    from pipec.runtime.local import LocalPipeline
    from pipec.runtime.reference import Reference, compare, rel_err

    device = torch.device(args.device or ("cuda" if args.backend == "nccl" else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        return _misuse("--device cuda (or --backend nccl) with --local needs a GPU, and torch sees none")
    kw = dict(optimizer=model.optimizer, dtype=model.dtype, device=device, loss_scale=args.loss_scale, seed=args.seed)
    links = getattr(args, "links", None)
    pipe = LocalPipeline(
        program, model.build_stage, model.loss_fn, where=f"{model.path}: build_stage", links=links, **kw
    )
    reference = None
    if args.check:
        reference = Reference(model.build_stage, model.loss_fn, program.num_stages, program.num_sequences, **kw)
        checks = CheckStats()
    show(header(program, f"--local on {device.type}, one process", model.path))
    if links is not None:
        show(links.describe() + " (--local: ranks interleaved, so step times are not parallel)")
    if getattr(args, "memory", False):
        for runner in pipe.runners:
            runner.executor.measure_memory()
    for step in range(args.steps):
        x, y = batch_of(model.batch(step), f"{model.path}: batch({step})")
        res = pipe.step(x, y, record=bool(args.trace) and step == args.steps - 1)
        errs = None
        if reference is not None:
            ref_loss = reference.step(x, y)
            g = compare(pipe.named_gradients(), reference.named_gradients())
            p = compare(pipe.named_parameters(), reference.named_parameters())
            checks.add(rel_err(res.loss, ref_loss), g, p)
            errs = (rel_err(res.loss, ref_loss), max(g.values(), default=0.0), max(p.values(), default=0.0))
        show(step_line(step, args.steps, res.loss, res.seconds, errs))
    code = 0
    if reference is not None:
        tol = args.tol if args.tol is not None else default_tol(pipe.runners[0])
        show("\n".join(checks.lines(tol, args.steps)))
        code = 0 if checks.worst() <= tol else 1
    if getattr(args, "memory", False):
        show("\n".join(memory_lines(args, program, [r.executor.peaks for r in pipe.runners])))
    if args.trace:
        from pipec.formats.trace import write_trace

        write_trace(timeline(program, pipe.events()), args.trace)
        show(f"wrote the measured timeline of step {args.steps} to {args.trace} (--local: ranks interleaved)")
    return code
