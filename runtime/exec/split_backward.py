"""Split backward: BWD computes the input gradient only, WGRAD the weight gradients later, without
recomputing the backward pass.

The autograd graph is split the way Zero Bubble and torch.distributed.pipelining's `_backward.py` do it
(re-implemented here: torch's module sits in a package that takes seconds to import):

- BWD walks the graph from the stage's outputs. The nodes on some path from the stage's inputs to its
  outputs form the input closure. For each parameter, the first nodes of the input closure that its
  gradient path reaches are its *intermediates* (for a Linear layer: the matmul node, whose other branch
  leads to the input). Parameters sharing an intermediate form a group. Pre-hooks capture the gradient
  flowing into every intermediate while `autograd.grad` computes the input gradients only (the graph is
  kept; autograd skips the weight branches, as nobody asked for them).
- WGRAD runs `autograd.grad` from each group's intermediates (with the captured gradients) to its
  parameters: only the weight branches execute, once. When one intermediate lies below another of the
  same group, a pre-hook pins its incoming gradient to the captured one so nothing is counted twice.

The first stage's inputs need no gradient, so its BWD does nothing and its WGRAD is the full backward.

A stage compiled with torch.compile (`--compile`, pipec.runtime.exec.compiled) has one autograd node for its
whole backward (AOTAutograd's compiled backward): the only intermediate of every parameter is that node,
and a WGRAD from it would run the whole compiled backward again. There (`whole`) BWD runs it once for the
input and the weight gradients together and WGRAD accumulates the weight gradients it kept: B gives the
input gradient and W the weight gradient, as the Program orders them, but the weight gradient's compute is
done at B. Splitting the compiled joint graph itself (torchtitan's GraphPP) is not done here.
A parameter that reaches an output without meeting the input closure (an output that does not depend on
the inputs) leaves no place to split: that micro-batch's BWD then does the full backward (still exact).
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node


def grad_node(t: torch.Tensor) -> Node | None:
    """The node that receives t's gradient: its grad_fn, or for a leaf its AccumulateGrad node."""
    if t.grad_fn is not None:
        return t.grad_fn
    if t.requires_grad:
        return t.view_as(t).grad_fn.next_functions[0][0]
    return None


def _parents(roots: list[Node]) -> dict[Node, list[Node]]:
    """Reverse edges of the graph below `roots`: node -> the nodes that feed it a gradient."""
    parents: dict[Node, list[Node]] = defaultdict(list)
    seen = set(roots)
    queue = deque(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is not None:
                parents[child].append(node)
                if child not in seen:
                    seen.add(child)
                    queue.append(child)
    return parents


def _upward(starts: list[Node], parents: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes reachable from `starts` toward the outputs, not passing `stop` nodes; and the stop nodes hit."""
    seen: set[Node] = set(starts)
    hit: set[Node] = set()
    queue = deque(starts)
    while queue:
        for parent in parents.get(queue.popleft(), ()):
            if parent in stop:
                hit.add(parent)
            elif parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return seen, hit


def _groups(in_nodes: list[Node], param_nodes: list[Node], parents: dict[Node, list[Node]]) -> list[dict]:
    closure, _ = _upward(in_nodes, parents, set())
    by_node: dict[Node, dict] = {}
    for p in param_nodes:
        _, hit = _upward([p], parents, closure)
        group = {"params": {p}, "intermediates": set(hit)}
        for node in hit:  # merge with every group sharing an intermediate
            other = by_node.get(node)
            if other is not None and other is not group:
                group["params"] |= other["params"]
                group["intermediates"] |= other["intermediates"]
        for node in group["intermediates"]:
            by_node[node] = group
    unique = {id(g): g for g in by_node.values()}
    return list(unique.values())


def backward_input(
    outputs: Sequence[torch.Tensor],
    output_grads: Sequence[torch.Tensor] | None,
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.nn.Parameter],
    whole: bool = False,
) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]]]:
    """Gradients of the inputs; the second value is what `backward_weight` needs later. `whole` (a compiled
    stage, pipec.runtime.exec.compiled): one pass computes the input and the weight gradients, and
    `backward_weight` accumulates the weight gradients kept."""
    pairs = [
        (o, torch.ones_like(o) if output_grads is None else output_grads[k])
        for k, o in enumerate(outputs)
        if o.requires_grad
    ]
    outs, grads = [o for o, _ in pairs], [g for _, g in pairs]
    wanted = [x for x in inputs if x.requires_grad]
    if not outs or not wanted:
        return tuple(None for _ in inputs), []
    trainable = [p for p in params if p.requires_grad]
    if whole:  # a compiled stage's backward is one node: split it and W would run it all again
        dx = torch.autograd.grad(outs, wanted + trainable, grads, allow_unused=True)
        it = iter(dx)
        return tuple(next(it) if x.requires_grad else None for x in inputs), [
            {"dws": list(zip(trainable, dx[len(wanted) :]))}
        ]
    parents = _parents([grad_node(o) for o in outs])
    param_nodes = {grad_node(p): p for p in trainable}
    reachable = [n for n in param_nodes if n in parents]  # parameters that took part in this forward
    groups = _groups([grad_node(x) for x in wanted], reachable, parents)
    covered = set().union(*(g["params"] for g in groups))
    if any(n not in covered for n in reachable):
        dx = torch.autograd.grad(outs, wanted + trainable, grads, allow_unused=True)
        for p, g in zip(trainable, dx[len(wanted) :]):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
        it = iter(dx)
        return tuple(next(it) if x.requires_grad else None for x in inputs), []

    handles = []
    try:
        for group in groups:
            nodes = list(group["intermediates"])
            group["intermediates"] = nodes
            group["grads"] = [None] * len(nodes)
            group["params"] = [param_nodes[n] for n in group["params"]]
            for i, node in enumerate(nodes):

                def capture(grad_outputs, group=group, i=i):
                    group["grads"][i] = grad_outputs

                handles.append(node.register_prehook(capture))
        dx = torch.autograd.grad(outs, wanted, grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    it = iter(dx)
    return tuple(next(it) if x.requires_grad else None for x in inputs), groups


def backward_weight(groups: list[dict[str, Any]]) -> None:
    """Accumulate the weight gradients into `.grad` from what `backward_input` kept."""
    for group in groups:
        if "dws" in group:  # computed at B (`whole`)
            for p, dw in group.pop("dws"):
                if dw is not None:
                    p.grad = dw if p.grad is None else p.grad.add_(dw)
            continue
        nodes, captured, params = group["intermediates"], group["grads"], group["params"]
        edges, grads = [], []
        for node, gs in zip(nodes, captured):
            for k, g in enumerate(gs or ()):
                if g is not None:
                    edges.append(GradientEdge(node, k))
                    grads.append(g)
        if not edges:
            continue
        handles = []
        try:
            if len(nodes) > 1:  # pin each intermediate's gradient to the captured one
                for node, gs in zip(nodes, captured):
                    handles.append(node.register_prehook(lambda _, gs=gs: gs))
            dws = torch.autograd.grad(edges, [GradientEdge(grad_node(p), 0) for p in params], grads, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        for p, dw in zip(params, dws):
            if dw is not None:
                p.grad = dw if p.grad is None else p.grad.add_(dw)
        group.clear()
