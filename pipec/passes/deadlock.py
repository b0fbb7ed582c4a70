"""Deadlock: can the Schedule's ranks all finish, each running its order and waiting for its inputs from
other ranks? The global wait-for relation of a Schedule, and a cycle explained rank by rank.

This is a question about the Schedule (its orders and `pipec.ir.rules`' dependencies), asked before
lowering: the rounds (`_rounds`) run every rank's order in lock-step, each op visited once, an op waiting
for its cross-rank input. It times nothing (that is `pipec.sim.machine`'s) and knows no messages or
matching (whether the lowered Program's sends and receives match under rendezvous is
`pipec.passes.dryrun`'s question). Only when ranks get stuck do we build the rank wait-for relation (each
stuck rank waits on one other) and follow it to the cycle to explain.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from pipec.errors import PipecError, error
from pipec.ir.rules import dependencies
from pipec.ir.schedule import Op, Schedule


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
    return _rounds(sched)[1]


def global_order(sched: Schedule) -> list[np.ndarray]:
    """Per rank, the time (a global counter) at which each op completes in one dependency-respecting
    execution of all ranks; raises E401 with the explained cycle when there is none."""
    times, cycle = _rounds(sched)
    if cycle:
        raise deadlock_error(sched, cycle)
    return times


def _rounds(sched: Schedule) -> tuple[list[np.ndarray], tuple[WaitStep, ...]]:
    """Whether the ranks can all finish: per rank, each op's place in one global order (by round, the round
    of an op one past the later of its rank's previous op and its cross-rank input) and no cycle; or no
    times and the wait cycle when some ranks stay stuck."""
    S, m, K = sched.num_stages, sched.num_microbatches, len(sched.kinds)
    R = sched.num_ranks
    where = np.full(K * S * m, -1, dtype=np.int64)  # op key -> (rank, index) packed
    offsets = np.cumsum([0] + [len(r) for r in sched.ranks])
    # Cross-rank input of each op (pipec.ir.rules: the one input a kind receives from another stage, when
    # that stage is on another rank); -1 when local or none. Same-rank inputs are E304's (checked before).
    placement = sched.placement_array
    none = [np.zeros(0, dtype=np.int64)]
    kind = np.concatenate([o.kind for o in sched.ranks] or none)
    mb = np.concatenate([o.mb for o in sched.ranks] or none)
    stage = np.concatenate([o.stage for o in sched.ranks] or none)
    rank = np.repeat(np.arange(R), np.diff(offsets))
    where[(kind * S + stage) * m + mb] = np.arange(len(kind))
    dep = np.full(len(kind), -1, dtype=np.int64)
    # On a stage graph an op may wait on several ranks (a fan-in's F, a fan-out's B): the first remote input
    # found stays in `dep`, the others go to `more` (per rank: op index -> further inputs).
    more: list[dict[int, list[int]]] = [{} for _ in range(R)]
    for rule, dk, di, ds, valid in dependencies(kind, mb, stage, S, K == 3, graph=sched.graph):
        if rule.stage:
            ds = np.clip(ds, 0, S - 1)
            # Indexed where valid only: a rule of a kind the schedule lacks (B in a forward-only one) points
            # past the table.
            key = np.where(valid, (dk * S + ds) * m + di, 0)
            hit = valid & (placement[ds] != rank)
            if sched.graph is not None:
                for g in np.flatnonzero(hit & (dep >= 0)).tolist():
                    r = int(rank[g])
                    more[r].setdefault(g - int(offsets[r]), []).append(int(where[key[g]]))
                hit &= dep < 0
            dep = np.where(hit, where[key], dep)
    # Flat lists over all ranks (global op indices): no per-rank slices, the loops index one list.
    deps = dep.tolist()
    pairs = np.concatenate([r.paired for r in sched.ranks] or [np.zeros(0, dtype=bool)]).tolist()
    has_pair = np.bincount(rank, weights=np.concatenate([r.paired for r in sched.ranks] or none), minlength=R)
    lean = [not (has_pair[i] or more[i]) for i in range(R)]

    # Rounds: all ranks step together, one op (or overlapped pair) per round, so an op runs in round
    # max(previous op's round, its remote inputs' rounds) + 1. Computed event-driven, each op once.
    n = int(offsets[-1])
    rounds = [-1] * n
    pc = offsets[:-1].tolist()  # each rank's next op, as a global index
    ends = offsets[1:].tolist()
    last_round = [-1] * R
    stuck_on: dict[int, int] = {}
    waiters: dict[int, list[int]] = {}
    awaited = bytearray(n)  # 1 where some rank waits for the op (a flag is cheaper than a dict lookup)
    queue = deque(range(R))
    while queue:
        r = queue.popleft()
        j, end, t = pc[r], ends[r], last_round[r]
        if lean[r]:  # the common case: no overlapped pairs, one remote input an op at most, a lean loop
            while j < end:
                d = deps[j]
                if d >= 0:
                    td = rounds[d]
                    if td < 0:
                        stuck_on[r] = d
                        awaited[d] = 1
                        waiters.setdefault(d, []).append(r)
                        break
                    if td > t:
                        t = td
                t += 1
                rounds[j] = t
                if awaited[j]:
                    queue.extend(waiters.pop(j))
                j += 1
            pc[r], last_round[r] = j, t
            continue
        extra, base = more[r], int(offsets[r])
        while j < end:
            width = 2 if pairs[j] and j + 1 < end else 1  # an overlapped pair starts when both have their inputs
            ds = [d for x in range(j, j + width) for d in (deps[x], *extra.get(x - base, ())) if d >= 0]
            pending = next((d for d in ds if rounds[d] < 0), None)
            if pending is not None:
                stuck_on[r] = pending
                awaited[pending] = 1
                waiters.setdefault(pending, []).append(r)
                break
            t = max([t, *(rounds[d] for d in ds)]) + 1
            for x in range(j, j + width):
                rounds[x] = t
                if awaited[x]:
                    queue.extend(waiters.pop(x))
            j += width
        pc[r], last_round[r] = j, t
    if pc != ends:
        return [], _explain(sched, [pc[r] - int(offsets[r]) for r in range(R)], stuck_on, offsets)
    # One total order, the same on every rank: by round, then rank, then position.
    rnd = np.asarray(rounds, dtype=np.int64)
    rank_of = np.repeat(np.arange(R), np.diff(offsets))
    order = np.argsort(rnd * R + rank_of, kind="stable")  # stable: position breaks the last ties
    time = np.empty(n, dtype=np.int64)
    time[order] = np.arange(n)
    return [time[offsets[r] : offsets[r + 1]] for r in range(R)], ()


def _explain(sched: Schedule, pc: list[int], stuck_on: dict[int, int], offsets) -> tuple[WaitStep, ...]:
    def locate(g: int) -> tuple[int, int]:
        r = int(np.searchsorted(offsets, g, side="right") - 1)
        return r, g - int(offsets[r])

    # Each stuck rank waits on exactly one other rank, which is stuck too (a finished rank computed all it
    # sends): following the waits from the lowest stuck rank must come back to a rank already passed.
    waits_on = {r: locate(need)[0] for r, need in stuck_on.items() if pc[r] < len(sched.ranks[r])}
    path, seen, r = [], {}, min(waits_on)
    while r not in seen:
        seen[r] = len(path)
        path.append(r)
        r = waits_on[r]
    loop = path[seen[r] :]
    cycle = [(a, loop[(i + 1) % len(loop)]) for i, a in enumerate(loop)]
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

    def name(op: Op) -> str:  # `F(1, stage 0)`, or `F(0, slice 1, stage 2)` with token slices
        return sched.op_text(op.kind, op.mb, op.stage)

    for w in cycle:
        what = "activation" if w.needs.kind == "F" else "gradient"
        needs = name(w.needs)
        text = f"rank {w.rank} waits at `{name(w.op)}`{_line(w.line)} for the {what} of `{needs}` from rank {w.peer}"
        if w.peer_op == w.needs:
            text += f"; rank {w.peer} is stuck at `{needs}` itself"
        else:
            text += f"; rank {w.peer} only reaches `{needs}` after `{name(w.peer_op)}`{_line(w.peer_line)}"
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
