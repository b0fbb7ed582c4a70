"""The proof of an order family (pipec.ir.family): every order it admits is deadlock-free, its messages
match on the chosen transport, and its worst-case memory.

**Members.** Rank r's members are the orders of its ops that keep every pair its windows force (different
segments, or b - a >= k) and every local dependency (`pipec.ir.rules`, an op's inputs on its own rank):
what a runtime that starts only ready ops of its window can run. The runtime's own choices are members, so
proving every member proves any choice. (A dynamic run stuck with ops left would leave each rank waiting at
some op of its window; the member that runs what it ran, then that op, deadlocks the same way.)

**Deadlock, for an executor that runs only ready ops** (an op whose inputs have arrived and which its
window allows). It never stalls when the static order is deadlock-free (what `compile_schedule` proves,
E401). Proof: say it stalls with the set S of ops run (each rank's a down-set of its family, S closed
under dependencies: only ready ops ran). Take the static order's execution (the global order of
`pipec.passes.deadlock`) and its first op x not in S, on rank r. Everything before x in that execution is
in S: x's inputs, and the ops before x in r's static order. So x is r's first op not run, which every
window allows (every op forced before it comes before it), and its inputs are in: x is ready, and the
executor had not stalled. The same holds with any member that finishes in place of the static order, so
the executor can stall only if no member finishes. `tests/unit/passes/test_family_soundness.py` runs every
interleaving of ready choices on small cases and finds none stuck.

**Deadlock, strict** (`strict=True`: an executor that may commit to an op, say post its blocking receive,
before its inputs arrive; every member must then finish on its own). A member deadlocks iff the rounds of
`pipec.passes.deadlock` get stuck on it iff its wait-for graph (dependencies plus each rank's order) has a
cycle. Shortcutting a cycle inside one rank's (total) order, a minimal cycle enters each rank once, at op a,
and leaves it once, at op b, with a = b, b after a, or b before a where the member may put a first ("a may
precede b": b is not forced before a). So the family has a deadlocking member iff the *hop graph* has a
cycle: per op an entry node and an exit node; entry(a) -> exit(b) when a may precede b on a's rank; exit(b)
-> entry(c) when c needs b from another rank. One way is clear (a deadlocking member gives a cycle). The
other: a cycle of the hop graph entering rank r twice, with hops (a1, b1) and (a2, b2), shortcuts to one hop
(a1, b2) or (a2, b1) unless b2 is forced before a1 and b1 before a2; with forced = the windows' interval
order that cannot be (an interval order has no 2 + 2: b2 < a1 and b1 < a2 give b2 < a2 or b1 < a1, against
the hops), so the cycle has a rank-distinct form, and the member that makes each hop (a before b on its
rank, one per rank: always possible) deadlocks. Local dependencies can, rarely, break the interval order;
the member built from the cycle is therefore checked by the rounds themselves, and a cycle that no member
realises is reported as unproven (E428 says which) rather than accepted. The graph is built in O(ops x
window): "b after a" by a chain through each rank's ops, "b before a" by the window's ops behind a not
locally needed by a (a local dependency path moves forward in the order, so it stays inside the window).

**Channels** (NCCL matches a pair of ranks' messages by issue order; gloo and shared memory by key): two
ops the family may swap must not both exchange messages with one peer (E429 names the ops and channel).

**Memory.** A prefix of a member is a down-set of its rank's forced order; every down-set is one. With
j0 the first op not run, a down-set is the ops before j0 plus some ops of the window after j0 not needing
j0; its largest memory is bounded by adding every such op that adds memory. The worst case is that bound's
largest value, reached by a member (`family_memory` builds it) whenever the ops adding memory need only
such ops (forwards need forwards: always, for F, B and W).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from pipec.errors import PipecError, error
from pipec.ir.family import OrderFamily, RankFamily
from pipec.ir.opcodes import COMPUTE_OF_KIND
from pipec.ir.rules import op_inputs
from pipec.ir.schedule import RankOps, Schedule
from pipec.passes.deadlock import deadlock_error, find_deadlock
from pipec.sim.memory import RankMemory, deltas, memory_model, rank_memory

TRANSPORTS = ("nccl", "gloo", "shm")


@dataclass(frozen=True, eq=False)
class _Graph:
    """The schedule's ops, all ranks concatenated: where each rank starts, each op's rank, its local inputs
    and cross-rank inputs and consumers (global indices)."""

    offsets: np.ndarray
    rank: np.ndarray
    local_in: list[list[int]]
    local_out: list[list[int]]
    cross_in: list[list[int]]
    cross_out: list[list[int]]


def _graph(sched: Schedule) -> _Graph:
    """The schedule's dependency graph (`pipec.ir.rules.op_inputs`) split into local and cross-rank edges."""
    ops = op_inputs(sched)
    rank, n = ops.rank, int(ops.offsets[-1])
    local_in: list[list[int]] = [[] for _ in range(n)]
    local_out: list[list[int]] = [[] for _ in range(n)]
    cross_in: list[list[int]] = [[] for _ in range(n)]
    cross_out: list[list[int]] = [[] for _ in range(n)]
    for c, ins in enumerate(ops.inputs):
        for p in ins:
            if rank[c] == rank[p]:
                local_in[c].append(p)
                local_out[p].append(c)
            else:
                cross_in[c].append(p)
                cross_out[p].append(c)
    return _Graph(ops.offsets, rank, local_in, local_out, cross_in, cross_out)


class _Rank:
    """One rank's family with its local dependencies: which op may precede which."""

    def __init__(self, g: _Graph, r: int, fam: RankFamily | None, n: int) -> None:
        self.base = int(g.offsets[r])
        self.fam = fam
        if fam is None:
            self.seg = np.zeros(n, dtype=np.int64)
            self.reach = np.arange(1, n + 1)
        else:
            self.seg, self.reach, _ = fam.arrays()
        self.g = g
        self._anc: dict[int, set[int]] = {}

    def lo(self, j: int) -> int:
        """The first op that may run after op j (in the order): j's window behind it, in its segment."""
        back = j
        while back > 0 and self.seg[back - 1] == self.seg[j] and self.reach[back - 1] > j:
            back -= 1
        return back

    def ancestors(self, j: int) -> set[int]:
        """The ops between `lo(j)` and j that j needs, locally and transitively (rank positions)."""
        if j not in self._anc:
            lo, base, seen = self.lo(j), self.base, set()
            todo = [j]
            while todo:
                x = todo.pop()
                for p in self.g.local_in[base + x]:
                    q = p - base
                    if q >= lo and q not in seen:
                        seen.add(q)
                        todo.append(q)
            self._anc[j] = seen
        return self._anc[j]

    def may_precede_back(self, j: int) -> list[int]:
        """The ops before j that a member may run after j."""
        anc = self.ancestors(j)
        return [b for b in range(self.lo(j), j) if b not in anc]


def _ranks(sched: Schedule, g: _Graph) -> list[_Rank]:
    fam = sched.family or OrderFamily(())
    return [_Rank(g, r, fam.of(r), len(ops)) for r, ops in enumerate(sched.ranks)]


def prove_family(
    sched: Schedule, transport: str = "nccl", memory: Mapping[str, float] | None = None, strict: bool = False
) -> None:
    """Raise E429 when the family reorders a channel on NCCL, E430 when its worst-case memory is over a
    rank's limit; with `strict` (an executor that may commit to an op before its inputs arrive) E428 when
    a member deadlocks, its order in the notes. None for a static schedule. Deadlock freedom for an
    executor that runs only ready ops is the static order's (module docstring), which
    `pipec.passes.compiler.compile_schedule` proves (E401) before it calls this."""
    if sched.family is None or sched.family.is_static:
        return
    if transport not in TRANSPORTS:
        raise ValueError(f"transport {transport!r}: one of {', '.join(TRANSPORTS)}")
    g = _graph(sched)
    ranks = _ranks(sched, g)
    if transport == "nccl":
        _check_channels(sched, g, ranks)
    if strict:
        cycle = _hop_cycle(g, ranks)
        if cycle is not None:
            raise _deadlock(sched, g, ranks, cycle)
    for rep in family_memory(sched, memory):
        if rep.limit is not None and rep.peak > rep.limit * (1 + 1e-9):
            fam = sched.family.of(rep.rank)
            raise error(
                "E430",
                f"rank {rep.rank}'s order family can hold {rep.peak:g} {rep.unit}, above its limit of {rep.limit:g}",
                fam.span if fam else None,
                sched.source,
                (f"a member reaching it: {_order_text(sched, rep.rank, _worst(sched, rep.rank, memory)[1])}",),
            )


# ---- channels --------------------------------------------------------------


def nccl_reason(sched: Schedule) -> str | None:
    """Why NCCL cannot run the schedule's family (E429's message: a channel it may reorder), or None when
    it can: what the compiler records on the family (`OrderFamily.nccl`) and a Program file's reader
    re-derives (`pipec.formats.family_field`)."""
    if sched.family is None or sched.family.is_static:
        return None
    try:
        g = _graph(sched)
        _check_channels(sched, g, _ranks(sched, g))
    except PipecError as e:
        return e.diagnostics[0].message
    return None


def _check_channels(sched: Schedule, g: _Graph, ranks: list[_Rank]) -> None:
    for r, rk in enumerate(ranks):
        if rk.fam is None:
            continue
        base, n = rk.base, len(sched.ranks[r])
        peers = [{int(g.rank[x]) for x in g.cross_in[base + j] + g.cross_out[base + j]} for j in range(n)]
        for b in range(n):
            if not peers[b]:
                continue
            anc = rk.ancestors(b)
            for a in range(rk.lo(b), b):
                common = peers[a] & peers[b]
                if common and a not in anc:
                    q = min(common)
                    ops = sched.ranks[r]
                    first, then = (
                        sched.op_text(sched.kinds[int(ops.kind[x])], int(ops.mb[x]), int(ops.stage[x])) for x in (a, b)
                    )
                    raise error(
                        "E429",
                        f"rank {r} may run `{then}` before `{first}`: both exchange messages with rank {q}, and "
                        f"NCCL matches the channel between ranks {min(r, q)} and {max(r, q)} by issue order",
                        rk.fam.span,
                        sched.source,
                        (
                            "on NCCL a family may reorder only ops whose messages go to different peers, or local ones "
                            "(W, or ops of stages on one rank); on gloo or shared memory messages match by key",
                        ),
                    )


# ---- deadlock: the hop graph -----------------------------------------------


def _hop_cycle(g: _Graph, ranks: list[_Rank]) -> list[int] | None:
    """A cycle of the hop graph as its nodes in order (entry a: a, exit b: n + b, chain at c: 2n + c), or
    None when it has none (every member finishes)."""
    n = int(g.offsets[-1])
    succ: list[list[int]] = [[] for _ in range(3 * n)]
    for r, rk in enumerate(ranks):
        lo, hi = int(g.offsets[r]), int(g.offsets[r + 1])
        for x in range(lo, hi):
            succ[x].append(2 * n + x)
            succ[2 * n + x].append(n + x)
            if x + 1 < hi:
                succ[2 * n + x].append(2 * n + x + 1)
            if rk.fam is not None:
                succ[x].extend(n + lo + b for b in rk.may_precede_back(x - lo))
    for p in range(n):
        succ[n + p].extend(g.cross_out[p])
    indeg = [0] * (3 * n)
    for out in succ:
        for y in out:
            indeg[y] += 1
    queue = deque(x for x in range(3 * n) if indeg[x] == 0)
    done = 0
    while queue:
        x = queue.popleft()
        done += 1
        for y in succ[x]:
            indeg[y] -= 1
            if indeg[y] == 0:
                queue.append(y)
    if done == 3 * n:
        return None
    # Every node left has a predecessor left: walk back until a node repeats.
    pred: list[list[int]] = [[] for _ in range(3 * n)]
    for x, out in enumerate(succ):
        if indeg[x] > 0:
            for y in out:
                if indeg[y] > 0:
                    pred[y].append(x)
    x = next(i for i in range(3 * n) if indeg[i] > 0)
    path, seen = [], {}
    while x not in seen:
        seen[x] = len(path)
        path.append(x)
        x = pred[x][0]
    return list(reversed(path[seen[x] :]))


def _visits(g: _Graph, cycle: list[int]) -> list[tuple[int, int, int]]:
    """The cycle as (rank, entry op, exit op) per visit of a rank, rank positions."""
    n = int(g.offsets[-1])
    k = next(i for i, x in enumerate(cycle) if x < n)  # start at an entry
    cycle = cycle[k:] + cycle[:k]
    out, entry = [], None
    for x in cycle:
        if x < n:
            entry = x
        elif x < 2 * n:
            r = int(g.rank[x - n])
            base = int(g.offsets[r])
            out.append((r, entry - base, x - n - base))
    return out


def _shortcut(ranks: list[_Rank], visits: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """One visit per rank where the shortcuts of the module docstring allow it."""

    def hop(r: int, a: int, b: int) -> bool:
        return b >= a or b in ranks[r].may_precede_back(a)

    changed = True
    while changed:
        changed = False
        for i in range(len(visits)):
            for j in range(i + 1, len(visits)):
                (r, a1, b1), (q, a2, b2) = visits[i], visits[j]
                if r != q:
                    continue
                if hop(r, a1, b2):
                    visits = visits[:i] + [(r, a1, b2)] + visits[j + 1 :]
                elif hop(r, a2, b1):
                    visits = [(r, a2, b1)] + visits[i + 1 : j]
                else:
                    continue
                changed = True
                break
            if changed:
                break
    return visits


def member(sched: Schedule, orders: Mapping[int, list[int]]) -> Schedule:
    """The static Schedule running `orders[r]` (rank positions, a permutation) on the ranks named."""
    ranks = list(sched.ranks)
    for r, order in orders.items():
        o = np.asarray(order, dtype=np.int64)
        ops = ranks[r]
        ranks[r] = RankOps(ops.kind[o], ops.mb[o], ops.stage[o], ops.sid[o], ops.paired[o])
    return replace(sched, ranks=tuple(ranks), family=None)


def _realise(sched: Schedule, ranks: list[_Rank], visits: list[tuple[int, int, int]]) -> dict[int, list[int]]:
    """Per rank of the cycle, a member order making its hops: for a hop back from a to b, a and what it
    needs between b and a move just before b."""
    orders: dict[int, list[int]] = {}
    for r, a, b in visits:
        order = orders.get(r, list(range(len(sched.ranks[r]))))
        if b < a:
            moved = sorted(ranks[r].ancestors(a) & set(range(b, a)) | {a})
            ia, ib = order.index(a), order.index(b)
            if ib < ia:
                rest = [x for x in order if x not in moved]
                at = rest.index(b)
                order = rest[:at] + moved + rest[at:]
        orders[r] = order
    return orders


def _deadlock(sched: Schedule, g: _Graph, ranks: list[_Rank], cycle: list[int]) -> PipecError:
    visits = _shortcut(ranks, _visits(g, cycle))
    orders = _realise(sched, ranks, visits)
    witness = member(sched, orders)
    waits = find_deadlock(witness) if is_member(sched, orders) else ()
    first = next((r for r, *_ in visits if ranks[r].fam is not None), visits[0][0])
    span = ranks[first].fam.span if ranks[first].fam else None
    changed = [r for r in sorted(orders) if orders[r] != list(range(len(sched.ranks[r])))]
    shown = tuple(f"rank {r} may run {_order_text(sched, r, orders[r])}" for r in changed)
    if not waits:
        path = " -> ".join(str(r) for r, *_ in visits)
        return error(
            "E428",
            f"cannot prove the order family deadlock-free: ranks {path} may wait on each other",
            span,
            sched.source,
            ("the cycle enters a rank twice and no single order makes both hops; shorten the window",),
        )
    inner = deadlock_error(witness, waits).diagnostics[0]
    ring = " -> ".join(str(w.rank) for w in waits) + f" -> {waits[0].rank}"
    return error(
        "E428",
        f"an order the family admits deadlocks: ranks {ring} wait on each other",
        span,
        sched.source,
        shown + inner.notes,
    )


def is_member(sched: Schedule, orders: Mapping[int, list[int]]) -> bool:
    """Whether each `orders[r]` keeps every pair rank r's family forces and every local dependency."""
    g = _graph(sched)
    for r, order in orders.items():
        fam = sched.family.of(r) if sched.family else None
        pos = np.empty(len(order), dtype=np.int64)
        pos[np.asarray(order, dtype=np.int64)] = np.arange(len(order))
        base = int(g.offsets[r])
        for j in range(len(order)):
            if any(pos[p - base] > pos[j] for p in g.local_in[base + j]):
                return False
        if fam is None:
            if list(order) != list(range(len(order))):
                return False
            continue
        seg, reach, _ = fam.arrays()
        for a in range(len(order)):
            # every op forced after a: a later segment, or at or past its reach
            if (
                (pos[a + 1 :] < pos[a]) & ((seg[a + 1 :] != seg[a]) | (np.arange(a + 1, len(order)) >= reach[a]))
            ).any():
                return False
    return True


def _order_text(sched: Schedule, r: int, order: list[int]) -> str:
    ops = sched.ranks[r]
    many = len(sched.stages_of(r)) > 1
    words = []
    for j in order:
        k, i, s = sched.kinds[int(ops.kind[j])], int(ops.mb[j]), int(ops.stage[j])
        words.append(f"{k}{i}.{s}" if many else f"{k}{i}")
    return " ".join(words)


# ---- memory ------------------------------------------------------------------


def _worst(sched: Schedule, r: int, memory: Mapping[str, float] | None, model=None) -> tuple[float, list[int]]:
    """Rank r's largest device level over its family (the bound of the module docstring) and a member
    order reaching the largest level of the down-sets built from it."""
    model = model if model is not None else memory_model(sched, memory)
    ops = sched.ranks[r]
    n = len(ops)
    w, _ = deltas(COMPUTE_OF_KIND[ops.kind], ops.mb, ops.stage, model, sched.split_backward)
    prefix = np.concatenate([[0.0], np.cumsum(w)])
    best, best_order = float(prefix.max(initial=0.0)), list(range(n))
    fam = sched.family.of(r) if sched.family else None
    if fam is None:
        return best, best_order
    g = _graph(sched)
    rk = _Rank(g, r, fam, n)
    base = int(g.offsets[r])
    for j0 in range(n):
        hi = int(rk.reach[j0])
        if hi <= j0 + 1:
            continue
        after = set()  # ops of the window after j0 that need it
        todo = [j0]
        while todo:
            x = todo.pop()
            for c in g.local_out[base + x]:
                q = c - base
                if q < hi and q not in after:
                    after.add(q)
                    todo.append(q)
        free = [x for x in range(j0 + 1, hi) if x not in after]
        bound = prefix[j0] + sum(float(w[x]) for x in free if w[x] > 0)
        if bound > best:
            chosen = {x for x in free if w[x] > 0}
            for x in list(chosen):
                chosen |= {y for y in rk.ancestors(x) if y > j0}
            best = bound
            picked = sorted(chosen)
            best_order = list(range(j0)) + picked + [x for x in range(j0, n) if x not in chosen]
    return best, best_order


def family_memory(sched: Schedule, memory: Mapping[str, float] | None = None) -> list[RankMemory]:
    """Per rank, its worst-case memory over the family (`pipec check --memory`'s figure for a family): the
    report of a member reaching it (`rank_memory`), its peak the bound of the module docstring."""
    model = memory_model(sched, memory)
    worst = [_worst(sched, r, memory, model) for r in range(sched.num_ranks)]
    witness = member(sched, {r: order for r, (_, order) in enumerate(worst)})
    reports = rank_memory(witness, memory)
    out = []
    for rep, (level, _) in zip(reports, worst):
        peak = rep.params + max(level, 0.0)
        out.append(replace(rep, peak=max(rep.peak, peak)))
    return out
