"""One pipeline stage on this rank: forward, backward (full or input-only), weight gradient, optimizer step.

Per micro-batch it keeps what the backward needs: the inputs (leaves that require grad, so the input
gradient can be handed back) and the outputs with their graph; after an input-only BWD, what WGRAD needs.
The last stage computes the loss, scaled by `loss_scale`, and accumulates it for the step's report.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pipec.runtime import split
from pipec.runtime.shapes import outputs_of


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
    ) -> None:
        self.index = index
        self.first = index == 0
        self.last = index == num_stages - 1
        self.module = module
        self.loss_fn = loss_fn
        self.loss_scale = loss_scale
        self.split_backward = split_backward
        self.optimizer = optimizer
        self.params = [p for p in module.parameters() if p.requires_grad]
        # Under FSDP2 the module's parameters change between the sharded ones (the optimizer's) and the
        # gathered ones (the autograd graph's) with each unshard and reshard: read them when needed.
        self.live_params = False
        self.saved: dict[int, tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = {}
        self.deferred: dict[int, Any] = {}
        self.loss = None  # sum of this step's scaled micro-batch losses (last stage)

    def forward(self, mb: int, args: tuple, target: Any = None) -> tuple[torch.Tensor, ...] | None:
        """Run the stage; returns the (detached) outputs to pass on, or None on the last stage."""
        if not self.first:
            args = tuple(x.requires_grad_() for x in args)
        out = self.module(*args)
        if self.last:
            loss = self.loss_fn(out, target)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
            loss = loss.reshape(()) * self.loss_scale
            self.loss = loss.detach() if self.loss is None else self.loss + loss.detach()
            self.saved[mb] = (args, (loss,))
            return None
        outs = outputs_of(out, self.index)
        self.saved[mb] = (args, outs)
        return tuple(o.detach() for o in outs)

    def backward(self, mb: int, grads: tuple[torch.Tensor, ...] | None) -> tuple[torch.Tensor, ...] | None:
        """BWD: the gradient of the stage's inputs (None on the first stage). With split backward the weight
        gradients wait for `wgrad`; otherwise they are accumulated now."""
        args, outs = self.saved.pop(mb)
        if self.split_backward:
            if self.first:  # no input gradient to compute: WGRAD does the whole backward
                self.deferred[mb] = (outs, grads)
                return None
            dargs, groups = split.backward_input(outs, grads, args, self.trainable())
            self.deferred[mb] = groups
        else:
            pairs = [(o, None if grads is None else grads[k]) for k, o in enumerate(outs) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], None if grads is None else [g for _, g in pairs])
            if self.first:
                return None
            dargs = tuple(x.grad for x in args)
        return tuple(torch.zeros_like(x) if g is None else g for x, g in zip(args, dargs))

    def wgrad(self, mb: int) -> None:
        """WGRAD: accumulate the weight gradients of micro-batch mb from what BWD kept."""
        state = self.deferred.pop(mb)
        if self.first:
            outs, grads = state
            pairs = [(o, None if grads is None else grads[k]) for k, o in enumerate(outs) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], None if grads is None else [g for _, g in pairs])
        else:
            split.backward_weight(state)

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
        self.loss = None

    def step(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step()

    def check_done(self) -> list[int]:
        """Micro-batches whose backward never ran (a Program bug): empty when the step is complete."""
        return sorted(set(self.saved) | set(self.deferred))
