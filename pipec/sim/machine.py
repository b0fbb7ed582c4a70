"""The machine: ranks that run their next op once its inputs have arrived, and the network between them.

This is the one machine model of pipec. Its one step is `Ranks.run`: a rank runs its next op when it is free
and the op's inputs have arrived (whichever is later), for the op's cost, then spends its overhead on the
transfers after it. Inputs: the message `Plan.need` names and, on a stage graph, those `Plan.more` names
(an op with several remote inputs waits for the last to arrive). Its network is `Links`: per pair of ranks,
messages in issue order; on a shared link, bandwidth divided among the messages on it. Who steps it:

- the simulator (`pipec.sim.simulate`): `run` (no contention: any order of ranks, arrivals known at send)
  or `run_events` (time order), over the Plan of a Program;
- the list scheduler of `pipec.passes.policy`, which chooses each rank's next op by its policy and runs it
  with the same step and the same `Links`, so its times are the simulator's by construction;
- partition and synth evaluate candidates with the simulator (and synth with the list scheduler);
- the family machine (`run_family`, issue 44): a Schedule with an order family, each free rank choosing
  among the ready ops its family allows, as the runtime does (`pipec.runtime.exec.dynamic`), under the
  faults of `pipec.sim.faults`; `predicted_gain` compares it with the static order.

Not this machine: `pipec.passes.deadlock`'s rounds (can the orders finish at all?) and
`pipec.passes.dryrun`'s rendezvous replay (does the Program's message matching hold?) time nothing.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pipec.errors import error
from pipec.ir.family import OrderFamily
from pipec.ir.rules import op_inputs
from pipec.sim.costs import CostModel
from pipec.sim.faults import Faults


class Ranks:
    """The ranks' compute streams: per rank the time it is next free (`clock`)."""

    __slots__ = ("clock",)

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock

    def run(self, r: int, ready: float, cost: float, tail: float) -> tuple[float, float]:
        """The one step: rank r runs its next op, whose inputs have all arrived by `ready`, for `cost`, then
        spends `tail` on the transfers it issues after it (the overhead); the op's start and end."""
        c = self.clock[r]
        start = ready if ready > c else c
        end = start + cost
        self.clock[r] = end + tail
        return start, end


def run(pl) -> tuple[list[float], list[float], list[float], list[float]]:
    """The pass over a `pipec.sim.plan.Plan` without contention (no shared link carries two channels):
    a message's arrival is known when it leaves (`Links.leave`), so ranks are advanced in any order, each
    as far as its inputs have arrived, each compute op one `Ranks.run`; a rank that waits for a message
    sleeps until its sender sends it. Each compute op visited once. Returns what `run_events` returns.

    The hot loop of the simulator: it has `Ranks.run` and `Links.leave` inlined (calls cost it about a third
    of its time, issue 27's benchmark), the only copies of the machine's rules outside their methods;
    tests/unit/sim/test_machine_room.py holds it to `run_events`, which calls them."""
    R, first, ends, need, cost = pl.num_ranks, pl.first, pl.ends, pl.need, pl.cost
    n, M = len(cost), len(pl.txd)
    mlo, mhi, off, tail, more = pl.mlo, pl.mhi, pl.off, pl.tail, pl.more
    start = [0.0] * n
    end = [0.0] * n
    waiting: dict[int, int] = {}
    links = Links(pl.txd, pl.lat, pl.prev, pl.chan, [-1] * M, 0, _no_event, _no_event)
    arrival, leave = links.arrival, links.leave
    send_t, tx_end, prev, txd, lat = links.send_t, links.tx_end, links.prev, links.txd, links.lat
    for x in pl.pre:  # sends before any compute op of their rank: when their own call is over
        leave(x, 0.0 if off is None else off[x])
    clock = list(pl.head) if pl.head is not None else [0.0] * R  # `Ranks.clock`
    pc = list(first)
    queue = deque(range(R))
    while queue:
        r = queue.popleft()
        j, stop, c = pc[r], ends[r], clock[r]
        while j < stop:
            # `Ranks.run(r, arrival of its input, cost[j], tail[j])`, inlined: a call per op cost this pass a
            # quarter of its time.
            k = need[j]
            if k >= 0:
                a = arrival[k]
                if a < 0.0:
                    waiting[k] = r
                    break
                if more is not None and more[j]:  # a stage graph's op with several remote inputs: all of them
                    k = next((x for x in more[j] if arrival[x] < 0.0), -1)
                    if k >= 0:
                        waiting[k] = r
                        break
                    a = max(a, *(arrival[x] for x in more[j]))
                if a > c:
                    c = a
            start[j] = c
            e = c + cost[j]
            end[j] = e
            if tail is not None:
                c = e + tail[j]
            else:
                c = e
            lo, hi = mlo[j], mhi[j]
            if lo != hi:
                for x in range(lo, hi):
                    # `Links.leave(x, e + off[x])`, inlined: the call per message cost this pass a third
                    # of its time; tests/unit/sim/test_machine_room.py holds this pass to `run_events`, which calls it.
                    t = e if off is None else e + off[x]
                    send_t[x] = t
                    p = prev[x]
                    if p >= 0 and tx_end[p] > t:
                        t = tx_end[p]
                    t += txd[x]
                    tx_end[x] = t
                    t += lat[x]
                    if p >= 0 and arrival[p] > t:
                        t = arrival[p]
                    arrival[x] = t
                    w = waiting.pop(x, None)
                    if w is not None:
                        queue.append(w)
            j += 1
        pc[r], clock[r] = j, c
    finished(pc, ends)
    return start, end, send_t, arrival


def core_sharing(
    rank: np.ndarray, start: np.ndarray, end: np.ndarray, ranks_per_node: int, cores: int, replicas: int = 1
) -> np.ndarray:
    """Per op, how much slower it ran for sharing its node's cores: max(1, k / cores), with k the mean over
    the op's span of the number of the node's processes computing (the op's own included). With data
    parallelism each pipeline rank stands for its `replicas` processes, which compute in step with it on its
    node: `ranks_per_node` and `cores` count processes, pipeline rank r's are r * replicas onwards.

    Processor sharing, as an operating system gives ranks that outnumber their cores: each of k computing
    ranks gets cores / k of a core's speed. `pipec.sim.simulate` stretches each op's cost by this factor
    and runs the machine again until the times settle (a fixed point), since the stretched ops change
    which ops overlap. Per node, the count of computing ranks is a step function of time; its integral over
    an op's span, from one cumulative sum at the breakpoints, gives the mean."""
    factor = np.ones(len(start))
    busy = end > start
    node = rank * replicas // ranks_per_node
    for n in np.unique(node[busy]).tolist():
        ops = np.flatnonzero(busy & (node == n))
        s, e = start[ops], end[ops]
        t = np.concatenate([s, e])
        order = np.argsort(t, kind="stable")
        t = t[order]
        k = np.cumsum(np.concatenate([np.ones(len(ops)), -np.ones(len(ops))])[order])  # computing after t[i]
        area = np.concatenate([[0.0], np.cumsum(k[:-1] * np.diff(t))])  # its integral up to t[i]
        mean = (np.interp(e, t, area) - np.interp(s, t, area)) / (e - s)
        factor[ops] = np.maximum(1.0, replicas * mean / cores)
    return factor


def _no_event(*_: object) -> None:
    """`Links`' callbacks in the uncontended pass: no event is ever scheduled, arrivals are read directly."""


def finished(pc: list[int], ends: list[int]) -> None:
    """E403 when some rank stopped short of its last compute op (it waits for a message never sent)."""
    stuck = [r for r in range(len(ends)) if pc[r] < ends[r]]
    if stuck:
        raise error(
            "E403",
            "the program cannot finish: ranks " + ", ".join(map(str, stuck)) + " wait for messages never sent",
        )


def shared_links(costs: CostModel, src: np.ndarray, dst: np.ndarray, txd: np.ndarray) -> list[int] | None:
    """Per message (src, dst, time on the wire), the shared link it crosses (-1: none), when some shared
    link carries messages of two channels (pairs of ranks) that take time on the wire; else None, and
    the per-pair rule is exact (one channel's messages leave one after the other, so they never overlap
    on its link). Messages that take no time on the wire cross no link."""
    if costs.link_group is None:
        return None
    group = costs.link_group[src, dst]
    busy = (group >= 0) & (txd > 0)
    if not busy.any():
        return None
    chan = src * costs.latency.shape[0] + dst
    pairs = np.unique(np.stack([group[busy], chan[busy]]), axis=1)
    if len(np.unique(pairs[0])) == pairs.shape[1]:
        return None  # every shared link carries one channel at most
    return np.where(txd > 0, group, -1).tolist()


class Links:
    """The network of the machine model: when each message leaves the wire and arrives.

    Within one channel (pair of ranks, one direction) messages enter the wire one after the other, in
    issue order, and never overtake each other: a message takes `txd` on the wire after the previous one
    left it, then `lat`. Each shared link (a message's `group` >= 0) is a processor-sharing server: the
    messages on it at one time each get an equal share of its bandwidth (`txd` is a message's time on
    the wire alone), so two messages that start together both take twice as long as one. Virtual time
    `V` grows at rate 1 / (messages on the link); a message that enters at `V` leaves when `V` reaches
    `V + txd`, so messages leave in the order of those tags.

    Event-driven, for an owner that runs events in time order: `send` at the time a message leaves its
    rank; the owner calls `link_event` when the time `schedule(time, link, version)` asked for comes;
    `arrived(x)` tells it a message's arrival (`arrival[x]`) is known. Used by the simulator's
    `run_events` and by the list scheduler of `pipec.passes.policy` (which adds messages as it goes).
    """

    def __init__(
        self,
        txd: list[float],
        lat: list[float],
        prev: list[int],
        chan: list[int],
        group: list[int],
        groups: int,
        schedule: Callable[[float, int, int], None],
        arrived: Callable[[int], None],
    ) -> None:
        self.txd, self.lat, self.prev, self.chan, self.group = txd, lat, prev, chan, group
        M = len(txd)
        self.send_t = [0.0] * M
        self.tx_end = [0.0] * M
        self.arrival = [-1.0] * M
        self.link_v = [0.0] * groups  # virtual time
        self.link_t = [0.0] * groups  # when link_v was last brought up to date
        self.link_tags: list[list[tuple[float, int]]] = [[] for _ in range(groups)]  # heap of (tag, message)
        self.link_ver = [0] * groups
        self.chan_busy: dict[int, bool] = {}
        self.chan_queue: dict[int, deque] = {}
        self.last: dict[int, int] = {}  # per channel, the last message `add`ed
        self.schedule, self.arrived = schedule, arrived

    def add(self, chan: int, group: int, txd: float, lat: float) -> int:
        """A new message on this channel, after those added before it; its id."""
        x = len(self.txd)
        self.prev.append(self.last.get(chan, -1))
        self.last[chan] = x
        self.chan.append(chan)
        self.group.append(group)
        self.txd.append(txd)
        self.lat.append(lat)
        self.send_t.append(0.0)
        self.tx_end.append(0.0)
        self.arrival.append(-1.0)
        return x

    def _advance(self, g: int, t: float) -> None:
        k = len(self.link_tags[g])
        if k:
            self.link_v[g] += (t - self.link_t[g]) / k
        self.link_t[g] = t

    def _reschedule(self, g: int) -> None:
        self.link_ver[g] += 1
        tags = self.link_tags[g]
        if tags:
            self.schedule(self.link_t[g] + max(tags[0][0] - self.link_v[g], 0.0) * len(tags), g, self.link_ver[g])

    def _leave_wire(self, x: int, t: float) -> None:
        self.tx_end[x] = t
        a = t + self.lat[x]
        p = self.prev[x]
        if p >= 0 and self.arrival[p] > a:
            a = self.arrival[p]
        self.arrival[x] = a
        self.arrived(x)

    def _enter(self, x: int, t: float) -> None:
        g = self.group[x]
        self.chan_busy[self.chan[x]] = True
        self._advance(g, t)
        heapq.heappush(self.link_tags[g], (self.link_v[g] + self.txd[x], x))
        self._reschedule(g)

    def send(self, x: int, t: float) -> None:
        """Message x leaves its rank at t."""
        self.send_t[x] = t
        c = self.chan[x]
        if self.chan_busy.get(c):  # the channel's previous message is still on a shared link: queue behind it
            self.chan_queue.setdefault(c, deque()).append(x)
        elif self.group[x] >= 0:
            self._enter(x, t)
        else:
            self.leave(x, t)
            self.arrived(x)

    def leave(self, x: int, t: float) -> float:
        """Message x leaves its rank at t onto a channel of its own (no shared link): it enters the wire when
        the channel's previous message has left it and arrives `lat` after, never before that one; its
        arrival. The uncontended pass (`run`) has these lines inlined in its loop (a test holds them equal)."""
        self.send_t[x] = t
        p = self.prev[x]
        tx_end, arrival = self.tx_end, self.arrival
        t0 = tx_end[p] if p >= 0 and tx_end[p] > t else t
        te = t0 + self.txd[x]
        tx_end[x] = te
        a = te + self.lat[x]
        if p >= 0 and arrival[p] > a:
            a = arrival[p]
        arrival[x] = a
        return a

    def link_event(self, g: int, version: int, t: float) -> None:
        """The time `schedule` asked for has come (stale versions do nothing)."""
        if version != self.link_ver[g]:
            return
        self._advance(g, t)
        tags = self.link_tags[g]
        eps = 1e-12 * max(1.0, abs(self.link_v[g]))
        done = []
        while tags and tags[0][0] <= self.link_v[g] + eps:
            done.append(heapq.heappop(tags)[1])
        for x in done:
            self._leave_wire(x, t)
            c = self.chan[x]
            self.chan_busy[c] = False
            q = self.chan_queue.get(c)
            while q and not self.chan_busy[c]:
                y = q.popleft()
                if self.group[y] >= 0:
                    self._enter(y, t)
                else:  # no bytes: it leaves right behind the message before it
                    self._leave_wire(y, t + self.txd[y])
        self._reschedule(g)


def run_events(pl) -> tuple[list[float], list[float], list[float], list[float]]:
    """The time-ordered pass over a `pipec.sim.plan.Plan`, for messages that share links (`Links`): every
    event in time order; each compute op is one `Ranks.run` when its rank reaches it and its input arrived.
    Returns per compute op its start and end, per message its issue and arrival."""
    R, first, ends, need, cost = pl.num_ranks, pl.first, pl.ends, pl.need, pl.cost
    mlo, mhi, off, tail, head, more = pl.mlo, pl.mhi, pl.off, pl.tail, pl.head, pl.more
    n, M = len(cost), len(pl.txd)
    group = pl.group or [-1] * M
    start = [0.0] * n
    end = [0.0] * n
    waiting: dict[int, int] = {}
    # (time, seq, kind, who, version): kind 0 = op end on rank `who`, 1 = link `who`, 2 = message `who`
    # is issued (its send's overhead is over), 3 = held message `who` leaves (the one before it arrived)
    events: list = []
    seq = 0
    pc = list(first)
    ranks = Ranks([0.0] * R if head is None else list(head))

    def push(t: float, kind: int, who: int, ver: int = 0) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, who, ver))
        seq += 1

    def try_start(r: int) -> None:
        j = pc[r]
        if j >= ends[r]:
            return
        k = need[j]
        a = 0.0
        if k >= 0:
            a = arrival[k]
            if a < 0.0:
                waiting[k] = r
                return
            for x in more[j] if more is not None else ():  # a stage graph's op: every remote input
                if arrival[x] < 0.0:
                    waiting[x] = r
                    return
                a = max(a, arrival[x])
        start[j], end[j] = ranks.run(r, a, cost[j], 0.0 if tail is None else tail[j])
        push(end[j], 0, r)

    hold, prev = pl.hold, pl.prev
    issued = [0.0] * M  # when each message's instruction was issued (a held one leaves later)
    pending: dict[int, int] = {}  # a held message waiting for the one before it to arrive

    def delivered(x: int) -> None:
        w = waiting.pop(x, None)
        if w is not None:
            try_start(w)
        y = pending.pop(x, None)
        if y is not None:
            push(arrival[x], 3, y)

    def out(x: int, t: float) -> None:
        issued[x] = t
        if hold is not None and hold[x] and prev[x] >= 0:
            a = arrival[prev[x]]
            if a < 0.0:
                pending[prev[x]] = x
                return
            if a > t:
                push(a, 3, x)
                return
        links.send(x, t)

    links = Links(
        pl.txd, pl.lat, pl.prev, pl.chan, group, max(group, default=-1) + 1, lambda t, g, v: push(t, 1, g, v), delivered
    )
    arrival = links.arrival
    if hold is None:  # nothing held: messages go straight to the links, as before collectives
        out = links.send
    for x in pl.pre:
        if off is None:
            out(x, 0.0)
        else:
            push(off[x], 2, x)
    for r in range(R):
        try_start(r)
    while events:
        t, _, kind, who, ver = heapq.heappop(events)
        if kind == 0:
            r = who
            j = pc[r]
            for x in range(mlo[j], mhi[j]):
                if off is None:
                    out(x, t)
                else:
                    push(t + off[x], 2, x)
            pc[r] = j + 1
            try_start(r)
        elif kind == 2:
            out(who, t)
        elif kind == 3:
            links.send(who, t)
        else:
            links.link_event(who, ver, t)
    finished(pc, ends)
    return start, end, issued if hold is not None else links.send_t, arrival


# ---- the family machine: the choice step and the faults (issue 44) ------------------------------------
@dataclass(frozen=True)
class FamilyRun:
    """One simulated step: its makespan, each rank's ops in the order run (static positions) and each op's
    start and end (per rank, by static position)."""

    makespan: float
    order: tuple[tuple[int, ...], ...]
    start: tuple[np.ndarray, ...]
    end: tuple[np.ndarray, ...]


def prefer_key(prefer: str, kind: int, mb: int, q: int) -> tuple:
    """The runtime's choice among ready ops (`pipec.runtime.exec.dynamic.choose` restates it, torch-side):
    `depth` the lowest micro-batch, a backward before a forward; `breadth` a forward first, then the lowest
    micro-batch; `order` the earliest in the static order (q)."""
    if prefer == "depth":
        return (mb, -kind, q)
    if prefer == "breadth":
        return (kind, mb, q)
    return (q,)


def run_family(
    sched,
    cost: np.ndarray,
    latency: np.ndarray | float,
    bandwidth: np.ndarray | float,
    nbytes: np.ndarray | float = 0.0,
    family: OrderFamily | None = None,
    faults: Faults | None = None,
    *,
    step: int = 0,
    static: bool = False,
) -> FamilyRun:
    """One step of `sched` (a pipec.ir.schedule.Schedule without memory ops or pairs) with each rank
    choosing its next op within its family, on this machine. `cost[kind, stage]`: seconds of an op;
    `latency[a, b]`, `bandwidth[a, b]` (bytes/s, 0: no time on the wire; scalars for every pair) and
    `nbytes[stage]`, the bytes of a stage's activation (its gradient the same). `static=True` (or a rank
    without a family) runs the static order.

    The machine's rules, with only the choice step and the faults added:

    - the step is `Ranks.run` (an op starts when its rank is free and its inputs have arrived); the
      *choice* is which op: among the ops of the rank's window (pipec.ir.family: those its family lets
      run before the first op not run) whose inputs are all produced, the ones that can start earliest,
      ranked by the family's `prefer` (`prefer_key`). Ranks are advanced in time order (the rank that can
      start an op earliest goes next, as `run_events` runs events), so no message that could still arrive
      before then is missed;
    - a message is `Links.leave`'s: per pair of ranks, latency plus bytes over bandwidth, in issue order on
      its channel; it is added (`Links.add`) when its op ends, since the issue order is the one chosen;
    - the faults: a straggler multiplies an op's cost (`Faults.slow`), and jitter is added to a message's
      arrival (`Faults.delay`) outside the channel's order: the runtime stamps each message with its own
      due time (`JitterComm`), and gloo and shared memory match by key, so a held message does not hold
      the ones behind it.

    Where it differs from `run`/`run_events` over a Program's Plan, and why: no shared links (it is given
    latency and bandwidth per pair, not a topology's link groups, so it is the uncontended rule of `run`);
    no overhead `tail` (the cost arrays have no overhead model, and a predicted gain is the ratio of two
    runs of the same machine, where a per-op overhead adds alike); no memory ops or collectives (the
    runtime runs a family without them between REDUCE_GRAD and STEP, its barrier)."""
    faults = faults or Faults()
    g = op_inputs(sched)
    R, S = sched.num_ranks, sched.num_stages
    lat = np.broadcast_to(np.asarray(latency, dtype=float), (R, R))
    bw = np.broadcast_to(np.asarray(bandwidth, dtype=float), (R, R))
    nb = np.broadcast_to(np.asarray(nbytes, dtype=float), (S,))
    offsets, n = g.offsets, int(g.offsets[-1])
    kind_l, mb_l, stage_l, rank_l = g.kind.tolist(), g.mb.tolist(), g.stage.tolist(), g.rank.tolist()
    deps = g.inputs
    fwd = sched.kinds.index("F") if "F" in sched.kinds else 0
    dur = [float(cost[k, s]) * faults.slow(step, r, k, i, s) for k, i, s, r in zip(kind_l, mb_l, stage_l, rank_l)]
    remote: list[list[int]] = [[] for _ in range(n)]  # per op, the ops of other ranks that need it
    for c in range(n):
        for p in deps[c]:
            if rank_l[p] != rank_l[c]:
                remote[p].append(c)
    links = Links([], [], [], [], [], 0, _no_event, _no_event)
    due: dict[tuple[int, int], float] = {}  # (op, consumer): when its message may be used
    end = np.full(n, np.nan)
    start = np.full(n, np.nan)
    done = np.zeros(n, dtype=bool)
    fams = [None if (static or family is None) else family.of(r) for r in range(R)]
    reach = [None if f is None else f.arrays()[1] for f in fams]
    first = [int(offsets[r]) for r in range(R)]  # global index of each rank's first op not run
    ranks = Ranks([0.0] * R)
    orders: list[list[int]] = [[] for _ in range(R)]

    def ready(c: int) -> float:
        """When op c's inputs are all there (its inputs all produced)."""
        return max([0.0] + [end[p] if rank_l[p] == rank_l[c] else due[p, c] for p in deps[c]])

    for _ in range(n):
        best = None  # (time, rank, [(ready, op)] that can start by then)
        for r in range(R):
            f, base = first[r], int(offsets[r])
            if f >= offsets[r + 1]:
                continue
            window = [f] if reach[r] is None else [c for c in range(f, base + int(reach[r][f - base])) if not done[c]]
            times = [(ready(c), c) for c in window if all(done[p] for p in deps[c])]
            if not times:
                continue
            clock = ranks.clock[r]
            t = min(max(clock, a) for a, _ in times)
            if best is None or t < best[0]:
                best = (t, r, [(a, c) for a, c in times if max(clock, a) <= t])
        if best is None:
            stuck = "; ".join(
                f"rank {r} at its op {first[r] - offsets[r]}" for r in range(R) if first[r] < offsets[r + 1]
            )
            raise ValueError(f"the family machine is stuck: {stuck}")
        _, r, can = best
        prefer = fams[r].prefer if fams[r] is not None else "order"
        a, c = min(can, key=lambda ac: prefer_key(prefer, kind_l[ac[1]], mb_l[ac[1]], ac[1]))
        start[c], end[c] = ranks.run(r, a, dur[c], 0.0)
        done[c] = True
        orders[r].append(c - int(offsets[r]))
        for d in remote[c]:  # its messages leave as it ends, in this order on each channel
            b, act = rank_l[d], kind_l[c] == fwd
            nbytes_x = float(nb[stage_l[c if act else d]])
            x = links.add(r * R + b, -1, nbytes_x / float(bw[r, b]) if bw[r, b] > 0 else 0.0, float(lat[r, b]))
            u, v = stage_l[c], -1
            if sched.graph is not None:  # the edge: (producer, consumer) for an activation, reversed for a gradient
                u, v = (stage_l[c], stage_l[d]) if act else (stage_l[d], stage_l[c])
            due[c, d] = links.leave(x, float(end[c])) + faults.delay(step, 0 if act else 1, mb_l[c], u, v, r, b)
        while first[r] < offsets[r + 1] and done[first[r]]:
            first[r] += 1
    cut = [(int(offsets[r]), int(offsets[r + 1])) for r in range(R)]
    return FamilyRun(
        float(np.nanmax(end)) if n else 0.0,
        tuple(tuple(o) for o in orders),
        tuple(start[a:b] for a, b in cut),
        tuple(end[a:b] for a, b in cut),
    )


def predicted_gain(
    sched,
    cost: np.ndarray,
    latency: np.ndarray | float,
    bandwidth: np.ndarray | float,
    nbytes: np.ndarray | float = 0.0,
    family: OrderFamily | None = None,
    faults: Faults | None = None,
    steps=(0,),
) -> dict:
    """The family machine's static and dynamic makespans, averaged over `steps` (each step its own fault
    draws), and the gain 1 - dynamic / static."""
    st = sum(
        run_family(sched, cost, latency, bandwidth, nbytes, family, faults, step=s, static=True).makespan for s in steps
    )
    dy = sum(run_family(sched, cost, latency, bandwidth, nbytes, family, faults, step=s).makespan for s in steps)
    return {"static": st / len(steps), "dynamic": dy / len(steps), "gain": 1.0 - dy / st if st > 0 else 0.0}


# pipec run's default number of steps (pipec.options): what `pipec simulate`'s prediction averages over.
PREDICTED_STEPS = 3


def predict(
    sched, costs: CostModel, family: OrderFamily | None, faults: Faults | None, *, static: bool = False
) -> dict:
    """`pipec simulate`'s prediction for a schedule with an order family, under a cost model and faults:
    the family machine's static step and, unless `static`, its dynamic step and the gain (`predicted_gain`),
    averaged over the steps 0 .. PREDICTED_STEPS - 1 that a default `pipec run` takes (each step its own
    fault draws, as in the run). The cost model gives each op kind's time per stage (`kind_time`), the
    latency and bandwidth per pair and the activation bytes per stage; what it gives per stage on top of a
    pair's latency (`comm`) the family machine, timed per pair, leaves out."""
    K, S = len(sched.kinds), sched.num_stages
    cost = np.array([costs.kind_time(np.full(S, k), np.arange(S)) for k in range(K)], dtype=float)
    lat = np.asarray(costs.latency, dtype=float)
    bw = np.asarray(costs.bandwidth, dtype=float)  # inf: no time on the wire
    steps = range(PREDICTED_STEPS)
    args = (sched, cost, lat, bw, np.asarray(costs.act_bytes, dtype=float), family, faults)
    if static:
        return {"static": sum(run_family(*args, step=s, static=True).makespan for s in steps) / len(steps)}
    return predicted_gain(*args, steps=steps)
