"""Deadlock: the global wait-for relation of a Schedule, and a cycle explained rank by rank.

The fast path is a progress run over ops (program order plus cross-rank data
dependencies, each op visited once). Only when ranks get stuck do we build
the rank wait-for graph and let networkx find the cycle to explain.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import networkx as nx
import numpy as np

from pipec.errors import PipecError, error
from pipec.ir import Op, Schedule


@dataclass(frozen=True)
class WaitStep:
    """Rank `rank` is stuck at `op`, which needs `needs` from rank `peer`; `peer` is stuck at `peer_op`."""

    rank: int
    op: Op
    line: int | None
    needs: Op
    peer: int
    peer_op: Op
    peer_line: int | None


def find_deadlock(sched: Schedule) -> tuple[WaitStep, ...]:
    """The wait cycle if the schedule's ranks cannot all finish, else ()."""
    S, m, K = sched.num_stages, sched.num_microbatches, len(sched.kinds)
    R = sched.num_ranks
    where = np.full(K * S * m, -1, dtype=np.int64)  # op key -> (rank, index) packed
    offsets = np.cumsum([0] + [len(r) for r in sched.ranks])
    for r, ops in enumerate(sched.ranks):
        where[(ops.kind * S + ops.stage) * m + ops.mb] = offsets[r] + np.arange(len(ops))
    # Cross-rank input of each op: F(i,s) <- F(i,s-1), B(i,s) <- B(i,s+1); -1 when local or none.
    remote = []
    placement = np.asarray(sched.placement)
    for r, ops in enumerate(sched.ranks):
        k, i, s = ops.kind, ops.mb, ops.stage
        dep_stage = np.where(k == 0, s - 1, s + 1)
        valid = ((k == 0) & (s > 0)) | ((k == 1) & (s < S - 1))
        dep_stage_c = np.clip(dep_stage, 0, S - 1)
        valid &= placement[dep_stage_c] != r
        dep = np.where(valid, where[(k * S + dep_stage_c) * m + i], -1)
        remote.append(dep.tolist())
    paired = [r.paired.tolist() for r in sched.ranks]

    done = bytearray(int(offsets[-1]))
    pc = [0] * R
    stuck_on: dict[int, int] = {}
    waiters: dict[int, list[int]] = {}
    queue = deque(range(R))
    while queue:
        r = queue.popleft()
        deps, pairs, base = remote[r], paired[r], int(offsets[r])
        j, end = pc[r], len(deps)
        while j < end:
            # An overlapped pair starts only when both ops have their inputs.
            last = j + 1 if pairs[j] and j + 1 < end else j
            need = next((d for d in deps[j : last + 1] if d >= 0 and not done[d]), -1)
            if need >= 0:
                stuck_on[r] = need
                waiters.setdefault(need, []).append(r)
                break
            for x in range(j, last + 1):
                done[base + x] = 1
                for w in waiters.pop(base + x, ()):
                    queue.append(w)
            j = last + 1
        pc[r] = j
    if all(pc[r] == len(remote[r]) for r in range(R)):
        return ()
    return _explain(sched, pc, stuck_on, offsets)


def _explain(sched: Schedule, pc: list[int], stuck_on: dict[int, int], offsets) -> tuple[WaitStep, ...]:
    def locate(g: int) -> tuple[int, int]:
        r = int(np.searchsorted(offsets, g, side="right") - 1)
        return r, g - int(offsets[r])

    graph = nx.DiGraph()
    for r, need in stuck_on.items():
        if pc[r] < len(sched.ranks[r]):
            graph.add_edge(r, locate(need)[0])
    start = min(r for r in stuck_on if pc[r] < len(sched.ranks[r]))
    cycle = nx.find_cycle(graph, source=start)
    steps = []
    for a, b in cycle:
        op = _op_at(sched, a, pc[a])
        _, d_index = locate(stuck_on[a])
        needs = _op_at(sched, b, d_index)
        peer_op = _op_at(sched, b, pc[b])
        steps.append(
            WaitStep(
                a,
                op,
                sched.span_of(a, pc[a]).line if sched.spans else None,
                needs,
                b,
                peer_op,
                sched.span_of(b, pc[b]).line if sched.spans else None,
            )
        )
    return tuple(steps)


def _op_at(sched: Schedule, r: int, j: int) -> Op:
    ops = sched.ranks[r]
    return Op(sched.kinds[int(ops.kind[j])], int(ops.mb[j]), int(ops.stage[j]))


def _line(line: int | None) -> str:
    return f" (line {line})" if line is not None else ""


def deadlock_error(sched: Schedule, cycle: tuple[WaitStep, ...]) -> PipecError:
    ranks = " -> ".join(str(w.rank) for w in cycle) + f" -> {cycle[0].rank}"
    notes = []
    for w in cycle:
        what = "activation" if w.needs.kind == "F" else "gradient"
        text = f"rank {w.rank} waits at `{w.op}`{_line(w.line)} for the {what} of `{w.needs}` from rank {w.peer}"
        if w.peer_op == w.needs:
            text += f"; rank {w.peer} is stuck at `{w.needs}` itself"
        else:
            text += f"; rank {w.peer} only reaches `{w.needs}` after `{w.peer_op}`{_line(w.peer_line)}"
        notes.append(text)
    first = cycle[0]
    ops = sched.ranks[first.rank]
    kind = sched.kinds.index(first.op.kind)
    j = int(np.flatnonzero((ops.kind == kind) & (ops.mb == first.op.mb) & (ops.stage == first.op.stage))[0])
    span = sched.span_of(first.rank, j) if sched.spans else None
    return error(
        "E401",
        f"deadlock: ranks {ranks} wait on each other",
        span,
        sched.source,
        tuple(notes),
    )
