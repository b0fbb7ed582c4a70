"""A Program under a cost model as the machine's passes read it: the `Plan`, built once by `plan`.

Why a module of its own: turning a Program into arrays (per compute op its duration, the message it waits
for and the messages sent after it; per message its channel, its wire time and latency; the inserted waits
of data parallelism, memory ops and all-to-alls) is one job, done once per simulation with numpy, and read
by two others: `pipec.sim.simulate` steps a Plan on the machine (`pipec.sim.machine`) and turns the result
into a Timeline, and the list scheduler of `pipec.passes.policy` steps the same machine on the Plan of the
Program it derived (and reads the overhead from it), so its times are the simulator's. What the machine
does with the Plan is described in `pipec.sim.simulate`'s docstring; not to be confused with `pipec plan`
(`pipec.planner`), which searches schedules.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipec.errors import error
from pipec.ir.experts import a2a_latencies
from pipec.ir.opcodes import (
    A2A_KIND,
    BWD,
    IS_COLLECTIVE,
    IS_HOST,
    IS_P2P,
    IS_RECV,
    IS_SEND,
    MSG_OF,
    ON_COMPUTE,
    OP_KINDS,
    RECOMPUTE,
    REDUCE_GRAD,
    RELOAD,
    RESHARD,
    STEP,
    UNSHARD,
    message_key,
)
from pipec.ir.program import Program
from pipec.sim.costs import CostModel
from pipec.sim.inputs import describe_key, resolve, wanted
from pipec.sim.machine import shared_links
from pipec.sim.segments import a2a_needs, a2a_plan, counts, cut


@dataclass(frozen=True, eq=False)
class Plan:
    """A Program under a cost model, as the event passes read it; built once by `plan`.

    Compute ops are numbered rank by rank in stream order, messages in the order of their sends
    (rank by rank, in stream order). Lists rather than arrays where the passes read one element at a
    time (faster in their loops); numpy columns for the Timeline.
    """

    num_ranks: int
    first: list[int]  # per rank, the id of its first compute op
    ends: list[int]  # per rank, one past the id of its last compute op
    cost: list[float]  # per compute op, its duration
    need: list[int]  # per compute op, the (first) message it waits for (-1: none)
    mlo: list[int]  # per compute op, the messages sent after it (before the next one): mlo[j] <= x < mhi[j]
    mhi: list[int]
    pre: list[int]  # messages sent before any compute op of their rank (they leave at time 0)
    prev: list[int]  # per message, the one sent before it on its channel (-1: none)
    txd: list[float]  # per message, its time on the wire when alone there
    lat: list[float]  # per message, latency + comm after it left the wire
    chan: list[int]  # per message, its channel: src * ranks + dst
    group: list[int] | None  # per message, the contended shared link it crosses (-1: none); None: no contention
    # The overhead as times (None when o = 0): per message, how long after the end of the compute op
    # before its send (or after time 0) it leaves; per compute op, the rank's time on the sends and
    # receives after it, up to its next compute op; per rank, the time on those before its first one.
    off: list[float] | None
    tail: list[float] | None
    head: list[float] | None
    # For the Timeline.
    c_rank: np.ndarray
    c_op: np.ndarray
    c_mb: np.ndarray
    c_stage: np.ndarray
    m_kind: np.ndarray  # pipec.ir.opcodes.MESSAGES index
    m_mb: np.ndarray
    m_stage: np.ndarray  # the sending stage
    m_src: np.ndarray
    m_dst: np.ndarray
    m_bytes: np.ndarray
    recv_msg: np.ndarray  # per receive of a message that is sent: the message
    recv_after: np.ndarray  # the compute op just before that receive on its rank (-1: none)
    # Data parallelism (None without): which stream ops are computes (the rest are STEPs and waits), the
    # ids of the p2p messages among all, and the collectives' message ids, opcodes, stages, ranks, bytes.
    real: np.ndarray | None = None
    p2p: np.ndarray | None = None
    k_ids: np.ndarray | None = None
    k_op: np.ndarray | None = None
    k_stage: np.ndarray | None = None
    k_rank: np.ndarray | None = None
    k_bytes: np.ndarray | None = None
    k_after: np.ndarray | None = None  # per collective, the computes of its rank before it in the stream
    # Per compute op, the messages it waits for beyond `need` (a stage graph's op with several remote inputs,
    # `pipec.sim.inputs`); None when no op waits for more than one.
    more: list[tuple[int, ...]] | None = None
    # Per message, whether it waits for the one before it on its channel to arrive before it leaves (the
    # collectives of a rank when some of them share a link; None: no such waits).
    hold: list[bool] | None = None
    # Per stream op, whether it is a Program's STEP (None without data parallelism or step costs); the
    # cost model's fixed seconds per step, by which every time of the step is later.
    is_step: np.ndarray | None = None
    step_overhead: float = 0.0
    # The host link (OFFLOAD, RELOAD; None without a stream of ops): their message ids, opcodes,
    # micro-batches, stages and ranks.
    h_ids: np.ndarray | None = None
    h_op: np.ndarray | None = None
    h_mb: np.ndarray | None = None
    h_stage: np.ndarray | None = None
    h_rank: np.ndarray | None = None
    # Experts (None without all-to-alls): per stream op, its segment index (-1: not cut) and the instruction
    # it comes from (pipec.sim.segments); the all-to-alls' message ids, opcodes (FWD, BWD), micro-batches,
    # stages, ranks and index within their op.
    c_seg: np.ndarray | None = None
    c_src: np.ndarray | None = None
    a_ids: np.ndarray | None = None
    a_op: np.ndarray | None = None
    a_mb: np.ndarray | None = None
    a_stage: np.ndarray | None = None
    a_rank: np.ndarray | None = None
    a_index: np.ndarray | None = None

    def posted(self, end: list[float]) -> np.ndarray:
        """When each message's receive was posted: the end of the compute op before it (else 0); NaN: none."""
        post = np.full(len(self.txd), np.nan)
        if len(self.recv_msg):
            end_arr = np.asarray(end, dtype=float) if len(end) else np.zeros(1)
            post[self.recv_msg] = np.where(self.recv_after >= 0, end_arr[np.maximum(self.recv_after, 0)], 0.0)
        return post


def plan(prog: Program, costs: CostModel, overlap: bool = True) -> Plan:
    """The Program's compute ops and messages as the passes read them; E403 for a malformed Program.

    With data parallelism (dp > 1 and collectives in the Program), the passes see collectives as messages
    on a channel of their own per rank (R * R + rank): issued where the stream reaches them, one after the
    other, each `CostModel.collective_time` on that channel's wire, so the channel is the rank's collective
    stream; RESHARD is an instant message on a second channel (R * R + R + rank). The stream waits on them
    through zero-cost ops: each STEP waits for its stage's REDUCE_GRAD, and a wait inserted before the
    next compute of stage s after an UNSHARD s waits for that UNSHARD. When the rings of two ranks or more
    cross a link between replica datacenters, that link is one more shared link (`Links`): a crossing
    collective's bytes on it are its wire time, the rest of its time its latency, and it leaves only when
    the collective before it on its rank has arrived (`hold`). With dp = 1 none of this exists. OFFLOAD
    and RELOAD are messages on a third channel per rank (R * R + 2R + rank), the host link, each
    `CostModel.host_time`; a wait inserted before the BWD (or RECOMPUTE) of a RELOAD's micro-batch and
    stage waits for it. All-to-alls (a Program whose expert group has 2 ranks or more and stages with MoE
    layers): each op that issues them is cut into segments (`pipec.sim.segments`, an overlapped pair's in
    `pair_order` unless `overlap` is False), and each all-to-all is a message on a fourth channel per rank
    (R * R + 3R + rank), the expert link: its bytes hold the link (one all-to-all on the wire at a time), its
    latency does not (`CostModel.a2a_parts`; a forward's dispatch takes it twice, `a2a_latencies`); the
    segment after it waits for it, and a pair's segment that takes the turn from the other op starts the
    cost model's `pair_handoff` after that one ends (`_handoffs`).
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
    placement = prog.placement_array
    graph = prog.graph  # None: the chain; with one, each transfer names its edge by the stage at its other end
    other = None
    if graph is not None:
        parts = [rp.other if rp.other is not None else np.full(len(rp), -1, np.int64) for rp in prog.ranks]
        other = np.concatenate(parts) if sum(lengths) else z
    dp = prog.dp > 1 and bool(IS_COLLECTIVE[op].any())
    blocking = dp and costs.dp_blocking
    # optimizer steps with a cost: the STEPs become stream ops (as with data parallelism) that take it
    stepping = costs.step is not None and bool((costs.step > 0).any()) and bool((op == STEP).any())
    host = bool(IS_HOST[op].any())  # OFFLOAD/RELOAD: a host-link stream per rank, as the collectives' stream
    layers = prog.a2a_layers
    moe = bool(counts(op, stage, layers).any())  # some op issues all-to-alls
    wait_for = None
    group = np.concatenate([rp.group for rp in prog.ranks]) if sum(lengths) else np.zeros(0, dtype=bool)
    if dp or stepping or host or moe:
        op, mb, stage, peer, rank, other, wait_for, group = _with_waits(
            op, mb, stage, peer, rank, S, m, blocking, group, other
        )
        lengths = np.bincount(rank, minlength=R).tolist()
    cutting = None
    is_a2a = np.zeros(len(op), dtype=bool)
    if moe:
        cutting = cut(op, mb, stage, peer, rank, wait_for, group, layers, overlap)
        op, mb, stage, peer, rank = cutting.op, cutting.mb, cutting.stage, cutting.peer, cutting.rank
        other = None if other is None else other[cutting.src]
        wait_for = cutting.wait_for
        is_a2a = cutting.a2a >= 0
        lengths = np.bincount(rank, minlength=R).tolist()

    # Compute ops: duration and the message each one waits for (the table's `needs`, when its sender
    # is on another rank; one on the same rank hands over locally, earlier on the same stream). With
    # data parallelism the stream's ops also hold STEPs and the inserted waits (zero cost, `real` False).
    # A RECOMPUTE is a compute op of the stream too (its stage's F; no message to wait for).
    streamed = dp or stepping or host or moe
    cidx = np.flatnonzero(ON_COMPUTE[op] | (op == STEP)) if streamed else np.flatnonzero(ON_COMPUTE[op])
    cidx = cidx[~is_a2a[cidx]]
    n = len(cidx)
    c_op, c_mb, c_s, c_rank = op[cidx], mb[cidx], stage[cidx], rank[cidx]
    cost = costs.compute_time(c_op, c_s, c_mb) if n else np.zeros(0)
    if cutting is not None:  # a segment takes an equal share of its op
        cost = cost / cutting.nseg[cidx]
    real = ON_COMPUTE[c_op] if streamed else None
    is_step = None
    if real is not None:
        is_step = (c_op == STEP) & (wait_for[cidx] < 0)  # a Program's STEP, not an inserted wait
        step_cost = costs.step[c_s] if costs.step is not None else np.zeros(n)
        cost = np.where(real, cost, np.where(is_step, step_cost, 0.0))
    wants = wanted(c_op, c_mb, c_s, c_rank, placement, S, m, graph)  # per input slot (one on the chain)
    if cutting is not None:  # a later segment waits for its all-to-all instead (below)
        wants = [np.where(cutting.seg[cidx] <= 0, w, -1) for w in wants]

    # Messages, one per send, in issue order; the compute just before each send gives its clock.
    sidx = np.flatnonzero(IS_SEND[op])
    M = len(sidx)
    s_kind = MSG_OF[op[sidx]]
    s_stage, s_mb, s_src, s_dst = stage[sidx], mb[sidx], rank[sidx], peer[sidx]
    if M and not ((s_dst >= 0) & (s_dst < R)).all():
        raise error("E403", "a send names no valid peer rank")
    s_other = None if other is None else other[sidx]  # a graph's: the stage at the other end of the edge
    key = message_key(op[sidx], s_mb, s_stage, S, m, s_other, graph)
    if graph is not None and (key < 0).any():
        j = int(np.flatnonzero(key < 0)[0])
        raise error("E403", f"a send of stage {int(s_stage[j])} to stage {int(s_other[j])} names no edge of the graph")
    order = np.argsort(key, kind="stable")
    keys = key[order]
    if M and (keys[1:] == keys[:-1]).any():
        dup = int(keys[1:][keys[1:] == keys[:-1]][0])
        raise error("E403", f"message {describe_key(dup, S, m, graph)} is sent twice")
    need, more = resolve(wants, keys, order, S, m, graph)

    size, txd, lat = costs.wire(s_kind, s_stage, s_src, s_dst, s_mb, s_other)
    chan = s_src * R + s_dst
    group = shared_links(costs, s_src, s_dst, txd) if M else None
    p2p = k_pos = hold = h_ids = a_ids = None
    midx = sidx  # every message's instruction, in issue order (with data parallelism: collectives too)
    if streamed:
        midx = np.flatnonzero(IS_SEND[op] | IS_COLLECTIVE[op] | (op == RESHARD) | IS_HOST[op] | is_a2a)
        p2p = np.searchsorted(midx, sidx)  # each p2p message's id among all messages
        is_a = is_a2a[midx]
        is_h = IS_HOST[op[midx]] & ~is_a
        is_k = ~IS_SEND[op[midx]] & ~is_h & ~is_a
        k_pos = midx[is_k]
        k_op = op[k_pos]
        k_txd = costs.collective_time(k_op, stage[k_pos], rank[k_pos], prog.dp, prog.dp_kind)
        all_txd, all_lat = np.zeros(len(midx)), np.zeros(len(midx))
        # Channels past the R * R of rank pairs: each rank's collective stream, its RESHARDs, its host link.
        all_chan = R * R + rank[midx] + np.where(op[midx] == RESHARD, R, 0) + np.where(is_h, 2 * R, 0)
        all_chan = np.where(is_a, R * R + 3 * R + rank[midx], all_chan)
        all_txd[p2p], all_lat[p2p], all_chan[p2p] = txd, lat, chan
        all_txd[is_k] = k_txd
        a_ids = np.flatnonzero(is_a)
        if len(a_ids):  # the all-to-alls on each rank's expert link
            assert cutting is not None  # all-to-all rows come from cutting
            a_pos = midx[a_ids]
            wire, a_lat = costs.a2a_parts(stage[a_pos], rank[a_pos], prog.experts.size, prog.dp)
            kinds = [OP_KINDS[k] for k in A2A_KIND[op[a_pos]].tolist()]
            trips = [a2a_latencies(k, i) for k, i in zip(kinds, cutting.a2a[a_pos].tolist())]
            all_txd[a_ids], all_lat[a_ids] = wire, a_lat * np.array(trips, dtype=float)
        h_ids = np.flatnonzero(is_h)
        if len(h_ids):  # OFFLOAD/RELOAD: what the F keeps over the host link (its input when recomputed)
            h_pos = midx[h_ids]
            rec = np.flatnonzero(op == RECOMPUTE)
            recomputed = np.isin(stage[h_pos] * m + mb[h_pos], stage[rec] * m + mb[rec])
            all_txd[h_ids] = costs.host_time(stage[h_pos], recomputed)
        if group is not None:
            full = np.full(len(midx), -1, dtype=np.int64)
            full[p2p] = group
            group = full.tolist()
        # Rings of two ranks or more crossing a link between replica datacenters share it: their bytes on
        # it become a message's wire time on one more shared link, the rest its latency, and each waits
        # for the collective before it on its rank to end (`hold`), the time-ordered pass running them.
        k_wire = costs.collective_wire(k_op, stage[k_pos], rank[k_pos], prog.dp, prog.dp_kind)
        on_link = k_wire > 0
        if len(np.unique(rank[k_pos][on_link])) >= 2:
            kid = np.flatnonzero(is_k)[on_link]
            all_txd[kid] = k_wire[on_link]
            all_lat[kid] = np.maximum(k_txd[on_link] - k_wire[on_link], 0.0)
            full = np.full(len(midx), -1, dtype=np.int64) if group is None else np.asarray(group)
            full[kid] = max(group or [-1]) + 1
            group = full.tolist()
            hold = IS_COLLECTIVE[op[midx]].tolist()
        if len(p2p):
            need = np.where(need >= 0, p2p[np.maximum(need, 0)], -1)
            if more is not None:
                more = [tuple(p2p[list(x)].tolist()) if x else () for x in more]
        need = _collective_needs(need, op, stage, rank, cidx, midx, wait_for, S)
        if cutting is not None:
            need = a2a_needs(need, cutting, cidx, midx)
        txd, lat, chan = all_txd, all_lat, all_chan
        M = len(midx)
    s_src_all = rank[midx]

    before = np.searchsorted(cidx, midx) - 1  # global compute id of the op just before each send
    own = (before >= 0) & (c_rank[np.maximum(before, 0)] == s_src_all) if n else np.zeros(M, dtype=bool)
    first_of_rank = np.concatenate([[0], np.cumsum(np.bincount(c_rank, minlength=R))])[:-1]
    slot = np.where(own, before.astype(float), first_of_rank[s_src_all] - 0.5)  # monotone in issue order
    ids = np.arange(n)
    mlo = np.searchsorted(slot, ids, "left")
    mhi = np.searchsorted(slot, ids, "right")
    pre = np.flatnonzero(~own)  # sends before any compute of their rank leave at time 0

    by_chan = np.argsort(chan, kind="stable")
    prev = np.full(M, -1, dtype=np.int64)
    if M:
        same = chan[by_chan][1:] == chan[by_chan][:-1]
        prev[by_chan[1:][same]] = by_chan[:-1][same]

    off, tail, head = _overheads(costs.overhead, op, rank, lengths, cidx, midx, before, own, R)
    if cutting is not None and costs.pair_handoff and n:
        tail = _handoffs(tail, cutting.turn[cidx], costs.pair_handoff)

    # Receives: the message each names and the compute op just before it on its rank.
    ridx = np.flatnonzero(IS_RECV[op])
    recv_msg, recv_after = z, z
    if len(ridx) and M:
        r_key = message_key(op[ridx], mb[ridx], stage[ridx], S, m, None if other is None else other[ridx], graph)
        at = np.clip(np.searchsorted(keys, r_key), 0, M - 1)
        ok = keys[at] == r_key
        rb = np.searchsorted(cidx, ridx) - 1
        mine = (rb >= 0) & (c_rank[np.maximum(rb, 0)] == rank[ridx]) if n else np.zeros(len(ridx), dtype=bool)
        recv_msg, recv_after = order[at[ok]], np.where(mine, rb, -1)[ok]
        if p2p is not None:
            recv_msg = p2p[recv_msg]

    return Plan(
        num_ranks=R,
        first=np.searchsorted(c_rank, np.arange(R), "left").tolist(),
        ends=np.searchsorted(c_rank, np.arange(R), "right").tolist(),
        cost=cost.tolist(),
        need=need.tolist(),
        more=more,
        mlo=mlo.tolist(),
        mhi=mhi.tolist(),
        pre=pre.tolist(),
        prev=prev.tolist(),
        txd=txd.tolist(),
        lat=lat.tolist(),
        chan=chan.tolist(),
        group=group,
        off=off,
        tail=tail,
        head=head,
        c_rank=c_rank.astype(np.int64),
        c_op=c_op.astype(np.int64),
        c_mb=c_mb.astype(np.int64),
        c_stage=c_s.astype(np.int64),
        m_kind=s_kind.astype(np.int64),
        m_mb=s_mb.astype(np.int64),
        m_stage=s_stage.astype(np.int64),
        m_src=s_src.astype(np.int64),
        m_dst=s_dst.astype(np.int64),
        m_bytes=np.asarray(size, dtype=float),
        recv_msg=recv_msg,
        recv_after=recv_after,
        real=real,
        p2p=p2p,
        k_ids=None if k_pos is None else np.flatnonzero(is_k),
        k_op=None if k_pos is None else k_op,
        k_stage=None if k_pos is None else stage[k_pos],
        k_rank=None if k_pos is None else rank[k_pos],
        k_bytes=None if k_pos is None else _shard_bytes(costs, k_op, stage[k_pos]),
        k_after=None if k_pos is None else _computes_before(cidx, real, c_rank, k_pos, rank, R),
        hold=hold,
        is_step=is_step,
        step_overhead=costs.step_overhead,
        h_ids=h_ids,
        h_op=None if h_ids is None else op[midx[h_ids]],
        h_mb=None if h_ids is None else mb[midx[h_ids]],
        h_stage=None if h_ids is None else stage[midx[h_ids]],
        h_rank=None if h_ids is None else rank[midx[h_ids]],
        **({} if cutting is None else a2a_plan(cutting, cidx, midx, a_ids)),
    )


def _with_waits(op, mb, stage, peer, rank, S: int, m: int, blocking: bool, group, other):
    """The instruction columns with a zero-cost wait (coded STEP, stage s) inserted right before the next
    compute of stage s on its rank after each UNSHARD s, right before the BWD i s after each RELOAD i s (the
    RECOMPUTE i s when there is one: it computes from what comes back), and with `blocking` (collectives
    that block the rank: `CostModel.dp_blocking`) right after each REDUCE_GRAD and UNSHARD; and per
    instruction, for an inserted wait the index of the collective or host op it waits for (-1 elsewhere),
    and `group` (an inserted wait binding nothing); `other` (a graph Program's edge ends, or None) goes
    along, -1 at an inserted wait."""
    N = len(op)
    comp = np.flatnonzero(ON_COMPUTE[op])
    uns = np.flatnonzero(op == UNSHARD)
    target = src = np.zeros(0, dtype=np.int64)
    if len(uns) and len(comp):
        group_c = rank[comp] * S + stage[comp]
        o = np.lexsort((comp, group_c))
        keys = group_c[o] * N + comp[o]
        ukey = (rank[uns] * S + stage[uns]) * N + uns
        at = np.searchsorted(keys, ukey)
        ok = at < len(keys)
        ok[ok] = keys[at[ok]] // N == ukey[ok] // N
        target, src = comp[o][at[ok]], uns[ok]
    rel = np.flatnonzero(op == RELOAD)
    if len(rel):  # the first RECOMPUTE or BWD of its micro-batch and stage after it (one stage: one rank)
        cand = np.flatnonzero((op == BWD) | (op == RECOMPUTE))
        ckey = (stage[cand] * m + mb[cand]) * N + cand
        o = np.argsort(ckey, kind="stable")
        keys = ckey[o]
        rkey = (stage[rel] * m + mb[rel]) * N + rel
        at = np.searchsorted(keys, rkey)
        ok = at < len(keys)
        ok[ok] = keys[at[ok]] // N == rkey[ok] // N
        target, src = np.concatenate([target, cand[o][at[ok]]]), np.concatenate([src, rel[ok]])
    slot = 2 * target  # before the target compute
    if blocking:  # and right after each collective, before whatever follows it
        coll = np.flatnonzero((op == REDUCE_GRAD) | (op == UNSHARD))
        target, src = np.concatenate([target, coll]), np.concatenate([src, coll])
        slot = np.concatenate([slot, 2 * coll + 2])
    K = len(target)
    order = np.argsort(np.concatenate([2 * np.arange(N) + 1, slot]), kind="stable")
    inv = np.empty(N + K, dtype=np.int64)
    inv[order] = np.arange(N + K)
    minus = np.full(K, -1, dtype=np.int64)
    cols = [
        np.concatenate([op, np.full(K, STEP)])[order],
        np.concatenate([mb, minus])[order],
        np.concatenate([stage, stage[src]])[order],
        np.concatenate([peer, minus])[order],
        np.concatenate([rank, rank[target]])[order],
    ]
    cols.append(None if other is None else np.concatenate([other, minus])[order])  # a graph's edge ends
    wait_for = np.full(N + K, -1, dtype=np.int64)
    wait_for[inv[N:]] = inv[src]
    return (*cols, wait_for, np.concatenate([group, np.zeros(K, dtype=bool)])[order])  # an inserted wait binds nothing


def _collective_needs(need, op, stage, rank, cidx, midx, wait_for, S: int) -> np.ndarray:
    """`need` with each zero-cost op's collective: an inserted wait's UNSHARD, a STEP's REDUCE_GRAD (the
    last of its stage before it on its rank); a message id among `midx`."""
    need = need.copy()
    steps = np.flatnonzero(op[cidx] == STEP)
    if not len(steps):
        return need
    pos = cidx[steps]
    waits = wait_for[pos] >= 0
    need[steps[waits]] = np.searchsorted(midx, wait_for[pos[waits]])
    N = len(op)
    rg = np.flatnonzero(op == REDUCE_GRAD)
    plain = steps[~waits]
    if len(rg) and len(plain):
        p = cidx[plain]
        keys = (rank[rg] * S + stage[rg]) * N + rg
        o = np.argsort(keys, kind="stable")
        keys = keys[o]
        want = (rank[p] * S + stage[p]) * N + p
        at = np.searchsorted(keys, want) - 1
        ok = (at >= 0) & (keys[np.maximum(at, 0)] // N == want // N)
        need[plain[ok]] = np.searchsorted(midx, rg[o][at[ok]])
    return need


def _handoffs(tail: list[float] | None, turn: np.ndarray, seconds: float) -> list[float]:
    """The rank's time after each compute op (`Plan.tail`) with an overlapped pair's handoff added before
    every segment that takes the turn from the pair's other op: that op's thread wakes up for it, which
    computes nothing (so the sharing of cores does not stretch it) and delays the segment by `seconds`
    (the cost key `pair_handoff`). A pair's first segment never takes a turn, so the op before is its
    pair's, on its rank."""
    out = np.zeros(len(turn)) if tail is None else np.asarray(tail, dtype=float)
    out[np.flatnonzero(turn) - 1] += seconds
    return out.tolist()


def _computes_before(cidx, real, c_rank, pos, rank, R: int) -> np.ndarray:
    """For instructions at these positions, how many computes of their rank come before them."""
    real_pos, real_rank = cidx[real], c_rank[real]
    first = np.searchsorted(real_rank, np.arange(R), "left")
    return (np.searchsorted(real_pos, pos) - first[rank[pos]]).astype(np.int64)


def _shard_bytes(costs: CostModel, op: np.ndarray, stage: np.ndarray) -> np.ndarray:
    """The bytes each collective moves in: the stage's parameters (or gradients); RESHARD none."""
    size = np.zeros(len(op)) if costs.param_bytes is None else costs.param_bytes[stage].astype(float)
    return np.where(op == RESHARD, 0.0, size)


def _overheads(o: float, op, rank, lengths, cidx, sidx, before, own, R: int):
    """The `overhead` o as times (see `Plan`); None when o = 0."""
    if not o:
        return None, None, None
    comm = IS_P2P[op]
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
