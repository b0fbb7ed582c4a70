"""The torchrun entry point: one process runs one rank of a Program.

    torchrun --nproc-per-node 4 -m pipec.runtime.job.launch 1f1b -D p=4 -D m=8 --model examples/mlp.py
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m pipec.runtime.job.launch zb-v -D p=8 -D m=16 --model examples/mlp.py --backend nccl

FILE|NAME is a schedule (a .pipe file or a library name, with -D parameters) or a compiled Program
(`pipec compile ... -o prog.json`). `pipec run` launches this module through torchrun.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Sequence

from pipec.ir.dataparallel import dp_mismatch
from pipec.options import OptionError, RunOptions, add_define_argument
from pipec.runtime.host.affinity import bind_local_rank
from pipec.runtime.host.malloc import keep_freed_memory
from pipec.runtime.job.monitor import BEAT_EVERY, block_sigterm, die_with_parent, say
from pipec.runtime.job.program import read_source, run_program
from pipec.sim.faults import faults_of

# A collective that timed out waits this long at most (or the timeout, if shorter) for another rank's report
# before blaming the replica that never joined: that replica is usually waiting on its own pipeline.
COLLECTIVE_GRACE_S = 10.0


def parser() -> argparse.ArgumentParser:
    """The worker's arguments: FILE|NAME, -D, and the run options a launcher writes (RunOptions.to_argv)."""
    ap = argparse.ArgumentParser(prog="python -m pipec.runtime.job.launch", description=__doc__.split("\n\n")[0])
    ap.add_argument("schedule", metavar="FILE|NAME", help="a .pipe file, a library schedule, or a compiled program")
    add_define_argument(ap)
    RunOptions.add_arguments(ap, launcher=False)
    return ap


def with_dp(program, opts: RunOptions):
    """The Program to run under the command line's data parallelism: as it stands when no flag is given
    or the flags agree with what it was compiled for; ValueError otherwise (a Program's collectives are
    placed by its lowering for one dp and kind, as `pipec.ir.dataparallel.dp_mismatch` says)."""
    dp, kind = opts.dp, opts.dp_kind
    if dp < 1:
        raise ValueError(f"data parallelism: the size (--dp) must be an integer >= 1, got {dp}")
    problem = None if dp == 1 and kind == "ddp" else dp_mismatch(program, dp, kind, f"--dp {dp} --dp-kind {kind}")
    if problem is None:
        return program
    raise ValueError(f"{problem}; compile it again with these options, or leave them out")


def load_program(spec: str, defines: Sequence[tuple[str, str]], opts: RunOptions | None = None):
    """A Program from a compiled file (JSON or text), or by compiling a schedule with its parameters, as
    `run_program` builds it for `opts` (None: no flag given)."""
    from pipec.driver import target_of

    obj, where = target_of(spec, list(defines))
    return run_program(obj, where, opts).program


def experts_problem(program, opts: RunOptions) -> str | None:
    """Why this run's expert parallelism (--ep, --experts: pipec.ir.experts) cannot start, None when it can:
    said before any process starts (pipec run) and by every worker before any communication."""
    from pipec.errors import PipecError
    from pipec.options import experts_of

    try:
        experts = experts_of(opts)  # E425: sizes out of range, experts not a multiple of --ep
    except PipecError as e:
        return "; ".join(d.message for d in e.diagnostics)
    if experts.size == 1:  # no flag: the Program's own (a Program file compiled with --ep)
        experts = program.experts
    if experts.size == 1:
        return None
    if program.dp == 1:
        return (
            f"expert parallelism (--ep {experts.size}) is folded into data parallelism: it needs --dp {experts.size} "
            "or a multiple of it"
        )
    problem = experts.fits(program.dp)
    if problem:
        return f"expert parallelism: {problem}"
    if opts.checkpoint:
        return "--checkpoint does not save expert shards yet (each rank holds different experts): leave out --ep"
    return None


def dp_problem(program, opts: RunOptions, world: int | None) -> str | None:
    """Why this data-parallel run cannot start (None when it can): the world, and what dp does not support."""
    problem = experts_problem(program, opts)
    if problem:
        return problem
    if world is not None:
        from pipec.runtime.exec.replicas import check_world

        problem = check_world(program.num_ranks, program.dp, world)
        if problem:
            return problem
    return None


def main(argv: Sequence[str] | None = None) -> int:
    die_with_parent()  # a SIGKILL of the launcher must not leave this rank training on
    block_sigterm()  # before torch starts any thread
    ap = parser()
    ns = ap.parse_args(argv)
    try:
        opts = RunOptions.from_args(ns)
    except OptionError as e:
        ap.error(str(e))
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else None  # torchrun's
    # before torch starts any thread, so that gloo's and OpenMP's threads inherit it
    cpus = bind_local_rank(opts.cpu_bind, opts.backend, local_rank, local_world)
    keep_freed_memory()  # before the step's tensors: profiles and runs see the same allocator
    from pipec.errors import PipecError

    try:
        from pipec.driver import target_of

        c = run_program(*target_of(ns.schedule, list(ns.defines)), opts)
        program, schedule = with_dp(c.program, opts), c.schedule if c.schedule.spans else None
        if opts.family:  # deprecated: the family now comes in the Program file (pipec.formats.family_field)
            import dataclasses
            import warnings

            from pipec.runtime.exec.dynamic import family_of_json

            warnings.warn(
                "--family FILE.json is deprecated and goes in 0.3.0: a Program file carries its order family "
                "(version 3, its `family` field; docs/program.md)",
                DeprecationWarning,
                stacklevel=1,
            )
            with open(opts.family) as f:
                program = dataclasses.replace(program, family=family_of_json(f.read()))
    except PipecError as e:
        say("\n".join(d.format() for d in e.diagnostics))
        return 1
    except ValueError as e:
        say(f"pipec: rank {rank}: error: {e}")
        return 1
    from pipec.runtime.errors import wrong_world_size

    if program.dp > 1 or program.experts.size > 1:  # before any communication
        problem = dp_problem(program, opts, world)
        if problem:
            say(f"pipec: rank {rank}: error: {problem}")
            return 1
    elif world != program.num_ranks:
        say(f"pipec: rank {rank}: error: {wrong_world_size(program, world)}")
        return 1

    import torch

    from pipec.runtime.errors import PipelineError
    from pipec.runtime.model.contract import load_model

    try:
        model = load_model(opts.model)
    except PipelineError as e:
        say(f"pipec: rank {rank}: error: {e}")
        return 1
    return Worker(program, model, opts, rank, world, local_rank, torch, cpus, local_world, schedule).run()


class Worker:
    """One rank of the job. `args` are the run's options; `cpus` the CPUs this process was bound to
    (None: unbound), of `local_world` processes on this machine (torchrun's, None without it)."""

    def __init__(
        self,
        program,
        model,
        args: RunOptions,
        rank: int,
        world: int,
        local_rank: int,
        torch,
        cpus,
        local_world,
        schedule=None,
    ) -> None:
        self.program, self.model, self.args = program, model, args
        self.schedule = schedule  # the Schedule it was lowered from, when known (else the launcher's --source)
        self.cpus, self.local_world = cpus, local_world
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self.torch = torch
        self.runner = None
        self.monitor = None
        self.finished = False

    def where(self) -> str:
        if self.runner is not None:
            return self.runner.where()
        return "the teardown" if self.finished else "start-up"

    def _teardown(self, dist) -> bool:
        """End a successful run so that the interpreter's shutdown finds no thread but the main one.

        A thread that takes the GIL once the interpreter is finalizing is ended there (`pthread_exit`), and
        that cannot unwind the C++ frames it is in: "terminate called without an active exception", SIGABRT.
        gloo's worker threads do take it: freeing a finished collective (the barrier's work frees the
        all_reduce's before it) frees its tensors, and a tensor whose Python object was released first
        takes the GIL to free that object. Those threads end with the process group's last reference, so
        every reference is dropped here, on the main thread, and `destroy_process_group` joins them (torch
        releases the GIL for that). The monitor's threads are joined first.
        False when a thread is left all the same: the caller then exits without the interpreter's shutdown."""
        import gc

        # No rank tears its connections down while a peer may still be using them.
        dist.barrier()
        # `fail` still works after this: its store calls fail quietly.
        stopped = self.monitor.stop()
        # The communicator holds the process group and its works; cycles are collected now, on this thread.
        self.runner = self.store = None
        gc.collect()
        dist.destroy_process_group()
        return stopped and not backend_threads()

    def run(self) -> int:
        import torch.distributed as dist

        from pipec.runtime.errors import CollectiveError, CommError, PeerLostError, PipelineError

        try:
            self._init(dist)
            code = self._train(dist)
            self.finished = True
            if not self._teardown(dist):  # a thread is left that the interpreter's shutdown could abort
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
            return code
        except BaseException as e:  # noqa: BLE001 - every failure must reach the other ranks
            if self.monitor is None:
                say(f"pipec: rank {self.rank}: error during start-up: {type(e).__name__}: {e}")
                os._exit(1)
            if isinstance(e, CollectiveError):
                if "timed out" in str(e):
                    # A replica peer that never joined is alive and waiting on something of its own (its
                    # pipeline, most often): its own report names the cause, so it gets the time to make it.
                    self.monitor.await_record(min(float(self.args.timeout), COLLECTIVE_GRACE_S))
                # The replica that never joined: one whose last reported position is not this collective's.
                here = self.where()
                behind = [p for p in e.peers if self.monitor.position_of(p) != here]
                e.peer = behind[0] if behind else e.peer
            elif isinstance(e, CommError) and not isinstance(e, PeerLostError) and self.runner is not None:
                e.peer = self.runner.global_rank(e.peer)  # the Program's rank -> this job's rank
            culprit = e.peer if isinstance(e, CommError) else self.rank
            if isinstance(e, CommError):
                # Blame the rank whose heartbeat stopped, not merely the one this rank waited on.
                # A closed connection is a dead peer; a timeout may be a peer waiting on a silent one.
                timed_out = "timed out" in str(e)
                silent = self.monitor.silent_ranks() if timed_out and not self.monitor.recorded() else []
                peer = e.peer if e.peer in silent or not silent else silent[0]
                culprit = peer
                silence = f"no heartbeat for {4 * BEAT_EVERY:g} s; " if peer in silent else ""
                reason = (
                    f"rank {peer} stopped responding or died ({silence}its last reported position: "
                    f"{self.monitor.position_of(peer)}); rank {self.rank} found out at {self.where()}: {e}"
                )
            elif isinstance(e, KeyboardInterrupt):
                reason = f"rank {self.rank} was interrupted at {self.where()}"
            else:
                if not isinstance(e, PipelineError):
                    traceback.print_exc()
                text = str(e) if isinstance(e, PipelineError) else f"{type(e).__name__}: {e}"
                reason = f"rank {self.rank} failed at {self.where()}: {text}"
            code = self.monitor.fail(reason, culprit)
            os._exit(code)

    def _init(self, dist) -> None:
        from datetime import timedelta

        from pipec.runtime.job.monitor import Monitor
        from pipec.runtime.job.sameness import check_same_program
        from pipec.runtime.runner import Runner, StageOptions, Transport

        torch, args = self.torch, self.args
        if args.backend == "nccl":
            if not torch.cuda.is_available():
                raise RuntimeError("--backend nccl needs CUDA, and torch sees no GPU here; use gloo")
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        # Imported before the process group exists: its functions' default argument `group=group.WORLD` is
        # evaluated at import, and imported later (torch.optim imports torch._dynamo, which imports it) it
        # keeps the default group alive after `destroy_process_group`, with gloo's threads (see `_teardown`).
        importlib.import_module("torch.distributed.nn.functional")

        if args.backend == "nccl":
            dist.init_process_group("nccl", timeout=timedelta(seconds=args.timeout), device_id=self.device)
        else:
            dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
        self.store = dist.distributed_c10d._get_default_store()
        stores = self._store_factory(dist, args.timeout)
        self.monitor = Monitor(self.rank, self.world, self.where, stores, grace=args.heartbeat_grace).start()
        # Before any transfer: nodes launched with different schedules fail here, in seconds, not at the timeout.
        check_same_program(
            self.store,
            self.rank,
            self.program,
            self.model.path,
            args.timeout,
            os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
        )
        m = self.model
        self.runner = Runner(
            self.program,
            m.build_stage,
            m.loss_fn,
            rank=self.rank if self.program.dp == 1 else None,  # with a mesh: its "pp" coordinate
            options=StageOptions(
                optimizer=m.optimizer,
                dtype=m.dtype,
                device=self.device,
                loss_scale=args.loss_scale,
                seed=args.seed,
                where=f"{m.path}: build_stage",
                compile=args.compile,
                cuda_graphs=args.cuda_graphs,
            ),
            transport=Transport(
                timeout=args.timeout,
                links=self._links(),
                recv_ahead=args.recv_ahead,
                p2p=args.transport,
                dp_unit=args.dp_unit,
                experts=self.program.experts if self.program.experts.size > 1 else None,
                overlap=not args.no_overlap,
                schedule=self._schedule(),
                static=args.static,
                faults=faults_of(args.straggler, args.jitter, args.fault_seed),
            ),
        )

    def _schedule(self):
        """The Schedule whose source lines locate a start-up diagnostic (expert parallelism's E427), if any:
        the one this worker compiled, else the launcher's (`read_source`), for this pipeline rank."""
        if self.schedule is not None or self.program.experts.size < 2:
            return self.schedule
        return read_source(self.args.source, self.rank // self.program.dp)

    def _links(self):
        if not getattr(self.args, "links", None):
            return None
        from pipec.runtime.exec.links import Links

        with open(self.args.links) as f:
            return Links.from_json(f.read())

    def _store_factory(self, dist, timeout: float):
        from datetime import timedelta

        # One namespace per torchrun attempt: a restarted job must not see the previous attempt's abort record.
        prefix = f"pipec/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if host and port:  # the monitor's own connections, so a blocked main thread never holds them up
            return lambda: dist.PrefixStore(
                prefix,
                dist.TCPStore(
                    host, int(port), is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False
                ),
            )
        return lambda: dist.PrefixStore(prefix, self.store)

    def _train(self, dist) -> int:
        from pipec.runtime.exec.microbatch import batch_of
        from pipec.runtime.host.affinity import describe
        from pipec.runtime.job.report import CheckStats, Report, StepRecord, header
        from pipec.runtime.reference import Reference, compare, rel_err

        torch, args, runner, m = self.torch, self.args, self.runner, self.model
        reference = None
        if args.check:
            reference = Reference(
                m.build_stage,
                m.loss_fn,
                self.program.num_stages,
                self.program.num_sequences,
                optimizer=m.optimizer,
                dtype=m.dtype,
                device=self.device,
                loss_scale=args.loss_scale,
                seed=args.seed,
                replicas=self.program.dp,
                graph=getattr(self.program, "graph", None),
            )
            checks = CheckStats()
        report = Report(args.records if self.rank == 0 else None)
        show = report.line
        needs_batch = runner.has_first or runner.has_last or reference is not None
        if args.memory_out:
            runner.executor.measure_memory()
        start = self._resume(dist, reference)
        if self.rank == 0:
            how = f"{args.backend}, {self.world} processes"
            if self.program.dp > 1:
                unit = f" per {args.dp_unit}" if self.program.dp_kind == "fsdp" else ""
                how += f" ({self.program.num_ranks} ranks x {self.program.dp} {self.program.dp_kind} replicas{unit})"
            if args.ep > 1:
                pairs = "one op after the other" if args.no_overlap else "overlapped"
                how += f", experts over groups of {args.ep} replicas (pairs {pairs})"
            if args.compile or args.cuda_graphs:
                how += ", stages through torch.compile" + (" with CUDA graphs" if args.cuda_graphs else "")
            show(header(self.program, how, m.path))
            binding = describe(self.cpus, self.local_world, args.cpu_bind, args.backend)
            if binding:
                show(binding)
            show(f"malloc: {keep_freed_memory()}")
            if getattr(runner.executor.comm, "links", None) is not None:
                show(runner.executor.comm.links.describe())
        if self.rank == 0 and self.restored is not None:
            for line in self.restored.skipped:
                show(line)
        if self.rank == 0 and start:
            if start >= args.steps:
                show(f"{self.restored.path} is after step {start}: nothing left to run for --steps {args.steps}")
            else:
                show(f"resumed from {self.restored.path}: steps {start + 1} to {args.steps}")
        for step in range(start, args.steps):
            x, y = batch_of(m.batch(step), f"{m.path}: batch({step})") if needs_batch else (None, None)
            res = runner.step(x, y, record=bool(args.trace) and step == args.steps - 1)
            errs = [0.0, 0.0, 0.0]
            if reference is not None:
                ref_loss = reference.step(x, y)
                g = compare(runner.named_gradients(), reference.named_gradients())
                p = compare(runner.named_parameters(), reference.named_parameters())
                le = rel_err(res.loss, ref_loss) if res.loss is not None else 0.0
                checks.add(le, g, p)
                errs = [le, max(g.values(), default=0.0), max(p.values(), default=0.0)]
            loss = res.loss if res.loss is not None else float("-inf")
            stats = torch.tensor([res.seconds, loss, *errs], dtype=torch.float64, device=self.device)
            what = "the step's statistics (an all-reduce over the job)"
            self._job_wide(what, dist.all_reduce, stats, dist.ReduceOp.MAX)
            s = stats.tolist()
            if self.rank == 0:
                report.step(StepRecord.of(step, args.steps, s[1], s[0], tuple(s[2:]) if reference else None))
            self._maybe_save(dist, step + 1)
        self._buffers(show)
        if args.memory_out:
            from pipec.runtime.exec.saved import publish_peaks

            publish_peaks(self.store, self.rank, self.world, runner.executor.peaks, args.memory_out, args.timeout)
        code = 0
        if reference is not None:
            self.store.set(f"pipec/check/{self.rank}", checks.to_json())
            if self.rank == 0:
                for r in range(1, self.world):
                    checks.merge_json(self.store.get(f"pipec/check/{r}").decode())
                tol = args.tol if args.tol is not None else default_tol(runner)
                show("\n".join(checks.lines(tol, args.steps)))
                code = 0 if checks.worst() <= tol else 1
        if args.trace:
            import json

            self.store.set(f"pipec/trace/{self.rank}", json.dumps(runner.events()))
            if self.rank == 0:
                from pipec.formats.trace import write_trace
                from pipec.runtime.exec.measure import timeline

                # the pipeline of replica 0 (global ranks 0, dp, 2 dp, ...: pipec.runtime.exec.replicas)
                ranks = range(0, self.world, self.program.dp)
                events = [json.loads(self.store.get(f"pipec/trace/{r}").decode()) for r in ranks]
                write_trace(timeline(self.program, events), args.trace)
                show(f"wrote the measured timeline of step {args.steps} to {args.trace}")
        return code

    def _buffers(self, show) -> None:
        """Each rank's receive buffers per step (pipec.runtime.exec.buffers) and, with CUDA graphs, the replays:
        published under the store, shown by rank 0 (report.buffer_lines)."""
        import json

        from pipec.runtime.job.report import buffer_lines

        ex = self.runner.executor
        doc = {"made": ex.made, "how": ex.slots.describe() if ex.slots is not None else "no receives"}
        if self.args.cuda_graphs:
            from pipec.runtime.exec.compiled import replays

            doc["replays"] = replays()
        self.store.set(f"pipec/buffers/{self.rank}", json.dumps(doc))
        if self.rank == 0:
            docs = [json.loads(self.store.get(f"pipec/buffers/{r}").decode()) for r in range(self.world)]
            for line in buffer_lines(docs):
                show(line)

    def _resume(self, dist, reference) -> int:
        """With --checkpoint, check its folder before any step, and with --resume load the newest checkpoint
        that verifies; the step to start at (0 without one). The --check reference is brought to the same
        step by running it over the steps already done."""
        self.restored = None
        args = self.args
        if not args.checkpoint:
            return 0
        from pipec.runtime.exec.microbatch import batch_of
        from pipec.runtime.job.checkpoint import prepare

        # until: a run that saves nothing (a resume with no step left) may read a read-only folder
        start = prepare(args.checkpoint, self.runner, args.resume, until=args.steps)
        self.run_id, self.restored = start.run, start.restored
        if self.restored is None:
            return 0
        if reference is not None:
            for step in range(self.restored.step):
                reference.step(*batch_of(self.model.batch(step)))
        return self.restored.step

    def _job_wide(self, what: str, collective, *args):
        """A collective of every rank outside the Program (the step's statistics; a checkpoint's save,
        whose barriers are collectives). When it fails, the rank whose heartbeat has
        stopped is the culprit (PeerLostError): a survivor says it lost that peer, and never reports the
        transport's error as its own failure. Without a silent rank the error is this rank's own."""
        from pipec.runtime.errors import PeerLostError, PipelineError

        try:
            return collective(*args)
        except Exception as e:
            silent = [] if self.monitor is None or self.monitor.recorded() else self.monitor.silent_ranks()
            if not silent:
                if self.monitor is not None and not isinstance(e, PipelineError):
                    # a live peer that failed (a full disk at its save) is recording why: its report first
                    self.monitor.await_record(min(float(self.args.timeout), 2.0))
                raise
            raise PeerLostError(f"{what} failed: {type(e).__name__}: {str(e).splitlines()[0]}", silent[0]) from e

    def _maybe_save(self, dist, steps_done: int) -> None:
        args = self.args
        if not args.checkpoint:
            return
        every = args.checkpoint_every
        if steps_done != args.steps and not (every and steps_done % every == 0):
            return
        from pipec.runtime.job.checkpoint import save
        from pipec.runtime.job.report import Report

        path = self._job_wide("saving the checkpoint", save, args.checkpoint, self.runner, steps_done, self.run_id)
        if self.rank == 0:
            Report(args.records).line(f"checkpoint: {path}")


def backend_threads() -> list[str]:
    """The threads of torch.distributed's backends still running in this process, by name (Linux)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    names = []
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # it ended meanwhile
            pass
    return [n for n in names if n.startswith(("pt_gloo", "gloo_", "pt_nccl"))]


def default_tol(runner) -> float:
    import torch

    # the modules' own parameters: named_parameters gathers shards, a collective rank 0 cannot call alone
    dtypes = {p.dtype for st in runner.stages.values() for p in st.module.parameters()}
    return 1e-10 if dtypes <= {torch.float64} else 1e-4


if __name__ == "__main__":
    sys.exit(main())
