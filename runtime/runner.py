"""The Python API: a Runner executes one rank's part of a Program, one training step per `step` call.

    runner = Runner(program, build_stage, loss_fn)        # after torch.distributed.init_process_group
    runner = Runner(program, build_stage, loss_fn, options=StageOptions(dtype=torch.float64),
                    transport=Transport(timeout=600))     # how stages are built; how ranks talk
    for step in range(steps):
        result = runner.step(inputs, targets)             # the whole batch; split into m micro-batches
        if result.loss is not None: print(result.loss)     # on the rank that owns the last stage

`LocalPipeline` (pipec.runtime.local) runs every rank of a Program in this one process, same interface.

Token slices (`program.slicing`, pipec.runtime.exec.slices): the batch splits into the Program's sequences, and
each of those into its token slices along dim 1; every stage module must have the key/value cache interface.

Variable shapes: `inputs` and `targets` may be given as their micro-batches (pipec.runtime.exec.microbatch.
MicroBatches, what a model file's list of (inputs, targets) pairs becomes), which may differ in shape from
each other and from step to step. The shapes are then exchanged again at a step whose micro-batch input
shapes differ from the last exchange's, and only then. Every rank learns it cheaply: at the first exchange
the rank of stage 0 publishes whether its batches come as micro-batches (one store read per other rank);
if they do, it publishes each step's exchange number under `epoch/<step>` (one small store read per step
on every other rank), and a new number means a new exchange, under that number's keys.

A stage graph (`program.graph`, pipec.ir.graph): every rank with a source stage (one without inputs) needs
the inputs, the shapes are exchanged per edge (pipec.runtime.exec.shapes.handshake_graph), and each stage
is called with its in-edges' messages in the order of `graph.inputs(s)` (docs/runtime.md, "Stage graphs").
"""

from __future__ import annotations

import copy
import itertools
import time
import warnings
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

# gloo: how many receives ahead of the Program's placement a rank posts (pipec.runtime.exec.executor says why);
# each costs one posted buffer of a message's size. It lives with the buffer plan, whose `ahead` it is for a
# gloo run: one number for both.
from pipec.ir.buffers import GLOO_RECV_AHEAD
from pipec.ir.program import Program
from pipec.runtime.errors import CommError, PipelineError, ShapeError, wrong_world_size
from pipec.runtime.exec import shm, slices
from pipec.runtime.exec.comm import DistComm
from pipec.runtime.exec.executor import Executor
from pipec.runtime.exec.microbatch import MicroBatches, as_args, split, to_device
from pipec.runtime.exec.replicas import (
    UNITS,
    StageDP,
    as_replica_mesh,
    check_mesh,
    check_not_shared,
    check_program,
    make_mesh,
    named_full,
    replica_peers,
    set_timeout,
    slice_replica,
    wrap,
)
from pipec.runtime.exec.shapes import KV, Specs, TensorSpec, fmt, handshake, handshake_graph
from pipec.runtime.exec.stage import Stage
from pipec.runtime.model.contract import build_stage_module, default_optimizer
from pipec.runtime.model.moe import ExpertGrads, by_stage, expert_parallel, is_expert, layer_counts

_IDS = itertools.count()


@dataclass(frozen=True)
class StepResult:
    """What one training step of `Runner.step` gives back on this rank: its loss (last stage) and wall time."""

    step: int
    loss: float | None  # the step's loss (sum of scaled micro-batch losses) on the last stage's rank
    seconds: float  # this rank's wall time for the step


@dataclass(frozen=True)
class StageOptions:
    """How a Runner builds and trains its stages: kept apart from `Transport` because they are what the
    single-process `Reference` must share to compute the same numbers.

    optimizer: params -> optimizer per stage (default Adam for built stages, none for given modules);
    dtype and device of the modules; loss_scale: each micro-batch loss's factor (default 1 / m); seed:
    weights seeded by (seed, stage), None to leave torch's RNG alone; where: how errors name build_stage;
    compile: each stage's forward (and so its backward) through torch.compile (pipec.runtime.exec.compiled);
    cuda_graphs: compiled with CUDA graphs (CUDA only; implies compile)."""

    optimizer: Callable[[list], torch.optim.Optimizer] | None = None
    dtype: torch.dtype | None = None
    device: torch.device | str | None = None
    loss_scale: float | None = None
    seed: int | None = 0
    where: str = "build_stage"
    compile: bool = False
    cuda_graphs: bool = False


@dataclass(frozen=True)
class Transport:
    """How a Runner reaches the other ranks.

    timeout: seconds any wait may take; comm and kv: a given message transport and key-value store
    (LocalPipeline's; default torch.distributed and its c10d store); group: the process group of the
    pipeline's ranks; mesh: the ("pp", "dp") DeviceMesh or a (pp, dp) pair of 1-D meshes, for dp > 1;
    dp_unit: "stage" or "block", what FSDP shards as one unit; links: emulated links between datacenters
    (pipec.runtime.exec.links.Links); recv_ahead: receives posted ahead of the Program's placement (gloo
    only; default 4 on gloo, 0 on NCCL); on_reduce_grad: called with (stage, module) at each REDUCE_GRAD;
    experts: expert parallelism (pipec.ir.experts.Experts; size > 1 shards the model's experts over groups of
    that many "dp" replicas, pipec.runtime.model.moe); overlap: run an overlapped pair's two ops together,
    their all-to-alls hidden behind each other's compute (False: one after the other, `--no-overlap`);
    schedule: the Schedule the Program was lowered from, whose source lines locate a start-up diagnostic;
    p2p: the point-to-point transport, "auto" (shared memory when every rank of the pipeline is on this host
    and tensors are on the CPU, pipec.runtime.exec.shm), "gloo" (torch.distributed, NCCL on CUDA) or "shm";
    static: run a Program's order family (`program.family`) in its compiled order (default: orders chosen
    at run time, pipec.runtime.exec.dynamic); faults: pipec.sim.faults.Faults to emulate (a straggler's slow
    ops, link jitter: pipec.runtime.exec.faults)."""

    timeout: float = 60.0
    comm: Any = None
    kv: KV | None = None
    group: Any = None
    mesh: Any = None
    dp_unit: str = "stage"
    links: Any = None
    recv_ahead: int | None = None
    on_reduce_grad: Callable[[int, torch.nn.Module], None] | None = None
    experts: Any = None
    overlap: bool = True
    schedule: Any = None
    p2p: str = "auto"
    static: bool = False
    faults: Any = None


class StoreKV(KV):
    """Specs through the job's c10d store (blocking gets with the run's timeout)."""

    def __init__(self, store, timeout: float) -> None:
        self.store = store
        self.timeout = timedelta(seconds=timeout)

    def set(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def get(self, key: str, waiting_for: str, peer: int) -> Generator[object, None, str]:
        try:
            self.store.wait([key], self.timeout)
            value = self.store.get(key)
        except Exception as e:
            raise CommError(f"waiting for {waiting_for} from rank {peer}: {str(e).splitlines()[0]}", peer) from e
        return value.decode() if isinstance(value, bytes) else value
        yield  # never yields

    def delete(self, key: str) -> None:
        self.store.delete_key(key)


class Runner:
    """One rank of a pipeline. Builds this rank's stages (weights seeded by (seed, stage), so every process
    and the single-process reference agree), an optimizer per stage, and executes the rank's instructions.
    Its options come as two values, `options` (StageOptions: how stages are built and trained) and
    `transport` (Transport: how this rank reaches the others).

    Bring your own modules: `build_stage` may instead be a mapping {stage index: nn.Module} holding (at
    least) this rank's stages. Then the Runner owns no optimizer unless `options.optimizer` is given (the Program's
    STEP instructions do nothing), and it leaves `.grad` alone between steps: gradients accumulate until the
    caller zeroes them, as after torch's schedules (`pipec.runtime.pipeline_schedule` is built on this).

    Data parallelism (`program.dp` > 1): `transport.mesh` is a 2-D DeviceMesh with dims ("pp", "dp"), or a (pp, dp)
    pair of 1-D meshes (built from the world when not given); the rank is this process's "pp" coordinate,
    each stage's module goes under FSDP2 (`program.dp_kind`; `dp_unit` "block" shards each child block
    too) before its optimizer is built, and `step` takes the global batch and runs this replica's slice
    (pipec.runtime.exec.replicas)."""

    def __init__(
        self,
        program: Program,
        build_stage: Callable[[int, int], torch.nn.Module] | Mapping[int, torch.nn.Module],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        rank: int | None = None,
        options: StageOptions = StageOptions(),
        transport: Transport = Transport(),
    ) -> None:
        optimizer, dtype, device = options.optimizer, options.dtype, options.device
        loss_scale, seed, where = options.loss_scale, options.seed, options.where
        timeout, comm, kv, group = transport.timeout, transport.comm, transport.kv, transport.group
        links, recv_ahead, mesh, dp_unit = transport.links, transport.recv_ahead, transport.mesh, transport.dp_unit
        on_reduce_grad = transport.on_reduce_grad
        replicas = None  # this process's place in the ("pp", "dp") mesh (pipec.runtime.exec.replicas)
        if dp_unit not in UNITS:
            raise PipelineError(f"dp_unit must be one of {', '.join(UNITS)}, got {dp_unit!r}")
        if comm is None:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise PipelineError("torch.distributed is not initialised: call init_process_group first")
            if device is None:
                device = default_device()
            if mesh is None and program.dp > 1:
                if group is not None:
                    raise PipelineError("a Program with dp > 1 takes mesh=, not group=")
                mesh = make_mesh(program.num_ranks, program.dp, torch.device(device).type, timeout)
            if mesh is not None:
                replicas = as_replica_mesh(mesh)
                check_mesh(program, replicas)
                set_timeout(replicas, timeout)  # a given mesh too: no collective waits past the run's timeout
                if replicas.dp_size > 1:
                    check_program(program)
                group = replicas.pp_group
            world = dist.get_world_size(group)
            if world != program.num_ranks:
                raise PipelineError(wrong_world_size(program, world))
            rank = dist.get_rank(group) if rank is None else rank
            # one namespace per replica: each replica's stages publish their shapes under the same names
            space = f"pipec/{next(_IDS)}/" + (f"dp{replicas.dp_rank}/" if replicas is not None else "")
            store = dist.PrefixStore(space, dist.distributed_c10d._get_default_store())
            kv = StoreKV(store, timeout) if kv is None else kv
            if shm.choose(transport.p2p, torch.device(device), links is not None, store, rank, world, timeout) == "shm":
                comm = shm.ShmComm(program, rank, timeout, group, store)
            else:
                comm = DistComm(program.num_stages, program.num_microbatches, torch.device(device), timeout, group)
            if recv_ahead is None:
                recv_ahead = GLOO_RECV_AHEAD if comm.pg is not None else 0
            elif recv_ahead and comm.pg is None and not isinstance(comm, shm.ShmComm):
                raise PipelineError(
                    f"recv_ahead={recv_ahead}: receives can be posted ahead on gloo only; NCCL must post them "
                    "where the Program places them (a pending receive holds up the peer's later transfers)"
                )
        elif program.dp > 1:
            raise PipelineError(
                f"the Program is compiled for {program.dp} data-parallel replicas, which need torch.distributed "
                "and a ('pp', 'dp') mesh; a given transport (--local, LocalPipeline) runs one pipeline"
            )
        if rank is None or not 0 <= rank < program.num_ranks:
            raise PipelineError(f"rank {rank} is not in 0..{program.num_ranks - 1}")
        if links is not None:  # emulated links between datacenters (pipec.runtime.exec.links)
            from pipec.runtime.exec.links import EmulatedComm

            comm = EmulatedComm(comm, rank, links, blocking=isinstance(comm, DistComm))
        self.jitter: Any = None
        if transport.faults is not None and transport.faults.jitter is not None:
            from pipec.runtime.exec.faults import JitterComm

            comm = self.jitter = JitterComm(comm, rank, transport.faults, blocking=not hasattr(comm, "hub"))
        self.program = program
        self.rank = rank
        self.device = torch.device(device or "cpu")
        self.dtype = dtype
        self.loss_fn = loss_fn
        self.kv = kv
        m = program.num_sequences  # micro-batches of the batch (each cut into token slices when sliced)
        scale = 1.0 / m if loss_scale is None else loss_scale
        slicing = program.slicing if program.slicing is not None and program.slicing.slices > 1 else None
        own = [s for s, r in enumerate(program.placement) if r == rank]
        given = isinstance(build_stage, Mapping)  # the caller's modules: its optimizer, its gradients
        make_opt = optimizer or (None if given else default_optimizer)
        self.owns_grads = not given
        self.replicas = replicas if replicas is not None and replicas.dp_size > 1 else None
        if given:
            modules = given_modules(build_stage, own, program, rank, dtype, self.device)
        else:
            modules = {
                s: build_stage_module(
                    build_stage, s, program.num_stages, seed=seed, dtype=dtype, device=self.device, where=where
                )
                for s in own
            }
        graph = program.graph
        if graph is not None and slicing is not None:
            raise PipelineError(
                f"`{program.name}` has a stage graph ({graph.describe()}) and token slices: the runtime runs a "
                "stage graph unsliced only"
            )
        if slicing is not None:  # before anything runs: a module without the key/value cache interface
            for s, module in modules.items():
                slices.check_interface(module, s, slicing, where)
        self.shape_modules: dict[int, torch.nn.Module] | None = None
        if self.replicas is not None:
            dp_unit = dp_unit if program.dp_kind == "fsdp" else "stage"  # replicate wraps the stage whole
            check_not_shared(modules, program.dp_kind, dp_unit)
            # The first step's shape handshake runs the plain modules (a sharded one has its shards' shapes);
            # the copies go once it is done.
            self.shape_modules = {s: copy.deepcopy(m) for s, m in modules.items()}
        self.expert_group: Any = None  # expert parallelism (pipec.runtime.exec.alltoall.ExpertGroup)
        self.expert_replicas: Any = None  # the process group over the expert groups' members at this place
        experts_held: set[torch.nn.Parameter] = set()
        if transport.experts is not None and transport.experts.size > 1:
            experts_held = self._expert_parallel(modules, transport.experts, timeout, links, where, transport.schedule)
        if self.replicas is not None:
            for m in modules.values():  # before the optimizer: it steps the shards
                wrap(m, program.dp_kind, self.replicas, dp_unit, ignored=experts_held)
        self.stages: dict[int, Stage] = {}
        for s in own:
            module = modules[s]
            params = [p for p in module.parameters() if p.requires_grad]
            self.stages[s] = Stage(
                s,
                program.num_stages,
                module,
                loss_fn if s == program.num_stages - 1 else None,
                scale,
                program.split_backward,
                make_opt(params) if params and make_opt is not None else None,
                slicing=slicing,
                source=None if graph is None else not graph.inputs(s),
                outputs=None if graph is None else graph.outputs(s),
            )
            self.stages[s].live_params = self.replicas is not None
        self.compile = options.compile or options.cuda_graphs  # after the first shape exchange (compiled.py)
        self.cuda_graphs = options.cuda_graphs
        if self.cuda_graphs:
            from pipec.runtime.exec.compiled import count_replays, needs_cuda

            if (why := needs_cuda(self.device)) is not None:
                raise PipelineError(f"cuda_graphs: {why}")
            count_replays()
        self.executor = Executor(program, rank, self.stages, comm, on_reduce_grad, recv_ahead or 0)
        self.executor.timeout, self.executor.overlap = timeout, transport.overlap
        if self.expert_group is not None:
            self.executor.moe = self.expert_group
            self.executor.moe_layers = layer_counts(modules)
            self.executor.expert_grads = ExpertGrads(by_stage(modules), self.replicas.dp_size, self.expert_replicas)
            if program.split_backward and self.executor.moe_layers.get(0):
                # the first stage's split BWD would defer its whole backward, all-to-alls included, to WGRAD;
                # they belong to B (pipec.ir.experts.all_to_alls), so it runs it whole at BWD
                self.stages[0].whole_backward = True
        if self.replicas is not None:
            peers = replica_peers(self.replicas)
            self.executor.dp = StageDP(modules, rank, self.replicas.dp_rank, self.executor.where, peers)
            if links is not None and links.dp_ring:  # the emulated link under the collectives
                from pipec.runtime.exec.links import DPLink

                rm = self.replicas
                link = DPLink(links, rm.dp_group, rm.dp_size, timeout, rank, rm.dp_rank, self.device)
                self.executor.dp.link = link
        if self.device.type == "cuda":
            self.executor.sync = lambda: torch.cuda.synchronize(self.device)
        if transport.faults is not None:  # a straggler's slow ops (pipec.runtime.exec.faults)
            from pipec.runtime.exec.faults import slow_handlers

            slow_handlers(self.executor, transport.faults)
        self.dynamic: Any = None  # orders chosen at run time (pipec.runtime.exec.dynamic)
        if program.family is not None and program.family.of(rank) is not None and not transport.static:
            from pipec.runtime.exec.dynamic import DynamicOrder, refuse_nccl

            refuse_nccl(program, rank, comm)
            self.dynamic = DynamicOrder(self.executor, program.family.of(rank))
        self.slicing = slicing
        self.last_specs: list[Specs] | None = None  # stage 0's inputs per micro-batch at the last exchange
        self.steps_done = 0  # a restored checkpoint sets it (pipec.runtime.job.checkpoint)
        self.handshaken = False  # shapes are exchanged at this runner's first step, whatever its number
        self.varying = False  # the batches come as micro-batches, whose shapes may change (learned at the first step)
        self.epoch = 0  # the number of the last shape exchange (0: the first step's)
        self.exchanges = 0  # shape exchanges this runner has run
        self.mb_targets: list | None = None  # the last step's micro-batch targets (last stage's rank)
        self.lengths_warned = False  # a LengthWarning was given (slices.length_mismatch)

    def _expert_parallel(
        self, modules: dict[int, torch.nn.Module], experts: Any, timeout: float, links: Any, where: str, schedule: Any
    ) -> set[torch.nn.Parameter]:
        """Shard the experts of this rank's stages over its expert group (pipec.runtime.model.moe.expert_parallel,
        which checks first, before any step, that the run can have expert parallelism)."""
        if self.replicas is None:
            raise PipelineError(
                f"expert parallelism (--ep {experts.size}) is folded into data parallelism: it needs --dp of at "
                f"least {experts.size} (a multiple of it) and torch.distributed"
            )
        self.expert_group, self.expert_replicas, held = expert_parallel(
            modules,
            experts,
            self.replicas,
            timeout,
            links,
            where,
            self.rank,
            lambda: self.executor.where(),
            self.program,
            schedule,
        )
        return held

    @property
    def has_first(self) -> bool:
        """Whether this rank runs a stage that reads the micro-batch: stage 0, or on a stage graph any source."""
        g = self.program.graph
        return 0 in self.stages if g is None else any(not g.inputs(s) for s in self.stages)

    @property
    def has_last(self) -> bool:
        return self.program.num_stages - 1 in self.stages

    def modules(self) -> dict[int, torch.nn.Module]:
        return {s: st.module for s, st in self.stages.items()}

    def where(self) -> str:
        return self.executor.where()

    def global_rank(self, rank: int) -> int:
        """The job's rank of the Program's rank `rank` in this replica (itself without a mesh or group)."""
        comm = self.executor.comm
        if self.replicas is None and getattr(comm, "peers", None) is None:
            return rank
        try:
            return comm.global_rank(rank)
        except (AttributeError, IndexError):
            return rank

    def step(self, inputs: Any = None, targets: Any = None, *, record: bool = False) -> StepResult:
        """One training step on the whole batch (inputs needed on the first stage's rank, targets on the
        last stage's); the optimizer has stepped when it returns, and `.grad` holds this step's gradients."""
        gen = self.step_gen(inputs, targets, record=record)
        try:
            while True:
                next(gen)
        except StopIteration as stop:
            return stop.value

    def step_gen(self, inputs: Any, targets: Any, *, record: bool = False) -> Generator[object, None, StepResult]:
        t0 = time.perf_counter()
        m = self.program.num_sequences
        mb_in = mb_tg = None
        given_mbs = isinstance(inputs, MicroBatches)
        if self.replicas is not None and (given_mbs or isinstance(targets, MicroBatches)):
            raise PipelineError(
                "a batch given as its micro-batches (variable shapes) runs one pipeline; with data parallelism "
                "give the global batch whole"
            )
        if self.replicas is not None:  # this replica's share of the global batch
            n, d = self.replicas.dp_size, self.replicas.dp_rank
            inputs = None if inputs is None else slice_replica(inputs, n, d, "inputs")
            targets = None if targets is None else slice_replica(targets, n, d, "targets")
        if self.has_first:
            if inputs is None:
                raise PipelineError(f"rank {self.rank} runs stage 0 and needs the inputs")
            mb_in = [as_args(to_device(x, self.device, self.dtype)) for x in split(inputs, m, "inputs")]
            if not self.lengths_warned and (differs := slices.length_mismatch(self.program.slicing, mb_in)):
                self.lengths_warned = True  # once a run: the same data would say it every step
                warnings.warn(f"rank {self.rank}, step {self.steps_done + 1}: {differs}", slices.LengthWarning, 2)
            if self.slicing is not None:
                mb_in = slices.units(mb_in, self.slicing, "inputs")
        if self.has_last:
            if targets is None:
                raise PipelineError(f"rank {self.rank} runs the last stage and needs the targets")
            mb_tg = [to_device(x, self.device) for x in split(targets, m, "targets")]
            if self.slicing is not None:
                mb_tg = slices.units(mb_tg, self.slicing, "targets")
        self.mb_targets = mb_tg
        for st in self.stages.values():
            if self.owns_grads:
                st.zero_grad()
            else:  # the caller zeroes its gradients (optimizer.zero_grad()); only the step's loss restarts
                st.loss = None
        self.executor.step, self.executor.at = self.steps_done, -1
        if mb_in is None:
            specs = None
        elif self.last_specs is not None and same_specs(mb_in, self.last_specs):
            specs = self.last_specs  # the last exchange's: no spec objects built per step
        else:
            specs = [tuple(TensorSpec.of(a) for a in args) for args in mb_in]
        if not self.handshaken:
            self.executor.handshaking = True
            yield from self._learn_varying(given_mbs)
            yield from self._exchange(specs, 0)
            self.handshaken = True
        elif self.varying:
            epoch = yield from self._epoch_of_step(specs)
            if epoch != self.epoch:
                yield from self._exchange(specs, epoch)
        elif specs is not None and specs != self.last_specs:
            i = next(i for i, (a, b) in enumerate(zip(specs, self.last_specs)) if a != b)
            raise ShapeError(
                f"micro-batch {i}'s input is {fmt(specs[i])} at step {self.steps_done + 1}, but was "
                f"{fmt(self.last_specs[i])} at the first step (shapes are fixed at the first step unless the batch "
                "comes as micro-batches: a model file's batch(step) returning a list of (inputs, targets) pairs, "
                "see pipec.runtime.model.contract)"
            )
        self.executor.record = [] if record else None
        if self.jitter is not None:
            self.jitter.step = self.steps_done
        yield from (self.executor if self.dynamic is None else self.dynamic).run(self.steps_done, mb_in, mb_tg)
        loss = None
        if self.has_last:
            loss = self.stages[self.program.num_stages - 1].loss
            if self.replicas is not None:  # the global batch's loss: the mean of the replicas'
                import torch.distributed as dist

                loss = loss.detach().clone()
                dist.all_reduce(loss, group=self.replicas.dp_group)
                loss = loss / self.replicas.dp_size
            loss = float(loss)
        self.steps_done += 1
        t1 = time.perf_counter()
        if self.executor.record is not None:  # the step's own span (see Executor's "run" event)
            self.executor.record.append(("bounds", t0, t1))
        return StepResult(self.steps_done - 1, loss, t1 - t0)

    def _learn_varying(self, given_mbs: bool) -> Generator[object, None, None]:
        """At the first step: whether the batches come as micro-batches (stage 0's rank knows, and tells)."""
        placement = self.program.placement
        others = any(r != placement[0] for r in placement)
        if 0 in self.stages:
            self.varying = given_mbs
            if others:
                self.kv.set("vary", "1" if given_mbs else "0")
        else:
            text = yield from self.kv.get("vary", "whether stage 0's batches vary in shape", placement[0])
            self.varying = text == "1"

    def _epoch_of_step(self, specs: list[Specs] | None) -> Generator[object, None, int]:
        """A varying run's exchange number for this step: stage 0's rank raises it when its inputs' shapes
        changed and publishes it; every other rank reads it (one small store read per step)."""
        step, first = self.steps_done, self.program.placement[0]
        if 0 in self.stages:
            epoch = self.epoch + 1 if specs != self.last_specs else self.epoch
            if any(r != first for r in self.program.placement):
                self.kv.set(f"epoch/{step}", str(epoch))
                # every rank read the last step's number before that step's work, which stage 0's finished
                # step needed (its backward waits for every stage's)
                self.kv.delete(f"epoch/{step - 1}")
            return epoch
        text = yield from self.kv.get(f"epoch/{step}", f"step {step + 1}'s shape exchange number", first)
        return int(text)

    def _exchange(self, specs: list[Specs] | None, epoch: int) -> Generator[object, None, None]:
        """The shape exchange (pipec.runtime.exec.shapes.handshake) under exchange number `epoch`."""
        self.executor.handshaking = True
        shapes = self.shape_modules if self.shape_modules is not None else self.modules()
        place = self.program.placement
        if self.program.graph is not None:
            graph = self.program.graph
            _, edge_in, edge_out = yield from handshake_graph(
                shapes, place, self.rank, specs, self.kv, self.device, graph, epoch
            )
        else:
            ins, outs = yield from handshake(shapes, place, self.rank, specs, self.kv, self.device, self.slicing, epoch)
        if not self.varying:  # the plain modules were kept for the exchange only (data parallelism)
            self.shape_modules = None
        self.executor.fixed_shapes = not self.varying  # receive buffers: slots, or one per message
        if self.program.graph is not None:
            self.executor.set_edge_specs(edge_in, edge_out)
        else:
            self.executor.set_specs(ins, outs)
        self.executor.handshaking = False
        self.last_specs, self.epoch = specs, epoch
        self.exchanges += 1
        if self.compile and self.exchanges == 1:
            from pipec.runtime.exec.compiled import compile_stages

            compile_stages(self.stages, self.cuda_graphs)

    def events(self) -> list[tuple]:
        """The measured events of the last step run with record=True (see pipec.runtime.trace)."""
        return list(self.executor.record or [])

    def named_gradients(self) -> dict[tuple[int, str], torch.Tensor | None]:
        """Each parameter's gradient; with data parallelism the whole (gathered) one: under fsdp that is an
        all-gather over "dp", so every replica must call it, in the same order."""
        named = [((s, n), p.grad) for s, st in self.stages.items() for n, p in st.module.named_parameters()]
        return self._whole(named)

    def named_parameters(self) -> dict[tuple[int, str], torch.Tensor]:
        """Each parameter; whole (gathered) with data parallelism, as named_gradients."""
        named = [((s, n), p) for s, st in self.stages.items() for n, p in st.module.named_parameters()]
        return self._whole(named)

    def _whole(self, named: list[tuple[tuple[int, str], torch.Tensor | None]]) -> dict:
        """Whole tensors: shards gathered over "dp" (fsdp) and experts over the expert group (in order, on
        every replica)."""
        if self.replicas is None:
            return dict(named)
        out = named_full(named)
        if self.expert_group is not None:
            experts = {(s, n) for s, st in self.stages.items() for n, p in st.module.named_parameters() if is_expert(p)}
            for k, v in named:
                if k in experts and v is not None:
                    out[k] = self.expert_group.gather(v.detach())
        return out


def same_specs(mb_in: list, specs: list[Specs]) -> bool:
    """Whether the micro-batch inputs have exactly the shapes and dtypes of `specs` (no TensorSpec built)."""
    if len(mb_in) != len(specs):
        return False
    for args, sp in zip(mb_in, specs):
        if len(args) != len(sp):
            return False
        for a, t in zip(args, sp):
            if a.shape != t.shape or a.dtype != t.dtype:
                return False
    return True


def given_modules(
    modules: Mapping[int, torch.nn.Module],
    own: list[int],
    program: Program,
    rank: int,
    dtype: torch.dtype | None,
    device: torch.device,
) -> dict[int, torch.nn.Module]:
    """This rank's stages from the caller's {stage: module}, checked against the Program's placement and
    moved to the device (and dtype, when given)."""
    missing = [s for s in own if s not in modules]
    if missing:
        raise PipelineError(
            f"rank {rank} runs stage{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of "
            f"`{program.name}` (placement {list(program.placement)}), but no module was given for "
            f"{'them' if len(missing) > 1 else 'it'} (given: stages {sorted(modules)})"
        )
    out = {}
    for s in own:
        module = modules[s]
        if not isinstance(module, torch.nn.Module):
            raise PipelineError(f"stage {s}'s module is {type(module).__name__}, not a torch.nn.Module")
        if dtype is not None:
            module = module.to(dtype)
        out[s] = module.to(device)
    return out


def default_device() -> torch.device:
    import os

    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")
