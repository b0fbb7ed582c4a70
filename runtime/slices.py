"""Token slices (TeraPipe) in the runtime: cutting sequences into slices, and each stage's key/value cache.

A Program with `slicing` (pipec.schedule.Slicing, `slices` n > 1) numbers its instructions by unit
u = i * n + j, slice j of sequence (micro-batch) i. The Runner splits the batch into the Program's
`num_sequences` micro-batches along dim 0 as usual, then cuts each along dim 1 (the tokens) into slices of
`Slicing.tokens[j]` tokens (`units`): inputs and targets alike, so dim 1 of every input and target tensor
must hold the sequence's `seqlen` tokens.

The key/value cache interface a stage module provides (all of them, on a sliced Program):

    module(*inputs, past_kv=past) -> (output, kv)

- `past` is a tuple of tensors: what the earlier slices of the same sequence left at this stage, each
  tensor the concatenation of their tensors along dim -2 (the sequence dim of the usual layouts
  (batch, heads, seq, head_dim) and (batch, seq, dim)); `()` for slice 0.
- `kv` is this call's own tuple of tensors, in the same order and layout, with this slice's tokens
  along dim -2 (not past and present together, as Hugging Face's `past_key_values` are: the runtime keeps
  each slice's part apart, so each gets its own gradient). A causal transformer stage returns, per
  attention layer, its keys and values; a stage without attention returns `()`.
- Called without `past_kv` the module must behave as it always did (the unsliced run, the reference and
  the shape inference call it so). examples/gpt.py implements the interface.

A module that does not take `past_kv` is refused before training (`check_interface`).

The autograd across slices (`KVCache`, used by pipec.runtime.stage.Stage): at the FWD of slice j, the
kv tensors of each earlier slice k < j at this stage enter as detached leaves that require grad (one leaf
set per earlier slice, made once when slice k's FWD ran), so each slice's graph is its own. The slice's
own `kv` stays with its graph for its own backward. The BWD of slice j (which every Program orders after
the BWD of slice j + 1 on the stage: pipec.passes.checks) runs from the output gradient and from the
gradient accumulated on slice j's leaves by the later slices' backwards, and accumulates into the leaves
of the earlier slices. With split backward, BWD computes the input and leaf gradients and WGRAD the
weight gradients (pipec.runtime.split). A slice's leaves go with its BWD; the sequence's entry when its
slice 0's BWD is done.

Loss: the last stage's loss of slice j is weighted by l_j / L (`Slicing.share`), so the slices of a
sequence sum to its unsliced loss when `loss_fn` is a mean over the tokens (cross-entropy's default):
a loss summed over tokens, or one that mixes tokens of different positions, is not what the sliced run
computes.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from pipec.runtime.errors import ModelError, PipelineError, ShapeError
from pipec.schedule import Slicing

KV_DIM = -2  # the sequence dim of every key/value tensor
INTERFACE = "module(*inputs, past_kv=past) -> (output, kv)"


def takes_past(module: torch.nn.Module) -> bool:
    """Whether the module's forward accepts the `past_kv` keyword."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return "past_kv" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def check_interface(module: torch.nn.Module, stage: int, slicing: Slicing, where: str = "build_stage") -> None:
    """Refuse, before anything runs, a stage module that cannot take a slice with its cache."""
    if takes_past(module):
        return
    raise ModelError(
        f"stage {stage}'s module ({type(module).__name__}, from {where}) has no key/value cache interface: "
        f"the Program cuts each sequence into {slicing.slices} token slices, and a slice attends to the keys "
        f"and values of the earlier ones at its stage. Give its forward a keyword argument `past_kv` "
        f"({INTERFACE}: `past` the earlier slices' tensors, concatenated along dim -2, `()` for the first "
        "slice; `kv` this slice's own, e.g. each attention layer's keys and values; see pipec.runtime.slices "
        "and examples/gpt.py)"
    )


def cut(x: Any, tokens: tuple[int, ...], what: str) -> list[Any]:
    """One micro-batch (a tensor, or a tuple/list/dict of tensors) cut along dim 1 into slices of `tokens`."""
    if isinstance(x, torch.Tensor):
        total = sum(tokens)
        if x.dim() < 2 or x.shape[1] != total:
            got = f"shape {list(x.shape)}" if x.dim() else "a 0-d tensor"
            raise ShapeError(
                f"the Program cuts each sequence into slices of {', '.join(map(str, tokens))} tokens ({total} in "
                f"all, along dim 1), but a micro-batch of the {what} has {got}: the schedule's `seqlen` must be "
                "the sequence length of the data"
            )
        return list(torch.split(x, list(tokens), dim=1))
    if isinstance(x, (tuple, list)):
        parts = [cut(v, tokens, what) for v in x]
        return [type(x)(p[j] for p in parts) for j in range(len(tokens))]
    if isinstance(x, dict):
        parts = {k: cut(v, tokens, what) for k, v in x.items()}
        return [{k: v[j] for k, v in parts.items()} for j in range(len(tokens))]
    raise PipelineError(f"the {what} must be a tensor, or a tuple, list or dict of tensors, not {type(x).__name__}")


def units(per_sequence: list[Any], slicing: Slicing, what: str) -> list[Any]:
    """Per unit (i * n + j), slice j of sequence i."""
    out: list[Any] = []
    for x in per_sequence:
        out += cut(x, slicing.tokens, what)
    return out


def loss_scales(slicing: Slicing, scale: float) -> list[float]:
    """Per unit, the weight of its loss: the sequence's `scale` times the slice's share of the tokens."""
    return [scale * float(w) for w in slicing.share()]


def past_specs(earlier: list[tuple]) -> tuple:
    """The specs of `past` from the kv specs of the earlier slices (pipec.runtime.shapes.TensorSpec)."""
    if not earlier:
        return ()
    first = earlier[0]
    out = []
    for t, spec in enumerate(first):
        shape = list(spec.shape)
        shape[KV_DIM] = sum(e[t].shape[KV_DIM] for e in earlier)
        out.append(type(spec)(tuple(shape), spec.dtype))
    return tuple(out)


def kv_of(value: Any, stage: int, unit_text: str) -> tuple[Any, tuple[torch.Tensor, ...]]:
    """(output, kv) from what a sliced call returned, checked."""
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[1], (tuple, list))):
        raise ModelError(
            f"stage {stage}'s module, called as {INTERFACE} for {unit_text}, returned "
            f"{type(value).__name__}; it must return a pair (output, kv) with kv a tuple of tensors"
        )
    out, kv = value
    for t in kv:
        if not isinstance(t, torch.Tensor):
            raise ModelError(f"stage {stage}'s kv for {unit_text} holds a {type(t).__name__}, not a tensor")
    return out, tuple(kv)


def leaf_grads(
    outs: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor | None, ...] | None, leaves: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor | None, ...]:
    """The gradients of the cache leaves a unit read, keeping its graph for the weight gradients.

    The first stage's split backward computes them alone at BWD and leaves the weights to WGRAD's full
    backward (restricted to the parameters): its inputs are token ids, so the input closure that
    pipec.runtime.split cuts the graph at would start inside the attention, below which the weights'
    paths share nodes and one group's weight pass would free another's."""
    pairs = [(o, None if grads is None else grads[k]) for k, o in enumerate(outs) if o.requires_grad]
    wanted = [t for t in leaves if t.requires_grad]
    if not pairs or not wanted:
        return tuple(None for _ in leaves)
    got = iter(
        torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], retain_graph=True, allow_unused=True)
    )
    return tuple(next(got) if t.requires_grad else None for t in leaves)


class KVCache:
    """One stage's cache: per sequence, the leaf sets of its slices whose FWD ran and whose BWD has not.

    Per unit between its FWD and its BWD it also holds what the BWD needs besides the stage's own record:
    the leaves it read (of every earlier slice) and its own kv with their graph."""

    def __init__(self, slicing: Slicing, stage: int) -> None:
        self.slicing = slicing
        self.stage = stage
        self.leaves: dict[int, dict[int, tuple[torch.Tensor, ...]]] = {}  # sequence -> slice -> leaf set
        self.units: dict[int, tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = {}  # unit -> (read, own)

    def text(self, unit: int) -> str:
        return self.slicing.op_text("F", unit, self.stage)

    def past(self, unit: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """(past, leaves read): the earlier slices' leaves, concatenated per tensor along dim -2, and flat."""
        i, j = self.slicing.split(unit)
        have = self.leaves.get(i, {})
        missing = [k for k in range(j) if k not in have]
        if missing:
            raise PipelineError(
                f"{self.text(unit)} runs before the forward of slice {missing[0]} of micro-batch {i} on stage "
                f"{self.stage} (or after its backward), whose keys and values it attends to: the Program breaks "
                "the causal order"
            )
        sets = [have[k] for k in range(j)]
        if not sets:
            return (), ()
        if any(len(x) != len(sets[0]) for x in sets):
            raise ModelError(f"stage {self.stage}'s module returned kv of different lengths for one sequence's slices")
        width = range(len(sets[0]))
        past = tuple(sets[0][t] if j == 1 else torch.cat([x[t] for x in sets], dim=KV_DIM) for t in width)
        return past, tuple(t for x in sets for t in x)

    def keep(self, unit: int, kv: tuple[torch.Tensor, ...]) -> None:
        """After a FWD: the slice's kv as leaves for the later slices (the last slice has none)."""
        i, j = self.slicing.split(unit)
        want = self.slicing.tokens[j]
        for t in kv:
            if t.dim() < 2 or t.shape[KV_DIM] != want:
                raise ShapeError(
                    f"stage {self.stage}'s kv for {self.text(unit)} has shape {list(t.shape)}: its dim -2 must be "
                    f"the slice's {want} tokens (the cache concatenates the slices along dim -2)"
                )
        if j < self.slicing.slices - 1:
            self.leaves.setdefault(i, {})[j] = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in kv)

    def record(self, unit: int, read: tuple[torch.Tensor, ...], own: tuple[torch.Tensor, ...]) -> None:
        """What the unit's BWD needs: the leaves its forward read and its own kv, with their graph."""
        self.units[unit] = (read, own)

    def backward_of(self, unit: int) -> tuple[tuple[torch.Tensor, ...], list[tuple[torch.Tensor, torch.Tensor]]]:
        """At BWD: (the leaves the unit read, [(own kv tensor, its gradient)] for those the later slices
        gave a gradient). Drops the slice's leaves, and the sequence's entry after slice 0."""
        i, j = self.slicing.split(unit)
        later = [k for k in range(j + 1, self.slicing.slices) if self.slicing.unit(i, k) in self.units]
        if later:
            raise PipelineError(
                f"{self.slicing.op_text('B', unit, self.stage)} runs before the backward of slice {later[0]} of its "
                "micro-batch on this stage, which returns the gradients of its keys and values: the Program breaks "
                "the causal order"
            )
        read, own = self.units.pop(unit)
        mine = self.leaves.get(i, {}).pop(j, ())
        pairs = [(t, leaf.grad) for t, leaf in zip(own, mine) if leaf.grad is not None and t.requires_grad]
        if j == 0:
            self.leaves.pop(i, None)
        return read, pairs

    def add_grads(self, leaves: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor | None, ...]) -> None:
        """Accumulate gradients computed for leaves (split backward computes them with autograd.grad)."""
        for leaf, g in zip(leaves, grads):
            if g is not None:
                leaf.grad = g if leaf.grad is None else leaf.grad + g

    def left(self) -> list[int]:
        """Units whose cache state outlived the step (a Program bug): empty when the step is complete."""
        return sorted(set(self.units) | {self.slicing.unit(i, j) for i, d in self.leaves.items() for j in d})
