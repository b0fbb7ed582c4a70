"""Discrete-event simulation of a Program under a cost model: a Timeline, and the numbers people choose by.

The machine it models is the runtime's: each rank runs its instruction
stream in order on one compute stream; a compute op starts when the rank
reaches it and its remote input has arrived (local inputs come earlier on the
same stream), and runs for its cost. Sends are asynchronous: a message leaves
when its rank reaches the SEND, after the compute before it, and costs the
rank no time beyond the cost model's `overhead` (LogP's o: the rank's own time
for each send and each receive instruction it issues; a message leaves when
its send's overhead is over). Receives are posted where the Program places
them and do not block; only the compute that needs the data waits for it. Messages are eager
(a message may arrive before its receive is posted, as with gloo and NCCL's
eager protocol; rendezvous stalls are what `pipec.passes.dryrun` rules out, not what
this models). Between two ranks, messages in one direction travel in issue
order: each takes `bytes / bandwidth` of the link after the previous one has
left, then `latency + comm`, and never overtakes it. Overlapped pairs (`&`)
run one after the other on the compute stream; what overlap buys inside a
pair (hiding its own communication) is not modelled. REDUCE_GRAD and STEP
take no time.

Messages between two datacenters share one link per direction (the cost
model's `link_group`): those on it at one time divide its bandwidth equally.
When every shared link carries one pair of ranks at most, that changes
nothing (a pair's messages leave the wire one after the other) and the pass
below runs; otherwise `_run_events` runs every event in time order.

Deterministic: message times depend only on the sender's own clock, so the
order in which ranks are advanced does not matter. Fast: numpy precomputes,
per compute op, its duration, the message it waits for and the messages
sent after it; then one event-driven pass visits each compute op once and a
rank that waits for a message sleeps until the message's sender reaches it.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

import numpy as np

from pipec.sim.costs import CostModel
from pipec.errors import error
from pipec.program import BWD, FWD, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, WGRAD, Program
from pipec.sim.timeline import Timeline


def simulate(prog: Program, costs: CostModel, *, _events: bool = False) -> Timeline:
    """Run the Program on the modelled machine; raises E403 if it cannot finish (a malformed Program).

    `_events` forces the event-driven pass even without contention (for tests: both passes agree).
    """
    S, m, R = prog.num_stages, prog.num_microbatches, prog.num_ranks
    if costs.num_stages != S or costs.latency.shape != (R, R):
        raise ValueError(f"cost model for {costs.num_stages} stages does not fit a program of {S} stages, {R} ranks")
    lengths = [len(rp) for rp in prog.ranks]
    z = np.zeros(0, dtype=np.int64)
    op = np.concatenate([rp.op for rp in prog.ranks]) if sum(lengths) else z
    mb = np.concatenate([rp.mb for rp in prog.ranks]) if sum(lengths) else z
    stage = np.concatenate([rp.stage for rp in prog.ranks]) if sum(lengths) else z
    peer = np.concatenate([rp.peer for rp in prog.ranks]) if sum(lengths) else z
    rank = np.repeat(np.arange(R), lengths)
    placement = np.asarray(prog.placement, dtype=np.int64)

    # Compute ops: duration and the message each one waits for.
    cidx = np.flatnonzero(op <= WGRAD)
    n = len(cidx)
    c_op, c_mb, c_s, c_rank = op[cidx], mb[cidx], stage[cidx], rank[cidx]
    cost = costs.compute_time(c_op, c_s) if n else np.zeros(0)
    prev_owner = placement[np.clip(c_s - 1, 0, S - 1)]
    next_owner = placement[np.clip(c_s + 1, 0, S - 1)]
    f_remote = (c_op == FWD) & (c_s > 0) & (prev_owner != c_rank)
    b_remote = (c_op == BWD) & (c_s < S - 1) & (next_owner != c_rank)
    want = np.where(f_remote, (c_s - 1) * m + c_mb, np.where(b_remote, (S + c_s + 1) * m + c_mb, -1))

    # Messages, one per send, in issue order; the compute just before each send gives its clock.
    sidx = np.flatnonzero((op == SEND_ACT) | (op == SEND_GRAD))
    M = len(sidx)
    s_kind = (op[sidx] == SEND_GRAD).astype(np.int64)
    s_stage, s_mb, s_src, s_dst = stage[sidx], mb[sidx], rank[sidx], peer[sidx]
    if M and not ((s_dst >= 0) & (s_dst < R)).all():
        raise error("E403", "a send names no valid peer rank")
    key = (s_kind * S + s_stage) * m + s_mb
    order = np.argsort(key, kind="stable")
    keys = key[order]
    if M and (keys[1:] == keys[:-1]).any():
        dup = int(keys[1:][keys[1:] == keys[:-1]][0])
        raise error("E403", f"message {_describe_key(dup, S, m)} is sent twice")
    need = np.full(n, -1, dtype=np.int64)
    remote = np.flatnonzero(want >= 0)
    if len(remote):
        at = np.clip(np.searchsorted(keys, want[remote]), 0, max(M - 1, 0))
        found = (keys[at] == want[remote]) if M else np.zeros(len(remote), dtype=bool)
        if not found.all():
            k = int(want[remote][~found][0])
            raise error("E403", f"the program never sends {_describe_key(k, S, m)}, which a compute op needs")
        need[remote] = order[at]

    before = np.searchsorted(cidx, sidx) - 1  # global compute id of the op just before each send
    own = (before >= 0) & (c_rank[np.maximum(before, 0)] == s_src) if n else np.zeros(M, dtype=bool)
    first_of_rank = np.concatenate([[0], np.cumsum(np.bincount(c_rank, minlength=R))])[:-1]
    slot = np.where(own, before.astype(float), first_of_rank[s_src] - 0.5)  # monotone in issue order
    ids = np.arange(n)
    mlo = np.searchsorted(slot, ids, "left")
    mhi = np.searchsorted(slot, ids, "right")
    pre = np.flatnonzero(~own)  # sends before any compute of their rank leave at time 0

    size = np.where(s_kind == 0, costs.act_bytes[s_stage], costs.grad_bytes[s_stage]) if M else np.zeros(0)
    bw = costs.bandwidth[s_src, s_dst] if M else np.zeros(0)
    txd = np.where(np.isfinite(bw) & (size > 0), size / np.where(np.isfinite(bw), bw, 1.0), 0.0)
    lat = costs.latency[s_src, s_dst] + costs.comm[s_stage] if M else np.zeros(0)
    chan = s_src * R + s_dst
    by_chan = np.argsort(chan, kind="stable")
    prev = np.full(M, -1, dtype=np.int64)
    if M:
        same = chan[by_chan][1:] == chan[by_chan][:-1]
        prev[by_chan[1:][same]] = by_chan[:-1][same]

    off, tail, head = _overheads(costs.overhead, op, rank, lengths, cidx, sidx, before, own, R)
    ends = np.searchsorted(c_rank, np.arange(R), "right").tolist()
    starts_of_rank = np.searchsorted(c_rank, np.arange(R), "left").tolist()
    args = (
        R,
        n,
        M,
        starts_of_rank,
        ends,
        need.tolist(),
        cost.tolist(),
        mlo.tolist(),
        mhi.tolist(),
        pre.tolist(),
        prev.tolist(),
        txd.tolist(),
        lat.tolist(),
        off,
        tail,
        head,
    )
    group = _contended(costs, s_src, s_dst, chan, txd) if M else None
    if group is None and not _events:
        start_t, end_t, send_t, arrival = _run(*args)
    else:
        start_t, end_t, send_t, arrival = _run_events(*args, chan.tolist(), group or [-1] * M)

    # When each receive was posted: the end of the compute just before it on its rank (else 0).
    post = np.full(M, np.nan)
    ridx = np.flatnonzero((op == RECV_ACT) | (op == RECV_GRAD))
    if len(ridx) and M:
        r_kind = (op[ridx] == RECV_GRAD).astype(np.int64)
        r_sender = np.where(r_kind == 0, stage[ridx] - 1, stage[ridx] + 1)
        r_key = (r_kind * S + r_sender) * m + mb[ridx]
        at = np.clip(np.searchsorted(keys, r_key), 0, M - 1)
        ok = keys[at] == r_key
        rb = np.searchsorted(cidx, ridx) - 1
        mine = (rb >= 0) & (c_rank[np.maximum(rb, 0)] == rank[ridx]) if n else np.zeros(len(ridx), dtype=bool)
        end_arr = np.asarray(end_t) if n else np.zeros(1)
        when = np.where(mine, end_arr[np.maximum(rb, 0)] if n else 0.0, 0.0)
        post[order[at[ok]]] = when[ok]

    return Timeline(
        num_ranks=R,
        rank=c_rank.astype(np.int64),
        op=c_op.astype(np.int64),
        mb=c_mb.astype(np.int64),
        stage=c_s.astype(np.int64),
        start=np.asarray(start_t, dtype=float),
        end=np.asarray(end_t, dtype=float),
        msg_kind=s_kind,
        msg_mb=s_mb.astype(np.int64),
        msg_stage=s_stage.astype(np.int64),
        msg_src=s_src.astype(np.int64),
        msg_dst=s_dst.astype(np.int64),
        msg_send=np.asarray(send_t, dtype=float),
        msg_arrival=np.asarray(arrival, dtype=float),
        msg_bytes=np.asarray(size, dtype=float),
        msg_post=post,
        origin="simulated",
        schedule=prog.name,
        params=prog.params,
    )


def _overheads(o: float, op, rank, lengths, cidx, sidx, before, own, R: int):
    """The `overhead` o as times: per message, how long after the end of the compute op before its send
    (or after time 0) it leaves; per compute op, the rank's time on the sends and receives after it, up
    to its next compute op; per rank, the time on those before its first compute op. None when o = 0."""
    if not o:
        return None, None, None
    comm = (op >= RECV_ACT) & (op <= SEND_GRAD)
    cum = np.concatenate([[0], np.cumsum(comm)])  # comm instructions among the first i
    rank_start = np.concatenate([[0], np.cumsum(lengths)])
    c_rank = rank[cidx]
    counts = np.bincount(c_rank, minlength=R)
    if len(cidx):
        last = np.append(c_rank[1:] != c_rank[:-1], True)  # the rank's last compute op
        nxt = np.where(last, rank_start[c_rank + 1], np.append(cidx[1:], 0))
        tail = o * (cum[nxt] - cum[cidx + 1])
        first = cidx[np.minimum(np.searchsorted(c_rank, np.arange(R), "left"), len(cidx) - 1)]
        stop = np.where(counts > 0, first, rank_start[1:])
    else:
        tail, stop = np.zeros(0), rank_start[1:]
    head = o * (cum[stop] - cum[rank_start[:-1]])
    anchor = np.where(own, cidx[np.maximum(before, 0)] + 1 if len(cidx) else 0, rank_start[rank[sidx]])
    off = o * (cum[sidx + 1] - cum[anchor])
    return off.tolist(), tail.tolist(), head.tolist()


def _run(R, n, M, first, ends, need, cost, mlo, mhi, pre, prev, txd, lat, off, tail, head):
    """The event-driven pass over compute ops; lists, not arrays, for speed in the loop."""
    start = [0.0] * n
    end = [0.0] * n
    send_t = [0.0] * M
    tx_end = [0.0] * M
    arrival = [-1.0] * M
    waiting: dict[int, int] = {}

    def leave(x: int, clock: float) -> None:
        send_t[x] = clock
        p = prev[x]
        t0 = clock
        if p >= 0 and tx_end[p] > t0:
            t0 = tx_end[p]
        te = t0 + txd[x]
        tx_end[x] = te
        a = te + lat[x]
        if p >= 0 and arrival[p] > a:
            a = arrival[p]
        arrival[x] = a

    if off is not None:  # the overhead: sends leave when their own call is over
        for x in pre:
            leave(x, off[x])
        clocks = list(head)
    else:
        for x in pre:
            leave(x, 0.0)
        clocks = [0.0] * R
    pc = list(first)
    queue = deque(range(R))
    while queue:
        r = queue.popleft()
        j, stop, clock = pc[r], ends[r], clocks[r]
        while j < stop:
            k = need[j]
            if k >= 0:
                a = arrival[k]
                if a < 0.0:
                    waiting[k] = r
                    break
                if a > clock:
                    clock = a
            start[j] = clock
            clock += cost[j]
            end[j] = clock
            lo, hi = mlo[j], mhi[j]
            if lo != hi:
                for x in range(lo, hi):
                    # inline of leave(x, clock + its overhead), the hot path
                    t0 = clock if off is None else clock + off[x]
                    send_t[x] = t0
                    p = prev[x]
                    if p >= 0 and tx_end[p] > t0:
                        t0 = tx_end[p]
                    te = t0 + txd[x]
                    tx_end[x] = te
                    a = te + lat[x]
                    if p >= 0 and arrival[p] > a:
                        a = arrival[p]
                    arrival[x] = a
                    w = waiting.pop(x, None)
                    if w is not None:
                        queue.append(w)
            if tail is not None:
                clock += tail[j]
            j += 1
        pc[r], clocks[r] = j, clock
    stuck = [r for r in range(R) if pc[r] < ends[r]]
    if stuck:
        raise error(
            "E403",
            "the program cannot finish: ranks " + ", ".join(map(str, stuck)) + " wait for messages never sent",
        )
    return start, end, send_t, arrival


def _contended(costs: CostModel, src: np.ndarray, dst: np.ndarray, chan: np.ndarray, txd: np.ndarray):
    """Per message, the shared link it crosses (-1: none), when some shared link carries messages of two
    channels (pairs of ranks) that take time on the wire; else None, and the per-pair pass is exact (one
    channel's messages leave one after the other, so they never overlap on its link)."""
    if costs.link_group is None:
        return None
    group = costs.link_group[src, dst]
    busy = (group >= 0) & (txd > 0)
    if not busy.any():
        return None
    pairs = np.unique(np.stack([group[busy], chan[busy]]), axis=1)
    if len(np.unique(pairs[0])) == pairs.shape[1]:
        return None  # every shared link carries one channel at most
    return np.where(txd > 0, group, -1).tolist()


def _run_events(R, n, M, first, ends, need, cost, mlo, mhi, pre, prev, txd, lat, off, tail, head, chan, group):
    """The event-driven pass, in time order, for messages that share links.

    Each shared link is a processor-sharing server: the messages on it at one time each get an equal
    share of its bandwidth (`txd` is a message's time on the wire alone), so two messages that start
    together both take twice as long as one. Virtual time `V` grows at rate 1 / (messages on the link);
    a message that enters at `V` leaves when `V` reaches `V + txd`, so messages leave in the order of
    those tags. Within one channel (pair of ranks, one direction) messages still enter the wire one after
    the other, in issue order, and never overtake each other. Messages on links that are not shared
    take the per-pair pass's times; compute ops start when their rank is free and their input arrived.
    """
    start = [0.0] * n
    end = [0.0] * n
    send_t = [0.0] * M
    tx_end = [0.0] * M
    arrival = [-1.0] * M
    waiting: dict[int, int] = {}
    G = max(group, default=-1) + 1
    link_v = [0.0] * G  # virtual time
    link_t = [0.0] * G  # when link_v was last brought up to date
    link_tags: list[list[tuple[float, int]]] = [[] for _ in range(G)]  # heap of (tag, message)
    link_ver = [0] * G
    chan_busy: dict[int, bool] = {}
    chan_queue: dict[int, deque] = {}
    # (time, seq, kind, who, version): kind 0 = op end on rank `who`, 1 = link `who`, 2 = message `who`
    # leaves (its send's overhead is over)
    events: list = []
    seq = 0
    pc = list(first)
    clock = [0.0] * R if head is None else list(head)

    def push(t: float, kind: int, who: int, ver: int = 0) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, who, ver))
        seq += 1

    def advance(g: int, t: float) -> None:
        k = len(link_tags[g])
        if k:
            link_v[g] += (t - link_t[g]) / k
        link_t[g] = t

    def reschedule(g: int) -> None:
        link_ver[g] += 1
        if link_tags[g]:
            tag = link_tags[g][0][0]
            push(link_t[g] + max(tag - link_v[g], 0.0) * len(link_tags[g]), 1, g, link_ver[g])

    def try_start(r: int) -> None:
        j = pc[r]
        if j >= ends[r]:
            return
        t = clock[r]
        k = need[j]
        if k >= 0:
            a = arrival[k]
            if a < 0.0:
                waiting[k] = r
                return
            if a > t:
                t = a
        start[j] = t
        end[j] = t + cost[j]
        push(end[j], 0, r)

    def delivered(x: int) -> None:
        w = waiting.pop(x, None)
        if w is not None:
            try_start(w)

    def leave_wire(x: int, t: float) -> None:
        tx_end[x] = t
        a = t + lat[x]
        p = prev[x]
        if p >= 0 and arrival[p] > a:
            a = arrival[p]
        arrival[x] = a
        delivered(x)

    def enter(x: int, t: float) -> None:
        g = group[x]
        chan_busy[chan[x]] = True
        advance(g, t)
        heapq.heappush(link_tags[g], (link_v[g] + txd[x], x))
        reschedule(g)

    def send(x: int, t: float) -> None:
        send_t[x] = t
        c = chan[x]
        if chan_busy.get(c):  # the channel's previous message is still on a shared link: queue behind it
            chan_queue.setdefault(c, deque()).append(x)
        elif group[x] >= 0:
            enter(x, t)
        else:
            p = prev[x]
            leave_wire(x, (tx_end[p] if p >= 0 and tx_end[p] > t else t) + txd[x])

    for x in pre:
        if off is None:
            send(x, 0.0)
        else:
            push(off[x], 2, x)
    for r in range(R):
        try_start(r)
    while events:
        t, _, kind, who, ver = heapq.heappop(events)
        if kind == 0:
            r = who
            j = pc[r]
            clock[r] = t
            for x in range(mlo[j], mhi[j]):
                if off is None:
                    send(x, t)
                else:
                    push(t + off[x], 2, x)
            if tail is not None:
                clock[r] = t + tail[j]
            pc[r] = j + 1
            try_start(r)
        elif kind == 2:
            send(who, t)
        elif ver == link_ver[who]:
            g = who
            advance(g, t)
            tags = link_tags[g]
            eps = 1e-12 * max(1.0, abs(link_v[g]))
            done = []
            while tags and tags[0][0] <= link_v[g] + eps:
                done.append(heapq.heappop(tags)[1])
            for x in done:
                leave_wire(x, t)
                c = chan[x]
                chan_busy[c] = False
                q = chan_queue.get(c)
                while q and not chan_busy[c]:
                    y = q.popleft()
                    if group[y] >= 0:
                        enter(y, t)
                    else:  # no bytes: it leaves right behind the message before it
                        leave_wire(y, t + txd[y])
            reschedule(g)
    stuck = [r for r in range(R) if pc[r] < ends[r]]
    if stuck:
        raise error(
            "E403",
            "the program cannot finish: ranks " + ", ".join(map(str, stuck)) + " wait for messages never sent",
        )
    return start, end, send_t, arrival


def _describe_key(k: int, S: int, m: int) -> str:
    rest, i = divmod(k, m)
    kind, s = divmod(rest, S)
    return f"the {'activation' if kind == 0 else 'gradient'} of micro-batch {i} from stage {s}"


# ---- numbers ----------------------------------------------------------------------


@dataclass(frozen=True)
class RankStats:
    rank: int
    first: float  # start of its first op
    last: float  # end of its last op
    busy: float  # total compute time
    peak_memory: float | None = None

    @property
    def span(self) -> float:
        return self.last - self.first

    @property
    def idle(self) -> float:
        """Time inside its span with nothing to compute."""
        return self.span - self.busy


@dataclass(frozen=True)
class Stats:
    makespan: float
    cost: float  # the longest rank's span (Zero Bubble's objective)
    ideal: float  # the busiest rank's compute time: m (T_F + T_B + T_W) with uniform costs
    ranks: tuple[RankStats, ...]

    @property
    def bubble_time(self) -> float:
        return self.cost - self.ideal

    @property
    def bubble_rate(self) -> float:
        """Zero Bubble's bubble rate, (cost - m(T_F + T_B + T_W)) / cost."""
        return self.bubble_time / self.cost if self.cost > 0 else 0.0

    @property
    def peak_memory(self) -> float | None:
        peaks = [r.peak_memory for r in self.ranks if r.peak_memory is not None]
        return max(peaks) if peaks else None


def stats(tl: Timeline, memory: dict[str, np.ndarray] | None = None) -> Stats:
    """The numbers of a Timeline (simulated or measured); peak memory per rank when a memory model is given."""
    R = tl.num_ranks
    busy = np.bincount(tl.rank, weights=tl.end - tl.start, minlength=R)
    first = np.full(R, np.inf)
    last = np.full(R, -np.inf)
    np.minimum.at(first, tl.rank, tl.start)
    np.maximum.at(last, tl.rank, tl.end)
    has = np.isfinite(first)
    first, last = np.where(has, first, 0.0), np.where(has, last, 0.0)
    peaks = [None] * R
    if memory is not None:
        peaks = [float(v.max()) if len(v) else 0.0 for _, v in memory_curve(tl, memory, collapse=False)]
    ranks = tuple(RankStats(r, float(first[r]), float(last[r]), float(busy[r]), peaks[r]) for r in range(R))
    cost = max((r.span for r in ranks), default=0.0)
    return Stats(tl.makespan, cost, float(busy.max()) if R else 0.0, ranks)


def memory_curve(
    tl: Timeline, memory: dict[str, np.ndarray], split: bool | None = None, *, collapse: bool = True
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per rank, memory over time as a step function (times, values): the value from each time on.

    The memory model of `pipec.passes.memory`: params of the rank's stages throughout; `act` from the start of
    F until the end of B; with split backward `wact` from the end of B until the end of W. Changes at one
    instant apply in the rank's order. `collapse` keeps only the last value at each time, and only
    where the value changes (for drawing and reports); otherwise every step is kept, and the maximum
    equals `pipec.passes.memory.rank_memory`'s peak.
    """
    split = bool((tl.op == WGRAD).any()) if split is None else split
    act, wact, params = memory["act"], memory["wact"], memory["params"]
    s = tl.stage
    is_f, is_b = tl.op == FWD, tl.op == BWD
    when = np.where(is_f, tl.start, tl.end)
    delta = np.where(is_f, act[s], np.where(is_b, (wact[s] if split else 0.0) - act[s], -wact[s]))
    out = []
    for r in range(tl.num_ranks):
        sel = np.flatnonzero(tl.rank == r)
        stages = np.unique(s[sel])
        base = float(params[stages].sum()) if len(stages) else 0.0
        # Order by time; at equal times, the op that came first in the rank's order first.
        o = sel[np.lexsort((sel, when[sel]))]
        t = np.concatenate([[0.0], when[o]])
        v = base + np.concatenate([[0.0], np.cumsum(delta[o])])
        if collapse and len(t) > 1:
            last = np.r_[t[1:] != t[:-1], True]
            t, v = t[last], v[last]
            moved = np.r_[True, v[1:] != v[:-1]]
            t, v = t[moved], v[moved]
        out.append((t, v))
    return out
