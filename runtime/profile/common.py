"""What every profiler of `pipec profile` shares: the stage modules as a run builds them, and how measured
numbers are written (six significant digits, enough for any timer and short in a cost file)."""

from __future__ import annotations

from typing import Any

import torch

from pipec.runtime.model.contract import Model, build_stage_module


def rounded(xs: list[float]) -> list[float]:
    """Each number to six significant digits."""
    return [float(f"{x:.6g}") for x in xs]


def stage_modules(model: Model, S: int, seed: int, device: torch.device) -> list[torch.nn.Module]:
    """Every stage's module as a run builds it (seeded by (seed, stage))."""
    return [
        build_stage_module(model.build_stage, s, S, seed=seed, dtype=model.dtype, device=device, where="build_stage")
        for s in range(S)
    ]


class Wiring:
    """How one micro-batch's tensors go from stage to stage when a profiler runs every stage in one process:
    on the chain each stage's output is the next one's input; on a stage graph (pipec.ir.graph, the
    Program's `graph`) a stage takes its in-edges' messages in the order of `graph.inputs(s)` (a source the
    micro-batch), leaves one message per out-edge, and its input gradient is cut back into the in-edges' (as
    the executor does). The stages must be built with `stage_options(s)` (a source, its outputs) and run in
    stage order, which is a topological order of the graph."""

    def __init__(self, graph: Any, num_stages: int) -> None:
        self.graph = graph if graph is not None and not graph.is_chain else None
        self.S = num_stages
        self.outs: dict[int, Any] = {}
        self.sizes: dict[int, list[int]] = {}
        self.grads: dict[Any, Any] = {}

    def stage_options(self, s: int) -> dict[str, Any]:
        if self.graph is None:
            return {}
        return {"source": not self.graph.inputs(s), "outputs": self.graph.outputs(s)}

    def inputs(self, s: int, x: tuple) -> tuple:
        """Stage s's arguments: the micro-batch for a source, else what its inputs passed on."""
        if self.graph is None:
            return x if s == 0 else self.outs[s - 1]
        ins = self.graph.inputs(s)
        if not ins:
            return x
        msgs = [self.outs[u][self.graph.outputs(u).index(s)] for u in ins]
        self.sizes[s] = [len(m) for m in msgs]
        return tuple(t for m in msgs for t in m)

    def passed(self, s: int, out: Any) -> None:
        self.outs[s] = out

    def sent(self, s: int) -> tuple:
        """The tensors stage s sent forward (every out-edge's), for their bytes."""
        out = self.outs.get(s)
        if out is None:
            return ()
        return tuple(out) if self.graph is None else tuple(t for m in out for t in m)

    def out_grads(self, s: int) -> Any:
        """The gradients stage s's backward takes: its consumers' (None on the last stage)."""
        if s == self.S - 1:
            return None
        if self.graph is None:
            return self.grads[s + 1]
        return tuple(t for v in self.graph.outputs(s) for t in self.grads[(s, v)])

    def input_grads(self, s: int, dargs: Any) -> None:
        """Stage s's input gradient, kept for the stages it came from."""
        if self.graph is None:
            self.grads[s] = dargs
            return
        at = 0
        for u, n in zip(self.graph.inputs(s), self.sizes.get(s, [])):
            self.grads[(u, s)] = dargs[at : at + n] if dargs is not None else None
            at += n
