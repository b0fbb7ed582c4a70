"""Data parallelism under the pipeline: a ("pp", "dp") DeviceMesh, and each stage's module under FSDP2.

World = R ranks of the Program x N replicas. `init_device_mesh(device, (R, N), mesh_dim_names=("pp", "dp"))`
puts global rank g at (pp, dp) = divmod(g, N): replica d is ranks d, N + d, 2N + d, ...; its pipeline's
point-to-point transfers go over that replica's "pp" group (the Program's rank r is pp coordinate r), and
the replicas of one pipeline rank share a "dp" group for the collectives.

Both kinds use torch's FSDP2 machinery, not hand-written bucketing:

- "ddp": `replicate` (torch.distributed._composable.replicate_with_fsdp), FSDP2 with replicated
  parameters; REDUCE_GRAD all-reduces the accumulated gradients.
- "fsdp": `fully_shard` of the stage (or of each child block, then the stage: `unit="block"`); parameters,
  gradients and optimizer state sharded over "dp"; UNSHARD all-gathers (`unshard(async_op=True)`), RESHARD
  frees (`reshard()`), REDUCE_GRAD reduce-scatters.

Why the module's own hooks are not left to decide: a pipeline runs many micro-batch backwards of a stage,
interleaved with other stages, and the gradients must be reduced once, after the last one (the Program's
REDUCE_GRAD). So, as torch.distributed.pipelining's `backward_maybe_with_nosync` and `perform_reduce_grad`
do, gradient sync is off during the micro-batches (`set_requires_gradient_sync(False)`,
`set_is_last_backward(False)`, `set_reshard_after_backward(False)`: gradients accumulate unsharded), and
REDUCE_GRAD runs each parameter group's post-backward with sync on. On CUDA, FSDP2 issues the reduction on
its own stream, so it can overlap what follows until STEP waits (`_root_post_backward_final_callback`; not
run on a GPU in this repository's tests); on gloo, FSDP2's reduce-scatter and all-reduce are blocking
calls, so the reduction finishes at REDUCE_GRAD.
Without UNSHARD instructions FSDP2's pre-forward hook gathers the parameters itself; STEP reshards a stage
still gathered, so the next step's forward gathers the updated shards.

The replicas average their gradients (FSDP2's default divide factor, the dp size), so a replica scales its
micro-batch losses as a lone pipeline does (1/m by default) and the result equals one pipeline over the
whole global batch (N x the micro-batch count) with losses scaled 1/(N m): what `--check` compares.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from pipec.runtime.errors import CollectiveError, PipelineError

KINDS = ("ddp", "fsdp")
UNITS = ("stage", "block")


@dataclass(frozen=True)
class ReplicaMesh:
    """This process's place in the ("pp", "dp") mesh: the groups, its coordinates and the sizes."""

    mesh: Any  # the 2-D DeviceMesh, or None when given as two 1-D sub-meshes
    pp_mesh: Any
    dp_mesh: Any
    pp_rank: int
    dp_rank: int
    pp_size: int
    dp_size: int

    @property
    def pp_group(self) -> Any:
        return self.pp_mesh.get_group()

    @property
    def dp_group(self) -> Any:
        return self.dp_mesh.get_group()


def check_world(num_ranks: int, dp: int, world: int) -> str | None:
    """Why a job of `world` processes cannot run `num_ranks` ranks x `dp` replicas (None when it can)."""
    if dp < 1:
        return f"data parallelism: the size (--dp) must be an integer >= 1, got {dp}"
    if world % dp:
        return f"--dp {dp} does not divide the {world} processes of this job"
    if world != num_ranks * dp:
        return (
            f"the Program has {num_ranks} ranks and --dp {dp} asks for {dp} replicas of each: that is "
            f"{num_ranks * dp} processes, but this job has {world}; launch {num_ranks * dp} "
            "(torchrun --nproc-per-node/--nnodes, or pipec run --nproc)"
        )
    return None


def make_mesh(num_ranks: int, dp: int, device_type: str = "cpu", timeout: float | None = None) -> ReplicaMesh:
    """The ("pp", "dp") mesh of an initialised job of num_ranks x dp processes; every process calls it.
    Both dims' groups get the run's `timeout`, so no collective waits longer than a transfer would."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    problem = check_world(num_ranks, dp, dist.get_world_size())
    if problem:
        raise PipelineError(problem)
    mesh = init_device_mesh(device_type, (num_ranks, dp), mesh_dim_names=("pp", "dp"))
    rm = as_replica_mesh(mesh)
    if timeout is not None:
        set_timeout(rm, timeout)
    return rm


def set_timeout(rm: ReplicaMesh, timeout: float) -> None:
    """Every collective and transfer on the mesh's groups gives up after `timeout` seconds (gloo raises;
    NCCL's watchdog aborts), instead of the backend's default of 10 or 30 minutes."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    for m in (rm.pp_mesh, rm.dp_mesh):
        _set_pg_timeout(timedelta(seconds=timeout), m.get_group())


def as_replica_mesh(mesh: Any) -> ReplicaMesh:
    """A ReplicaMesh from a 2-D DeviceMesh named ("pp", "dp"), or from a (pp, dp) pair of 1-D meshes."""
    if isinstance(mesh, ReplicaMesh):
        return mesh
    if isinstance(mesh, (tuple, list)):
        if len(mesh) != 2:
            raise PipelineError(f"mesh= takes a 2-D DeviceMesh or a (pp, dp) pair of 1-D meshes, got {len(mesh)}")
        pp, dp, full = mesh[0], mesh[1], None
        for what, m in (("pp", pp), ("dp", dp)):
            if m.ndim != 1:
                raise PipelineError(f"the {what} sub-mesh must be 1-D, it has {m.ndim} dimensions")
    else:
        names = tuple(mesh.mesh_dim_names or ())
        if mesh.ndim != 2 or set(names) != {"pp", "dp"}:
            raise PipelineError(
                f"mesh= must be a 2-D DeviceMesh with dims named 'pp' and 'dp', got {mesh.ndim}-D with names {names}"
            )
        pp, dp, full = mesh["pp"], mesh["dp"], mesh
    return ReplicaMesh(full, pp, dp, pp.get_local_rank(), dp.get_local_rank(), pp.size(), dp.size())


def check_mesh(program: Any, rm: ReplicaMesh) -> None:
    """The mesh and the Program agree: pp size = the Program's ranks, dp size = `program.dp`."""
    if rm.pp_size != program.num_ranks:
        raise PipelineError(
            f"the mesh's 'pp' dimension has {rm.pp_size} ranks but the Program for `{program.name}` has "
            f"{program.num_ranks}"
        )
    if rm.dp_size != program.dp:
        raise PipelineError(
            f"the mesh's 'dp' dimension has {rm.dp_size} replicas but the Program for `{program.name}` was "
            f"compiled for dp={program.dp}; compile it with data_parallel=DataParallel(size={rm.dp_size}, "
            f"kind={program.dp_kind!r}) (pipec.compile), or give a mesh with {program.dp} replicas"
        )


def check_program(program: Any) -> None:
    """A Program's data-parallel fields make sense for the runtime: a known kind, and UNSHARD/RESHARD only
    where the parameters are sharded."""
    from pipec.ir.opcodes import CODE

    if program.dp_kind not in KINDS:
        raise PipelineError(f"the Program's dp kind is {program.dp_kind!r}; the runtime knows {', '.join(KINDS)}")
    if program.dp_kind == "ddp":
        gather = (CODE["UNSHARD"], CODE["RESHARD"])
        for r, rp in enumerate(program.ranks):
            bad = [j for j, op in enumerate(rp.op.tolist()) if op in gather]
            if bad:
                raise PipelineError(
                    f"rank {r}'s instruction #{bad[0]} is {program.ranks[r].instructions()[bad[0]].op}, but the "
                    "Program is ddp (replicated parameters): UNSHARD and RESHARD belong to fsdp Programs"
                )


def check_not_shared(modules: dict[int, torch.nn.Module], kind: str, unit: str) -> None:
    """FSDP2 owns each parameter in exactly one unit: a Parameter object in two stages of this rank (a
    tied weight built once and returned twice), or in two blocks when sharding per block, cannot be sharded
    twice. Said before any step, naming both places."""
    seen: dict[int, str] = {}
    for s, module in modules.items():
        units = _units(module) if unit == "block" else [("", module)]
        for uname, u in units:
            where = f"stage {s}" + (f" block `{uname}`" if uname else "")
            for n, p in u.named_parameters(remove_duplicate=False):
                other = seen.get(id(p))
                if other is not None and other != where:
                    raise PipelineError(
                        f"{kind}: parameter `{n}` of {where} is the same Parameter as one of {other}; parameters "
                        f"shared across {'stages' if unit == 'stage' else 'blocks or stages'} cannot be "
                        f"{'sharded' if kind == 'fsdp' else 'replicated'} per "
                        f"{unit} (untie them, or keep the tied modules in one {unit})"
                    )
                seen[id(p)] = where


def _units(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Per-block sharding: each direct child holding parameters is a unit, the blocks of a container child
    (a ModuleList or ModuleDict: no forward of its own, so FSDP2 cannot gather it) each one unit; the stage
    keeps the rest."""
    kids = _blocks(module)
    own = [p for p in module.parameters(recurse=False)]
    return kids + ([("", module)] if own or not kids else [])


def _blocks(module: torch.nn.Module, prefix: str = "") -> list[tuple[str, torch.nn.Module]]:
    """The blocks of `module` that hold parameters: its children, a container's children in its place."""
    out: list[tuple[str, torch.nn.Module]] = []
    for n, c in module.named_children():
        if not any(True for _ in c.parameters()):
            continue
        if isinstance(c, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            out += _blocks(c, f"{prefix}{n}.")
        else:
            out.append((f"{prefix}{n}", c))
    return out


def wrap(
    module: torch.nn.Module,
    kind: str,
    rm: ReplicaMesh,
    unit: str = "stage",
    ignored: set[torch.nn.Parameter] | None = None,
) -> torch.nn.Module:
    """The stage's module under FSDP2 on the "dp" mesh (in place; returns it), gradient sync off. `ignored`
    parameters (expert shards: pipec.runtime.model.moe) stay plain tensors, left out of every collective."""
    ignored = {p for p in module.parameters() if p in ignored} if ignored else None
    from torch.distributed.fsdp import fully_shard

    if kind == "ddp":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        replicate(module, mesh=rm.dp_mesh, ignored_params=ignored)
    elif kind == "fsdp":
        if unit == "block":
            for _, child in _blocks(module):
                fully_shard(child, mesh=rm.dp_mesh, reshard_after_forward=False, ignored_params=ignored)
        # Gathered parameters stay gathered until the Program's RESHARD (or STEP) frees them.
        fully_shard(module, mesh=rm.dp_mesh, reshard_after_forward=False, ignored_params=ignored)
    else:
        raise PipelineError(f"unknown dp kind {kind!r}; expected one of {', '.join(KINDS)}")
    _accumulate(module)
    return module


def _accumulate(module: Any) -> None:
    module.set_requires_gradient_sync(False)
    module.set_is_last_backward(False)
    module.set_reshard_after_backward(False)


def _fsdp_modules(module: torch.nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def _state(module: Any) -> Any:
    from torch.distributed._composable.replicate_with_fsdp import ReplicateModule, replicate
    from torch.distributed.fsdp import fully_shard

    return replicate.state(module) if isinstance(module, ReplicateModule) else fully_shard.state(module)


def _reduction(module: Any) -> str:
    """The ring collective REDUCE_GRAD runs on a wrapped stage: all-reduce (ddp), reduce-scatter (fsdp)."""
    from torch.distributed._composable.replicate_with_fsdp import ReplicateModule

    return "all_reduce" if isinstance(module, ReplicateModule) else "reduce_scatter"


class StageDP:
    """What the executor does for UNSHARD, RESHARD, REDUCE_GRAD and STEP of one rank's stages.

    `where` says which rank and instruction a failed collective belongs to (the executor's position)."""

    def __init__(
        self, modules: dict[int, torch.nn.Module], rank: int, dp_rank: int, where: Any, peers: list[int] | None = None
    ) -> None:
        self.modules = modules
        self.units = {s: _fsdp_modules(m) for s, m in modules.items()}
        self.rank, self.dp_rank = rank, dp_rank
        self.where = where
        self.peers = peers or []  # the job ranks of this rank's other replicas
        self.pending: dict[int, list[Any]] = {}  # stage -> unshard handles not yet waited on
        self.reducing: set[int] = set()
        # --emulate-links across replica datacenters (pipec.runtime.exec.links.DPLink), and per stage the
        # emulated end of its all-gather and of its reduction in flight
        self.link: Any = None
        self.gather_end: dict[int, float] = {}
        self.reduce_end: dict[int, float] = {}

    def _fail(self, what: str, e: BaseException) -> CollectiveError:
        from pipec.runtime.exec.comm import short_error

        msg = "timed out" if "timed out" in str(e).lower() else short_error(e, 0.0)
        where = f"rank {self.rank} (replica {self.dp_rank})"
        return CollectiveError(f"{where}: {what} at {self.where()} failed: {msg}", self.peers)

    def unshard(self, s: int) -> None:
        """UNSHARD s: start the all-gather of every FSDP unit of stage s."""
        if s in self.pending:
            return  # already in flight (a prefetch placed twice is harmless)
        try:
            issued = self.link.issued() if self.link is not None else None
            self.pending[s] = [u.unshard(async_op=True) for u in self.units[s]]
        except Exception as e:
            raise self._fail(f"starting the all-gather of stage {s}", e) from e
        if issued is not None:
            self.gather_end[s] = self.link.end("all_gather", issued, self.modules[s])

    def ready(self, s: int) -> None:
        """Before a compute of s: wait for its UNSHARD (within the process group's timeout)."""
        handles = self.pending.pop(s, None)
        if not handles:
            return
        try:
            for h in handles:
                if h is not None:
                    h.wait()
        except Exception as e:
            raise self._fail(f"the all-gather of stage {s}'s parameters", e) from e
        if self.link is not None:
            self.link.hold(self.gather_end.pop(s, None), f"stage {s}'s all-gather", self.where())

    def reshard(self, s: int) -> None:
        """RESHARD s: free the gathered parameters (after any all-gather still in flight)."""
        self.ready(s)
        for u in self.units[s]:
            u.reshard()

    def reduce_grad(self, s: int) -> None:
        """REDUCE_GRAD s: every parameter group's post-backward with gradient sync on (reduce-scatter or
        all-reduce of the accumulated gradients), as torch's `perform_reduce_grad` does."""
        self.ready(s)
        root = self.modules[s]
        root.set_requires_gradient_sync(True)
        root.set_is_last_backward(True)
        try:
            issued = self.link.issued() if self.link is not None else None
            for state in _state(root)._state_ctx.all_states:
                for group in state._fsdp_param_groups:
                    group.post_backward()
        except Exception as e:
            raise self._fail(f"stage {s}'s gradient reduction", e) from e
        if issued is not None:
            self.reduce_end[s] = self.link.end(_reduction(root), issued, root)
        self.reducing.add(s)

    def finish(self, s: int) -> None:
        """At STEP s: wait for the reduction, free gathered parameters, turn gradient sync off again."""
        root = self.modules[s]
        if s not in self.reducing:  # a Program without REDUCE_GRAD for s is rejected by validate
            raise PipelineError(f"rank {self.rank}: STEP {s} at {self.where()} before stage {s}'s REDUCE_GRAD")
        self.reducing.discard(s)
        try:
            _state(root)._root_post_backward_final_callback()
        except Exception as e:
            raise self._fail(f"waiting for stage {s}'s gradient reduction", e) from e
        if self.link is not None:
            self.link.hold(self.reduce_end.pop(s, None), f"stage {s}'s gradient reduction", self.where())
        self.reshard(s)
        _accumulate(root)


def replica_peers(rm: ReplicaMesh) -> list[int]:
    """The job ranks of the other replicas of this pipeline rank (this process's "dp" group but itself)."""
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(rm.dp_group)
    me = dist.get_rank()
    return [r for r in ranks if r != me]


def slice_replica(batch: Any, dp: int, d: int, what: str = "batch") -> Any:
    """Replica d's rows of the global batch: part d of `dp` along dimension 0 (torch.tensor_split, so the
    same on every process and in the reference)."""
    from pipec.runtime.exec.microbatch import split

    return split(batch, dp, what)[d] if dp > 1 else batch


def full(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's whole value (an all-gather over "dp" for a shard: every replica must call it, in the
    same order); a plain tensor as it is."""
    if t is None:
        return None
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def named_full(tensors: Sequence[tuple[Any, torch.Tensor | None]]) -> dict[Any, torch.Tensor | None]:
    return {k: None if v is None else full(v.detach()) for k, v in tensors}
