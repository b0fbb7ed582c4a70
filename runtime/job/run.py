"""`pipec run`: compile a schedule, then run it on N local processes through torchrun, or in-process
with --local. Called lazily from pipec/cli/run.py, so the rest of the CLI never imports torch."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
import tempfile

from pipec.formats.program_file import write_json
from pipec.ir.program import Program
from pipec.options import LOCAL_PROCESSES_PER_CPU, OptionError, RunOptions

SHUTDOWN_S = 3  # seconds a rank has to answer SIGTERM (ours take about one) before SIGKILL

# Waits for its standard input to close, which happens however `pipec run` ends (a SIGKILL included),
# then removes the run's temporary folder if it is still there.
_REAPER = "import shutil, sys; sys.stdin.buffer.read(); shutil.rmtree(sys.argv[1], ignore_errors=True)"


def run(opts: RunOptions, program: Program, links=None, schedule=None) -> int:
    """Run `program` under `opts`: its steps on torchrun's processes, or in this process with --local.
    `links` (pipec.runtime.exec.links.Links) are the emulated links of --emulate-links; `schedule` is what
    the --memory prediction is made for (None: a Program file's, none to predict from). Options that do
    not fit the Program are an OptionError (misuse) before any process starts."""
    from pipec.runtime.job.launch import dp_problem, experts_problem, with_dp

    try:
        program = with_dp(program, opts)
    except ValueError as e:
        raise OptionError(str(e)) from None
    if opts.cuda_graphs:
        import torch

        on = "--local --device cuda" if opts.local else "--backend nccl"
        if not (opts.backend == "nccl" or (opts.local and opts.device == "cuda")):
            raise OptionError(
                "--cuda-graphs captures each stage's compiled ops as CUDA graphs, so it needs CUDA: this run's "
                f"tensors are on the CPU (--backend {opts.backend}); run it on GPUs with {on}, or use --compile alone"
            )
        if not torch.cuda.is_available():
            raise OptionError("--cuda-graphs needs CUDA, and torch sees no GPU here; use --compile alone on the CPU")
    problem = experts_problem(program, opts)  # --ep, --experts (pipec.ir.experts), before anything starts
    if problem:
        raise OptionError(problem)
    if program.dp > 1:
        if opts.local:
            raise OptionError(
                f"--dp {program.dp} needs the distributed runtime (a DeviceMesh of {program.num_ranks} x "
                f"{program.dp} processes); --local runs one pipeline in one process"
            )
        problem = dp_problem(program, opts, opts.nproc)
        if problem:
            raise OptionError(problem)
        if opts.dp_unit != "stage" and program.dp_kind != "fsdp":
            raise OptionError("--dp-unit block shards per block: it needs --dp-kind fsdp")
    elif not opts.local and opts.nproc is not None and opts.nproc != program.num_ranks:
        from pipec.runtime.errors import wrong_world_size

        raise OptionError(wrong_world_size(program, opts.nproc))
    world = program.num_ranks * program.dp
    from pipec.runtime.host.affinity import allowed_cpus

    cpus = len(allowed_cpus() or ()) or os.cpu_count() or 1
    if not opts.local and world > LOCAL_PROCESSES_PER_CPU * cpus and not opts.force:
        raise OptionError(
            f"this job starts {world} processes here ({program.num_ranks} ranks x dp {program.dp}), more than "
            f"{LOCAL_PROCESSES_PER_CPU} per CPU on this machine's {cpus}: each imports torch (hundreds of MB); "
            "check -D p and --dp, run it across nodes with torchrun, or pass --force"
        )
    # What the run leaves in temporary folders goes when it returns, by this block, not by atexit: the
    # entry point ends with os._exit once torch is loaded, which skips atexit.
    with contextlib.ExitStack() as cleanup:
        from pipec.runtime.errors import PipelineError
        from pipec.runtime.model.contract import load_model

        try:
            model = load_model(opts.model)  # a bad model file is reported once, before any process starts
            if opts.partition:  # stages from the model's layers() as the file splits them
                from pipec.errors import PipecError
                from pipec.runtime.model.partitioned import use_partition

                try:
                    folder = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="pipec-partition-"))
                    model = use_partition(model, opts.partition, program.num_stages, program.name, folder)
                except PipecError as e:
                    print("\n".join(d.format() for d in e.diagnostics), file=sys.stderr)
                    return 1
                opts = dataclasses.replace(opts, model=model.path)  # the workers load the partitioned model
        except PipelineError as e:
            print(f"pipec run: error: {e}", file=sys.stderr)
            return 1
        if opts.local:
            try:
                return run_local(opts, program, model, links, schedule)
            except PipelineError as e:
                print(f"pipec run: error: {e}", file=sys.stderr)
                return 1
        from pipec.runtime.exec.shm import sweep_leftovers

        cleanup.callback(sweep_leftovers)  # shared-memory channels of ranks killed before they could unlink
        return run_torchrun(opts, program, program.num_ranks * program.dp, links, schedule)


def worker_args(opts: RunOptions, folder: str, links=None, schedule=None) -> list[str]:
    """The options of every worker (after the Program's path): `opts` with its paths made absolute and
    the files this run's folder holds for the workers (the emulated links, the --memory peaks, the source
    of the `schedule` the Program was compiled from)."""
    from pipec.runtime.job.program import write_source

    files = {}
    if write_source(schedule, os.path.join(folder, "source.json")):
        files["source"] = os.path.join(folder, "source.json")
    if links is not None:
        files["links"] = os.path.join(folder, "links.json")
        with open(files["links"], "w") as f:
            f.write(links.to_json())
    if opts.memory:
        files["memory_out"] = os.path.join(folder, "memory.json")
    absolute = {k: os.path.abspath(v) for k, v in (("trace", opts.trace), ("checkpoint", opts.checkpoint)) if v}
    if opts.records:
        absolute["records"] = os.path.abspath(opts.records)
    return dataclasses.replace(opts, **absolute, **files).to_argv()


def run_torchrun(opts: RunOptions, program: Program, nproc: int, links=None, schedule=None) -> int:
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
        # the order family, if any, is in the Program file (pipec.formats.family_field): no family.json beside it
        # A rank that does not answer SIGTERM (stopped, or stuck in C code) is killed SHUTDOWN_S seconds
        # later instead of torchrun's default 30.
        targv = ["--standalone", "--nproc-per-node", str(nproc), "--shutdown-timeout", str(SHUTDOWN_S)]
        targv += ["--module", "pipec.runtime.job.launch"]
        try:
            with _stop_within_shutdown_timeout():
                torchrun(get_args_parser().parse_args(targv + [path] + worker_args(opts, tmp, links, schedule)))
        except ChildFailedError as e:
            print(f"pipec run: failed: {failure_summary(e.failures)}", file=sys.stderr)
            return 1
        except SignalException as e:  # Ctrl-C or a kill of `pipec run`: torchrun has stopped the workers
            print(f"pipec run: stopped by {e.sigval.name}", file=sys.stderr)
            return 128 + int(e.sigval)
        if opts.memory:
            import json

            from pipec.runtime.exec.saved import Peaks
            from pipec.runtime.job.report import Report

            with open(os.path.join(tmp, "memory.json")) as f:
                per_rank = json.load(f)
            # the pipeline of replica 0: global ranks 0, dp, 2 dp, ... (pipec.runtime.exec.replicas)
            measured = [Peaks(**per_rank[r * program.dp]) for r in range(program.num_ranks)]
            Report(opts.records).line("\n".join(memory_lines(opts, program, measured, schedule)))
    return 0


def memory_lines(opts: RunOptions, program: Program, measured: list, sched=None) -> list[str]:
    """`pipec run --memory`: each rank's measured peak saved bytes (pipec.runtime.exec.saved) in the last step,
    against pipec's memory model (`program_memory`, device and host pools) fed with the bytes `pipec
    profile` counts for this model (`stage_bytes`), when the run knows its Schedule (`sched`)."""
    from pipec.driver import memory_overrides
    from pipec.ir.units import fmt_bytes
    from pipec.runtime.model.contract import load_model
    from pipec.runtime.profile.held import stage_bytes
    from pipec.sim.memory import program_memory

    predicted, dynamic = None, False
    if sched is not None:
        dev = opts.device or ("cuda" if opts.backend == "nccl" else "cpu")
        counted = stage_bytes(program, load_model(opts.model), device=dev, seed=opts.seed, loss_scale=opts.loss_scale)
        overrides = memory_overrides([counted])
        dynamic = program.family is not None and not program.family.is_static and not opts.static
        if dynamic:  # any order of the family may run: its worst case, `pipec check --memory`'s figure for it
            from pipec.passes.family import family_memory

            predicted = family_memory(sched, overrides)
        else:
            predicted = program_memory(program, sched, overrides)
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
    if dynamic:
        how += ", the worst case over the order family (the run chose its orders)"
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


def run_local(opts: RunOptions, program: Program, model, links=None, schedule=None) -> int:
    """Every rank in this process (pipec.runtime.local): for debugging, or the CUDA path on one GPU."""
    import torch

    from pipec.runtime.exec.measure import timeline
    from pipec.runtime.exec.microbatch import batch_of
    from pipec.runtime.job.launch import default_tol
    from pipec.runtime.job.report import CheckStats, Report, StepRecord, header
    from pipec.runtime.local import LocalPipeline
    from pipec.runtime.reference import Reference, compare, rel_err
    from pipec.runtime.runner import StageOptions, Transport

    device = torch.device(opts.device or ("cuda" if opts.backend == "nccl" else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise OptionError("--device cuda (or --backend nccl) with --local needs a GPU, and torch sees none")
    kw = dict(optimizer=model.optimizer, dtype=model.dtype, device=device, loss_scale=opts.loss_scale, seed=opts.seed)
    report = Report(opts.records)
    compiled = dict(compile=opts.compile, cuda_graphs=opts.cuda_graphs)  # the runtime's, not the reference's
    options = StageOptions(where=f"{model.path}: build_stage", **kw, **compiled)
    from pipec.sim.faults import faults_of

    faults = faults_of(opts.straggler, opts.jitter, opts.fault_seed)
    transport = Transport(links=links, static=opts.static, faults=faults)
    pipe = LocalPipeline(program, model.build_stage, model.loss_fn, options=options, transport=transport)
    reference = None
    if opts.check:
        graph = getattr(program, "graph", None)
        reference = Reference(
            model.build_stage, model.loss_fn, program.num_stages, program.num_sequences, graph=graph, **kw
        )
        checks = CheckStats()
    report.line(header(program, f"--local on {device.type}, one process", model.path))
    if links is not None:
        report.line(links.describe() + " (--local: ranks interleaved, so step times are not parallel)")
    if opts.memory:
        for runner in pipe.runners:
            runner.executor.measure_memory()
    for step in range(opts.steps):
        x, y = batch_of(model.batch(step), f"{model.path}: batch({step})")
        res = pipe.step(x, y, record=bool(opts.trace) and step == opts.steps - 1)
        errs = None
        if reference is not None:
            ref_loss = reference.step(x, y)
            g = compare(pipe.named_gradients(), reference.named_gradients())
            p = compare(pipe.named_parameters(), reference.named_parameters())
            checks.add(rel_err(res.loss, ref_loss), g, p)
            errs = (rel_err(res.loss, ref_loss), max(g.values(), default=0.0), max(p.values(), default=0.0))
        report.step(StepRecord.of(step, opts.steps, res.loss, res.seconds, errs))
    code = 0
    if reference is not None:
        tol = opts.tol if opts.tol is not None else default_tol(pipe.runners[0])
        report.line("\n".join(checks.lines(tol, opts.steps)))
        code = 0 if checks.worst() <= tol else 1
    if opts.memory:
        report.line("\n".join(memory_lines(opts, program, [r.executor.peaks for r in pipe.runners], schedule)))
    if opts.trace:
        from pipec.formats.trace import write_trace

        write_trace(timeline(program, pipe.events()), opts.trace)
        report.line(f"wrote the measured timeline of step {opts.steps} to {opts.trace} (--local: ranks interleaved)")
    return code
