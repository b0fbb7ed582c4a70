"""Discrete-event simulation of a Program under a cost model: a Timeline, and the numbers people choose by.

The machine it models is the runtime's: each rank runs its instruction
stream in order on one compute stream; a compute op starts when the rank
reaches it and its remote inputs have arrived (local inputs come earlier on the
same stream), and runs for its cost. On the chain an op has one input (F from
stage s - 1, B from s + 1); on a stage graph (`Program.graph`) one per edge
into its stage (F) or out of it (B), each a message of its own keyed by its
edge (`pipec.ir.opcodes.message_key`; `pipec.sim.inputs`), and it waits for
all of them; messages travel per edge, each on the channel of its two ranks. Sends are asynchronous: a message leaves
when its rank reaches the SEND, after the compute before it, and costs the
rank no time beyond the cost model's `overhead` (LogP's o: the rank's own time
for each send and each receive instruction it issues; a message leaves when
its send's overhead is over). Receives are posted where the Program places
them and do not block; only the compute that needs the data waits for it. Messages are eager
(a message may arrive before its receive is posted, as with gloo and NCCL's
eager protocol; rendezvous stalls are what `pipec.passes.dryrun` rules out, not what
this models). Between two ranks, messages in one direction travel in issue
order: each takes `bytes / bandwidth` of the link after the previous one has
left, then `latency + comm`, and never overtakes it (`CostModel.wire` gives
each message's two terms). Overlapped pairs (`&`)
run one after the other on the compute stream; what overlap buys inside a
pair (hiding its own communication) is not modelled. Without data
parallelism REDUCE_GRAD and STEP take no time; with it (a Program of dp > 1),
each rank's collectives run on a stream of their own, overlapping compute,
one after the other in Program order, each for `CostModel.collective_time`;
STEP waits for its stage's REDUCE_GRAD, the next compute of stage s for an
UNSHARD s; rings of several ranks crossing a link between replica
datacenters share it (`CostModel.collective_wire`). See `pipec.sim.plan`. Memory ops: a
RECOMPUTE is a compute op costing its stage's F (`CostModel.compute_time`);
OFFLOAD and RELOAD run on a host-link stream of each rank, as the collectives
do on theirs, each for `CostModel.host_time`, and the BWD (or the RECOMPUTE) of
a reloaded micro-batch waits for its RELOAD (docs/simulate.md, "Memory ops").

Messages between two datacenters share one link per direction (the cost
model's `link_group`): those on it at one time divide its bandwidth equally
(`pipec.sim.machine.Links`). When every shared link carries one pair of ranks at
most, that changes nothing (a pair's messages leave the wire one after the other)
and the pass `pipec.sim.machine.run` runs; otherwise `machine.run_events` runs
every event in time order.

The machine itself (a rank runs its next op once its inputs have arrived; the
network) is `pipec.sim.machine`; `pipec.sim.plan` turns a Program into the `Plan`
its passes step; this module runs them and turns their results into a Timeline, and
defines the numbers of a step (`Stats`). The list scheduler of `pipec.passes.policy`
steps the same machine (and reads the overhead from a `Plan` of the Program it
derived), so its times are the simulator's.

What an instruction is (compute or transfer, which message it names, which
message a compute waits for) comes from the instruction table, `pipec.ir.opcodes`.

Deterministic: message times depend only on the sender's own clock, so the
order in which ranks are advanced does not matter. Fast: `pipec.sim.plan` precomputes with
numpy, once, per compute op its duration, the message it waits for and the
messages sent after it; then one event-driven pass visits each compute op once
and a rank that waits for a message sleeps until the message's sender reaches it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from pipec.ir.program import Program
from pipec.sim.costs import CostModel
from pipec.sim.machine import core_sharing, run, run_events
from pipec.sim.plan import Plan, plan
from pipec.sim.segments import a2a_rows, merge_segments
from pipec.sim.timeline import Timeline


def simulate(prog: Program, costs: CostModel, *, overlap: bool = True, _events: bool = False) -> Timeline:
    """Run the Program on the modelled machine; raises E403 if it cannot finish (a malformed Program).

    `overlap` False runs the two ops of each overlapped pair one after the other (their all-to-alls then
    hide behind nothing). `_events` forces the event-driven pass even without contention (for tests: both
    passes agree).
    """
    pl = plan(prog, costs, overlap)
    passes = run if pl.group is None and not _events else run_events
    start_t, end_t, send_t, arrival = passes(pl)
    if costs.shares_cores:
        times = (start_t, end_t, send_t, arrival)
        pl, (start_t, end_t, send_t, arrival) = _share_cores(pl, costs, passes, times, prog.dp)
    start, end = np.asarray(start_t, dtype=float), np.asarray(end_t, dtype=float)
    send, arr, post = np.asarray(send_t, dtype=float), np.asarray(arrival, dtype=float), pl.posted(end_t)
    coll: dict[str, np.ndarray] = {}
    c_rank, c_op, c_mb, c_stage = pl.c_rank, pl.c_op, pl.c_mb, pl.c_stage
    if pl.real is not None:  # data parallelism: split the stream's ops and the messages by what they are
        coll = _collective_rows(pl, start, end, send, arr)
        if pl.h_ids is not None and len(pl.h_ids):  # the host link: each op starts when issued and the link is free
            h = pl.h_ids
            prev = np.asarray(pl.prev, dtype=np.int64)[h]
            began = np.where(prev >= 0, np.maximum(send[h], arr[np.maximum(prev, 0)]), send[h])
            coll.update(host_rank=pl.h_rank, host_op=pl.h_op, host_mb=pl.h_mb, host_stage=pl.h_stage)
            coll.update(host_start=began, host_end=arr[h])
        costly = pl.is_step & (np.asarray(pl.cost, dtype=float) > 0)  # optimizer steps that take time
        if costly.any():
            coll.update(step_rank=c_rank[costly], step_stage=c_stage[costly])
            coll.update(step_start=start[costly], step_end=end[costly])
        if pl.a_ids is not None:
            coll.update(a2a_rows(pl, start, end, send, arr))
        real = pl.real
        c_rank, c_op, c_mb, c_stage, start, end = (a[real] for a in (c_rank, c_op, c_mb, c_stage, start, end))
        send, arr, post = send[pl.p2p], arr[pl.p2p], post[pl.p2p]
        if pl.a_ids is not None:  # one row per op again: from its first segment's start to its last's end
            c_rank, c_op, c_mb, c_stage, start, end = merge_segments(
                pl.c_seg[real], pl.c_src[real], c_rank, c_op, c_mb, c_stage, start, end
            )
    if pl.step_overhead:  # every rank starts its instructions that much later: every time moves by it
        o = pl.step_overhead
        start, end, send, arr, post = start + o, end + o, send + o, arr + o, post + o
        for k in (
            "coll_issue",
            "coll_start",
            "coll_end",
            "wait_start",
            "wait_end",
            "step_start",
            "step_end",
            "host_start",
            "host_end",
            "a2a_start",
            "a2a_end",
            "seg_start",
            "seg_end",
        ):
            if k in coll:
                coll[k] = coll[k] + o
    return Timeline(
        num_ranks=pl.num_ranks,
        rank=c_rank,
        op=c_op,
        mb=c_mb,
        stage=c_stage,
        start=start,
        end=end,
        msg_kind=pl.m_kind,
        msg_mb=pl.m_mb,
        msg_stage=pl.m_stage,
        msg_src=pl.m_src,
        msg_dst=pl.m_dst,
        msg_send=send,
        msg_arrival=arr,
        msg_bytes=pl.m_bytes,
        msg_post=post,
        **coll,
        dp=prog.dp,
        dp_kind=prog.dp_kind,
        slicing=prog.slicing,
        origin="simulated",
        schedule=prog.name,
        params=prog.params,
    )


def _collective_rows(pl: Plan, start: np.ndarray, end: np.ndarray, send: np.ndarray, arr: np.ndarray) -> dict:
    """The Timeline's collective rows and exposed waits from a data-parallel run (see `Plan`, `Timeline`).

    A collective's message leaves (`send`) when the stream issues it and arrives when its collective
    stream finishes it; it started when both the issue came and the one before it on that stream was done.
    A zero-cost op (a STEP or an inserted wait) reached at `reached` and passed at `start` waited that long;
    the part after the message its next compute needs anyway arrived is the collective's exposure.
    """
    k = pl.k_ids
    prev = np.asarray(pl.prev, dtype=np.int64)[k]
    issue = send[k]
    began = np.where(prev >= 0, np.maximum(issue, arr[np.maximum(prev, 0)]), issue)
    rows = {
        "coll_rank": pl.k_rank.astype(np.int64),
        "coll_op": pl.k_op.astype(np.int64),
        "coll_stage": pl.k_stage.astype(np.int64),
        "coll_issue": issue,
        "coll_start": began,
        "coll_end": arr[k],
        "coll_bytes": pl.k_bytes,
        "coll_after": pl.k_after,
    }
    zero = np.flatnonzero(~pl.real)
    first = np.asarray(pl.first, dtype=np.int64)
    r = pl.c_rank[zero]
    at_first = zero == first[r]
    head = np.zeros(pl.num_ranks) if pl.head is None else np.asarray(pl.head)
    tail = np.zeros(len(end)) if pl.tail is None else np.asarray(pl.tail)
    j = np.maximum(zero - 1, 0)
    reached = np.where(at_first, head[r], end[j] + tail[j]) if len(zero) else np.zeros(0)
    # The message the next op (a compute of the same rank) waits for anyway.
    nxt = np.minimum(zero + 1, len(end) - 1)
    need = np.asarray(pl.need, dtype=np.int64)
    follows = (zero + 1 < len(end)) & pl.real[nxt] & (pl.c_rank[nxt] == r) & (need[nxt] >= 0)
    other = np.where(follows, arr[np.maximum(need[nxt], 0)], reached)
    if pl.more is not None:  # a stage graph's op with several remote inputs waits for the last of them
        late = [max(arr[list(pl.more[j])], default=-np.inf) if pl.more[j] else -np.inf for j in nxt.tolist()]
        other = np.where(follows, np.maximum(other, late), other)
    lo = np.maximum(reached, other)
    sel = start[zero] > lo
    if pl.h_ids is not None and len(pl.h_ids):  # a wait for a RELOAD is the host link's, not a collective's
        on_host = np.zeros(len(arr), dtype=bool)
        on_host[pl.h_ids] = True
        sel &= ~on_host[np.maximum(need[zero], 0)] | (need[zero] < 0)
    rows.update(wait_rank=r[sel].astype(np.int64), wait_start=lo[sel], wait_end=start[zero][sel])
    return rows


_SHARING_ROUNDS = 60  # at most; the stretched costs usually settle within 10 to 20


def _share_cores(pl: Plan, costs: CostModel, passes, times: tuple, replicas: int = 1) -> tuple[Plan, tuple]:
    """The machine's times when ranks share their node's cores (`pipec.sim.machine.core_sharing`): each
    op's cost is its own stretched by how many of its node's ranks computed beside it, and the machine is
    run again until the costs settle. Damped (half the old costs, half the new): undamped, two ops that
    overlap less once stretched, and so are stretched less, can swap forever."""
    base = np.asarray(pl.cost, dtype=float)
    cost = base
    for _ in range(_SHARING_ROUNDS):
        start, end = np.asarray(times[0], dtype=float), np.asarray(times[1], dtype=float)
        new = base * core_sharing(pl.c_rank, start, end, costs.ranks_per_node, costs.cores_per_node, replicas)
        if np.allclose(new, cost, rtol=1e-6, atol=1e-12):
            break
        cost = 0.5 * (cost + new)
        pl = replace(pl, cost=cost.tolist())
        times = passes(pl)
    return pl, times


# ---- numbers ----------------------------------------------------------------------


@dataclass(frozen=True)
class RankStats:
    rank: int
    first: float  # start of its first op
    last: float  # end of its last op
    busy: float  # total compute time
    peak_memory: float | None = None
    collective_busy: float = 0.0  # time its collective stream runs (data parallelism; 0 without)
    collective_exposed: float = 0.0  # time its compute stream waits for collectives beyond other waits

    @property
    def span(self) -> float:
        return self.last - self.first

    @property
    def idle(self) -> float:
        """Time inside its span with nothing to compute."""
        return self.span - self.busy


@dataclass(frozen=True)
class Stats:
    """The figures of one step, defined here once: `simulate`, `compare`, `expect` and synth all read these.

    The bubble is measured on the makespan, from the step's common start, as Zero Bubble's cost is
    (each rank's time from the start of the step): so two schedules with the same work and the same
    makespan have the same bubble, whichever rank happens to start late or finish early.
    """

    makespan: float  # from the step's start (time 0, or the earliest event if earlier) to the last op's end
    cost: float  # the longest rank's span, first op to last (synth's tie-break after the makespan)
    ideal: float  # the busiest rank's compute time: m (T_F + T_B + T_W) with uniform costs
    ranks: tuple[RankStats, ...]

    @property
    def bubble_time(self) -> float:
        """The makespan less the busiest rank's compute: time that rank is not computing."""
        return self.makespan - self.ideal

    @property
    def bubble_rate(self) -> float:
        """(makespan - ideal) / makespan: Zero Bubble's (cost - m(T_F + T_B + T_W)) / cost, cost from the start."""
        return self.bubble_time / self.makespan if self.makespan > 0 else 0.0

    @property
    def peak_memory(self) -> float | None:
        peaks = [r.peak_memory for r in self.ranks if r.peak_memory is not None]
        return max(peaks) if peaks else None


def stats(tl: Timeline, memory: dict[str, np.ndarray] | None = None) -> Stats:
    """The numbers of a Timeline (simulated or measured); peak memory per rank when a memory model is given."""
    R = tl.num_ranks
    busy = tl.busy()
    first = np.full(R, np.inf)
    last = np.full(R, -np.inf)
    np.minimum.at(first, tl.rank, tl.start)
    np.maximum.at(last, tl.rank, tl.end)
    coll = np.zeros(R)
    exposed = np.zeros(R)
    if len(tl.coll_rank):  # a rank's step ends when its gradients are reduced
        np.minimum.at(first, tl.coll_rank, tl.coll_start)
        np.maximum.at(last, tl.coll_rank, tl.coll_end)
        coll = np.bincount(tl.coll_rank, weights=tl.coll_end - tl.coll_start, minlength=R)
    if len(tl.step_rank):  # and when its optimizer steps are done
        np.maximum.at(last, tl.step_rank, tl.step_end)
    if len(tl.wait_rank):
        exposed = np.bincount(tl.wait_rank, weights=tl.wait_end - tl.wait_start, minlength=R)
    has = np.isfinite(first)
    first, last = np.where(has, first, 0.0), np.where(has, last, 0.0)
    peaks = [None] * R
    if memory is not None:  # the two pools' rule is pipec.sim.memory's, timed by pipec.sim.memtime
        from pipec.sim.memtime import timeline_curves

        peaks = timeline_curves(tl, memory).device_peak.tolist()
    ranks = tuple(
        RankStats(r, float(first[r]), float(last[r]), float(busy[r]), peaks[r], float(coll[r]), float(exposed[r]))
        for r in range(R)
    )
    cost = max((r.span for r in ranks), default=0.0)
    return Stats(tl.makespan, cost, float(busy.max()) if R else 0.0, ranks)
