"""`pipec profile`: measure a model's per-stage costs on this machine and write the simulator's cost file.

    pipec profile 1f1b -D p=2 -D m=8 --model examples/mlp.py -o mlp.toml
    pipec simulate 1f1b -D p=2 -D m=8 --cost mlp.toml

Every stage of the schedule (its number of stages, its micro-batches) is built as the runtime builds it
(same seeds, dtype, device), in one process per rank timing at once on CPUs (a run's ranks share the
machine: alone, ops ran 1 to 13% faster), else in this process, and run through the runtime's own `Stage`
code on the micro-batches of `batch(0)`: the forward pass (`F`, with the loss on the last stage), the full backward,
and the split backward, input gradient (`BWD`) then weight gradient (`WGRAD`). Gradients accumulate over
m micro-batches between optimizer steps, as in a run. Each is timed `reps` times after `warmup` rounds;
the medians go into the file. Message sizes come from the tensors stages pass on: `act_bytes[s]` what
stage s sends forward, `grad_bytes[s]` the input gradient it sends back. With `comm`, two processes time
messages of the largest size over the backend (gloo ping-pong) and the file gets a link `latency` and
`bandwidth`, and the `overhead`: a rank's own time per send or receive instruction in the runtime's
executor, measured as the simulator charges it (pipec.runtime.profile.overhead). With `in_situ`, F, B, W and the
overhead come instead from steps of the schedule itself on its gloo processes (pipec.runtime.profile.insitu).

What the cost file says depends on the schedule: with split backward, `B` and `W` are the input- and
weight-gradient passes as the runtime runs them (the first stage's B is ~0: it needs no input gradient,
its W is its whole backward); without, `B` is the full backward and `W` is left out (the cost model then
takes B as the full backward). Every measurement, including the optimizer step (which the simulator
does not model), is also kept in the `[measured.*]` tables.

With `slices` N (`pipec profile --slices N`, docs/terapipe.md), each stage is also timed on token slices
(`measure_slices`): slices of whole N-ths of the sequence at every context that leaves room for them, through
the stage module's key/value cache interface (pipec.runtime.exec.slices; without one, prefixes of the sequence
at context 0), and the cost keys `attn` and `op_fixed` of `Slicing.weight` are fitted to them by least
squares; the fit's residual goes into `[measured.slices]`.

Threads: by default torch uses the number `pipec run` gives each of its processes (OMP_NUM_THREADS, or
the CPUs divided by the ranks), so the times are those of a rank in a run on this machine.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pipec.ir.opcodes import REDUCE_GRAD, UNSHARD
from pipec.ir.program import BWD, FWD, WGRAD, Program
from pipec.runtime.errors import PipelineError
from pipec.runtime.exec.microbatch import as_args, batch_of, split, to_device
from pipec.runtime.exec.saved import Pool, state_bytes, tensor_bytes
from pipec.runtime.exec.stage import Stage
from pipec.runtime.job.affinity import allowed_cpus, bind_local_rank
from pipec.runtime.model.contract import Model, build_stage_module, default_optimizer


@dataclass
class Profile:
    """Per-stage medians (seconds) and message sizes (bytes), and how they were measured."""

    schedule: str
    params: tuple[tuple[str, int], ...]
    split_backward: bool
    forward: list[float]
    full_backward: list[float]
    input_backward: list[float]
    weight_backward: list[float]
    optimizer_step: list[float]
    act_bytes: list[int]
    grad_bytes: list[int]
    info: dict[str, Any] = field(default_factory=dict)
    latency: float | None = None  # one-way time of a small message, seconds
    overhead: float | None = None  # a rank's time per send or receive instruction, seconds (LogP's o)
    bandwidth: float | None = None  # bits per second, beyond the latency; None: not measured or unmeasurable
    in_situ: dict | None = None  # pipec.runtime.profile.insitu's result: the ops as the schedule runs them
    # bytes of each stage's parameters (what its data-parallel collectives move, unsharded)
    param_bytes: list[int] = field(default_factory=list)
    collectives: Collectives | None = None  # the data-parallel group's collectives (`dp` > 1)
    # per stage, from `stage_bytes`: saved_bytes, wsaved_bytes, input_bytes, state_bytes, offload (seconds)
    memory: dict[str, list] = field(default_factory=dict)
    slices: SliceFit | None = None  # `measure_slices`: the (length, context) grid and the fit of attn, op_fixed

    def cost_doc(self) -> dict:
        """The cost file's document (for `pipec.sim.cost_files.dump_costs`)."""
        params = " ".join(f"{k}={v}" for k, v in self.params)
        doc: dict[str, Any] = {
            "comment": (
                f"measured by pipec profile: {self.schedule} ({params}), model {self.info.get('model')}, "
                f"{self.info.get('dtype')} on {self.info.get('device')}, {self.info.get('threads')} thread(s), "
                f"medians of {self.info.get('reps')} runs"
            ),
            "unit": "s",
            "schedule": self.schedule,
            "params": params,
        }
        F, B, W = self.forward, self.input_backward if self.split_backward else self.full_backward, self.weight_backward
        if self.in_situ is not None:  # the ops as they ran in the schedule
            F, B, W = (self.situ(op) for op in (FWD, BWD, WGRAD))
            doc["comment"] += f"; F, B, W and overhead in situ, medians over {self.in_situ['steps']} steps"
        doc["F"] = _r(F)
        doc["B"] = _r(B)  # without split backward, B without W: the cost model's full backward
        if self.split_backward:
            doc["W"] = _r(W)
        doc["act_bytes"] = list(self.act_bytes)
        doc["grad_bytes"] = list(self.grad_bytes)
        for key in ("saved_bytes", "wsaved_bytes", "input_bytes", "state_bytes"):
            if key in self.memory and (key != "wsaved_bytes" or self.split_backward):
                doc[key] = list(self.memory[key])
        if "offload" in self.memory:
            doc["offload"] = _r(self.memory["offload"])
        if self.latency is not None:
            doc["latency"] = round(self.latency, 9)
        if self.bandwidth is not None:
            doc["bandwidth"] = float(f"{self.bandwidth:.6g}")
        if self.overhead is not None:
            doc["overhead"] = round(self.overhead, 9)
        if self.in_situ is not None and self.in_situ.get("step"):  # the schedule's own STEPs
            doc["step"] = _r([self.in_situ["step"].get(s, 0.0) for s in range(len(self.forward))])
        if self.in_situ is not None and self.in_situ.get("outside_s") is not None:
            doc["step_overhead"] = float(f"{self.in_situ['outside_s']:.6g}")
        if self.slices is not None:
            fitted = f"{len(self.slices.points)} token slices ({self.slices.how})"
            doc["comment"] += f"; attn and op_fixed fitted to {fitted}"
            doc["attn"] = _r(self.slices.attn)
            doc["op_fixed"] = _r(self.slices.op_fixed)
        if self.collectives is not None:
            doc["comment"] += f"; collectives on a data-parallel group of {self.collectives.size}"
            doc.update(self.collectives.cost_keys(self.param_bytes))
            # timed on gloo, where FSDP2's reduce-scatter, all-reduce and all-gather are blocking calls
            doc["dp_blocking"] = 1
        doc["measured"] = {
            "stages": {
                "forward": _r(self.forward),
                "full_backward": _r(self.full_backward),
                "input_backward": _r(self.input_backward),
                "weight_backward": _r(self.weight_backward),
                "optimizer_step": _r(self.optimizer_step),
            },
            "run": {k: v for k, v in self.info.items() if v is not None},
        }
        if self.collectives is not None:
            doc["measured"]["collectives"] = self.collectives.measured()
        if self.slices is not None:
            doc["measured"]["slices"] = self.slices.measured()
        if self.in_situ is not None:
            doc["measured"]["in_situ"] = {
                "forward": _r(self.situ(FWD)),
                "backward": _r(self.situ(BWD)),
                **({"weight_backward": _r(self.situ(WGRAD))} if self.split_backward else {}),
                "step": float(f"{self.in_situ['step_s']:.6g}"),
                "steps": self.in_situ["steps"],
            }
            mean = self.in_situ.get("ops_mean") or {}
            if mean:  # the means of replica 0's ops (the cost keys are their medians)
                for name, code in (("forward", FWD), ("backward", BWD), ("weight_backward", WGRAD)):
                    if code != WGRAD or self.split_backward:
                        per = [mean.get((code, s), 0.0) for s in range(len(self.forward))]
                        doc["measured"]["in_situ"][f"{name}_mean"] = _r(per)
            by_replica = self.in_situ.get("ops_by_replica") or []
            if len(by_replica) > 1:  # each replica's own F, B (and W): replica 0's are the cost keys
                for name, code in (("forward", FWD), ("backward", BWD), ("weight_backward", WGRAD)):
                    if code != WGRAD or self.split_backward:
                        per = [[ops.get((code, s), 0.0) for s in range(len(self.forward))] for ops in by_replica]
                        doc["measured"]["in_situ"][f"{name}_by_replica"] = [_r(x) for x in per]
            coll = self.in_situ.get("collectives") or {}
            for name, code in (("reduce_grad", REDUCE_GRAD), ("unshard", UNSHARD)):
                if any(op == code for op, _ in coll):  # as the ranks spent them in the schedule
                    per = [coll.get((code, s), 0.0) for s in range(len(self.forward))]
                    doc["measured"]["in_situ"][name] = _r(per)
        return doc

    def situ(self, op: int) -> list[float]:
        """Per stage, the in-situ median of an op (0.0 where the schedule never ran it)."""
        assert self.in_situ is not None
        return [self.in_situ["ops"].get((op, s), 0.0) for s in range(len(self.forward))]


def _r(xs: list[float]) -> list[float]:
    return [float(f"{x:.6g}") for x in xs]


def _nbytes(tensors: tuple[torch.Tensor, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def profile(
    program: Program,
    model: Model,
    *,
    reps: int = 20,
    warmup: int = 3,
    threads: int | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
    loss_scale: float | None = None,
    comm: bool = True,
    backend: str = "gloo",
    in_situ: bool = False,
    progress: Callable[[str], None] | None = None,
    concurrent: bool | None = None,
    dp: int | None = None,
    dp_kind: str | None = None,
    slices: int | None = None,
) -> Profile:
    """Measure every stage of `program` on `model` (see the module's docstring); with `in_situ`, also run
    the schedule on its ranks' processes and take F, B, W and the overhead from that (pipec.runtime.profile.insitu).
    `progress` is told what is being measured, as each part starts. `concurrent` (default: on CPUs, with
    more than one rank and a CPU for each) times the ops in one process per rank at once, each bound to its
    CPUs as a run's rank is, and keeps each stage's times from the process of the rank that owns it;
    otherwise they are timed in this process alone (each process times every stage, so with more ranks
    than CPUs the concurrent profile would take ranks / CPUs times as long). `dp` and `dp_kind` (default:
    the Program's own, `program.dp` and `program.dp_kind`): with `dp` > 1 and `comm`, the collectives of a
    data-parallel group of `dp` processes are timed too (`measure_collectives`), and the file gets the
    ring model's `dp_latency` and `dp_bandwidth`, each stage's `param_bytes`, and its measured
    `reduce_grad` (and, for fsdp, `unshard`) times. With `slices` N, the stages are also timed on token
    slices of N-ths of the sequence (`measure_slices`) and the file gets the fitted `attn` and `op_fixed`."""
    say = progress or (lambda _: None)
    if slices is not None and slices < 2:
        raise PipelineError(f"--slices {slices}: time slices of at least halves of the sequence (2 or more)")
    dp = program.dp if dp is None else dp
    dp_kind = program.dp_kind if dp_kind is None else dp_kind
    if dp < 1 or dp_kind not in DP_KINDS:
        raise PipelineError(f"data parallelism: dp must be at least 1 and dp_kind one of {', '.join(DP_KINDS)}")
    if reps < 1 or warmup < 0:
        raise ValueError("reps must be at least 1 and warmup at least 0")
    device = torch.device(device)
    if in_situ and (device.type != "cpu" or backend != "gloo"):
        raise PipelineError("--in-situ runs the schedule on gloo processes on this machine's CPUs only")
    if in_situ and dp != program.dp:
        raise PipelineError(
            f"--in-situ runs the Program as compiled (dp = {program.dp}); compile it for dp = {dp} to profile that"
        )
    procs = program.num_ranks * dp  # the processes of a run: every rank of every replica
    if concurrent is None:  # as `pipec run --cpu-bind auto` binds: when every rank can have its own CPU
        cpus = allowed_cpus()
        # With replicas, always: the run's p x dp processes share the CPUs, so its ops take that long.
        concurrent = device.type == "cpu" and 1 < procs and (procs <= len(cpus or []) or dp > 1)
    elif concurrent and device.type != "cpu":
        raise PipelineError("concurrent timing is for ranks sharing this machine's CPUs; on GPUs each has its own")
    threads = threads or default_threads(procs)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if concurrent:
            say(f"timing each op of {program.num_stages} stages in {procs} processes at once, {warmup} + {reps} rounds")
            prof = _measure_concurrently(program, model.path, reps, warmup, threads, seed, loss_scale, dp)
        else:
            say(f"timing each op of {program.num_stages} stages alone, {warmup} + {reps} rounds")
            prof = _measure(program, model, reps, warmup, device, seed, loss_scale, dp)
    finally:
        torch.set_num_threads(old_threads)
    prof.info.update(
        model=model.path,
        dtype=str(next(iter(prof.info.pop("dtypes")), "none")),
        device=str(device),
        threads=threads,
        reps=reps,
        warmup=warmup,
        timing=f"{procs} processes at once, one per rank{' of each replica' if dp > 1 else ''}"
        if concurrent
        else "one process",
        **({"replica_rows": f"1/{dp} of batch(0) per replica, as a run's replicas split it"} if dp > 1 else {}),
        host=os.uname().nodename,
        when=time.strftime("%Y-%m-%d %H:%M:%S"),
        loadavg_1min=round(os.getloadavg()[0], 2),
    )
    prof.memory = stage_bytes(program, model, device=device, seed=seed, loss_scale=loss_scale, dp=dp)
    if slices is not None:
        torch.set_num_threads(threads)
        try:
            prof.slices = measure_slices(
                program, model, slices, reps=reps, warmup=warmup, device=device, seed=seed, progress=say
            )
        finally:
            torch.set_num_threads(old_threads)
    if comm and program.num_ranks > 1:
        sizes = sorted({b for b in prof.act_bytes + prof.grad_bytes if b > 0})
        if device.type == "cpu" and backend == "gloo":
            say("timing the gloo link and the executor's overhead on 2 processes")
            gap = min(max(statistics.median(prof.forward), 1e-4), 5e-3)
            prof.latency, prof.bandwidth, prof.overhead = measure_link(
                max(sizes, default=0), reps=max(reps, 20), gap=gap
            )
            prof.info["link"] = "gloo ping-pong between two local processes"
        else:
            prof.info["link"] = f"not measured ({backend} on {device.type}: profile measures gloo on CPU only)"
    if in_situ:
        from pipec.runtime.profile.insitu import profile_in_situ

        say(f"running {warmup} + {reps} steps of {program.name} on {program.num_ranks} gloo processes (--in-situ)")
        prof.in_situ = profile_in_situ(
            program, model.path, reps=reps, warmup=warmup, threads=threads, seed=seed, loss_scale=loss_scale
        )
        if prof.in_situ["overhead"] is not None:
            if prof.overhead is not None:  # the stand-in GPipe's, kept in [measured.run]
                prof.info["link_overhead"] = round(prof.overhead, 9)
            prof.overhead = prof.in_situ["overhead"]
    if comm and dp > 1:
        if device.type != "cpu" or backend != "gloo":
            prof.info["collectives"] = f"not measured ({backend} on {device.type}: profile measures gloo on CPU only)"
        else:
            say(f"timing all-reduce, all-gather and reduce-scatter on a data-parallel group of {dp} gloo processes")
            dtype = getattr(torch, prof.info["dtype"], None)  # the parameters' dtype: gloo reduces it
            prof.collectives = measure_collectives(
                dp,
                kind=dp_kind,
                stage_bytes=prof.param_bytes,
                reps=max(reps, 3),
                warmup=max(warmup, 1),
                dtype=dtype if isinstance(dtype, torch.dtype) else torch.float32,
                world=program.num_ranks * dp,
            )
            prof.info["collectives"] = prof.collectives.how
    return prof


def stage_bytes(
    program: Program,
    model: Model,
    *,
    device: str | torch.device = "cpu",
    seed: int = 0,
    loss_scale: float | None = None,
    dp: int = 1,
    reps: int = 5,
) -> dict[str, list]:
    """Per stage, in bytes, through the runtime's own `Stage` and saved-tensor holders (pipec.runtime.exec.saved)
    on micro-batch 0 of `batch(0)`: `saved_bytes`, what its FWD keeps for its BWD; `wsaved_bytes`, what its
    BWD keeps for its WGRAD (split backward: the graph stays whole until WGRAD, so about all of it);
    `input_bytes`, what a recomputed FWD keeps (its input; the first stage's is the step's data, held
    anyway: 0); `state_bytes`, its parameters, their gradients and the optimizer's state after a step of
    the model file's optimizer. And `offload`: the seconds of one OFFLOAD or RELOAD of its saved tensors as
    the runtime runs them (median of `reps`; on a CPU device nothing is copied, so microseconds)."""
    device = torch.device(device)
    S, m = program.num_stages, program.num_sequences  # with token slices, each a whole sequence
    scale = 1.0 / m if loss_scale is None else loss_scale
    modules = _stage_modules(model, S, seed, device)
    make_opt = model.optimizer or default_optimizer
    inputs, targets = batch_of(model.batch(0), f"{model.path}: batch(0)")
    if dp > 1:
        from pipec.runtime.exec.replicas import slice_replica

        inputs, targets = slice_replica(inputs, dp, 0, "inputs"), slice_replica(targets, dp, 0, "targets")
    x = as_args(to_device(split(inputs, m, "inputs")[0], device, model.dtype))
    y = to_device(split(targets, m, "targets")[0], device)
    out: dict[str, list] = {k: [0] * S for k in ("saved_bytes", "wsaved_bytes", "input_bytes", "state_bytes")}
    out["offload"] = [0.0] * S
    for split_backward in (False, True) if program.split_backward else (False,):
        pool = Pool()
        stages = []
        for s, mod in enumerate(modules):
            st = Stage(s, S, mod, model.loss_fn if s == S - 1 else None, scale, split_backward, None)
            st.pool = pool
            stages.append(st)
        args = x
        for s, st in enumerate(stages):
            if s > 0:
                out["input_bytes"][s] = tensor_bytes(args)
            args = st.forward(0, args, y if s == S - 1 else None)
            out["saved_bytes"][s] = pool.held(0, s)
        grads = None
        for s in reversed(range(S)):
            if not split_backward:
                seconds = []
                for _ in range(reps):  # as the runtime runs them: on CPU, the accounting only
                    t0 = time.perf_counter()
                    pool.offload(0, s)
                    pool.reload(0, s)
                    pool.ready(0, s)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    seconds.append((time.perf_counter() - t0) / 2)
                out["offload"][s] = statistics.median(seconds)
            grads = stages[s].backward(0, grads)
            if split_backward:
                out["wsaved_bytes"][s] = pool.held(0, s)
        for s in reversed(range(S)) if split_backward else ():
            stages[s].wgrad(0)
        if not split_backward:
            for s, (st, mod) in enumerate(zip(stages, modules)):
                params = [p for p in mod.parameters() if p.requires_grad]
                opt = make_opt(params) if params else None
                if opt is not None:
                    opt.step()
                out["state_bytes"][s] = state_bytes(mod, opt)
                st.zero_grad()
    return out


def default_threads(ranks: int) -> int:
    """What `pipec run` gives each process: OMP_NUM_THREADS, or the CPUs divided by the ranks."""
    env = os.environ.get("OMP_NUM_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, (os.cpu_count() or 1) // max(1, ranks))


def _stage_modules(model: Model, S: int, seed: int, device: torch.device) -> list[torch.nn.Module]:
    """Every stage's module as a run builds it (seeded by (seed, stage))."""
    return [
        build_stage_module(model.build_stage, s, S, seed=seed, dtype=model.dtype, device=device, where="build_stage")
        for s in range(S)
    ]


def _measure(
    program: Program, model: Model, reps: int, warmup: int, device: torch.device, seed: int, loss_scale, dp: int = 1
) -> Profile:
    """Time every stage's ops on the micro-batches of `batch(0)` (with `dp` replicas, of replica 0's share
    of it, as a run's replicas split the global batch: pipec.runtime.exec.replicas.slice_replica); with
    token slices, on whole sequences (what the cost model's F, B and W are given for)."""
    S, m = program.num_stages, program.num_sequences
    scale = 1.0 / m if loss_scale is None else loss_scale
    modules = _stage_modules(model, S, seed, device)
    make_opt = model.optimizer or default_optimizer
    opts = []
    for mod in modules:
        params = [p for p in mod.parameters() if p.requires_grad]
        opts.append(make_opt(params) if params else None)

    def stages(split_backward: bool) -> list[Stage]:
        return [
            Stage(s, S, mod, model.loss_fn if s == S - 1 else None, scale, split_backward, None)
            for s, mod in enumerate(modules)
        ]

    full, split_ = stages(False), stages(True)
    inputs, targets = batch_of(model.batch(0), f"{model.path}: batch(0)")
    if dp > 1:
        from pipec.runtime.exec.replicas import slice_replica

        inputs, targets = slice_replica(inputs, dp, 0, "inputs"), slice_replica(targets, dp, 0, "targets")
    mb_in = [as_args(to_device(x, device, model.dtype)) for x in split(inputs, m, "inputs")]
    mb_tg = [to_device(t, device) for t in split(targets, m, "targets")]
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def clock() -> float:
        sync()
        return time.perf_counter()

    times: dict[str, list[list[float]]] = {k: [[] for _ in range(S)] for k in ("F", "full", "B", "W", "step")}
    act = [[] for _ in range(S)]
    grad = [[] for _ in range(S)]

    def timed(kind: str, s: int, keep: bool, fn, *args):
        """fn(*args), its time kept under times[kind][s] when `keep`."""
        t0 = clock()
        out = fn(*args)
        t1 = clock()
        if keep:
            times[kind][s].append(t1 - t0)
        return out

    def forward(sts: list[Stage], mb: int, keep: bool) -> None:
        args = mb_in[mb]
        for s, st in enumerate(sts):
            out = timed("F", s, keep, st.forward, mb, args, mb_tg[mb] if s == S - 1 else None)
            if keep and s < S - 1:
                act[s].append(_nbytes(out))
            args = out

    for rep in range(warmup + reps):
        keep = rep >= warmup
        mb = rep % m
        # the full backward
        forward(full, mb, keep)
        grads = None
        for s in reversed(range(S)):
            grads = timed("full", s, keep, full[s].backward, mb, grads)
            if keep and s > 0:
                grad[s].append(_nbytes(grads))
        # Gradients accumulate over a step's m micro-batches, as in a run: zeroing them after every
        # micro-batch would make each backward allocate fresh gradient tensors (page faults included),
        # which a run does once per step. The optimizer step runs at the end of each step.
        end_of_step = mb == m - 1 or rep == warmup + reps - 1
        if end_of_step:
            for s, opt in enumerate(opts):
                if opt is not None:
                    timed("step", s, keep or not times["step"][s], opt.step)
            for st in full:
                st.zero_grad()
        # the split backward: every BWD, then every WGRAD (as a zero-bubble schedule orders them)
        forward(split_, mb, keep)
        grads = None
        for s in reversed(range(S)):
            grads = timed("B", s, keep, split_[s].backward, mb, grads)
        for s in reversed(range(S)):
            timed("W", s, keep, split_[s].wgrad, mb)
        if end_of_step:
            for st in split_:
                st.zero_grad()

    med = {k: [statistics.median(v) if v else 0.0 for v in per] for k, per in times.items()}
    mean_bytes = lambda xs: round(statistics.fmean(xs)) if xs else 0  # noqa: E731
    dtypes = {p.dtype for mod in modules for p in mod.parameters()} or {model.dtype}
    param_bytes = [sum(p.numel() * p.element_size() for p in mod.parameters()) for mod in modules]
    return Profile(
        schedule=program.name,
        params=tuple(program.params),
        split_backward=program.split_backward,
        forward=med["F"],
        full_backward=med["full"],
        input_backward=med["B"],
        weight_backward=med["W"],
        optimizer_step=med["step"],
        act_bytes=[mean_bytes(a) for a in act],
        grad_bytes=[mean_bytes(g) for g in grad],
        info={"dtypes": sorted(str(d).removeprefix("torch.") for d in dtypes if d is not None)},
        param_bytes=param_bytes,
    )


def _measure_concurrently(
    program: Program, model_path: str, reps: int, warmup: int, threads: int, seed: int, loss_scale, dp: int = 1
) -> Profile:
    """`_measure` in one process per rank at once (a run's ranks share this machine's caches, memory
    bandwidth and, beyond one per CPU, its CPUs), each bound as `pipec run` binds its ranks; stage s's
    times are those measured by the process of its rank. With `dp` replicas, one process per rank of every
    replica (process r * dp + d: rank r of replica d, as the ("pp", "dp") mesh numbers them), each on its
    replica's share of the batch; the times are replica 0's."""
    from pipec.formats.program_file import to_json
    from pipec.runtime.job import spawned

    spec = dict(program=to_json(program), model=model_path, reps=reps, warmup=warmup, threads=threads)
    spec.update(seed=seed, loss_scale=loss_scale, dp=dp)
    procs = program.num_ranks * dp
    per_rank = spawned.run(_timing_rank, procs, procs, spec, timeout=3600, barrier=True)
    if isinstance(per_rank, str):
        raise PipelineError(f"timing the ops of {program.name} failed: {per_rank}")
    return merge_by_owner(per_rank[::dp], program.placement)


def merge_by_owner(per_rank: list[Profile], placement: tuple[int, ...]) -> Profile:
    """One Profile from one per rank: each stage's times from its owner's (the rest from rank 0's)."""
    merged = dataclasses.replace(per_rank[0])
    for name in ("forward", "full_backward", "input_backward", "weight_backward", "optimizer_step"):
        setattr(merged, name, [getattr(per_rank[r], name)[s] for s, r in enumerate(placement)])
    return merged


def _timing_rank(rank: int, world: int, spec: dict, barrier, out) -> None:
    from pipec.formats.program_file import from_json
    from pipec.runtime.job import spawned
    from pipec.runtime.model.contract import load_model

    bind_local_rank("auto", "gloo", rank, world)  # every thread of this process, and those torch starts later
    torch.set_num_threads(spec["threads"])
    try:
        program, model = from_json(spec["program"]), load_model(spec["model"])
        barrier.wait(timeout=600)  # every rank starts timing at once
        prof = _measure(
            program,
            model,
            spec["reps"],
            spec["warmup"],
            torch.device("cpu"),
            spec["seed"],
            spec["loss_scale"],
            spec.get("dp", 1),
        )
        out.put(("result", rank, prof))
    except Exception as e:  # noqa: BLE001 - reported by the parent, which names the profile
        if not isinstance(e, PipelineError):  # the model's own code: where it failed
            import traceback

            traceback.print_exc()
        spawned.failed(out, rank, rank, f"rank {rank}: {type(e).__name__}: {e}")


# ---- token slices: F and backward per (length, context), and the fit of attn and op_fixed ----------------


@dataclass
class SliceFit:
    """Per stage, the medians of F plus the full backward of token slices (`points`: (length, context)
    pairs of a sequence of `seqlen` tokens), and the least-squares fit of the cost model's slice time
    (`Slicing.weight`): t(l, c) = f + u l / L + v l (2c + l + 1) / (L (L + 1)), so attn = v / (u + v) and
    op_fixed = f / 2 (a slice runs two ops, F and its backward). `residual` is the fit's root-mean-square
    relative error per stage, `worst` its largest; `how` says whether the contexts were real
    (the key/value cache interface) or prefixes at context 0."""

    seqlen: int
    points: list[tuple[int, int]]
    forward: list[list[float]]
    backward: list[list[float]]
    attn: list[float]
    op_fixed: list[float]
    residual: list[float]
    worst: list[float]
    how: str

    def measured(self) -> dict[str, Any]:
        return {
            "how": self.how,
            "seqlen": self.seqlen,
            "lengths": [n for n, _ in self.points],
            "contexts": [c for _, c in self.points],
            "forward": [_r(x) for x in self.forward],
            "backward": [_r(x) for x in self.backward],
            "fit_residual": _r(self.residual),
            "fit_worst": _r(self.worst),
        }


SHORTEST = 4  # tokens: the shortest slice `slice_points` adds below the n-ths


def slice_points(seqlen: int, n: int, contexts: bool = True) -> list[tuple[int, int]]:
    """(length, context) of every slice between boundaries at whole n-ths of the sequence (rounded down);
    without `contexts`, the prefixes only (context 0). Then slices shorter than an n-th, halving down to
    `SHORTEST` tokens, at context 0 and (with `contexts`) at the end of the sequence. Why: what an op costs
    whatever its length (`op_fixed`) is the fit's intercept, which slices of n-ths alone leave to an
    extrapolation from long slices; the dynamic program of `pipec slice` picks among short slices exactly
    where that intercept decides (a measured 114-slice cut ran 2.9x slower than unsliced while fitted
    without them, docs/terapipe.md)."""
    edges = sorted({seqlen * k // n for k in range(n + 1)})
    points = [(b - a, a) for ia, a in enumerate(edges) for b in edges[ia + 1 :] if contexts or a == 0]
    length = (seqlen // n) // 2
    while length >= SHORTEST:
        points += [(length, 0)] + ([(length, seqlen - length)] if contexts else [])
        length //= 2
    return points


def fit_slices(seqlen: int, points: list[tuple[int, int]], times: list[float]) -> tuple[float, float, float, float]:
    """(attn, op_fixed, rms relative residual, worst relative residual) of the least-squares fit, on
    relative errors, of one stage's slice times (F plus backward: two ops) to the cost model's form (see SliceFit)."""
    import numpy as np

    L = float(seqlen)
    l = np.array([p[0] for p in points], dtype=float)  # noqa: E741
    c = np.array([p[1] for p in points], dtype=float)
    X = np.stack([np.ones_like(l), l / L, l * (2 * c + l + 1) / (L * (L + 1))], axis=1)
    y = np.asarray(times, dtype=float)
    # relative errors, so that the short slices, which fix the intercept, weigh as much as the long ones
    scale = 1.0 / np.where(y > 0, y, 1.0)
    (f, u, v), *_ = np.linalg.lstsq(X * scale[:, None], y * scale, rcond=None)
    rel = (X @ np.array([f, u, v]) - y) * scale
    u, v = max(u, 0.0), max(v, 0.0)
    attn = v / (u + v) if u + v > 0 else 0.0
    return float(attn), max(float(f), 0.0) / 2, float(np.sqrt(np.mean(rel**2))), float(np.abs(rel).max())


def measure_slices(
    program: Program,
    model: Model,
    n: int,
    *,
    reps: int = 20,
    warmup: int = 3,
    device: str | torch.device = "cpu",
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> SliceFit:
    """Time F and the full backward of every stage on token slices of micro-batch 0 of `batch(0)` (its
    dim 1, the tokens, cut at whole n-ths: `slice_points`), and fit `attn` and `op_fixed` per stage.

    With the key/value cache interface (pipec.runtime.exec.slices: `module(*inputs, past_kv=past) -> (output,
    kv)`), a slice of l tokens after c runs as the runtime runs it: the keys and values of the c earlier
    tokens (computed untimed) enter as leaves that require grad, and its backward runs from its output's
    gradient and, unless it is the sequence's last slice, its own keys' and values' (as the later slices
    return them). Without the interface only prefixes are timed (context 0: the attention over the slice
    itself), which the fit extends to other contexts by the cost model's form. Each stage's input is the
    earlier stages' output on the whole sequence, computed once, untimed. Each point is timed once per
    round, `warmup` + `reps` rounds, and its fastest run kept (the fit needs the points' relative times,
    which other work on the machine blurs; a minimum is the least blurred)."""
    from pipec.runtime.exec.slices import takes_past

    say = progress or (lambda _: None)
    device = torch.device(device)
    S, m = program.num_stages, program.num_sequences
    modules = _stage_modules(model, S, seed, device)
    cached = all(takes_past(mod) for mod in modules)
    inputs, targets = batch_of(model.batch(0), f"{model.path}: batch(0)")
    x0 = as_args(to_device(split(inputs, m, "inputs")[0], device, model.dtype))
    y0 = to_device(split(targets, m, "targets")[0], device)
    if not isinstance(x0[0], torch.Tensor) or x0[0].dim() < 2 or not isinstance(y0, torch.Tensor):
        raise PipelineError("--slices cuts the inputs and targets along dim 1 (the tokens): give tensors of 2+ dims")
    L = int(x0[0].shape[1])
    points = slice_points(L, n, cached)
    if len({a for a, _ in points} if not cached else points) < 3:
        raise PipelineError(f"--slices {n}: fitting attn and op_fixed takes 3 or more slice lengths")
    how = "key/value cache, every context" if cached else "prefixes at context 0 (no key/value cache interface)"
    say(f"timing F and backward of {len(points)} token slices per stage ({how}), {warmup} + {reps} rounds each")
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def part(args: tuple, a: int, b: int) -> tuple:
        return tuple(t[:, a:b] if isinstance(t, torch.Tensor) and t.dim() >= 2 else t for t in args)

    def leaf(t):
        return t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t

    fwd: list[list[float]] = []
    bwd: list[list[float]] = []
    args = x0
    for s, mod in enumerate(modules):
        last = s == S - 1
        tf: list[list[float]] = [[] for _ in points]
        tb: list[list[float]] = [[] for _ in points]
        for rep in range(warmup + reps):  # rounds over every point: a busy spell slows them all alike
            for k, (l, c) in enumerate(points):  # noqa: E741
                with torch.no_grad():
                    past = mod(*part(args, 0, c), past_kv=())[1] if cached and c else ()
                past = tuple(leaf(t) for t in past)
                xs = tuple(leaf(t) for t in part(args, c, c + l))
                sync()
                t0 = time.perf_counter()
                out = mod(*xs, past_kv=past) if cached else mod(*xs)
                y, kv = out if cached else (out, ())
                if last:
                    y = model.loss_fn(y, y0[:, c : c + l]) * (l / L)
                sync()
                t1 = time.perf_counter()
                outs = [y] + ([t for t in kv if t.requires_grad] if c + l < L else [])
                grads = [None if last and j == 0 else torch.ones_like(t) for j, t in enumerate(outs)]
                torch.autograd.backward(outs, grads)
                sync()
                t2 = time.perf_counter()
                if rep >= warmup:
                    tf[k].append(t1 - t0)
                    tb[k].append(t2 - t1)
        # the fastest of each point's runs: on a machine shared with other work, a median measures it too
        per_f = [min(x) for x in tf]
        per_b = [min(x) for x in tb]
        fwd.append(per_f)
        bwd.append(per_b)
        mod.zero_grad(set_to_none=True)
        if not last:
            with torch.no_grad():
                args = as_args(mod(*args))
        say(f"stage {s}: {len(points)} slices timed")
    fits = [fit_slices(L, points, [f + b for f, b in zip(fs, bs)]) for fs, bs in zip(fwd, bwd)]
    return SliceFit(
        L,
        points,
        fwd,
        bwd,
        [a for a, _, _, _ in fits],
        [o for _, o, _, _ in fits],
        [r for _, _, r, _ in fits],
        [w for _, _, _, w in fits],
        how,
    )


# ---- the link: a gloo ping-pong between two local processes --------------------------------------------


def measure_link(
    nbytes: int, reps: int = 20, timeout: float = 120.0, gap: float = 1e-3
) -> tuple[float | None, float | None, float | None]:
    """One-way time of a small message (latency, s) and the bandwidth (bit/s) beyond it, from a gloo
    ping-pong of 8 bytes and of `nbytes` between two fresh local processes, and the per-instruction
    overhead (s) of pipec's executor for messages of `nbytes` between compute ops of about `gap` seconds
    (pipec.runtime.profile.overhead); Nones if it fails."""
    from pipec.runtime.job import spawned

    # bound as `pipec run` binds two gloo ranks (pipec.runtime.job.affinity), so the link is measured as runs use it
    results = spawned.run_gloo(_pingpong, 2, nbytes, reps, gap, timeout=timeout)
    if isinstance(results, str):
        return None, None, None
    small, big, overhead = results[0]
    if nbytes <= 8 or big <= small:
        return small, None, overhead
    return small, (nbytes - 8) * 8 / (big - small), overhead


def _pingpong(rank: int, world: int, port: int, nbytes: int, reps: int, gap: float, out) -> None:
    from pipec.runtime.job import spawned
    from pipec.runtime.profile.overhead import instruction_overhead

    dist = spawned.join_gloo(rank, world, port)
    try:
        results = [_rtt(rank, dist, n, reps) / 2 for n in (8, max(nbytes, 8))]
        overhead = instruction_overhead(rank, max(nbytes, 8), reps, gap)
        out.put(("result", rank, (*results, overhead) if rank == 0 else None))
    finally:
        spawned.leave_gloo(dist)  # the Runner's process groups and works go first, on this thread


def _rtt(rank: int, dist, nbytes: int, reps: int) -> float:
    buf = torch.zeros(max(1, nbytes // 8), dtype=torch.float64)
    peer = 1 - rank
    times = []
    for i in range(reps + 3):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.isend(buf, peer, tag=i).wait()
            dist.irecv(buf, peer, tag=i).wait()
        else:
            dist.irecv(buf, peer, tag=i).wait()
            dist.isend(buf, peer, tag=i).wait()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---- the data-parallel group's collectives: the ring model's latency and bandwidth -------------------

DP_KINDS = ("ddp", "fsdp")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
# 4 KiB .. 16 MiB, by factors of 4: from latency-bound to bandwidth-bound on any link `pipec run` uses
COLLECTIVE_SIZES = tuple(4096 * 4**k for k in range(7))


def ring_terms(kind: str, n: int) -> tuple[float, float]:
    """The ring model of a collective on n processes, as the simulator charges it (pipec.sim.costs): its
    time is `hops * latency + share * bytes * 8 / bandwidth`, `bytes` the whole buffer (the reduced one,
    the gathered one, the one scattered). All-reduce is a reduce-scatter then an all-gather: twice both."""
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r} (known: {', '.join(COLLECTIVES)})")
    hops, share = n - 1, (n - 1) / n
    return (2 * hops, 2 * share) if kind == "all_reduce" else (hops, share)


def ring_time(kind: str, n: int, nbytes: float, latency: float, bandwidth: float) -> float:
    """Seconds of one collective under the ring model (`ring_terms`); bandwidth in bits per second."""
    hops, share = ring_terms(kind, n)
    return hops * latency + share * nbytes * 8 / bandwidth


def fit_ring(samples: list[tuple[str, int, float, float]]) -> tuple[float, float]:
    """The ring model's (latency s, bandwidth bit/s) from timed collectives `(kind, n, bytes, seconds)`,
    by least squares on relative errors: the model is linear in (latency, 1 / bandwidth), and weighting each
    sample by 1 / its time lets a 4 KiB all-gather (latency-bound) count as much as a 16 MiB all-reduce,
    which absolute errors would drown. A fit that makes either term negative (latency below measurement
    noise, or a bandwidth no size reaches) keeps that term at 0 and fits the other alone; bandwidth is
    then inf (no size term)."""
    import numpy as np

    rows = [(k, n, b, t) for k, n, b, t in samples if t > 0 and n > 1]
    if not rows:
        raise ValueError("no timed collective to fit (each needs n > 1 processes and a positive time)")
    A = np.array([[ring_terms(k, n)[0], ring_terms(k, n)[1] * b * 8] for k, n, b, _ in rows], dtype=float)
    t = np.array([r[3] for r in rows], dtype=float)
    A, y = A / t[:, None], np.ones_like(t)
    (a, inv_b), *_ = np.linalg.lstsq(A, y, rcond=None)
    if a < 0 or inv_b <= 0:  # one term alone, the better of the two that are not negative
        fits = []
        for col in (0, 1):
            x = float(A[:, col] @ y / (A[:, col] @ A[:, col])) if A[:, col].any() else 0.0
            fits.append((float(np.sum((A[:, col] * x - y) ** 2)), col, max(x, 0.0)))
        _, col, x = min(fits)
        a, inv_b = (x, 0.0) if col == 0 else (0.0, x)
    return float(a), (1.0 / float(inv_b) if inv_b > 0 else math.inf)


@dataclass
class Collectives:
    """A data-parallel group's timed collectives and the ring model fitted to them."""

    size: int  # processes in the group
    kind: str  # ddp or fsdp: which collectives a stage's REDUCE_GRAD and UNSHARD are
    latency: float  # the fit over every kind and size: seconds per ring hop
    bandwidth: float  # bits per second
    times: dict[str, dict[int, float]]  # kind -> bytes -> median seconds
    per_kind: dict[str, tuple[float, float]]  # kind -> its own fit
    stage_bytes: list[int]  # each stage's parameter bytes, timed as they are
    how: str = ""

    def stage_times(self, kind: str) -> list[float]:
        """The measured seconds of collective `kind` on each stage's parameter bytes (0 for none)."""
        return [self.times[kind][b] if b > 0 else 0.0 for b in self.stage_bytes]

    def cost_keys(self, param_bytes: list[int]) -> dict[str, Any]:
        """The cost file's keys (pipec.sim.costs): the fit, the parameter bytes, and each stage's measured
        REDUCE_GRAD (all-reduce for ddp, reduce-scatter for fsdp) and, for fsdp, UNSHARD (all-gather)."""
        keys: dict[str, Any] = {
            "param_bytes": list(param_bytes),
            "dp_latency": float(f"{self.latency:.6g}"),
            "dp_bandwidth": float(f"{self.bandwidth:.6g}"),
        }
        keys["reduce_grad"] = _r(self.stage_times("all_reduce" if self.kind == "ddp" else "reduce_scatter"))
        if self.kind == "fsdp":
            keys["unshard"] = _r(self.stage_times("all_gather"))
        return keys

    def measured(self) -> dict[str, Any]:
        """The `[measured.collectives]` table: every size's median per kind, and each kind's own fit."""
        sizes = sorted({b for per in self.times.values() for b in per})
        table: dict[str, Any] = {"size": self.size, "kind": self.kind, "how": self.how, "bytes": sizes}
        for k, per in self.times.items():
            table[f"{k}_s"] = _r([per[b] for b in sizes])
            a, b = self.per_kind[k]
            table[f"{k}_latency"], table[f"{k}_bandwidth"] = float(f"{a:.6g}"), float(f"{b:.6g}")
        return table

    def worst_fit_error(self) -> float:
        """The largest relative error of the fit over the timed collectives."""
        return max(
            abs(ring_time(k, self.size, b, self.latency, self.bandwidth) / t - 1)
            for k, per in self.times.items()
            for b, t in per.items()
            if t > 0
        )


def measure_collectives(
    size: int,
    *,
    kind: str = "ddp",
    sizes: tuple[int, ...] | None = None,
    stage_bytes: list[int] | tuple[int, ...] = (),
    reps: int = 10,
    warmup: int = 2,
    dtype: torch.dtype = torch.float32,
    world: int | None = None,
    groups: int = 1,
    timeout: float = 600.0,
) -> Collectives:
    """Time all-reduce, all-gather and reduce-scatter on a gloo group of `size` fresh local processes, at
    each of `sizes` bytes (default COLLECTIVE_SIZES) and at each stage's `stage_bytes`, and fit the ring
    model (`fit_ring`).

    Each collective's time is the slowest process's, between barriers (a collective ends for the step when
    it ends everywhere), the median of `reps` after `warmup`. The processes are bound to CPUs as `pipec run`
    binds the ranks of a job of `world` processes on this machine (default: `size`): with the p x dp
    ranks of a PP x DP run sharing it, each gets the CPUs a rank of that run would. With `groups` > 1,
    `groups` such groups (rank g * size + i in group g, the "dp" dim of a ("pp", "dp") mesh) time theirs
    at once, as the pipeline ranks' groups may in a run; their medians are pooled."""
    from pipec.runtime.job import spawned

    if size < 2 or groups < 1 or reps < 1 or warmup < 0:
        raise ValueError("collectives need a group of at least 2 processes, groups >= 1, reps >= 1, warmup >= 0")
    if kind not in DP_KINDS:
        raise ValueError(f"kind must be one of {', '.join(DP_KINDS)}, got {kind!r}")
    nproc = size * groups
    world = max(world or nproc, nproc)
    sizes = COLLECTIVE_SIZES if sizes is None else sizes
    timed_sizes = sorted({int(b) for b in (*sizes, *stage_bytes) if b > 0})
    spec = dict(size=size, sizes=timed_sizes, reps=reps, warmup=warmup, dtype=str(dtype).removeprefix("torch."))
    spec["world"] = world
    per_rank = spawned.run_gloo(_collective_rank, nproc, spec, timeout=timeout)
    if isinstance(per_rank, str):
        raise PipelineError(f"timing the collectives of a data-parallel group of {size} failed: {per_rank}")
    times: dict[str, dict[int, float]] = {}
    for k in COLLECTIVES:
        times[k] = {}
        for b in timed_sizes:
            slowest = [  # per group and rep, the slowest of the group's processes
                max(per_rank[g * size + i][k][b][r] for i in range(size)) for g in range(groups) for r in range(reps)
            ]
            times[k][b] = statistics.median(slowest)
    samples = [(k, size, b, t) for k, per in times.items() for b, t in per.items()]
    per_kind = {k: fit_ring([x for x in samples if x[0] == k]) for k in COLLECTIVES}
    latency, bandwidth = fit_ring(samples)
    binding = "unbound" if per_rank[0]["cpus"] is None else f"each on {len(per_rank[0]['cpus'])} CPU(s)"
    how = (
        f"gloo, {groups} group(s) of {size} local processes at once, bound as {world} ranks of a run ({binding}), "
        f"{str(dtype).removeprefix('torch.')}, slowest process, medians of {reps}"
    )
    return Collectives(size, kind, latency, bandwidth, times, per_kind, [int(b) for b in stage_bytes], how)


def _collective_rank(rank: int, world: int, port: int, spec: dict, out) -> None:
    from pipec.runtime.job import spawned
    from pipec.runtime.job.affinity import bind_local_rank

    cpus = bind_local_rank("auto", "gloo", rank, spec["world"])  # as a rank of the whole run is bound
    dist = spawned.join_gloo(rank, world, port, bind=False)
    try:
        n = spec["size"]
        groups = [dist.new_group(list(range(g * n, (g + 1) * n))) for g in range(world // n)]
        group = groups[rank // n]
        dtype = getattr(torch, spec["dtype"])
        itemsize = torch.empty((), dtype=dtype).element_size()
        result: dict[str, Any] = {"cpus": cpus}
        for k in COLLECTIVES:
            result[k] = {}
        for nbytes in spec["sizes"]:
            count = max(n, -(-nbytes // itemsize // n) * n)  # whole shards, as FSDP pads them
            full = torch.ones(count, dtype=dtype)
            shard = torch.ones(count // n, dtype=dtype)
            ops = {
                "all_reduce": lambda f=full: dist.all_reduce(f, group=group),
                "all_gather": lambda f=full, h=shard: dist.all_gather_single(f, h, group=group),
                "reduce_scatter": lambda f=full, h=shard: dist.reduce_scatter_single(h, f, group=group),
            }
            for k, op in ops.items():  # the kinds alternate at each size, so load drifts hit them alike
                seconds = []
                for i in range(spec["warmup"] + spec["reps"]):
                    dist.barrier()
                    t0 = time.perf_counter()
                    op()
                    if i >= spec["warmup"]:
                        seconds.append(time.perf_counter() - t0)
                result[k][nbytes] = seconds
        out.put(("result", rank, result))
    finally:
        spawned.leave_gloo(dist, barrier=True)


def summary_lines(prof: Profile) -> list[str]:
    """A table of the measurements, for `pipec profile` to print."""
    ms = lambda x: f"{x * 1e3:.3f}"  # noqa: E731
    head = ["stage", "F ms", "B ms", "W ms", "full B ms", "opt ms", "act bytes", "grad bytes"]
    rows = [
        [
            str(s),
            ms(prof.forward[s]),
            ms(prof.input_backward[s]),
            ms(prof.weight_backward[s]),
            ms(prof.full_backward[s]),
            ms(prof.optimizer_step[s]),
            str(prof.act_bytes[s]),
            str(prof.grad_bytes[s]),
        ]
        for s in range(len(prof.forward))
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = lambda r: "  ".join(x.rjust(w) for x, w in zip(r, widths))  # noqa: E731
    lines = [fmt(head), *map(fmt, rows)]
    if prof.memory:
        keys = (
            ("saved_bytes", "wsaved_bytes", "input_bytes", "state_bytes")
            if prof.split_backward
            else ("saved_bytes", "input_bytes", "state_bytes")
        )
        per = "; ".join(f"{k} {prof.memory[k]}" for k in keys)
        lines.append(f"bytes per stage (saved-tensor hooks, micro-batch 0): {per}")
    if prof.latency is not None:
        bw = f"{prof.bandwidth / 1e9:.3g} Gbit/s" if prof.bandwidth else "not measurable"
        lines.append(f"link ({prof.info.get('link')}): latency {prof.latency * 1e6:.1f} us, bandwidth {bw}")
    if prof.collectives is not None:
        c = prof.collectives
        lines.append(
            f"collectives ({c.how}): ring fit latency {c.latency * 1e6:.1f} us per hop, bandwidth "
            f"{c.bandwidth / 1e9:.3g} Gbit/s (worst error {c.worst_fit_error():.0%}); per stage "
            f"param bytes {c.stage_bytes}, reduce_grad ms "
            f"{[round(x * 1e3, 3) for x in c.stage_times('all_reduce' if c.kind == 'ddp' else 'reduce_scatter')]}"
            + (f", unshard ms {[round(x * 1e3, 3) for x in c.stage_times('all_gather')]}" if c.kind == "fsdp" else "")
        )
    if prof.in_situ is not None:
        situ = prof.in_situ
        per = [
            f"{s}: F {ms(f)} B {ms(b)}" + (f" W {ms(w)}" if prof.split_backward else "")
            for s, (f, b, w) in enumerate(zip(prof.situ(FWD), prof.situ(BWD), prof.situ(WGRAD)))
        ]
        lines.append(
            f"in situ, {situ['steps']} steps of {prof.schedule} (median step {ms(situ['step_s'])} ms), ms per stage:"
        )
        lines.append("  " + "; ".join(per) + " (the cost file's F, B, W)")
    if prof.slices is not None:
        fit = prof.slices
        per = "; ".join(
            f"{s}: attn {a:.3g}, op_fixed {o * 1e3:.3g} ms, residual {r:.1%} (worst {w:.1%})"
            for s, (a, o, r, w) in enumerate(zip(fit.attn, fit.op_fixed, fit.residual, fit.worst))
        )
        lines.append(f"token slices ({len(fit.points)} per stage, {fit.how}), fitted per stage: {per}")
    if prof.overhead is not None:
        where = "in situ" if prof.in_situ is not None and prof.in_situ["overhead"] is not None else "GPipe, 2 ranks"
        lines.append(f"overhead: {prof.overhead * 1e6:.1f} us of a rank's time per send or receive ({where})")
    kind = "B = input gradient, W = weight gradient" if prof.split_backward else "B = the full backward (no W)"
    lines.append(f"the cost file's B and W for {prof.schedule}: {kind}")
    if prof.in_situ is None and prof.info.get("device") == "cpu":
        lines.append(
            "ops were timed one at a time, outside the schedule; --in-situ times them in steps of the schedule, "
            "which on CPUs shared by the ranks predicts runs more closely (docs/runtime.md)"
        )
    return lines
