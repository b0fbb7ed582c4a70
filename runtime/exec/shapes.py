"""Tensor shapes and dtypes between stages, established once before the first step.

Every message carries fixed shapes, so receives are posted with preallocated
buffers and nothing is pickled per step. The shapes are found stage by stage
in stage order: the owner of stage s takes stage s-1's output specs (from the
rank that owns it, through the job's key-value store, or locally), infers its
own outputs for each micro-batch without computing (meta tensors; a real
no-grad forward on zeros in eval mode if the module cannot run on meta), and
publishes them. A stage that cannot take its predecessor's output fails here,
at the first step, with both stages and shapes named.

Token slices: the specs are per unit (each slice has its own length), and a stage's
unit is inferred as it runs, with the specs of the earlier slices' keys and values
as its `past_kv` (pipec.runtime.exec.slices). Variable-length micro-batches: the Runner
runs the exchange again, under a new `epoch`, when a step's input specs differ
from the last exchange's (pipec.runtime.runner says how every rank learns it).

A stage graph (pipec.ir.graph; `handshake_graph`): the same, per edge. Stage s takes the specs of each
in-edge's message (from its source stage's rank under `spec/u>s`, or locally), spread in the order of
`graph.inputs(s)`; it infers its output, cuts it into one message per out-edge (`edge_outputs`) and
publishes each edge's specs for its destination's rank. Stage numbers are a topological order, so taking
the stages in order never waits on a stage that waits on this rank.
"""

from __future__ import annotations

import json
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch
from torch.func import functional_call

from pipec.ir.schedule import Slicing
from pipec.runtime.errors import ModelError, ShapeError
from pipec.runtime.exec import slices


def to_dtype(value: object) -> torch.dtype:
    """A torch dtype from a dtype or its name ("float64", "torch.float64")."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        d = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(d, torch.dtype):
            return d
    raise ValueError(f"must be a torch dtype or its name like 'float64', not {value!r}")


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')} {list(self.shape)}"

    @staticmethod
    def of(t: torch.Tensor) -> TensorSpec:
        return TensorSpec(tuple(t.shape), t.dtype)

    def empty(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)


Specs = tuple[TensorSpec, ...]  # one message: the tensors a stage passes on


def fmt(specs: Specs) -> str:
    return str(specs[0]) if len(specs) == 1 else "(" + ", ".join(map(str, specs)) + ")"


def encode(per_mb: list[Specs]) -> str:
    return json.dumps([[[list(s.shape), str(s.dtype).removeprefix("torch.")] for s in specs] for specs in per_mb])


def decode(text: str | bytes) -> list[Specs]:
    doc = json.loads(text)
    return [tuple(TensorSpec(tuple(shape), to_dtype(dtype)) for shape, dtype in specs) for specs in doc]


def outputs_of(value: Any, stage: int) -> tuple[torch.Tensor, ...]:
    """A stage's output as a tuple of floating-point tensors (what goes to the next stage)."""
    outs = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    for k, t in enumerate(outs):
        if not isinstance(t, torch.Tensor):
            raise ShapeError(
                f"stage {stage} returned {type(t).__name__}"
                + (f" at position {k}" if len(outs) > 1 else "")
                + "; a stage that is not the last must return a tensor or a tuple of tensors"
            )
        if not t.is_floating_point():
            raise ShapeError(
                f"stage {stage} returned a {str(t.dtype).removeprefix('torch.')} tensor"
                + (f" at position {k}" if len(outs) > 1 else "")
                + "; tensors passed between stages must be floating point (they carry gradients back)"
            )
    return outs


def edge_outputs(value: Any, stage: int, outputs: tuple[int, ...]) -> list[tuple[torch.Tensor, ...]]:
    """A stage graph's stage output as one message per out-edge (`outputs`: the destination stages, in edge
    order). With one out-edge the output is its message, as on the chain (a tensor or a tuple of tensors).
    With several: a tensor goes on every edge (a fan-out of one tensor), a tuple or list has one entry per
    edge in that order, each a tensor or a tuple of tensors."""
    if len(outputs) <= 1:
        return [outputs_of(value, stage)] * len(outputs)
    if not isinstance(value, (tuple, list)):
        one = outputs_of(value, stage)
        return [one] * len(outputs)
    if len(value) != len(outputs):
        edges = ", ".join(f"{stage} -> {v}" for v in outputs)
        raise ShapeError(
            f"stage {stage} returned {len(value)} outputs, but it feeds {len(outputs)} stages "
            f"({', '.join(map(str, outputs))}): the schedule declares its out-edges {edges}; a stage with "
            "several out-edges returns one tensor (sent on every edge) or a tuple with one entry per out-edge, "
            "in the order of its destination stages"
        )
    return [outputs_of(v, stage) for v in value]


def positional_arity(module: torch.nn.Module) -> tuple[int, int | None, str] | None:
    """How many positional inputs `module(...)` takes: (required, most or None for *args, its signature as
    text), or None where the signature cannot be read (a C extension, a callable without one)."""
    import inspect

    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None
    lo, hi = 0, 0
    for prm in sig.parameters.values():
        if prm.kind is prm.VAR_POSITIONAL:
            hi = None
        elif prm.kind in (prm.POSITIONAL_ONLY, prm.POSITIONAL_OR_KEYWORD):
            lo += prm.default is prm.empty
            hi = None if hi is None else hi + 1
    return lo, hi, f"{type(module).__name__}.forward{sig}"


def check_arity(
    module: torch.nn.Module,
    stage: int,
    srcs: tuple[int, ...],
    placement: tuple[int, ...],
    per_edge: list[Specs],
    inputs: Specs,
) -> None:
    """A stage graph's declared inputs against the stage's forward, before anything runs: the tensors of its
    in-edges (spread in the order of `srcs`, its graph.inputs), or a source's micro-batch inputs, must be a
    count its forward takes. ShapeError naming the stage, its rank, the edges and the forward otherwise."""
    arity = positional_arity(module)
    if arity is None:
        return
    lo, hi, sig = arity
    n = len(inputs)
    if lo <= n and (hi is None or n <= hi):
        return
    takes = f"{lo}" if hi == lo else f"{lo} or more" if hi is None else f"{lo} to {hi}"
    where = f"stage {stage} (rank {placement[stage]})"
    if not srcs:
        declared = (
            f"the schedule declares no in-edge into stage {stage} (a source), so it is called with the "
            f"micro-batch's {n} input(s) ({fmt(inputs)})"
        )
    else:
        parts = [f"{u} -> {stage} from rank {placement[u]} ({fmt(specs)})" for u, specs in zip(srcs, per_edge)]
        many = [f"{u} -> {stage}" for u, specs in zip(srcs, per_edge) if len(specs) > 1]
        declared = (
            f"the schedule declares {len(srcs)} in-edge(s) into stage {stage}, "
            + ", ".join(parts)
            + f", spread in that order as {n} input(s)"
            + (f" (edge {', '.join(many)} carries a tuple)" if many else "")
        )
    raise ShapeError(
        f"{where}: {declared}, but its forward takes {takes} positional input(s): {sig}. Declare the edges "
        "the model has (docs/language.md, section 19), or give the stage a forward with one input per "
        "in-edge tensor, in the order of its source stages"
    )


def infer(module: torch.nn.Module, stage: int, args: Specs, device: torch.device) -> Specs:
    """The output specs of `module(*args)`, computed on meta tensors when possible."""
    return tuple(TensorSpec.of(t) for t in outputs_of(_evaluate(module, args, None, device), stage))


def infer_slice(
    module: torch.nn.Module, stage: int, args: Specs, past: Specs, device: torch.device, unit_text: str
) -> tuple[Specs, Specs]:
    """The output and kv specs of `module(*args, past_kv=past)` (a token slice, pipec.runtime.exec.slices)."""
    out, kv = slices.kv_of(_evaluate(module, args, past, device), stage, unit_text)
    return tuple(TensorSpec.of(t) for t in outputs_of(out, stage)), tuple(TensorSpec.of(t) for t in kv)


def _evaluate(module: torch.nn.Module, args: Specs, past: Specs | None, device: torch.device) -> Any:
    """`module(*args)` (with `past_kv=past` when given) on meta tensors when possible."""
    try:
        with torch.no_grad():
            state = {
                k: torch.empty_like(v, device="meta") for k, v in [*module.named_parameters(), *module.named_buffers()]
            }
            meta = lambda specs: tuple(torch.empty(s.shape, dtype=s.dtype, device="meta") for s in specs)  # noqa: E731
            kwargs = None if past is None else {"past_kv": meta(past)}
            out = functional_call(module, state, meta(args), kwargs, strict=False)
        return out
    except Exception:
        pass
    # The module does something meta tensors cannot: run it for real, once, on zeros, without side effects
    # that matter (eval mode: no dropout, no batch-norm statistics update; no autograd graph).
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            zeros = lambda specs: tuple(torch.zeros(s.shape, dtype=s.dtype, device=device) for s in specs)  # noqa: E731
            out = module(*zeros(args)) if past is None else module(*zeros(args), past_kv=zeros(past))
    finally:
        module.train(was_training)
    return out


class KV:
    """Where stages publish their output specs: the job's store, or a dict in --local mode."""

    def set(self, key: str, value: str) -> None:
        raise NotImplementedError

    def get(self, key: str, waiting_for: str, peer: int) -> Generator[object, None, str]:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        """Drop a key nobody will read again (a no-op where keys cost nothing to keep)."""


def handshake(
    modules: dict[int, torch.nn.Module],
    placement: tuple[int, ...],
    rank: int,
    first_inputs: list[Specs] | None,
    kv: KV,
    device: torch.device,
    slicing: Slicing | None = None,
    epoch: int = 0,
) -> Generator[object, None, tuple[dict[int, list[Specs]], dict[int, list[Specs]]]]:
    """Input and output specs per micro-batch (per unit, when sliced) of each stage this rank owns (a
    generator: it yields while waiting for another rank's specs in --local mode). Exchange `epoch` e > 0
    publishes under its own keys, so a rank still reading an earlier exchange's never sees a later one's."""
    prefix = "spec/" if epoch == 0 else f"spec{epoch}/"
    sliced = slicing is not None and slicing.slices > 1
    num_stages = len(placement)
    ins: dict[int, list[Specs]] = {}
    outs: dict[int, list[Specs]] = {}
    for s in sorted(modules):
        if s == 0:
            assert first_inputs is not None
            ins[s] = first_inputs
        elif placement[s - 1] == rank:
            ins[s] = outs[s - 1]
        else:
            text = yield from kv.get(f"{prefix}{s - 1}", f"stage {s - 1}'s output shapes", placement[s - 1])
            ins[s] = decode(text)
        memo: dict[tuple[Specs, Specs | None], Specs | tuple[Specs, Specs]] = {}
        result = []
        earlier: dict[int, list[Specs]] = {}  # sliced: per sequence, the kv specs of its slices so far
        for i, specs in enumerate(ins[s]):
            past = slices.past_specs(earlier.setdefault(slicing.split(i)[0], [])) if sliced else None
            if (specs, past) not in memo:
                try:
                    if sliced:
                        text = slicing.op_text("F", i, s)
                        memo[(specs, past)] = infer_slice(modules[s], s, specs, past, device, text)
                    else:
                        memo[(specs, past)] = infer(modules[s], s, specs, device)
                except (ShapeError, ModelError):
                    raise
                except Exception as e:
                    raise mismatch(s, placement, i, specs, e) from None
            if sliced:
                out_specs, kv_specs = memo[(specs, past)]
                earlier[slicing.split(i)[0]].append(kv_specs)
                result.append(out_specs)
            else:
                result.append(memo[(specs, past)])
        outs[s] = result  # the last stage's too: a mismatch there is found now, not mid-step
        if s < num_stages - 1 and placement[s + 1] != rank:
            kv.set(f"{prefix}{s}", encode(result))
            if epoch > 1:  # the last exchange's, read by stage s + 1 before its last step (which this one's awaited)
                kv.delete(f"spec{epoch - 1}/{s}")
    return ins, outs


def handshake_graph(
    modules: dict[int, torch.nn.Module],
    placement: tuple[int, ...],
    rank: int,
    first_inputs: list[Specs] | None,
    kv: KV,
    device: torch.device,
    graph: Any,
    epoch: int = 0,
) -> Generator[object, None, tuple[dict[int, list[Specs]], dict[tuple[int, int], list[Specs]], dict]]:
    """`handshake` on a stage graph: (per own stage its inputs' specs per micro-batch, per in-edge (u, s) of an
    own stage its message's specs per micro-batch, the same per out-edge (s, v)).

    It ends with a gate: each rank publishes that its stages agree with the declared edges (or the error that
    says why not) and waits for every other rank's word, so a disagreement anywhere fails every rank, with
    that error, before any rank runs an instruction of the step (no rank computes a forward the failing
    one will never take, nor waits for a message the failing one will never send)."""
    prefix = "spec/" if epoch == 0 else f"spec{epoch}/"
    try:
        result = yield from _exchange_graph(modules, placement, rank, first_inputs, kv, device, graph, prefix, epoch)
    except (ShapeError, ModelError) as e:
        word = f"{type(e).__name__}: {e}"
        kv.set(f"{prefix}agreed/{rank}", word)
        for s in modules:  # the ranks waiting for this one's specs learn why they will not come
            for v in graph.outputs(s):
                if placement[v] != rank:
                    kv.set(f"{prefix}{s}>{v}", "!" + word)
        raise
    kv.set(f"{prefix}agreed/{rank}", "")
    for r in sorted(set(placement) - {rank}):
        word = yield from kv.get(f"{prefix}agreed/{r}", f"rank {r}'s end of the shape exchange", r)
        if word:
            kind, _, text = word.partition(": ")
            raise (ModelError if kind == "ModelError" else ShapeError)(_from_rank(r, text))
    return result


def _from_rank(rank: int, text: str) -> str:
    """Another rank's exchange error, said once where it began (a rank passing one on keeps its origin)."""
    return text if text.startswith("rank ") else f"rank {rank}, the shape exchange: {text}"


def _exchange_graph(
    modules: dict[int, torch.nn.Module],
    placement: tuple[int, ...],
    rank: int,
    first_inputs: list[Specs] | None,
    kv: KV,
    device: torch.device,
    graph: Any,
    prefix: str,
    epoch: int,
) -> Generator[object, None, tuple[dict[int, list[Specs]], dict[tuple[int, int], list[Specs]], dict]]:
    last = len(placement) - 1
    ins: dict[int, list[Specs]] = {}
    edge_in: dict[tuple[int, int], list[Specs]] = {}
    edge_out: dict[tuple[int, int], list[Specs]] = {}
    for s in sorted(modules):
        srcs = graph.inputs(s)
        if not srcs:
            assert first_inputs is not None
            ins[s] = first_inputs
        else:
            for u in srcs:
                if placement[u] == rank:
                    edge_in[(u, s)] = edge_out[(u, s)]
                else:
                    what = f"stage {u}'s output shapes for stage {s}"
                    text = yield from kv.get(f"{prefix}{u}>{s}", what, placement[u])
                    if text.startswith("!"):  # its rank failed the exchange (handshake_graph)
                        kind, _, why = text[1:].partition(": ")
                        error = ModelError if kind == "ModelError" else ShapeError
                        raise error(_from_rank(placement[u], why))
                    edge_in[(u, s)] = decode(text)
            m = len(edge_in[(srcs[0], s)])
            ins[s] = [tuple(t for u in srcs for t in edge_in[(u, s)][i]) for i in range(m)]
        dsts = graph.outputs(s)
        memo: dict[Specs, list[Specs]] = {}
        result: list[list[Specs]] = []
        for i, specs in enumerate(ins[s]):
            if specs not in memo:
                per_edge = [edge_in[(u, s)][i] for u in srcs]
                check_arity(modules[s], s, srcs, placement, per_edge, specs)
                try:
                    out = _evaluate(modules[s], specs, None, device)
                    if s == last:  # checked now, not mid-step
                        memo[specs] = [tuple(TensorSpec.of(t) for t in outputs_of(out, s))]
                    else:
                        memo[specs] = [tuple(TensorSpec.of(t) for t in msg) for msg in edge_outputs(out, s, dsts)]
                except (ShapeError, ModelError):
                    raise
                except Exception as e:
                    raise graph_mismatch(s, srcs, placement, i, specs, e, per_edge) from None
            result.append(memo[specs])
        for k, v in enumerate(dsts):
            edge_out[(s, v)] = [r[k] for r in result]
            if placement[v] != rank:
                kv.set(f"{prefix}{s}>{v}", encode(edge_out[(s, v)]))
                if epoch > 1:
                    kv.delete(f"spec{epoch - 1}/{s}>{v}")
    return ins, edge_in, edge_out


def graph_mismatch(
    stage: int,
    srcs: tuple[int, ...],
    placement: tuple[int, ...],
    mb: int,
    specs: Specs,
    e: Exception,
    per_edge: list[Specs] | None = None,
) -> ShapeError:
    """A stage of a stage graph that cannot take what its declared in-edges bring it (shapes that do not match
    across an edge): the stage, each edge with its source's rank and its message's shapes, and torch's error."""
    if not srcs:
        return ShapeError(
            f"stage {stage} (rank {placement[stage]}) cannot take micro-batch {mb}'s input of shape {fmt(specs)}: "
            f"{type(e).__name__}: {e}"
        )
    if per_edge is None:
        who = ", ".join(f"stage {u} (rank {placement[u]})" for u in srcs)
        what = f"the outputs of {who} in that order, {fmt(specs)}"
    else:
        what = "its in-edges " + ", ".join(
            f"{u} -> {stage} (stage {u} on rank {placement[u]}: {fmt(m)})" for u, m in zip(srcs, per_edge)
        )
    return ShapeError(
        f"stage {stage} (rank {placement[stage]}) takes {what} for micro-batch {mb}, in that order as the "
        f"schedule declares them, and cannot: {type(e).__name__}: {e}"
    )


def mismatch(stage: int, placement: tuple[int, ...], mb: int, specs: Specs, e: Exception) -> ShapeError:
    what = f"input of shape {fmt(specs)}"
    if stage == 0:
        return ShapeError(
            f"stage 0 (rank {placement[0]}) cannot take micro-batch {mb}'s {what}: {type(e).__name__}: {e}"
        )
    return ShapeError(
        f"stage {stage - 1} (rank {placement[stage - 1]}) outputs {fmt(specs)} for micro-batch {mb}, "
        f"which stage {stage} (rank {placement[stage]}) cannot take: {type(e).__name__}: {e}"
    )
