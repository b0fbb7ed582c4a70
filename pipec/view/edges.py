"""The stage graph in the view: which edge each drawn message travels, and the graph as the page reads it.

A Timeline names a message by its sending stage (`msg_stage`); on the chain the other end is the stage
next to it (s + 1 for an activation, s - 1 for a gradient), but on a stage graph (`pipec.ir.graph`) a
stage sends along every edge it has, and the page must say which: "the activation of F(3, stage 0) along
0 -> 3", and the idle-gap attribution (`pipec.view.critical`) must know which op a message feeds.

The Program knows: each send instruction names the stage at the other end of its edge
(`RankProgram.other`), and the simulator makes one message per send, in the order of the ranks' send
instructions. `receiving_stages` reads them off in that order, checked against the Timeline's own columns
(rank, micro-batch, sending stage, peer); where they disagree (a Timeline not simulated from this
Program) the graph and the placement decide (the one edge of the sending stage whose other end is on the
receiving rank; the first by edge order where there are several).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pipec.ir.graph import StageGraph
from pipec.ir.opcodes import IS_SEND, MSG_OF
from pipec.sim.timeline import Timeline

if TYPE_CHECKING:
    from pipec.ir.program import Program


def drawn_graph(graph: StageGraph | None) -> StageGraph | None:
    """The graph a page carries: None for the chain (a chain document stays as it was, byte for byte)."""
    return None if graph is None or graph.is_chain else graph


def receiving_stages(tl: Timeline, graph: StageGraph, prog: Program | None, placement) -> np.ndarray:
    """Per message of `tl`, the stage at the other end of its edge: the consumer of an activation, the
    producer a gradient returns to (the module docstring: from the Program, else the graph)."""
    n = len(tl.msg_stage)
    if prog is not None and prog.graph is not None and n:
        parts = []
        for r, rp in enumerate(prog.ranks):
            s = np.flatnonzero(IS_SEND[rp.op])
            other = rp.other[s] if rp.other is not None else np.full(len(s), -1, np.int64)
            parts.append((np.full(len(s), r), MSG_OF[rp.op[s]], rp.mb[s], rp.stage[s], rp.peer[s], other))
        cols = [np.concatenate([p[k] for p in parts]).astype(np.int64) for k in range(6)]
        mine = [tl.msg_src, tl.msg_kind, tl.msg_mb, tl.msg_stage, tl.msg_dst]
        if len(cols[0]) == n and all(np.array_equal(a, np.asarray(b, np.int64)) for a, b in zip(cols, mine)):
            if (cols[5] >= 0).all():
                return cols[5]
    return _by_placement(tl, graph, np.asarray(placement, np.int64))


def _by_placement(tl: Timeline, graph: StageGraph, placement: np.ndarray) -> np.ndarray:
    """The other end from the graph alone: the first edge of the sending stage, in its message's direction,
    whose other end is placed on the receiving rank (-1: none)."""
    out = np.full(len(tl.msg_stage), -1, np.int64)
    stage = tl.msg_stage.astype(np.int64)
    slots = max(graph.max_in, graph.max_out)
    for j in range(slots - 1, -1, -1):  # the last slot first, so the first slot that fits is what remains
        e_out, v_out = graph.out_slot(stage, j)
        e_in, v_in = graph.in_slot(stage, j)
        if not graph.num_edges:
            break
        fwd = tl.msg_kind == 0
        other = np.where(fwd, graph.dst[np.maximum(e_out, 0)], graph.src[np.maximum(e_in, 0)])
        valid = np.where(fwd, v_out, v_in) & (placement[np.clip(other, 0, len(placement) - 1)] == tl.msg_dst)
        out = np.where(valid, other, out)
    return out


def graph_json(graph: StageGraph) -> dict[str, object]:
    """The graph as the page reads it: its stages, its edges and their text (`0->1, 0->3, ...`)."""
    return {"stages": graph.num_stages, "edges": graph.to_json(), "text": graph.describe()}
