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
deliveries of 8 bytes and of the largest message in runs of the runtime (on the transport a run takes
between local ranks: pipec.runtime.profile.links) and the file gets a link `latency` and `bandwidth`, and
the `overhead`: a rank's own time per send or receive instruction in the runtime's executor, measured as the
simulator charges it (pipec.runtime.profile.overhead). With `in_situ`, F, B, W and the
overhead come instead from steps of the schedule itself on its gloo processes (pipec.runtime.profile.insitu).

What the cost file says depends on the schedule: with split backward, `B` and `W` are the input- and
weight-gradient passes as the runtime runs them (the first stage's B is ~0: it needs no input gradient,
its W is its whole backward; under expert parallelism with MoE layers on it, the other way round:
`split_as_run`); without, `B` is the full backward and `W` is left out (the cost model then
takes B as the full backward). Every measurement, including the optimizer step (which the simulator
does not model), is also kept in the `[measured.*]` tables.

With `slices` N (`pipec profile --slices N`, docs/terapipe.md), each stage is also timed on token slices
(`measure_slices`): slices of whole N-ths of the sequence at every context that leaves room for them, through
the stage module's key/value cache interface (pipec.runtime.exec.slices; without one, prefixes of the sequence
at context 0), and the cost keys `attn` and `op_fixed` of `Slicing.weight` are fitted to them by least
squares; the fit's residual goes into `[measured.slices]` (pipec.runtime.profile.slices).

Threads: by default torch uses the number `pipec run` gives each of its processes (OMP_NUM_THREADS, or
the CPUs divided by the ranks), so the times are those of a rank in a run on this machine.
"""

from __future__ import annotations

import dataclasses
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
from pipec.runtime.exec.stage import Stage
from pipec.runtime.host.affinity import allowed_cpus, bind_local_rank
from pipec.runtime.host.malloc import keep_freed_memory
from pipec.runtime.model.contract import Model, default_optimizer
from pipec.runtime.profile.collectives import DP_KINDS, Collectives, measure_collectives
from pipec.runtime.profile.common import Wiring, rounded, stage_modules
from pipec.runtime.profile.experts import AllToAll, measure_all_to_all, moe_layout, split_as_run
from pipec.runtime.profile.held import stage_bytes
from pipec.runtime.profile.links import measure_link
from pipec.runtime.profile.slices import SliceFit, measure_slices


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
    # expert parallelism (pipec.runtime.profile.experts): per stage `moe_layers` and, with an expert group,
    # `a2a_bytes` (empty: no MoE layer); the group's timed all-to-all and its fitted link (None: not timed)
    moe: dict[str, list] = field(default_factory=dict)
    a2a: AllToAll | None = None
    # processes that will share this machine's cores in a run of the schedule, and those cores (0: not
    # shared); the ops were timed without sharing (alone, in turns of `cores_per_node` processes, or in situ as
    # the CPU they took), so the simulator charges it
    ranks_per_node: int = 0
    cores_per_node: int = 0

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
        if self.split_backward:  # under --ep the first stage's whole backward runs at BWD
            B, W = split_as_run(B, W, self.full_backward, self.moe)
        if self.in_situ is not None:  # the ops as they ran in the schedule
            F, B, W = (self.situ(op) for op in (FWD, BWD, WGRAD))
            how = (
                "the CPU they took, shared out by the simulator (more processes than CPUs), overhead with stalls"
                if self.shares_cpu()
                else "medians"
            )
            doc["comment"] += f"; F, B, W and overhead in situ, {how} over {self.in_situ['steps']} steps"
        doc["F"] = rounded(F)
        doc["B"] = rounded(B)  # without split backward, B without W: the cost model's full backward
        if self.split_backward:
            doc["W"] = rounded(W)
        doc["act_bytes"] = list(self.act_bytes)
        doc["grad_bytes"] = list(self.grad_bytes)
        for key in ("saved_bytes", "wsaved_bytes", "input_bytes", "state_bytes"):
            if key in self.memory and (key != "wsaved_bytes" or self.split_backward):
                doc[key] = list(self.memory[key])
        if "offload" in self.memory:
            doc["offload"] = rounded(self.memory["offload"])
        latency = self.latency
        delivery = self.in_situ.get("delivery") if self.in_situ is not None else None
        if delivery is not None:  # as the run delivered its messages, less their bytes on the link
            wire = 8 * delivery["bytes"] / self.bandwidth if self.bandwidth else 0.0
            latency = max(delivery["median_s"] - wire, 0.0)
            doc["comment"] += f"; latency from {delivery['count']} messages as the run delivered them"
        if latency is not None:
            doc["latency"] = round(latency, 9)
        if self.bandwidth is not None:
            doc["bandwidth"] = float(f"{self.bandwidth:.6g}")
        if self.overhead is not None:
            doc["overhead"] = round(self.overhead, 9)
        if self.in_situ is not None and self.in_situ.get("step"):  # the schedule's own STEPs
            doc["step"] = rounded([self.in_situ["step"].get(s, 0.0) for s in range(len(self.forward))])
        if self.in_situ is not None and self.in_situ.get("outside_s") is not None:
            doc["step_overhead"] = float(f"{self.in_situ['outside_s']:.6g}")
        if self.in_situ is not None and self.in_situ.get("handoff") is not None:  # overlapped pairs' turns
            doc["pair_handoff"] = float(f"{self.in_situ['handoff']:.6g}")
        if self.cores_per_node and (self.in_situ is None or self.shares_cpu()):
            doc["ranks_per_node"], doc["cores_per_node"] = self.ranks_per_node, self.cores_per_node
            timed = "their CPU in situ" if self.in_situ is not None else f"timed {self.cores_per_node} at a time"
            doc["comment"] += f"; {self.ranks_per_node} processes share {self.cores_per_node} cores, {timed}"
        if self.slices is not None:
            fitted = f"{len(self.slices.points)} token slices ({self.slices.how})"
            doc["comment"] += f"; attn and op_fixed fitted to {fitted}"
            doc["attn"] = rounded(self.slices.attn)
            doc["op_fixed"] = rounded(self.slices.op_fixed)
        doc.update(self.moe)
        if self.a2a is not None:
            doc["comment"] += f"; all-to-all on an expert group of {self.a2a.size}"
            doc.update(self.a2a.cost_keys())
        if self.collectives is not None:
            doc["comment"] += f"; collectives on a data-parallel group of {self.collectives.size}"
            doc.update(self.collectives.cost_keys(self.param_bytes))
            # timed on gloo, where FSDP2's reduce-scatter, all-reduce and all-gather are blocking calls
            doc["dp_blocking"] = 1
        doc["measured"] = {
            "stages": {
                "forward": rounded(self.forward),
                "full_backward": rounded(self.full_backward),
                "input_backward": rounded(self.input_backward),
                "weight_backward": rounded(self.weight_backward),
                "optimizer_step": rounded(self.optimizer_step),
            },
            "run": {k: v for k, v in self.info.items() if v is not None},
        }
        if self.collectives is not None:
            doc["measured"]["collectives"] = self.collectives.measured()
        if self.a2a is not None:
            doc["measured"]["all_to_all"] = self.a2a.measured()
        if self.slices is not None:
            doc["measured"]["slices"] = self.slices.measured()
        if self.in_situ is not None:
            doc["measured"]["in_situ"] = {
                "forward": rounded(self.situ(FWD, median=True)),
                "backward": rounded(self.situ(BWD, median=True)),
                **({"weight_backward": rounded(self.situ(WGRAD, median=True))} if self.split_backward else {}),
                "step": float(f"{self.in_situ['step_s']:.6g}"),
                "steps": self.in_situ["steps"],
            }
            for key in ("overhead", "overhead_with_stalls"):  # both estimates, whichever the cost key took
                if self.in_situ.get(key) is not None:
                    doc["measured"]["in_situ"][key] = round(self.in_situ[key], 9)
            if self.in_situ.get("delivery"):  # messages sent to a waiting receiver: send to receive done
                d = self.in_situ["delivery"]
                doc["measured"]["in_situ"].update(
                    delivery_s=float(f"{d['median_s']:.6g}"), delivery_bytes=d["bytes"], deliveries=d["count"]
                )
            for suffix, key in (("mean", "ops_mean"), ("cpu", "ops_cpu")):  # replica 0's means, and their CPU
                mean = self.in_situ.get(key) or {}
                for name, code in (("forward", FWD), ("backward", BWD), ("weight_backward", WGRAD)):
                    if mean and (code != WGRAD or self.split_backward):
                        per = [mean.get((code, s), 0.0) for s in range(len(self.forward))]
                        doc["measured"]["in_situ"][f"{name}_{suffix}"] = rounded(per)
            by_replica = self.in_situ.get("ops_by_replica") or []
            if len(by_replica) > 1:  # each replica's own F, B (and W): replica 0's are the cost keys
                for name, code in (("forward", FWD), ("backward", BWD), ("weight_backward", WGRAD)):
                    if code != WGRAD or self.split_backward:
                        per = [[ops.get((code, s), 0.0) for s in range(len(self.forward))] for ops in by_replica]
                        doc["measured"]["in_situ"][f"{name}_by_replica"] = [rounded(x) for x in per]
            coll = self.in_situ.get("collectives") or {}
            for name, code in (("reduce_grad", REDUCE_GRAD), ("unshard", UNSHARD)):
                if any(op == code for op, _ in coll):  # as the ranks spent them in the schedule
                    per = [coll.get((code, s), 0.0) for s in range(len(self.forward))]
                    doc["measured"]["in_situ"][name] = rounded(per)
        return doc

    def shares_cpu(self) -> bool:
        """Whether the in-situ run's processes outnumbered the CPUs and its ops' CPU times were recorded."""
        return bool(self.in_situ is not None and self.in_situ.get("shared") and self.in_situ.get("ops_cpu"))

    def situ(self, op: int, median: bool = False) -> list[float]:
        """Per stage, the in-situ median of an op's time (`median`: always). Where the run's processes shared
        the CPUs (`in_situ["shared"]`), the mean CPU the op took instead: its wall time there holds the turns
        other ranks took on its core, which depend on what ran beside it, so the cost file keeps the work and
        the simulator shares the cores out (`ranks_per_node`, `cores_per_node`: docs/simulate.md). 0.0 where
        the schedule never ran it."""
        assert self.in_situ is not None
        ops = self.in_situ["ops_cpu"] if self.shares_cpu() and not median else self.in_situ["ops"]
        return [ops.get((op, s), 0.0) for s in range(len(self.forward))]


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
    `reduce_grad` (and, for fsdp, `unshard`) times. A model with MoE layers gets each stage's `moe_layers`
    and, for a Program with an expert group of `ep` > 1 ranks, its `a2a_bytes` and (with `comm`) the expert
    link's `ep_latency` and `ep_bandwidth` from timed all-to-alls (pipec.runtime.profile.experts). With
    `slices` N, the stages are also timed on token slices of N-ths of the sequence (`measure_slices`) and the
    file gets the fitted `attn` and `op_fixed`."""
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
    cpus = allowed_cpus()
    if concurrent is None:  # as `pipec run --cpu-bind auto` binds: when every rank can have its own CPU
        # With replicas, always: the run's p x dp processes share the CPUs, so its ops take that long.
        concurrent = device.type == "cpu" and 1 < procs and (procs <= len(cpus or []) or dp > 1)
    elif concurrent and device.type != "cpu":
        raise PipelineError("concurrent timing is for ranks sharing this machine's CPUs; on GPUs each has its own")
    threads = threads or default_threads(procs)
    keep_freed_memory()  # the ops timed here allocate as `pipec run`'s ranks do
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if concurrent:
            say(f"timing each op of {program.num_stages} stages in {procs} processes at once, {warmup} + {reps} rounds")
            at_once = min(procs, len(cpus) if cpus is not None else (os.cpu_count() or procs))
            prof = _measure_concurrently(program, model.path, reps, warmup, threads, seed, loss_scale, dp, at_once)
        else:
            say(f"timing each op of {program.num_stages} stages alone, {warmup} + {reps} rounds")
            prof = _measure(program, model, reps, warmup, device, seed, loss_scale, dp)
    finally:
        torch.set_num_threads(old_threads)
    shared = device.type == "cpu" and bool(cpus) and procs > len(cpus or [])  # a run's ranks share the CPUs
    if shared:  # its ops were timed without sharing them
        prof.ranks_per_node, prof.cores_per_node = procs, len(cpus or [])
    prof.info.update(
        model=model.path,
        dtype=str(next(iter(prof.info.pop("dtypes")), "none")),
        device=str(device),
        threads=threads,
        reps=reps,
        warmup=warmup,
        timing=(
            f"{procs} processes, one per rank{' of each replica' if dp > 1 else ''}, "
            + (f"in turns of {prof.cores_per_node} (the CPUs)" if prof.cores_per_node else "at once")
        )
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
            say("timing the link (deliveries in runs of the runtime) and the executor's overhead on 2 processes")
            gap = min(max(statistics.median(prof.forward), 1e-4), 5e-3)
            prof.latency, prof.bandwidth, prof.overhead, how = measure_link(
                max(sizes, default=0), reps=max(reps, 20), gap=gap
            )
            prof.info["link"] = f"{how} between two local processes"
        else:
            prof.info["link"] = f"not measured ({backend} on {device.type}: profile measures gloo on CPU only)"
    if in_situ:
        from pipec.runtime.profile.insitu import profile_in_situ

        say(
            f"running {warmup} + {reps} steps of {program.name} on {program.num_ranks * program.dp} gloo processes "
            "(--in-situ)"
        )
        # With more processes than CPUs the costs are the ops' CPU, which waits do not hold: run the Program's
        # expert parallelism and overlapped pairs then, so that the all-to-alls' CPU and the pairs' turns are
        # the run's (otherwise the ops' wall times are the costs, and an op of a pair would hold the other's).
        prof.in_situ = profile_in_situ(
            program,
            model.path,
            reps=reps,
            warmup=warmup,
            threads=threads,
            seed=seed,
            loss_scale=loss_scale,
            experts=shared,
        )
        prof.in_situ["shared"] = shared  # its run's processes (the same p x dp) took turns on the CPUs
        # Where the run's processes outnumber the CPUs, the ops are the CPU they took (`situ`: the simulator
        # shares the cores out) and the gaps between them have a long tail (a rank waiting for a core, a sender
        # stalled after waking its peer): their mean is what a step sums, the median leaves the tail out
        # (docs/runtime.md, "What the shortfall is made of").
        overhead = prof.in_situ["overhead_with_stalls" if prof.shares_cpu() else "overhead"]
        if overhead is not None:
            if prof.overhead is not None:  # the stand-in GPipe's, kept in [measured.run]
                prof.info["link_overhead"] = round(prof.overhead, 9)
            prof.overhead = overhead
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
    ep = program.experts.size
    layout = moe_layout(program, model, ep, seed=seed, device=device, dp=dp)
    prof.moe = {k: v for k, v in layout.items() if k != "a2a_bytes" or ep > 1}
    if comm and ep > 1:
        if device.type != "cpu" or backend != "gloo":
            prof.info["all_to_all"] = f"not measured ({backend} on {device.type}: profile measures gloo on CPU only)"
        else:
            say(f"timing all_to_all_single on an expert group of {ep} gloo processes")
            prof.a2a = measure_all_to_all(ep, reps=max(reps, 3), warmup=max(warmup, 1), world=procs)
            prof.info["all_to_all"] = prof.a2a.how
    return prof


def default_threads(ranks: int) -> int:
    """What `pipec run` gives each process: OMP_NUM_THREADS, or the CPUs divided by the ranks."""
    env = os.environ.get("OMP_NUM_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, (os.cpu_count() or 1) // max(1, ranks))


def _measure(
    program: Program, model: Model, reps: int, warmup: int, device: torch.device, seed: int, loss_scale, dp: int = 1
) -> Profile:
    """Time every stage's ops on the micro-batches of `batch(0)` (with `dp` replicas, of replica 0's share
    of it, as a run's replicas split the global batch: pipec.runtime.exec.replicas.slice_replica); with
    token slices, on whole sequences (what the cost model's F, B and W are given for)."""
    S, m = program.num_stages, program.num_sequences
    scale = 1.0 / m if loss_scale is None else loss_scale
    modules = stage_modules(model, S, seed, device)
    make_opt = model.optimizer or default_optimizer
    opts = []
    for mod in modules:
        params = [p for p in mod.parameters() if p.requires_grad]
        opts.append(make_opt(params) if params else None)

    wiring = Wiring(getattr(program, "graph", None), S)  # the chain, or the stage graph's edges (in one process)

    def stages(split_backward: bool) -> list[Stage]:
        return [
            Stage(
                s, S, mod, model.loss_fn if s == S - 1 else None, scale, split_backward, None, **wiring.stage_options(s)
            )
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
        for s, st in enumerate(sts):
            args = wiring.inputs(s, mb_in[mb])
            wiring.passed(s, timed("F", s, keep, st.forward, mb, args, mb_tg[mb] if s == S - 1 else None))
            if keep and s < S - 1:  # on a graph: per out-edge, the mean (the cost model's act_bytes is per edge)
                act[s].append(_nbytes(wiring.sent(s)) // max(1, len(wiring.stage_options(s).get("outputs", (0,)))))

    def backward(sts: list[Stage], mb: int, keep: bool, kind: str) -> None:
        for s in reversed(range(S)):
            grads = timed(kind, s, keep, sts[s].backward, mb, wiring.out_grads(s))
            wiring.input_grads(s, grads)
            if keep and s > 0 and kind == "full" and grads is not None:
                grad[s].append(_nbytes(grads))

    for rep in range(warmup + reps):
        keep = rep >= warmup
        mb = rep % m
        # the full backward
        forward(full, mb, keep)
        backward(full, mb, keep, "full")
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
        backward(split_, mb, keep, "B")
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
    program: Program,
    model_path: str,
    reps: int,
    warmup: int,
    threads: int,
    seed: int,
    loss_scale,
    dp: int = 1,
    at_once: int | None = None,
) -> Profile:
    """`_measure` in one process per rank at once (a run's ranks share this machine's caches, memory
    bandwidth and, beyond one per CPU, its CPUs), each bound as `pipec run` binds its ranks; stage s's
    times are those measured by the process of its rank. With `dp` replicas, one process per rank of every
    replica (process r * dp + d: rank r of replica d, as the ("pp", "dp") mesh numbers them), each on its
    replica's share of the batch; the times are replica 0's.

    With more processes than CPUs, all of them timing at once would time each op slowed by the others
    (4 processes on 2 cores: every op about twice its time), though in a run a rank shares its core only
    while others compute beside it. They take turns instead, `at_once` at a time (the CPUs), and the
    profile records the sharing (`ranks_per_node`, `cores_per_node`, in `profile`) for the simulator to
    charge (docs/simulate.md, "Ranks that share cores")."""
    from pipec.formats.program_file import to_json
    from pipec.runtime.host import spawned

    procs = program.num_ranks * dp
    spec = dict(program=to_json(program), model=model_path, reps=reps, warmup=warmup, threads=threads)
    spec.update(seed=seed, loss_scale=loss_scale, dp=dp, at_once=at_once or procs)
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
    from pipec.runtime.host import spawned
    from pipec.runtime.model.contract import load_model

    bind_local_rank("auto", "gloo", rank, world)  # every thread of this process, and those torch starts later
    keep_freed_memory()  # as `pipec run`'s ranks allocate
    torch.set_num_threads(spec["threads"])
    try:
        program, model = from_json(spec["program"]), load_model(spec["model"])
        barrier.wait(timeout=600)  # every rank starts timing at once, or in turns of `at_once` ranks
        at_once = spec.get("at_once", world)
        prof = None
        for turn in range(-(-world // at_once)):
            if rank // at_once == turn:
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
            if at_once < world:
                barrier.wait(timeout=3600)  # this turn's ranks are done; the next ones start
        out.put(("result", rank, prof))
    except Exception as e:  # noqa: BLE001 - reported by the parent, which names the profile
        if not isinstance(e, PipelineError):  # the model's own code: where it failed
            import traceback

            traceback.print_exc()
        spawned.failed(out, rank, rank, f"rank {rank}: {type(e).__name__}: {e}")


# ---- token slices: F and backward per (length, context), and the fit of attn and op_fixed ----------------


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
    if prof.moe:
        lines.append(
            f"MoE layers per stage {prof.moe['moe_layers']}"
            + (f", bytes one rank sends per all-to-all {prof.moe['a2a_bytes']}" if "a2a_bytes" in prof.moe else "")
        )
    if prof.a2a is not None:
        a = prof.a2a
        lines.append(
            f"all-to-all ({a.how}): latency {a.latency * 1e6:.1f} us, bandwidth {a.bandwidth / 1e9:.3g} Gbit/s "
            f"(worst error {a.worst_fit_error():.0%})"
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
        what = "the CPU each took, " if prof.shares_cpu() else ""
        lines.append("  " + "; ".join(per) + f" ({what}the cost file's F, B, W)")
        if prof.shares_cpu():
            lines.append(
                f"  {prof.ranks_per_node} processes shared {prof.cores_per_node} CPUs: the simulator shares them out"
            )
        if situ.get("handoff") is not None:
            lines.append(f"  an overlapped pair's turn: {situ['handoff'] * 1e6:.1f} us to wake its op (pair_handoff)")
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
