"""A torch-native schedule API: pipec's compiled Programs behind the shape of torch's `PipelineSchedule*`.

    from pipec.runtime import PipelineSchedule, clip_grad_norm_
    from pipec.runtime.model.split import split_model   # (`pipec.runtime.model.split` is the module)

    stages = split_model(model, [["transformer.wte", "transformer.wpe", "transformer.h.0"], [...], ...])
    schedule = PipelineSchedule("interleaved-1f1b", stages, loss_fn, n_microbatches=8, mesh=pp_mesh)
    opt = torch.optim.AdamW(schedule.parameters(), lr=3e-4)       # the user's optimizer, on its own stages
    for x, y in data:
        opt.zero_grad()
        losses = []
        schedule.step(x, target=y, losses=losses)                  # inputs on stage 0's rank, target on the last's
        clip_grad_norm_(schedule.parameters(), 1.0, mesh=pp_mesh)  # the norm over every stage, every rank
        opt.step()

Why a second API beside `Runner`: a torch or torchtitan user has modules (or `PipelineStage`s), an optimizer,
an LR scheduler and gradient clipping already; the schedule should only run the forward and backward passes
in its order, as torch's schedule classes do. So the stages' modules are the caller's, no optimizer is built,
the Program's STEP instructions do nothing, and `.grad` is never zeroed here (the caller's `zero_grad`, as
after torch's `step`). The Program runs on `Runner` (pipec.runtime.runner) and its executor, unchanged.

Loss scaling as torch's: `scale_grads=True` (the default) gives the mean of the micro-batch gradients (each
micro-batch loss scaled 1/m, pipec's default); False, their sum. `losses` receives each micro-batch's
unscaled loss, in micro-batch order; `step` returns the last stage's output, micro-batches concatenated on
dim 0 (None on other ranks), like torch's.

Stages on several ranks that share a Parameter (a tied input embedding and LM head, as `split_model` marks
them) get their copies' gradients summed at the end of `step` (an all-reduce between exactly the ranks that
hold a copy, as Megatron does for its shared embedding); `clip_grad_norm_` counts such a weight once.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from pipec.ir.program import Program
from pipec.runtime.errors import PipelineError
from pipec.runtime.exec.microbatch import as_args, split, to_device
from pipec.runtime.runner import Runner, StageOptions, Transport

TIED_ATTR = "_pipec_tied_copy"  # set on a tied Parameter's copies that `clip_grad_norm_` must not count again


def compile_for(
    schedule: str | os.PathLike | Program,
    params: Mapping[str, object] | None,
    *,
    num_ranks: int,
    num_stages: int | None,
    n_microbatches: int | None,
    dp: int = 1,
    dp_kind: str | None = None,
) -> Program:
    """The Program of a schedule given by library name or .pipe path (p, m and v filled in from the job
    when the schedule declares them and they are not given), or a compiled Program as it is. `dp_kind`:
    None is the Program's own (ddp when compiling); a kind other than a given Program's is refused, since
    the Program's collectives, not this argument, decide whether parameters are sharded. Without data
    parallelism (dp 1) there is nothing to shard or replicate over, so any kind is accepted, and "fsdp"
    (or one unlike the Program's) warned about: it cannot do what it asks."""
    from pipec.ir.dataparallel import KINDS

    if dp_kind is not None and dp_kind not in KINDS:
        raise PipelineError(
            f"dp_kind must be one of {', '.join(map(repr, KINDS))} (or None: the Program's own), got {dp_kind!r}"
        )
    single = (schedule.dp if isinstance(schedule, Program) else dp) == 1 and dp == 1
    if single and dp_kind is not None and dp_kind != (schedule.dp_kind if isinstance(schedule, Program) else "ddp"):
        warnings.warn(
            f"dp_kind={dp_kind!r} means nothing without data parallelism (dp=1): every parameter stays whole "
            "on its rank; shard them with a 2-D ('pp', 'dp') mesh whose 'dp' size is 2 or more (and a Program "
            f"compiled for it), or leave dp_kind out",
            UserWarning,
            stacklevel=3,
        )
    if isinstance(schedule, Program):
        program = schedule
        if dp_kind is not None and dp_kind != program.dp_kind and not single:
            raise PipelineError(
                f"dp_kind={dp_kind!r}, but the Program for `{program.name}` was compiled for "
                f"dp_kind={program.dp_kind!r} (dp={program.dp}): compile it with "
                f"data_parallel=DataParallel(size=..., kind={dp_kind!r}), or leave dp_kind out"
            )
    else:
        import pipec
        from pipec.driver import param_names
        from pipec.frontend.library import read
        from pipec.ir.dataparallel import DataParallel

        names = param_names(read(os.fspath(schedule)))
        merged = dict(params or {})
        if "p" in names:
            merged.setdefault("p", num_ranks)
        if "m" in names and n_microbatches is not None:
            merged.setdefault("m", n_microbatches)
        if "v" in names and num_stages is not None and num_ranks and num_stages % num_ranks == 0:
            merged.setdefault("v", num_stages // num_ranks)
        data_parallel = DataParallel(size=dp, kind=dp_kind or "ddp") if dp > 1 else None
        program = pipec.compile(schedule, merged, data_parallel=data_parallel)
    if n_microbatches is not None and program.num_microbatches != n_microbatches:
        raise PipelineError(
            f"n_microbatches={n_microbatches}, but the Program for `{program.name}` has m={program.num_microbatches}"
        )
    if num_stages is not None and program.num_stages != num_stages:
        raise PipelineError(
            f"the model is split into {num_stages} stages, but `{program.name}` ({describe(program)}) has "
            f"{program.num_stages} stages (placement {list(program.placement)}); split it into "
            f"{program.num_stages}, or choose the schedule's parameters for {num_stages}"
        )
    return program


def describe(program: Program) -> str:
    return " ".join(f"{k}={v}" for k, v in program.params) or "no parameters"


def stage_indices(program: Program, rank: int) -> list[int]:
    """The stages rank `rank` runs, from the compiled schedule's placement (several for interleaved, V or
    any `place`)."""
    return [s for s, r in enumerate(program.placement) if r == rank]


def _as_stage_map(stages: Any) -> tuple[dict[int, torch.nn.Module], int | None]:
    """{stage index: module} and the stage count the stages say (None when they do not say it), from torch
    PipelineStages, split_model's StageModules, a mapping, or a list of every stage's module."""
    if isinstance(stages, Mapping):
        return dict(stages), None
    items = list(stages) if isinstance(stages, (list, tuple)) else [stages]
    out: dict[int, torch.nn.Module] = {}
    counts = set()
    plain = []
    for it in items:
        if it is None:  # split_model(only=...): another rank's stage, not built here
            continue
        if hasattr(it, "submod") and hasattr(it, "stage_index"):  # torch.distributed.pipelining PipelineStage
            out[int(it.stage_index)] = it.submod
            counts.add(int(it.num_stages))
        elif isinstance(it, torch.nn.Module) and hasattr(it, "stage_index") and hasattr(it, "num_stages"):
            out[int(it.stage_index)] = it  # split_model's StageModule
            counts.add(int(it.num_stages))
        elif isinstance(it, torch.nn.Module):
            plain.append(it)
        else:
            raise PipelineError(f"a stage must be a torch PipelineStage or an nn.Module, not {type(it).__name__}")
    if plain:
        if out or not isinstance(stages, (list, tuple)):
            raise PipelineError(
                "plain nn.Modules carry no stage index: give {stage index: module}, or a list of every stage's "
                "module in stage order (or PipelineStages, or split_model's stages)"
            )
        return dict(enumerate(plain)), len(items)
    if len(counts) > 1:
        raise PipelineError(f"the stages disagree on the stage count: {sorted(counts)}")
    return out, (counts.pop() if counts else None)


class PipelineSchedule:
    """One rank's part of a pipec schedule, with torch's `step(*inputs, target=, losses=)` and `eval`.

    schedule: a library name or .pipe path (with `params`, e.g. {"v": 2}; p, m and v default to the job's
        ranks, `n_microbatches` and stages per rank), or a compiled `pipec.Program`.
    stages: this rank's torch `PipelineStage`s, split_model's stages (all of them or this rank's: each rank
        keeps the ones the placement gives it), {stage index: module}, or every stage's module in order.
    mesh: a 1-D DeviceMesh of the pipeline ranks (named "pp" or not), or a 2-D one with dims ("pp", "dp")
        (data parallelism: `step` takes the global batch, each replica runs its slice); default: the world.
    A Program compiled with `experts=` (pipec.Experts) has its MoE layers' experts sharded over its expert
    groups of "dp" replicas, as `Runner` with `Transport(experts=...)` and `pipec run --ep` do: each member
    keeps its share of the experts, and `clip_grad_norm_` counts every shard once.
    compile: each stage's forward and backward through torch.compile, split backward included (B the input
        gradient, W the weight gradient: pipec.runtime.exec.compiled); cuda_graphs: compiled with CUDA graphs
        (CUDA only).
    """

    def __init__(
        self,
        schedule: str | os.PathLike | Program,
        stages: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        *,
        n_microbatches: int | None = None,
        params: Mapping[str, object] | None = None,
        mesh: Any = None,
        group: Any = None,
        scale_grads: bool = True,
        device: torch.device | str | None = None,
        timeout: float = 60.0,
        recv_ahead: int | None = None,
        dp_kind: str | None = None,
        dp_unit: str = "stage",
        rank: int | None = None,
        comm: Any = None,
        kv: Any = None,
        compile: bool = False,
        cuda_graphs: bool = False,
    ) -> None:
        import torch.distributed as dist

        modules, said = _as_stage_map(stages)
        pp_group, dp_size, mesh2d = group, 1, None
        if mesh is not None:
            if mesh.ndim == 1:
                pp_group = mesh.get_group()
            elif mesh.ndim == 2:
                names = tuple(mesh.mesh_dim_names or ())
                if set(names) != {"pp", "dp"}:
                    raise PipelineError(f"a 2-D mesh must have dims named 'pp' and 'dp', got {names}")
                mesh2d, dp_size, pp_group = mesh, mesh["dp"].size(), mesh["pp"].get_group()
            else:
                raise PipelineError(f"mesh= takes a 1-D 'pp' or a 2-D ('pp', 'dp') DeviceMesh, got {mesh.ndim}-D")
        if comm is None:
            if not dist.is_initialized():
                raise PipelineError("torch.distributed is not initialised: call init_process_group first")
            num_ranks = dist.get_world_size(pp_group)
            rank = dist.get_rank(pp_group) if rank is None else rank
        else:
            num_ranks = None if isinstance(schedule, Program) else (params or {}).get("p")
        if num_ranks is None and isinstance(schedule, Program):
            num_ranks = schedule.num_ranks
        self.program = compile_for(
            schedule,
            params,
            num_ranks=num_ranks,
            num_stages=said,
            n_microbatches=n_microbatches,
            dp=dp_size,
            dp_kind=dp_kind,
        )
        if comm is None and dist.get_world_size(pp_group) != self.program.num_ranks:
            from pipec.runtime.errors import wrong_world_size

            raise PipelineError(wrong_world_size(self.program, dist.get_world_size(pp_group)))
        own = stage_indices(self.program, rank)
        bad = [s for s in modules if not 0 <= s < self.program.num_stages]
        if bad:
            raise PipelineError(
                f"stage {bad[0]} is not a stage of `{self.program.name}` ({describe(self.program)}), which has "
                f"stages 0..{self.program.num_stages - 1}"
            )
        self.rank = rank
        self.loss_fn = loss_fn
        self._outputs: dict[int, Any] = {}
        self._losses: dict[int, torch.Tensor] = {}
        self._ids: dict[int, int] = {}
        self._evaluator: Any = None  # the forward-only Program's executor, built at the first eval
        self._evals = 0
        m = self.program.num_microbatches
        self.runner = Runner(
            self.program,
            {s: modules[s] for s in own if s in modules},
            self._recording_loss,
            rank=rank,
            options=StageOptions(
                device=device,
                loss_scale=1.0 / m if scale_grads else 1.0,
                seed=None,
                compile=compile,
                cuda_graphs=cuda_graphs,
            ),
            transport=Transport(
                timeout=timeout,
                comm=comm,
                kv=kv,
                group=None if mesh2d is not None else pp_group,
                mesh=mesh2d,
                dp_unit=dp_unit,
                recv_ahead=recv_ahead,
                # a Program compiled with experts= runs them sharded over its expert groups, as pipec run does
                experts=self.program.experts if self.program.experts.size > 1 else None,
            ),
        )
        self.stages = self.runner.modules()
        self.ties = _tie_groups(self.stages, rank, pp_group, comm is None, self.runner)

    # ---- torch's interface -------------------------------------------------------------------
    @property
    def has_first(self) -> bool:
        return self.runner.has_first

    @property
    def has_last(self) -> bool:
        return self.runner.has_last

    def step(self, *inputs: Any, target: Any = None, losses: list | None = None) -> Any:
        """One forward and backward of the whole batch (split on dim 0 into the schedule's micro-batches).
        Gradients accumulate into `.grad`; zeroing them and the optimizer step are the caller's. Returns the
        last stage's output (micro-batches concatenated on dim 0) on its rank, else None."""
        if self.loss_fn is None:
            raise PipelineError("step needs a loss_fn (the schedule was built without one): use eval()")
        self._outputs.clear()
        self._losses.clear()
        gen = self.runner.step_gen(_batch(inputs) if inputs else None, target)
        try:
            while True:
                next(gen)
        except StopIteration:
            pass
        for tie in self.ties:
            tie.all_reduce()
        return self._finish(losses)

    def eval(self, *inputs: Any, target: Any = None, losses: list | None = None) -> Any:
        """Forward only, no autograd graph: the schedule's own FWDs in its order, as a forward-only Program
        (validated, proven, run by the executor). Returns the last stage's output on its rank (and the
        micro-batch losses when a target is given there)."""
        self._outputs.clear()
        self._losses.clear()
        gen = self._eval_gen(_batch(inputs) if inputs else None, target)
        try:
            while True:
                next(gen)
        except StopIteration:
            pass
        return self._finish(losses)

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """This rank's parameters, each once (a weight shared by two of its stages is one Parameter)."""
        for _, p in self.named_parameters():
            yield p

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """(name, parameter) of this rank's stages, like torch's: split_model's stages keep the model's own
        FQNs; other modules' names are prefixed with their stage index ("3.weight") when this rank holds
        several stages."""
        seen: set[int] = set()
        prefix = len(self.stages) > 1
        for s, module in sorted(self.stages.items()):
            keep_fqn = hasattr(module, "fqns")
            for n, p in module.named_parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                yield (n if keep_fqn or not prefix else f"{s}.{n}"), p

    # ---- internals ---------------------------------------------------------------------------
    def _recording_loss(self, output: Any, target: Any) -> torch.Tensor:
        """loss_fn, recording each micro-batch's output and unscaled loss (the micro-batch is found by the
        identity of its target, which the executor passes through unchanged)."""
        loss = self.loss_fn(output, target)
        mb = self._mb_of(target)
        self._outputs[mb] = _detach(output)
        if isinstance(loss, torch.Tensor):
            self._losses[mb] = loss.detach()
        return loss

    def _mb_of(self, target: Any) -> int:
        targets = self.runner.mb_targets or []
        for i, t in enumerate(targets):
            if t is target:
                return i
        return len(self._outputs)

    def _finish(self, losses: list | None) -> Any:
        if not self.has_last:
            return None
        m = self.program.num_microbatches
        if losses is not None and self._losses:
            losses.extend(self._losses[i] for i in range(m) if i in self._losses)
        outs = [self._outputs[i] for i in range(m) if i in self._outputs]
        return _merge(outs) if outs else None

    def _eval_gen(self, inputs: Any, target: Any):
        """The forward-only Program (`pipec.passes.lower.forward_program`: this schedule's FWDs in its order,
        lowered, validated and proven by the dry run) on the executor, after a shape exchange of its own
        (an eval batch may differ from training's), under a key space of its own."""
        from pipec.runtime.exec.executor import Executor
        from pipec.runtime.exec.shapes import TensorSpec, handshake, handshake_graph

        runner, program = self.runner, self.program
        m, rank = program.num_microbatches, self.rank
        if self._evaluator is None:
            from pipec.passes.lower import forward_program

            comm, ahead = runner.executor.comm, runner.executor.recv_ahead
            self._evaluator = Executor(forward_program(program), rank, runner.stages, comm, recv_ahead=ahead)
        ex = self._evaluator
        mb_in = mb_tg = None
        if self.has_first:
            if inputs is None:
                raise PipelineError(f"rank {rank} runs stage 0 and needs the inputs")
            mb_in = [as_args(to_device(x, runner.device, runner.dtype)) for x in split(inputs, m, "inputs")]
        if self.has_last and target is not None:
            mb_tg = [to_device(x, runner.device) for x in split(target, m, "targets")]
        runner.mb_targets = mb_tg  # _recording_loss finds each micro-batch by its target
        # this eval's number: every rank of the pipeline evaluates as often (a process-wide count would not
        # agree between the ranks of one process in local mode)
        number, self._evals = self._evals, self._evals + 1
        kv = _PrefixKV(runner.kv, f"eval{number}/")
        specs = [tuple(TensorSpec.of(a) for a in args) for args in mb_in] if mb_in is not None else None
        ex.handshaking = True
        if program.graph is not None:  # per edge, as the Runner's exchange
            _, edge_in, edge_out = yield from handshake_graph(
                runner.modules(), program.placement, rank, specs, kv, runner.device, program.graph
            )
            ex.set_edge_specs(edge_in, edge_out)
        else:
            ins, outs = yield from handshake(runner.modules(), program.placement, rank, specs, kv, runner.device)
            ex.set_specs(ins, outs)
        ex.handshaking = False
        for st in runner.stages.values():
            st.loss = None
        yield from ex.run(number, mb_in, mb_tg)
        self._outputs.update((mb, _detach(out)) for mb, out in ex.outputs.items())
        ex.outputs = {}


class _PrefixKV:
    """A KV under a prefix: each eval call's shape exchange in its own keys."""

    def __init__(self, kv: Any, prefix: str) -> None:
        self.kv, self.prefix = kv, prefix
        self.data = getattr(kv, "data", None)

    def set(self, key: str, value: str) -> None:
        self.kv.set(self.prefix + key, value)

    def get(self, key: str, waiting_for: str, peer: int):
        return (yield from self.kv.get(self.prefix + key, waiting_for, peer))


def _batch(inputs: tuple) -> Any:
    return inputs[0] if len(inputs) == 1 else tuple(inputs)


def _detach(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, (tuple, list)):
        return type(x)(_detach(v) for v in x)
    if isinstance(x, dict):
        return {k: _detach(v) for k, v in x.items()}
    return x


def _merge(outs: list[Any]) -> Any:
    """Micro-batch outputs back into one batch along dim 0 (torch's default output merge)."""
    first = outs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outs, dim=0) if first.dim() > 0 else torch.stack(outs)
    if isinstance(first, (tuple, list)):
        return type(first)(_merge([o[i] for o in outs]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _merge([o[k] for o in outs]) for k in first}
    return outs


# ---- tied weights across ranks ----------------------------------------------------------------------
class TiedGroup:
    """One weight held by stages on several ranks: its copies' gradients are summed over exactly those
    ranks (a small gloo/NCCL group) at the end of each step."""

    def __init__(self, key: str, params: list[torch.nn.Parameter], ranks: list[int], group: Any) -> None:
        self.key, self.params, self.ranks, self.group = key, params, ranks, group

    def all_reduce(self) -> None:
        import torch.distributed as dist

        p = self.params[0]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        try:
            dist.all_reduce(p.grad, group=self.group)
        except Exception as e:
            raise PipelineError(
                f"summing the gradient of tied weight `{self.key}` over ranks {self.ranks} failed: "
                f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
            ) from e


def _tie_groups(stages: dict[int, torch.nn.Module], rank: int, pp_group: Any, dist_ok: bool, runner) -> list:
    """The tied weights of split_model's stages that span ranks, agreed by every rank of the pipeline (an
    all_gather_object of each rank's tie keys), each with its own process group."""
    mine: dict[str, torch.nn.Parameter] = {}
    for module in stages.values():
        for local, key in getattr(module, "tied", {}).items():
            mine.setdefault(key, module.get_parameter(local))
    if not dist_ok:
        if mine:
            raise PipelineError(
                f"tied weight `{sorted(mine)[0]}` spans stages, which needs torch.distributed to sum its copies' "
                "gradients; run every stage in one process or launch the job"
            )
        return []
    import torch.distributed as dist

    world = dist.get_world_size(pp_group)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, sorted(mine), group=pp_group)
    keys = sorted({k for ks in everyone for k in ks})
    if keys and runner.replicas is not None:
        raise PipelineError(
            f"tied weight `{keys[0]}` spans pipeline ranks {[r for r in range(world) if keys[0] in everyone[r]]}: "
            "with data parallelism (dp > 1) this is not supported; untie it, or keep its modules on one rank"
        )
    groups = []
    for key in keys:
        ranks = [r for r in range(world) if key in everyone[r]]
        if len(ranks) < 2:
            continue
        glob = [dist.get_global_rank(pp_group, r) if pp_group is not None else r for r in ranks]
        group = dist.new_group(glob, use_local_synchronization=True) if rank in ranks else None
        if rank in ranks:
            p = mine[key]
            if ranks[0] != rank:
                setattr(p, TIED_ATTR, True)
            _check_equal(p, key, ranks, group)
            groups.append(TiedGroup(key, [p], ranks, group))
    return groups


def _check_equal(p: torch.nn.Parameter, key: str, ranks: list[int], group: Any) -> None:
    """The copies of a tied weight start equal (the model built with the same seed everywhere), or the
    summed gradients train two different weights."""
    import torch.distributed as dist

    x = p.detach().to(torch.float64)
    lo, hi = x.clone(), x.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(lo, hi):
        raise PipelineError(
            f"tied weight `{key}` differs between ranks {ranks} (by up to {float((hi - lo).abs().max()):.3g}): "
            "build the model with the same seed on every rank before splitting it"
        )


# ---- global gradient-norm clipping ------------------------------------------------------------------
def clip_grad_norm_(
    parameters: Any,
    max_norm: float,
    *,
    mesh: Any = None,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the gradients of this rank's parameters by the norm of every stage's gradients together: the
    local norm reduced over the mesh's "pp" dim (a sum of p-th powers, or a max for inf), as torchtitan's
    dist utils do, then each gradient scaled by min(1, max_norm / (total + 1e-6)), as
    torch.nn.utils.clip_grads_with_norm_ does (a DTensor's through its local shard).
    The local norm counts each element of the model once, whatever holds it: FSDP's (and replicate's)
    DTensors through their own norm made whole over their mesh ("dp"), expert shards (a Program compiled
    with experts=) summed over their expert group (the groups' replicas hold the same experts, so once),
    plain replicated tensors as they are; a tied weight's other copies (marked by PipelineSchedule) are
    scaled but not counted again. The parts are reduced apart because torch's norm refuses a mix of
    DTensors and tensors. mesh: a 1-D DeviceMesh of the pipeline, a 2-D one with a "pp" dim, a process
    group, a PipelineSchedule (its group), or None (the default group). Returns the total norm (float64),
    the same on every rank."""
    import torch.distributed as dist

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    given = list(parameters)
    params = [p for p in given if p.grad is not None]
    norm_type = float(norm_type)
    device = params[0].grad.device if params else torch.device("cpu")
    local = _local_norm([p for p in given if not getattr(p, TIED_ATTR, False)], norm_type, foreach, device)
    group = _pp_group(mesh)
    if dist.is_initialized():
        total = _reduce_norm(local, norm_type, group)
    else:
        total = local
    if error_if_nonfinite and not torch.isfinite(total):
        raise PipelineError(f"the total gradient norm of order {norm_type} is {float(total)}: not finite")
    _scale(params, max_norm, total, foreach)
    return total


def _scale(params: list[torch.nn.Parameter], max_norm: float, total: torch.Tensor, foreach: bool | None) -> None:
    """Each gradient times min(1, max_norm / (total + 1e-6)), as torch.nn.utils.clip_grads_with_norm_ does;
    a DTensor's through its local tensor (torch's refuses a mix of DTensors and plain tensors)."""
    from torch.distributed.tensor import DTensor

    coef = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        g = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
        groups.setdefault((g.device, g.dtype), []).append(g)
    with torch.no_grad():
        for (device, dtype), grads in groups.items():
            if foreach is False:
                for g in grads:
                    g.mul_(coef.to(device, dtype))
            else:
                torch._foreach_mul_(grads, coef.to(device, dtype))


def _local_norm(counted: list[torch.nn.Parameter], norm_type: float, foreach: bool | None, device) -> torch.Tensor:
    """This rank's share of the global norm (float64): its DTensor gradients' norm per mesh made whole
    over it, its expert shards' norm per expert group reduced over the group, and the plain gradients'
    norm, combined. An expert shard without a gradient still joins its group's reduction (as zero), so
    every member makes the same calls whatever its tokens were."""
    from torch.distributed.tensor import DTensor
    from torch.nn.utils import get_total_norm

    from pipec.runtime.model.moe import expert_process_group

    by_mesh: dict[int, list[torch.Tensor]] = {}
    by_group: dict[int, tuple[Any, list[torch.Tensor]]] = {}
    plain: list[torch.Tensor] = []
    for p in counted:
        pg = expert_process_group(p)
        if pg is not None:
            by_group.setdefault(id(pg), (pg, []))[1].extend([] if p.grad is None else [p.grad])
        elif p.grad is None:
            continue
        elif isinstance(p.grad, DTensor):
            by_mesh.setdefault(id(p.grad.device_mesh), []).append(p.grad)
        else:
            plain.append(p.grad)
    parts = []
    for grads in by_mesh.values():
        parts.append(get_total_norm(grads, norm_type, foreach=foreach).full_tensor().to(torch.float64))
    for pg, grads in by_group.values():
        mine = _norm(grads, norm_type, foreach, device)
        parts.append(_reduce_norm(mine, norm_type, pg))
    if plain:
        parts.append(get_total_norm(plain, norm_type, foreach=foreach).to(torch.float64))
    return _combine(parts, norm_type, device)


def _norm(grads: list[torch.Tensor], norm_type: float, foreach: bool | None, device) -> torch.Tensor:
    from torch.nn.utils import get_total_norm

    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    return get_total_norm(grads, norm_type, foreach=foreach).to(torch.float64)


def _combine(parts: list[torch.Tensor], norm_type: float, device) -> torch.Tensor:
    """The norm of the union of disjoint sets, given each set's norm."""
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=device)
    stacked = torch.stack([p.to(device) for p in parts])
    if norm_type == float("inf"):
        return stacked.max()
    return (stacked**norm_type).sum() ** (1.0 / norm_type)


def _reduce_norm(local: torch.Tensor, norm_type: float, group: Any) -> torch.Tensor:
    """The norm over the ranks of `group` from each one's norm of its own disjoint part."""
    import torch.distributed as dist

    if norm_type == float("inf"):
        total = local.clone()
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        return total
    total = local**norm_type
    dist.all_reduce(total, group=group)
    return total ** (1.0 / norm_type)


def _pp_group(mesh: Any) -> Any:
    if mesh is None:
        return None
    if isinstance(mesh, PipelineSchedule):
        runner = mesh.runner
        return runner.replicas.pp_group if runner.replicas is not None else runner.executor.comm.group
    if hasattr(mesh, "mesh_dim_names") and hasattr(mesh, "ndim"):
        if mesh.ndim == 1:
            return mesh.get_group()
        names = tuple(mesh.mesh_dim_names or ())
        if "pp" not in names:
            raise PipelineError(f"clip_grad_norm_: the mesh has no 'pp' dim (dims {names})")
        return mesh["pp"].get_group()
    return mesh  # a process group


__all__ = ["PipelineSchedule", "clip_grad_norm_", "compile_for", "stage_indices"]
