"""One pipeline stage on this rank: forward, backward (full or input-only), weight gradient, optimizer step.

Per micro-batch it keeps what the backward needs: the inputs (leaves that require grad, so the input
gradient can be handed back) and the outputs with their graph; after an input-only BWD, what WGRAD needs.
The last stage computes the loss, scaled by `loss_scale`, and accumulates it for the step's report.

Recomputation (a RECOMPUTE in the Program): the FWD runs under `torch.no_grad()` and keeps only its
input (and the RNG state, so dropout draws the same masks again); `recompute` runs the forward again
with grad from that input, and the BWD then finds its graph as after a plain FWD. This is what
non-reentrant `torch.utils.checkpoint` does, with the Program saying when (torch's checkpoint reruns
the forward inside the backward, at the first use of a saved tensor, with no way to trigger it earlier).
With a `pool` (pipec.runtime.exec.saved) what autograd saves goes to the pool's holders, counted, and
offloadable.

Token slices (a Program with `slicing`): micro-batch indices are units (slice j of sequence i), each
forward takes the earlier slices' keys and values from the stage's `KVCache` and leaves its own there, and
each backward also runs from the gradient of its own keys and values (pipec.runtime.exec.slices says how);
the loss of unit u is scaled by `loss_scale` times its slice's share of the tokens (`loss_scales[u]`).

A stage of a stage graph (pipec.ir.graph; `outputs` given: the stages that read this one, in edge order):
its inputs are the messages of its in-edges spread in the order of the graph's `inputs(s)` (the executor
concatenates them), a source stage (`source`: no inputs) reads the micro-batch, and its output is one
message per out-edge (`shapes.edge_outputs`: one tensor sent on every edge, or a tuple with one entry per
edge). `forward` then returns the list of those messages; `backward` takes their gradients concatenated in
the same order, and a tensor sent on several edges (a fan-out) gets the sum of their gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pipec.ir.schedule import Slicing
from pipec.runtime.errors import PipelineError
from pipec.runtime.exec import slices
from pipec.runtime.exec import split_backward as split
from pipec.runtime.exec.saved import Pool, module_storages, storages
from pipec.runtime.exec.shapes import edge_outputs, outputs_of

try:  # torch.autograd.backward's engine call, without the Python checks before it (see run_backward)
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # pragma: no cover - a torch without it takes the public call
    _engine_run_backward = None


def run_backward(outs: list[torch.Tensor], grads: list[torch.Tensor | None], inputs: Any = None) -> None:
    """`torch.autograd.backward(outs, grads, inputs=inputs)`, calling autograd's engine directly. Why: on a
    small stage its Python checks (`_make_grads` compares each gradient's shape with its output's,
    symbolically) were half of a backward's CPU (60 us against 32, measured on the empty model), and they
    check what is proven here already: the shape handshake fixed every gradient's shape and dtype
    (ShapeError otherwise), and a missing gradient is the loss's, a scalar, whose gradient is one."""
    if _engine_run_backward is not None and len(outs) == 1:  # one output, the common case: no generators
        g = grads[0]
        if g is None:
            if outs[0].numel() != 1:
                torch.autograd.backward(outs, grads, inputs=inputs)  # the public call's error for a non-scalar
                return
            g = torch.ones_like(outs[0], memory_format=torch.preserve_format)
        ins = () if inputs is None else tuple(inputs)
        _engine_run_backward((outs[0],), (g,), False, False, ins, allow_unreachable=True, accumulate_grad=True)
        return
    if _engine_run_backward is None or any(g is None and o.numel() != 1 for o, g in zip(outs, grads)):
        torch.autograd.backward(outs, grads, inputs=inputs)  # the public call, and its error for a non-scalar
        return
    gs = tuple(torch.ones_like(o, memory_format=torch.preserve_format) if g is None else g for o, g in zip(outs, grads))
    ins = () if inputs is None else tuple(inputs)
    _engine_run_backward(tuple(outs), gs, False, False, ins, allow_unreachable=True, accumulate_grad=True)


class Stage:
    def __init__(
        self,
        index: int,
        num_stages: int,
        module: torch.nn.Module,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        loss_scale: float,
        split_backward: bool,
        optimizer: torch.optim.Optimizer | None,
        slicing: Slicing | None = None,
        *,
        source: bool | None = None,
        outputs: tuple[int, ...] | None = None,
    ) -> None:
        self.index = index
        self.first = index == 0 if source is None else source  # reads the micro-batch: no input gradient
        self.last = index == num_stages - 1
        self.outputs = outputs  # on a stage graph, the stages this one's output goes to (None: the chain)
        self.module = module
        self.loss_fn = loss_fn
        self.loss_scale = loss_scale
        self.split_backward = split_backward
        # the first stage of a split backward runs its whole backward at BWD, not WGRAD (expert parallelism:
        # its all-to-alls belong to B; pipec.runtime.runner sets it), and WGRAD does nothing
        self.whole_backward = False
        self.compiled = False  # its forward through torch.compile (pipec.runtime.exec.compiled): split BWD whole
        self.optimizer = optimizer
        self.params = [p for p in module.parameters() if p.requires_grad]
        # Under FSDP2 the module's parameters change between the sharded ones (the optimizer's) and the
        # gathered ones (the autograd graph's) with each unshard and reshard: read them when needed.
        self.live_params = False
        self.saved: dict[int, tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = {}
        self.deferred: dict[int, Any] = {}
        self.stashed: dict[int, tuple] = {}  # recomputed micro-batches: (input, target, RNG states) until RECOMPUTE
        self.losses: list[torch.Tensor] = []  # this step's scaled micro-batch losses, detached (last stage)
        self.pool: Pool | None = None  # saved-tensor holders (pipec.runtime.exec.saved), when measuring or offloading
        self._state_storages: set[int] | None = None
        self.kv = slices.KVCache(slicing, index) if slicing is not None and slicing.slices > 1 else None
        # per unit with token slices: loss_scale times the slice's share of the tokens (slices.loss_scales)
        self.loss_scales = slices.loss_scales(slicing, loss_scale) if self.kv is not None else None
        # the forward's plain case (no token slices, no saved-tensor pool, the chain): `_run` calls the module
        # directly, without `_call`'s and `_outs`'s general cases
        self.plain = self.kv is None and outputs is None

    @property
    def loss(self) -> torch.Tensor | None:
        """The sum of this step's scaled micro-batch losses (last stage; None before the first), added up in
        micro-batch order when read: one add per micro-batch on the hot path saved, the same sum."""
        losses = self.losses
        if not losses:
            return None
        total = losses[0]
        for x in losses[1:]:
            total = total + x
        return total

    @loss.setter
    def loss(self, value: torch.Tensor | None) -> None:
        self.losses = [] if value is None else [value]

    def forward(
        self, mb: int, args: tuple, target: Any = None, *, keep_input_only: bool = False
    ) -> tuple[torch.Tensor, ...] | None:
        """Run the stage; returns the (detached) outputs to pass on, or None on the last stage. With
        `keep_input_only` (its micro-batch is recomputed) nothing is saved for the backward but the input;
        `recompute` must run before `backward`."""
        if not keep_input_only:
            return self._run(mb, args, target, accumulate=True)
        devices = [args[0].device] if args and isinstance(args[0], torch.Tensor) and args[0].is_cuda else []
        rng = (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices])
        with torch.no_grad():
            out, _, _ = self._call(mb, args, keep=True)
            if self.last:
                self._add_loss(self.loss_fn(out, target), mb)
        held = self.pool.keep(mb, self.index, args, self._exclude(args, target)) if self.pool is not None else []
        # What the pool holds (and an OFFLOAD may move) the stage does not hold as well: RECOMPUTE takes it back
        stash = tuple(None if i in held else a for i, a in enumerate(args))
        self.stashed[mb] = (stash, held, target, rng, devices)
        return None if self.last else self._pass_on(self._outs(out)[1])

    def infer(self, mb: int, args: tuple, target: Any = None) -> Any:
        """FWD of a forward-only Program (an evaluation pass): no graph, nothing kept for a backward. Returns
        what goes on to the next stage, or on the last stage its output, after adding its loss to the step's
        when a target is given."""
        if self.kv is not None:
            raise PipelineError("a forward-only pass over token slices is not supported: evaluate unsliced")
        with torch.no_grad():
            out = self.module(*args)
            if not self.last:
                return self._outs(out)[1]
            if target is not None and self.loss_fn is not None:
                self._add_loss(self.loss_fn(out, target), mb)
            return out

    def recompute(self, mb: int) -> None:
        """RECOMPUTE: the forward of micro-batch mb again, with grad, from the input its FWD kept."""
        try:
            args, held, target, (cpu_rng, dev_rng), devices = self.stashed.pop(mb)
        except KeyError:
            raise RuntimeError(f"RECOMPUTE {mb} {self.index}: its FWD did not keep its input") from None
        if held:  # the input the pool holds, back on the device (after its RELOAD when it was offloaded)
            kept, args = self.pool.kept(mb, self.index), list(args)
            for k, i in enumerate(held):
                args[i] = kept[k]
            args = tuple(args)
        with torch.random.fork_rng(devices=devices, device_type=devices[0].type if devices else "cuda"):
            torch.set_rng_state(cpu_rng)
            for d, state in zip(devices, dev_rng):
                torch.cuda.set_rng_state(state, d)
            self._run(mb, args, target, accumulate=False)

    def _run(self, mb: int, args: tuple, target: Any, accumulate: bool) -> tuple[torch.Tensor, ...] | None:
        if not self.first:
            args = (args[0].requires_grad_(),) if len(args) == 1 else tuple(x.requires_grad_() for x in args)
        if self.plain and self.pool is None:  # the hot path: one call of the module, its output passed on
            out = self.module(*args)
            if self.last:
                loss = self.loss_fn(out, target)
                loss = self._add_loss(loss, mb) if accumulate else self._scaled(loss, mb)
                self.saved[mb] = (args, (loss,))
                return None
            if out.__class__ is torch.Tensor and out.is_floating_point():  # one tensor: outputs_of's checks
                self.saved[mb] = (args, (out,))
                return (out.detach(),)
            outs = outputs_of(out, self.index)
            self.saved[mb] = (args, outs)
            return tuple(o.detach() for o in outs)
        if self.pool is None:
            out, read, own = self._call(mb, args, keep=accumulate)
            loss = self.loss_fn(out, target) if self.last else None
        else:
            with self.pool.saving(mb, self.index, self._exclude(args, target)):
                out, read, own = self._call(mb, args, keep=accumulate)
                loss = self.loss_fn(out, target) if self.last else None
        if self.kv is not None:
            self.kv.record(mb, read, own)
        if self.last:
            loss = self._add_loss(loss, mb) if accumulate else self._scaled(loss, mb)
            self.saved[mb] = (args, (loss,))
            return None
        outs, msgs = self._outs(out)
        self.saved[mb] = (args, outs)
        return self._pass_on(msgs)

    def _outs(self, out: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        """The module's output as (the tensors the backward starts from, what is passed on): on the chain both
        the tuple of its tensors; on a graph the flat tuple and the list of per-edge messages."""
        if self.outputs is None:
            outs = outputs_of(out, self.index)
            return outs, outs
        msgs = edge_outputs(out, self.index, self.outputs)
        return tuple(t for msg in msgs for t in msg), msgs

    def _pass_on(self, msgs: Any) -> Any:
        """Detached copies to pass on: on a graph one per edge, so that two consumers on this rank never share
        a leaf (each takes its own input's gradient)."""
        if self.outputs is None:
            return tuple(o.detach() for o in msgs)
        return [tuple(o.detach() for o in msg) for msg in msgs]

    def _call(self, mb: int, args: tuple, keep: bool) -> tuple[Any, tuple, tuple]:
        """The module on one micro-batch: (output, cache leaves read, own kv). Sliced, it reads the earlier
        slices' kv from the cache and, when `keep` (a FWD, not a RECOMPUTE), leaves its own there."""
        if self.kv is None:
            return self.module(*args), (), ()
        past, read = self.kv.past(mb)
        out, own = slices.kv_of(self.module(*args, past_kv=past), self.index, self.kv.text(mb))
        if keep:
            self.kv.keep(mb, own)
        return out, read, own

    def _scaled(self, loss: Any, mb: int) -> torch.Tensor:
        scale = self.loss_scale if self.loss_scales is None else self.loss_scales[mb]
        if isinstance(loss, torch.Tensor):
            # a 0-dim loss as it is: a reshape's view and its backward node cost ~10 us a micro-batch on a
            # small stage (and a 0-dim tensor has one element: no numel call)
            if loss.dim() == 0:
                return loss * scale
            if loss.numel() == 1:
                return loss.reshape(()) * scale
        raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")

    def _add_loss(self, loss: Any, mb: int) -> torch.Tensor:
        loss = self._scaled(loss, mb)
        self.losses.append(loss.detach())  # summed when read (`loss`)
        return loss

    def _exclude(self, args: tuple, target: Any) -> set[int]:
        """Storages autograd may save that are not activations: parameters, buffers, the step's data."""
        if self._state_storages is None or self.live_params:
            self._state_storages = module_storages(self.module)
        data: list[Any] = [target] if isinstance(target, torch.Tensor) else []
        if self.first:
            data += list(args)
        return self._state_storages | storages(data) if data else self._state_storages

    def backward(self, mb: int, grads: tuple[torch.Tensor, ...] | None) -> tuple[torch.Tensor, ...] | None:
        """BWD: the gradient of the stage's inputs (None on the first stage). With split backward the weight
        gradients wait for `wgrad`; otherwise they are accumulated now."""
        args, outs = self.saved.pop(mb)
        if self.pool is not None:
            self.pool.ready(mb, self.index)  # a RELOAD's copy has landed
        if self.outputs is not None and grads is not None and len(outs) > 1:
            outs, grads = _merge(outs, grads)
        read: tuple[torch.Tensor, ...] = ()
        if self.kv is not None:  # the slice's own kv are outputs too, with the later slices' gradients
            read, own = self.kv.backward_of(mb)
            if own:
                grads = [None] * len(outs) if grads is None else list(grads)
                outs, grads = (*outs, *(t for t, _ in own)), (*grads, *(g for _, g in own))
        if self.split_backward and not (self.first and self.whole_backward):
            if self.first:  # no input gradient to compute: WGRAD does the whole weight backward
                if read:  # but the earlier slices' kv gradients are due now
                    self.kv.add_grads(read, slices.leaf_grads(outs, grads, read))
                self.deferred[mb] = (outs, grads)
                return None
            dall, groups = split.backward_input(outs, grads, (*args, *read), self.trainable(), self.compiled)
            self.deferred[mb] = groups
            dargs = dall[: len(args)]
            if read:  # the earlier slices' kv gradients, for their own BWD
                self.kv.add_grads(read, dall[len(args) :])
        else:
            if len(outs) == 1:  # one output, the common case: no lists built
                if outs[0].requires_grad:
                    run_backward(outs, (None,) if grads is None else grads)
            else:
                pairs = [(o, None if grads is None else grads[k]) for k, o in enumerate(outs) if o.requires_grad]
                if pairs:
                    run_backward([o for o, _ in pairs], [g for _, g in pairs])
            if self.pool is not None:
                self.pool.release(mb, self.index)
            if self.split_backward:  # whole_backward: WGRAD finds nothing left to do
                self.deferred[mb] = None
            if self.first:
                return None
            if len(args) == 1:
                g = args[0].grad
                return (torch.zeros_like(args[0]) if g is None else g,)
            dargs = tuple(x.grad for x in args)
        return tuple(torch.zeros_like(x) if g is None else g for x, g in zip(args, dargs))

    def wgrad(self, mb: int) -> None:
        """WGRAD: accumulate the weight gradients of micro-batch mb from what BWD kept."""
        state = self.deferred.pop(mb)
        if state is None:  # done at BWD (whole_backward)
            return
        if isinstance(state, tuple):  # the first stage's whole backward, deferred by its BWD
            outs, grads = state
            pairs = [(o, None if grads is None else grads[k]) for k, o in enumerate(outs) if o.requires_grad]
            # sliced, the graph reaches the cache's leaves too, whose gradients BWD has given already
            only = {"inputs": self.trainable()} if self.kv is not None else {}
            if pairs:
                run_backward([o for o, _ in pairs], [g for _, g in pairs], **only)
        else:
            split.backward_weight(state)
        if self.pool is not None:
            self.pool.release(mb, self.index)

    def trainable(self) -> list[torch.nn.Parameter]:
        if self.live_params:
            return [p for p in self.module.parameters() if p.requires_grad]
        return self.params

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        if self.live_params:
            for p in self.module.parameters():
                p.grad = None
        self.losses = []

    def step(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step()

    def check_done(self) -> list[int]:
        """Micro-batches whose backward never ran (a Program bug): empty when the step is complete."""
        left = set(self.saved) | set(self.deferred) | set(self.stashed)
        return sorted(left | set(self.kv.left()) if self.kv is not None else left)


def _merge(outs: tuple[torch.Tensor, ...], grads: Any) -> tuple[tuple[torch.Tensor, ...], tuple]:
    """A stage graph's fan-out: a tensor sent on several edges is one output whose gradient is the sum of the
    edges' (summed here, so that every backward, split or not, sees each output once)."""
    at: dict[int, int] = {}
    o2: list[torch.Tensor] = []
    g2: list[Any] = []
    for o, g in zip(outs, grads):
        k = at.get(id(o))
        if k is None:
            at[id(o)] = len(o2)
            o2.append(o)
            g2.append(g)
        elif g is not None:
            g2[k] = g if g2[k] is None else g2[k] + g
    return tuple(o2), tuple(g2)
