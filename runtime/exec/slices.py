"""Token slices (TeraPipe) in the runtime: cutting sequences into slices, and each stage's key/value cache.

A Program with `slicing` (pipec.ir.schedule.Slicing, `slices` n > 1) numbers its instructions by unit
u = i * n + j, slice j of sequence (micro-batch) i. The Runner splits the batch into the Program's
`num_sequences` micro-batches along dim 0 as usual, then cuts each along dim 1 (the tokens) into slices of
`Slicing.tokens[j]` tokens (`units`): inputs and targets alike, so dim 1 of every input and target tensor
must hold the sequence's `seqlen` tokens.

The key/value cache interface a stage module provides (all of them, on a sliced Program):

    module(*inputs, past_kv=past) -> (output, kv)

- `past` is a tuple of tensors: what the earlier slices of the same sequence left at this stage, each
  tensor theirs laid end to end along dim -2 (the sequence dim of the usual layouts
  (batch, heads, seq, head_dim) and (batch, seq, dim)); `()` for slice 0.
- `kv` is this call's own tuple of tensors, in the same order and layout, with this slice's tokens
  along dim -2 (not past and present together, as Hugging Face's `past_key_values` are: the runtime keeps
  each slice's part apart, so each gets its own gradient). A causal transformer stage returns, per
  attention layer, its keys and values; a stage without attention returns `()`.
- Called without `past_kv` the module must behave as it always did (the unsliced run, the reference and
  the shape inference call it so). examples/gpt.py implements the interface.

A module that does not take `past_kv` is refused before training (`check_interface`).

The autograd across slices (`KVCache`, used by pipec.runtime.exec.stage.Stage): per sequence and stage, one
buffer per kv tensor spans the whole sequence along dim -2, a leaf that requires grad; each slice's FWD
writes its kv into its tokens' part, and slice j reads the first c_j tokens as one view, so each slice's
graph is its own and ends at the buffer. The slice's own `kv` stays with its graph for its own backward.
The BWD of slice j (which every Program orders after the BWD of slice j + 1 on the stage:
pipec.passes.checks) runs from the output gradient and from its tokens' part of the buffer's gradient,
which the later slices' backwards have accumulated, and accumulates into the buffer at the earlier tokens.
With split backward, BWD computes the input and buffer gradients and WGRAD the weight gradients
(pipec.runtime.exec.split_backward). The sequence's buffers go when its slice 0's BWD is done.

Loss: the last stage's loss of slice j is weighted by l_j / L (`Slicing.share`), so the slices of a
sequence sum to its unsliced loss when `loss_fn` is a mean over the tokens (cross-entropy's default):
a loss summed over tokens, or one that mixes tokens of different positions, is not what the sliced run
computes.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from pipec.ir.schedule import Slicing
from pipec.runtime.errors import ModelError, PipelineError, ShapeError

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
        f"({INTERFACE}: `past` the earlier slices' tensors, laid end to end along dim -2, `()` for the first "
        "slice; `kv` this slice's own, e.g. each attention layer's keys and values; see pipec.runtime.exec.slices "
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


class LengthWarning(UserWarning):
    """The data's micro-batches are not the lengths the schedule's `length i -> ...` declares."""


def length_mismatch(slicing: Slicing | None, first_inputs: list[tuple]) -> str | None:
    """What differs between the schedule's declared sequence lengths and the micro-batches' (dim 1 of the
    first input tensor of each, on the rank of stage 0); None when they agree or nothing is declared.
    Why a warning and not an error: gradients do not depend on it, but the simulated step and the memory
    check priced the declared lengths, so a longer sequence may not fit where the check said it would."""
    if slicing is None or slicing.slices > 1 or len(first_inputs) != len(slicing.lengths):
        return None
    for i, (args, want) in enumerate(zip(first_inputs, slicing.lengths)):
        t = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if t is None or t.dim() < 2 or t.shape[1] == want:
            continue
        more = "more" if t.shape[1] > want else "fewer"
        declared = ", ".join(map(str, slicing.lengths))
        return (
            f"micro-batch {i} holds {t.shape[1]} tokens along dim 1, where the schedule's `length` declares "
            f"{want}: the simulated step and the memory check priced the declared lengths ({declared}), "
            f"and this batch has {more} tokens there; declare the data's lengths, or drop `length` to price "
            "every micro-batch at `seqlen`"
        )
    return None


def loss_scales(slicing: Slicing, scale: float) -> list[float]:
    """Per unit, the weight of its loss: the sequence's `scale` times the slice's share of the tokens."""
    return [scale * float(w) for w in slicing.share()]


def past_specs(earlier: list[tuple]) -> tuple:
    """The specs of `past` from the kv specs of the earlier slices (pipec.runtime.exec.shapes.TensorSpec)."""
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
    pipec.runtime.exec.split_backward cuts the graph at would start inside the attention, below which the weights'
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
    """One stage's cache: per sequence, one buffer per kv tensor holding the whole sequence along dim -2, a
    leaf that requires grad, filled slice by slice as their FWDs run.

    Why one buffer and not a leaf set per slice: slice j reads the first c_j tokens of it as one view
    (`narrow`), where concatenating the j earlier slices' leaves at every forward, and handing gradients back
    into each of them at every backward, cost O(n^2) small tensor operations per stage and sequence (a 9-token
    slice's backward grew 2.7x from the first quarter of 114 slices to the last; the buffer makes such a step
    6% faster, docs/terapipe.md). A slice's kv are written through `.data`, which autograd's version counter
    does not see: the views the earlier slices' forwards saved cover only tokens before them, which no later
    write touches. The later slices' backwards accumulate into the buffer's gradient; slice j's BWD takes its
    own tokens' part of it, which every later slice has added to by then (the Program orders the BWDs of one
    sequence's slices last to first on a stage: pipec.passes.checks).

    Per unit between its FWD and its BWD it also holds what the BWD needs besides the stage's own record:
    the buffers it read and its own kv with their graph."""

    def __init__(self, slicing: Slicing, stage: int) -> None:
        self.slicing = slicing
        self.stage = stage
        self.starts = slicing.unit_context()[: slicing.slices].tolist()  # slice j's first token
        self.buffers: dict[int, tuple[torch.Tensor, ...]] = {}  # sequence -> one buffer per kv tensor
        self.kept: dict[int, set[int]] = {}  # sequence -> the slices written into its buffers, BWD not yet run
        self.units: dict[int, tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = {}  # unit -> (read, own)

    def text(self, unit: int) -> str:
        return self.slicing.op_text("F", unit, self.stage)

    def past(self, unit: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """(past, buffers read): the earlier slices' tokens of each buffer (a view), and the buffers."""
        i, j = self.slicing.split(unit)
        have = self.kept.get(i, set())
        missing = [k for k in range(j) if k not in have]
        if missing:
            raise PipelineError(
                f"{self.text(unit)} runs before the forward of slice {missing[0]} of micro-batch {i} on stage "
                f"{self.stage} (or after its backward), whose keys and values it attends to: the Program breaks "
                "the causal order"
            )
        if j == 0:
            return (), ()
        bufs = self.buffers[i]
        return tuple(b.narrow(KV_DIM, 0, self.starts[j]) for b in bufs), bufs

    def keep(self, unit: int, kv: tuple[torch.Tensor, ...]) -> None:
        """After a FWD: the slice's kv written into the sequence's buffers for the later slices (the last
        slice's are read by none)."""
        i, j = self.slicing.split(unit)
        want = self.slicing.tokens[j]
        for t in kv:
            if t.dim() < 2 or t.shape[KV_DIM] != want:
                raise ShapeError(
                    f"stage {self.stage}'s kv for {self.text(unit)} has shape {list(t.shape)}: its dim -2 must be "
                    f"the slice's {want} tokens (the cache lays the slices out along dim -2)"
                )
        if j == self.slicing.slices - 1:
            return
        if j == 0:
            self.buffers[i] = tuple(self._buffer(t) for t in kv)
        bufs = self.buffers[i]
        if len(kv) != len(bufs) or any(
            t.shape[:KV_DIM] != b.shape[:KV_DIM] or t.shape[KV_DIM + 1 :] != b.shape[KV_DIM + 1 :] or t.dtype != b.dtype
            for t, b in zip(kv, bufs)
        ):
            raise ModelError(
                f"stage {self.stage}'s module returned kv for {self.text(unit)} that differ from slice 0's in "
                "number, dtype or a dim other than -2: every slice of a sequence must return the same layout"
            )
        with torch.no_grad():
            for t, b in zip(kv, bufs):
                b.data.narrow(KV_DIM, self.starts[j], want).copy_(t)
        self.kept.setdefault(i, set()).add(j)

    def _buffer(self, t: torch.Tensor) -> torch.Tensor:
        shape = list(t.shape)
        shape[KV_DIM] = self.slicing.seqlen
        return torch.zeros(shape, dtype=t.dtype, device=t.device).requires_grad_(t.is_floating_point())

    def record(self, unit: int, read: tuple[torch.Tensor, ...], own: tuple[torch.Tensor, ...]) -> None:
        """What the unit's BWD needs: the buffers its forward read and its own kv, with their graph."""
        self.units[unit] = (read, own)

    def backward_of(self, unit: int) -> tuple[tuple[torch.Tensor, ...], list[tuple[torch.Tensor, torch.Tensor]]]:
        """At BWD: (the buffers the unit read, [(own kv tensor, its gradient)] for those the later slices
        gave a gradient). Frees the sequence's buffers after slice 0."""
        i, j = self.slicing.split(unit)
        later = [k for k in range(j + 1, self.slicing.slices) if self.slicing.unit(i, k) in self.units]
        if later:
            raise PipelineError(
                f"{self.slicing.op_text('B', unit, self.stage)} runs before the backward of slice {later[0]} of its "
                "micro-batch on this stage, which returns the gradients of its keys and values: the Program breaks "
                "the causal order"
            )
        read, own = self.units.pop(unit)
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        if j in self.kept.get(i, ()):
            self.kept[i].discard(j)
            a, n = self.starts[j], self.slicing.tokens[j]
            # a copy: this backward accumulates into the same gradient, at the earlier tokens
            pairs = [
                (t, b.grad.narrow(KV_DIM, a, n).clone())
                for t, b in zip(own, self.buffers[i])
                if b.grad is not None and t.requires_grad
            ]
        if j == 0:
            self.buffers.pop(i, None)
            self.kept.pop(i, None)
        return read, pairs

    def add_grads(self, leaves: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor | None, ...]) -> None:
        """Accumulate gradients computed for buffers (split backward computes them with autograd.grad)."""
        for leaf, g in zip(leaves, grads):
            if g is not None:
                leaf.grad = g if leaf.grad is None else leaf.grad + g

    def left(self) -> list[int]:
        """Units whose cache state outlived the step (a Program bug): empty when the step is complete."""
        return sorted(set(self.units) | {self.slicing.unit(i, j) for i, d in self.kept.items() for j in d})
