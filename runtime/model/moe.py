"""The mixture-of-experts part of the model contract: which modules are experts, and sharding them over an
expert group (pipec.runtime.exec.alltoall runs them).

An MoE layer's experts are one module with an integer attribute `num_experts`, every parameter of which
(its own: no child holds parameters) has the experts along dim 0, called as `experts(tokens, counts)` with
the tokens grouped by expert in expert order and `counts` the tokens of each, one count per expert the
module holds (so the same forward runs all experts, or a shard of them). torchtitan's `GroupedExperts` has
this shape; examples/moe.py is one.

With an expert group of `size` ranks, member i keeps experts [i E/size, (i+1) E/size) of every such module
(its parameters become those rows, marked `is_expert`), and its forward goes through the group: dispatch,
the local experts, combine. Expert parameters are left out of the data-parallel all-reduce over "dp"
(their gradients already hold every member's tokens) and reduced over the replicas of the expert group
instead when there are several groups (`ExpertGrads`).

Every problem is said before the first step, naming the stage and the module.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from pipec.runtime.errors import PipelineError

# expert shard -> the process group of the expert group its experts are spread over: what a global gradient
# norm (pipec.runtime.clip_grad_norm_) sums a shard's share over, given only the parameters
_GROUP_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()


def expert_modules(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The experts modules of a stage, in module order (each is one MoE layer)."""
    return [(n, m) for n, m in module.named_modules() if isinstance(getattr(m, "num_experts", None), int)]


def layer_counts(modules: dict[int, torch.nn.Module]) -> dict[int, int]:
    """MoE layers per stage."""
    return {s: len(expert_modules(m)) for s, m in modules.items()}


def digest(modules: dict[int, torch.nn.Module]) -> dict[int, list[tuple[str, int]]]:
    """Per stage, each MoE layer's name and expert count: what every member of an expert group must share."""
    return {s: [(n, e.num_experts) for n, e in expert_modules(m)] for s, m in sorted(modules.items())}


def check_experts(modules: dict[int, torch.nn.Module], size: int, num: int, where: str) -> None:
    """The experts modules fit expert groups of `size` ranks (and `--experts num`, when num > 0)."""
    for s, module in modules.items():
        for name, e in expert_modules(module):
            at = f"{where}: stage {s}'s experts module `{name}`"
            if e.num_experts < 1:
                raise PipelineError(f"{at} has num_experts = {e.num_experts}; it must be at least 1")
            if num and e.num_experts != num:
                raise PipelineError(f"{at} has {e.num_experts} experts, but --experts says {num}")
            if e.num_experts % size:
                raise PipelineError(
                    f"{at} has {e.num_experts} experts, which cannot be sharded evenly over an expert group of "
                    f"{size} ranks (--ep); give it a multiple of {size}"
                )
            kids = [n for n, c in e.named_children() if any(True for _ in c.parameters())]
            if kids:
                raise PipelineError(f"{at} has parameters in its child `{kids[0]}`: an experts module holds its own")
            for pn, p in e.named_parameters(recurse=False):
                if p.dim() == 0 or p.shape[0] != e.num_experts:
                    raise PipelineError(
                        f"{at}: parameter `{pn}` has shape {tuple(p.shape)}, but every parameter of an experts module "
                        f"has the experts along dim 0 ({e.num_experts})"
                    )


def shard(modules: dict[int, torch.nn.Module], group: Any) -> set[torch.nn.Parameter]:
    """Keep this member's experts of every experts module and route its forward through `group` (a
    pipec.runtime.exec.alltoall.ExpertGroup); the expert parameters, now shards."""
    held: set[torch.nn.Parameter] = set()
    for module in modules.values():
        for _, e in expert_modules(module):
            per = e.num_experts // group.size
            lo = group.index * per
            for pn, p in list(e.named_parameters(recurse=False)):
                q = torch.nn.Parameter(p.detach()[lo : lo + per].clone(), requires_grad=p.requires_grad)
                q.is_expert = True
                setattr(e, pn, q)
                held.add(q)
                _GROUP_OF[q] = group.pg
            local = e.forward  # the module's own forward, now over its shard

            def forward(self: torch.nn.Module, tokens: torch.Tensor, counts: Any, _local: Any = local) -> torch.Tensor:
                return group.forward(_local, tokens, counts)

            e.forward = types.MethodType(forward, e)
    return held


def is_expert(p: Any) -> bool:
    return bool(getattr(p, "is_expert", False))


def expert_process_group(p: Any) -> Any:
    """The process group of the expert group whose members hold the other shards of expert parameter `p`
    (None when `p` is not a shard `shard` made): its members' shards together are the whole parameter."""
    return _GROUP_OF.get(p)


class ExpertGrads:
    """At REDUCE_GRAD: an expert parameter's gradient already sums the tokens of its expert group's
    members (each loss scaled as one replica's); summed over the groups (`replica_group`, the members at
    this place in every group; None with one group) and divided by the dp size it is the global batch's,
    as the "dp" all-reduce's average is for the other parameters."""

    def __init__(self, params: dict[int, list[torch.nn.Parameter]], dp_size: int, replica_group: Any) -> None:
        self.params, self.dp_size, self.group = params, dp_size, replica_group

    def reduce(self, s: int) -> None:
        import torch.distributed as dist

        for p in self.params.get(s, ()):
            if p.grad is None:
                continue
            if self.group is not None:
                dist.all_reduce(p.grad, group=self.group)
            p.grad.div_(self.dp_size)


def by_stage(modules: dict[int, torch.nn.Module]) -> dict[int, list[torch.nn.Parameter]]:
    """Each stage's expert parameters (shards)."""
    return {s: [p for p in m.parameters() if is_expert(p)] for s, m in modules.items()}


def expert_groups(rm: Any, size: int, timeout: float) -> tuple[Any, list[int], int, Any]:
    """This process's expert group in the ("pp", "dp") mesh `rm` (pipec.runtime.exec.replicas.ReplicaMesh):
    (its process group, its members' job ranks, this process's index in it, and the process group of the
    members at this index in every expert group of this pipeline rank, None when there is one group).
    Members only create each group (`use_local_synchronization`), expert group first, so every process
    makes the same calls in the same order."""
    from datetime import timedelta

    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(rm.dp_group)  # in "dp" order
    d = rm.dp_rank
    g, i = divmod(d, size)
    members = ranks[g * size : (g + 1) * size]
    t = timedelta(seconds=timeout)
    pg = dist.new_group(members, timeout=t, use_local_synchronization=True)
    replica = None
    if len(ranks) > size:
        peers = [ranks[k * size + i] for k in range(len(ranks) // size)]
        replica = dist.new_group(peers, timeout=t, use_local_synchronization=True)
    return pg, members, i, replica


def check_same_layers(
    modules: dict[int, torch.nn.Module],
    pg: Any,
    members: list[int],
    index: int,
    program: Any,
    rank: int,
    schedule: Any = None,
) -> None:
    """Every member of an expert group builds the same MoE layers on every stage (names and expert counts):
    exchanged once before the first step (a small all-gather of objects), a mismatch said by `layers_error`."""
    import torch.distributed as dist

    everyone: list[Any] = [None] * len(members)
    dist.all_gather_object(everyone, digest(modules), group=pg)
    problem = layers_error(program, rank, dict(zip(members, everyone)), schedule)
    if problem:
        raise PipelineError(problem)


def layers_error(program: Any, rank: int, digests: dict[int, dict[int, list[tuple[str, int]]]], schedule: Any) -> str:
    """Why the members of an expert group of pipeline rank `rank` (job rank -> its `digest`) cannot run
    together ("" when they can). Layer counts that change the all-to-all order are E427, the diagnostic of
    the compile-time check (pipec.passes.experts.order_error, located in `schedule` when given); the same
    counts with other names or expert counts are said naming both job ranks. Every member says it the same
    way (the lower rank first), whichever reports first."""
    from pipec.passes.experts import order_error

    S = program.num_stages
    counts = {g: tuple(len(d.get(s, ())) for s in range(S)) for g, d in digests.items()}
    e = order_error(program, rank, counts, schedule)
    if e is not None:
        return "\n".join(d.format() for d in e.diagnostics)
    (a, da), *rest = sorted(digests.items())
    for b, db in rest:
        if db != da:
            s = next(s for s in sorted(set(da) | set(db)) if da.get(s) != db.get(s))
            return (
                f"the expert group's members build different MoE layers: job rank {a} builds stage {s} "
                f"with {_layers(da.get(s))}, job rank {b} with {_layers(db.get(s))} (every member of "
                "an expert group runs the same stages, and must issue the same all-to-alls in the same order)"
            )
    return ""


def _layers(layers: list[tuple[str, int]] | None) -> str:
    if not layers:
        return "no MoE layer"
    return f"{len(layers)} MoE layer(s) (" + ", ".join(f"`{n}`: {e} experts" for n, e in layers) + ")"


def expert_parallel(
    modules: dict[int, torch.nn.Module],
    experts: Any,
    rm: Any,
    timeout: float,
    links: Any,
    where: str,
    rank: int,
    position: Any,
    program: Any,
    schedule: Any = None,
) -> tuple[Any, Any, set[torch.nn.Parameter]]:
    """Expert parallelism for this rank's stages `modules` (before FSDP2 wraps them and before the
    optimizers): the checks (the group fits the dp size, the experts modules fit the group and `--experts`,
    the model has MoE layers at all, the group's members build the same ones), then the expert group
    (pipec.runtime.exec.alltoall.ExpertGroup, with its emulated link when `links` has one) and the sharding.
    Returns (the group, the process group over the groups' members at this place or None, the shards).
    `experts` is a pipec.ir.experts.Experts, `rm` the ReplicaMesh, `position()` names where the rank is,
    `rank` the pipeline rank of `program`, lowered from `schedule` (when known: it locates a diagnostic)."""
    import torch.distributed as dist

    from pipec.runtime.exec.alltoall import ExpertGroup

    problem = experts.fits(rm.dp_size)
    if problem:
        raise PipelineError(f"expert parallelism: {problem}")
    check_experts(modules, experts.size, experts.num, where)
    device = next((p.device for m in modules.values() for p in m.parameters()), torch.device("cpu"))
    total = torch.tensor([sum(layer_counts(modules).values())], dtype=torch.int64, device=device)
    dist.all_reduce(total, group=rm.pp_group)  # over the pipeline's ranks: does the model have any?
    if not int(total):
        raise PipelineError(
            f"--ep {experts.size}: the model has no MoE layer (no experts module, a module with an integer "
            '`num_experts`; see docs/runtime.md, "Mixture of experts"), so there is nothing to shard'
        )
    pg, members, index, replicas = expert_groups(rm, experts.size, timeout)
    check_same_layers(modules, pg, members, index, program, rank, schedule)
    link = links.replica_link(rm.dp_rank, experts.size) if links is not None else None
    group = ExpertGroup(pg, members, index, rank=rank, dp_rank=rm.dp_rank, timeout=timeout, where=position, link=link)
    return group, replicas, shard(modules, group)
