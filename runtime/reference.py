"""The single-process reference: the same stages (same seeds, so the same weights), chained, on the same
micro-batches, with the same loss scaling and optimizers; and the relative errors against it. With
`replicas=N` it runs the whole global batch of N data-parallel replicas: N x m micro-batches.

A sliced run (token slices) is checked against this unsliced reference with m = the Program's
`num_sequences`: the slices of a sequence together compute its loss and gradients (pipec.runtime.exec.slices).
Micro-batches given as such (pipec.runtime.exec.microbatch.MicroBatches, variable shapes) run as given.

With a stage graph (`graph=`, pipec.ir.graph.StageGraph) the stages run in stage order (a topological order),
each on its in-edges' messages in the order of `graph.inputs(s)`, a source on the micro-batch, each output cut
into its out-edges' messages as the runtime cuts it (pipec.runtime.exec.shapes.edge_outputs); autograd sums a
fan-out's gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pipec.runtime.exec.microbatch import MicroBatches, as_args, split, to_device
from pipec.runtime.exec.shapes import edge_outputs
from pipec.runtime.model.contract import build_stage_module, default_optimizer


class Reference:
    """The single-process reference a pipelined run is checked against: the same stages, chained, in float64.

    Same seeds (so the same weights), the same micro-batches, loss scaling and optimizers; `replicas=N` runs
    the global batch of N data-parallel replicas.
    """

    def __init__(
        self,
        build_stage: Callable[[int, int], torch.nn.Module],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        num_stages: int,
        num_microbatches: int,
        *,
        optimizer: Callable[[list], torch.optim.Optimizer] | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        loss_scale: float | None = None,
        seed: int | None = 0,
        replicas: int = 1,
        graph: Any = None,
    ) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {replicas}")
        self.replicas = replicas
        self.graph = graph if graph is not None and not graph.is_chain else None
        self.device = torch.device(device)
        self.dtype = dtype
        self.loss_fn = loss_fn
        self.m = num_microbatches
        self.scale = 1.0 / num_microbatches if loss_scale is None else loss_scale
        self.stages = [
            build_stage_module(build_stage, s, num_stages, seed=seed, dtype=dtype, device=self.device)
            for s in range(num_stages)
        ]
        make_opt = optimizer or default_optimizer
        self.optimizers = []
        for st in self.stages:
            params = [p for p in st.parameters() if p.requires_grad]
            self.optimizers.append(make_opt(params) if params else None)

    def step(self, inputs: Any, targets: Any) -> float:
        """Forward and backward of every micro-batch in order, then every optimizer; returns the loss."""
        for st in self.stages:
            for p in st.parameters():
                p.grad = None
        # With data parallelism: replica d's micro-batches are part d of the global batch, split in m (as
        # pipec.runtime.exec.replicas.slice_replica and the Runner do); each replica's loss counts 1/replicas.
        if self.replicas > 1 and isinstance(inputs, MicroBatches):
            raise ValueError("a batch given as its micro-batches runs one pipeline: replicas must be 1")
        xs, ts = [], []
        for x, t in zip(_parts(inputs, self.replicas, "inputs"), _parts(targets, self.replicas, "targets")):
            xs += split(x, self.m, "inputs")
            ts += split(t, self.m, "targets")
        scale = self.scale / self.replicas
        total = 0.0
        for x, t in zip(xs, ts):
            args = as_args(to_device(x, self.device, self.dtype))
            if self.graph is not None:
                out = self._graph_forward(args)
            else:
                for k, st in enumerate(self.stages):
                    out = st(*args)
                    args = tuple(out) if isinstance(out, (tuple, list)) and k < len(self.stages) - 1 else (out,)
            loss = self.loss_fn(out, to_device(t, self.device)).reshape(()) * scale
            loss.backward()
            total += float(loss.detach())
        for opt in self.optimizers:
            if opt is not None:
                opt.step()
        return total

    def _graph_forward(self, inputs: tuple) -> Any:
        """One micro-batch through the stage graph; the last stage's output."""
        g = self.graph
        sent: dict[tuple[int, int], tuple] = {}
        out = None
        for s, st in enumerate(self.stages):
            srcs = g.inputs(s)
            args = tuple(t for u in srcs for t in sent.pop((u, s))) if srcs else inputs
            out = st(*args)
            dsts = g.outputs(s)
            for v, msg in zip(dsts, edge_outputs(out, s, dsts)):
                sent[(s, v)] = msg
        return out

    def named_gradients(self) -> dict[tuple[int, str], torch.Tensor | None]:
        return {(s, n): p.grad for s, st in enumerate(self.stages) for n, p in st.named_parameters()}

    def named_parameters(self) -> dict[tuple[int, str], torch.Tensor]:
        return {(s, n): p for s, st in enumerate(self.stages) for n, p in st.named_parameters()}


def _parts(batch: Any, n: int, what: str) -> list[Any]:
    return split(batch, n, what) if n > 1 else [batch]


def rel_err(a: torch.Tensor | float | None, b: torch.Tensor | float | None) -> float:
    """max |a - b| / max |b| (0 when both are zero or both missing; inf when only one is missing)."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    a = torch.as_tensor(a, dtype=torch.float64).detach().cpu()
    b = torch.as_tensor(b, dtype=torch.float64).detach().cpu()
    if a.shape != b.shape:
        return float("inf")
    scale = b.abs().max().item() if b.numel() else 0.0
    diff = (a - b).abs().max().item() if b.numel() else 0.0
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


def compare(
    ours: dict[tuple[int, str], torch.Tensor | None], ref: dict[tuple[int, str], torch.Tensor | None]
) -> dict[tuple[int, str], float]:
    """Relative error of each of our tensors against the reference's tensor of the same (stage, name)."""
    return {k: rel_err(v, ref[k]) for k, v in ours.items()}
