"""An exact dry run of a Program under the strictest NCCL behaviour: does its message matching hold?

The question is the Program's, not the Schedule's (`pipec.passes.deadlock` asks whether the ranks'
orders can finish at all) nor a time (`pipec.sim.machine` runs messages eagerly and times them): whether
every send and receive the lowering placed meets its peer under rendezvous. A compute's inputs are
`pipec.ir.rules`'.

The rules: between two ranks, messages match in the order each side issued
them (NCCL runs one pair's operations in issue order), so both sides must
issue the same sequence (checked first, E404). Posting a receive never
blocks; a send blocks its rank until the matching receive is posted and every
earlier message between the two ranks has matched (rendezvous); a batched
group issues all of its operations before its sends wait; a compute waits
until the receive of its input has completed and its local inputs were
computed. A Program that finishes under these rules finishes under any
buffering.

Two ways to the verdict, the same verdict. A compiled Program comes with a
witness, the execution the lowering built it from; checking that execution
against the rules is a handful of numpy passes (`_witnessed` says why a
witness that holds proves the run). Without one, or when it fails, the run is
replayed event by event: each instruction visited once, a blocked rank asleep
until the event it waits for, per-instruction keys from numpy; the replay is
what names the stuck ranks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from pipec.errors import PipecError, Source, Span, error
from pipec.ir.graph import StageGraph, message_edge
from pipec.ir.opcodes import (
    COMPUTE_OF_KIND,
    IS_COMPUTE,
    IS_P2P,
    IS_RECV,
    IS_SEND,
    KIND_OF,
    MESSAGE_NOUNS,
    OP_KINDS,
    OPCODES,
    message_key,
    message_keys,
)
from pipec.ir.program import Instr, Program
from pipec.ir.rules import dependencies
from pipec.ir.schedule import Slicing
from pipec.ir.validate import validate


@dataclass(frozen=True)
class Wait:
    """A rank stuck at an instruction, waiting for `event` ("match", "arrival" or "compute") from `peer`."""

    rank: int
    index: int
    instr: Instr
    event: str
    peer: int
    what: str  # human description of what it waits for
    # With token slices, the instruction's unit as people read it (` (micro-batch 1, slice 2)`), else "".
    unit: str = ""

    def describe(self, at: str | None = None) -> str:
        """One line of a deadlock's chain of waits; `at` names the instruction (default: its text, and with
        token slices the micro-batch and slice of its unit)."""
        at = at or f"`{self.instr}`{self.unit}"
        if self.event == "match":
            return f"rank {self.rank} blocks at {at} until rank {self.peer} posts the matching receive"
        if self.event == "arrival":
            return f"rank {self.rank} blocks at {at} waiting for {self.what}, sent by rank {self.peer}"
        return f"rank {self.rank} blocks at {at} waiting for its own `{self.what}`, which comes later"


@dataclass(frozen=True)
class DryRun:
    completed: bool
    waits: tuple[Wait, ...]  # for each stuck rank, what it waits on (empty when completed)


# What the run does at each instruction, decided once per instruction in numpy so the loop below
# branches on one small integer: nothing (a local or collective instruction: every replica of a rank runs
# the same Program, so a DP group's collectives meet without waiting on any pipeline peer; a memory op,
# RECOMPUTE, OFFLOAD or RELOAD, which waits on its own rank only, for an FWD or OFFLOAD earlier in its
# stream, as `validate` proved; or a compute
# whose inputs are all local and earlier on its rank), wait for a remote input's arrival, wait for it and
# for local inputs computed elsewhere in the order, or issue a lone receive or send, or a batched exchange
# of two (named by its first instruction, the second then reads as lone). Sends are the odd ones.
NOTHING, ARRIVAL, ARRIVAL_AND_LOCAL, LOCAL, RECV, SEND, EXCHANGE_RECV, EXCHANGE_SEND = range(8)


@dataclass(frozen=True, eq=False)
class _Columns:
    """Per instruction, all ranks concatenated (numpy): its rank and action (above); the local ops it
    needs and the op key of the compute (dep1, dep2, own; empty when every local input is simply earlier
    on its rank, `local_in_order`); the channel (pair of ranks) and its position k on it (for a compute:
    the k of the receive it awaits, and `recv` that receive's index); the directed counters it touches;
    the message key it issues or awaits and the rank at its other end."""

    offsets: np.ndarray
    rank: np.ndarray
    act: np.ndarray
    group: np.ndarray
    dep1: np.ndarray
    dep2: np.ndarray
    own: np.ndarray
    chan: np.ndarray
    k: np.ndarray
    recv: np.ndarray
    out: np.ndarray
    back: np.ndarray
    msg: np.ndarray
    peer: np.ndarray
    local_in_order: bool
    real: np.ndarray  # each column's instruction index in its rank's stream (a graph's waits add columns)


def _columns(prog: Program) -> _Columns:
    """Message key: (kind * S + sending stage) * m + mb; op key: (kind * S + stage) * m + mb."""
    S, m, R = prog.num_stages, prog.num_microbatches, prog.num_ranks
    lengths = [len(rp) for rp in prog.ranks]
    offsets = np.cumsum([0] + lengths)
    placement = prog.placement_array

    def cat(xs: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64)

    op = cat([rp.op for rp in prog.ranks]).astype(np.int64)
    mb = cat([rp.mb for rp in prog.ranks]).astype(np.int64)
    s = cat([rp.stage for rp in prog.ranks]).astype(np.int64)
    group = cat([rp.group for rp in prog.ranks]).astype(bool)
    peer = cat([rp.peer for rp in prog.ranks]).astype(np.int64)
    rank = np.repeat(np.arange(R), lengths)
    none = np.full(len(op), -1, dtype=np.int64)
    # A compute's inputs (pipec.ir.rules; its slice rules are the validator's, on one rank's stream): the
    # message from the stage beside it, received from a peer or, when that stage shares the rank, handed
    # over locally (dep1, a dependency on the op that produced it); and the op before it on its own stage
    # (dep2). `in_msg` is the message (pipec.ir.opcodes.MESSAGES) and `src` the stage it comes from.
    kind = KIND_OF[op]
    has_in = np.zeros(len(op), dtype=bool)
    src, in_msg, dep1, dep2 = s.copy(), none.copy(), none.copy(), none.copy()
    g = prog.graph
    extra = []  # a graph's fan-in: each compute's further inputs, (compute index, message, stage), per slot
    for rule, dk, dmb, ds, valid in dependencies(kind, mb, s, S, True, graph=g):
        if rule.message is not None:
            if g is not None:
                more = np.flatnonzero(valid & has_in)
                extra.append((more, np.full(len(more), rule.message), ds[more]))
                valid = valid & ~has_in
            has_in |= valid
            src, in_msg = np.where(valid, ds, src), np.where(valid, rule.message, in_msg)
            dep1 = np.where(valid, (dk * S + np.clip(ds, 0, S - 1)) * m + dmb, dep1)
        else:
            dep2 = np.where(valid, (dk * S + ds) * m + dmb, dep2)
    src_c = np.clip(src, 0, S - 1)
    local_in = placement[src_c] == rank if len(placement) else np.zeros(len(op), dtype=bool)
    remote = has_in & ~local_in
    msg = np.where(remote, _in_key(in_msg, src_c, s, mb, S, m, g), _out_key(prog, op, mb, s, S, m))
    dep1 = np.where(has_in & local_in, dep1, none)
    own = np.where(kind >= 0, (kind * S + s) * m + mb, none)
    # Channel position of each send/receive: how many earlier ones its rank issued to that peer.
    comm = np.flatnonzero(IS_P2P[op])
    k = none.copy()
    directed = rank[comm] * R + peer[comm]
    by_order = np.argsort(directed, kind="stable")
    by, d_sorted = comm[by_order], directed[by_order]
    if len(by):
        starts = np.flatnonzero(np.r_[True, d_sorted[1:] != d_sorted[:-1]])
        k[by] = np.arange(len(by)) - np.repeat(starts, np.diff(np.r_[starts, len(by)]))
    # A compute with a remote input waits on its rank's receive of that message.
    needs = np.flatnonzero(remote)
    recvs = np.flatnonzero(IS_RECV[op])
    recv_at = none.copy()
    if len(needs):
        peer[needs] = placement[src_c[needs]]
    index_of = np.full(message_keys(S, m, g), -1, dtype=np.int64)
    index_of[msg[recvs]] = recvs
    if len(needs):
        if len(recvs):  # a message key names one message: look its receive up directly
            at = index_of[msg[needs]]
            mine = (at >= 0) & (rank[np.maximum(at, 0)] == rank[needs])
            recv_at[needs] = np.where(mine, at, -1)
            k[needs] = np.where(mine, k[np.maximum(at, 0)], -1)
    q = np.clip(peer, 0, max(R - 1, 0))
    chan = np.minimum(rank, q) * R + np.maximum(rank, q)
    out, back = rank * R + q, q * R + rank
    # When every local input is computed earlier on its own rank, no compute can wait for one: the run
    # then tracks remote inputs only (and leaves the three local-dependency columns empty).
    is_compute = IS_COMPUTE[op]
    computes = np.flatnonzero(is_compute)
    where_own = np.full(len(OP_KINDS) * S * m, -1, dtype=np.int64)
    where_own[own[computes]] = computes
    local_in_order = True
    for dep in (dep1, dep2):
        at = np.flatnonzero(dep >= 0)
        src = where_own[dep[at]]
        local_in_order &= bool(((src >= 0) & (src < at) & (rank[np.maximum(src, 0)] == rank[at])).all())
    act = np.full(len(op), NOTHING, dtype=np.int64)
    if local_in_order:
        act[remote] = ARRIVAL
        dep1 = dep2 = np.zeros(0, dtype=np.int64)
    else:
        act[is_compute] = np.where(remote[is_compute], ARRIVAL_AND_LOCAL, LOCAL)
    p2p = IS_P2P[op]
    act[p2p] = RECV + IS_SEND[op[p2p]] + 2 * group[p2p]
    real = np.arange(len(op)) - offsets[:-1][rank]
    cols = _Columns(
        offsets, rank, act, group, dep1, dep2, own, chan, k, recv_at, out, back, msg, q, local_in_order, real
    )
    remote_extra = [
        (at[keep], key[keep])
        for at, m_kind, src_s in extra
        for keep, key in [(placement[src_s] != rank[at], _in_key(m_kind, src_s, s[at], mb[at], S, m, g))]
    ]
    if remote_extra:
        at = np.concatenate([x[0] for x in remote_extra])
        key = np.concatenate([x[1] for x in remote_extra])
        if len(at):
            cols = _with_waits(cols, at, key, index_of)
    return cols


def _in_key(in_msg, src, s, mb, S: int, m: int, g: StageGraph | None) -> np.ndarray:
    """The key (`message_key`'s numbering) of the message a compute of stage `s` receives from stage `src`."""
    if g is None:
        return (in_msg * S + src) * m + mb
    edge = message_edge(g, np.minimum(src, s), np.maximum(src, s))
    return np.where(edge >= 0, (in_msg * g.num_edges + edge) * m + mb, -1)


def _out_key(prog: Program, op, mb, s, S: int, m: int) -> np.ndarray:
    """Each transfer's message key (`message_key`), -1 for the rest."""
    if prog.graph is None:
        return message_key(op, mb, s, S, m)
    other = np.concatenate([rp.other if rp.other is not None else np.full(len(rp), -1) for rp in prog.ranks])
    return message_key(op, mb, s, S, m, other, prog.graph)


def _with_waits(cols: _Columns, at: np.ndarray, key: np.ndarray, index_of: np.ndarray) -> _Columns:
    """A graph's fan-in: a compute with several inputs from other ranks waits for each. The first is the
    compute's own (as on the chain); each further one becomes an ARRIVAL of its own on that input's receive,
    right before the compute. (A further input from this rank is `local_fan_in`'s: it must be computed
    earlier on the rank.) `real` keeps each column's instruction index, so the run names real ones."""
    n = len(cols.act)
    order = np.argsort(at, kind="stable")
    at, key = at[order], key[order]
    recv = index_of[np.maximum(key, 0)]
    recv = np.where((key >= 0) & (recv >= 0) & (cols.rank[np.maximum(recv, 0)] == cols.rank[at]), recv, -1)
    new_at = np.arange(n) + np.searchsorted(at, np.arange(n), side="right")  # where each column goes
    wait_at = at + np.arange(len(at))  # each wait right before its compute, after the waits before it
    total = n + len(at)

    def spread(old: np.ndarray, fill) -> np.ndarray:
        out = np.empty(total, dtype=old.dtype)
        out[new_at] = old
        out[wait_at] = fill
        return out

    none = np.full(len(at), -1, dtype=np.int64)
    recv_new = np.where(cols.recv >= 0, new_at[np.maximum(cols.recv, 0)], -1)
    return _Columns(
        cols.offsets + np.searchsorted(at, cols.offsets, side="left"),
        spread(cols.rank, cols.rank[at]),
        spread(cols.act, ARRIVAL),
        spread(cols.group, False),
        spread(cols.dep1, none) if len(cols.dep1) else cols.dep1,
        spread(cols.dep2, none) if len(cols.dep2) else cols.dep2,
        spread(cols.own, none),
        spread(cols.chan, np.where(recv >= 0, cols.chan[np.maximum(recv, 0)], cols.chan[at])),
        spread(cols.k, np.where(recv >= 0, cols.k[np.maximum(recv, 0)], -1)),
        spread(recv_new, np.where(recv >= 0, new_at[np.maximum(recv, 0)], -1)),
        spread(cols.out, cols.out[at]),
        spread(cols.back, cols.back[at]),
        spread(cols.msg, key),
        spread(cols.peer, cols.peer[np.maximum(recv, 0)] if len(recv) else none),
        cols.local_in_order,
        spread(cols.real, cols.real[at]),
    )


def local_fan_in(prog: Program) -> DryRun | None:
    """On a stage graph, every input a compute takes from a stage of its own rank must be computed earlier in
    the rank's stream (the replay tracks one input per compute; a later one would have the rank wait for
    itself). The first compute that breaks it, as a failed run waiting for its own op; else None."""
    g = prog.graph
    if g is None:
        return None
    for r, rp in enumerate(prog.ranks):
        done: set[tuple[int, int, int]] = set()
        for j, (o, i, st) in enumerate(zip(rp.op.tolist(), rp.mb.tolist(), rp.stage.tolist())):
            kind = int(KIND_OF[o])
            if kind < 0 or not IS_COMPUTE[o]:
                continue
            if kind < 2:  # F reads its input stages, B its consumers' gradients (pipec.ir.rules)
                for t in g.inputs(st) if kind == 0 else g.outputs(st):
                    if prog.placement[t] == r and (kind, i, t) not in done:
                        what = f"{OPCODES[COMPUTE_OF_KIND[kind]]} {i} {t}"
                        return DryRun(False, (Wait(r, j, _instr_at(prog, r, j), "compute", r, what),))
            done.add((kind, i, st))
    return None


def _witnessed(cols: _Columns, op_round: np.ndarray) -> bool:
    """Whether an execution the caller proposes satisfies every rule: True proves the Program finishes.

    The witness gives each compute op a round (the lowering's `global_order`); every instruction gets
    the time I = its rank's last compute round so far, then its place after that compute. The rules
    hold when, on every rank, I strictly increases; each compute with a remote input comes after the
    match of its message, M = max(I of the two ends at that channel position) (both sides have issued
    it, so every earlier message on the pair matched too); and each send's successor (the instruction
    after its group) comes after the send's match.

    Why that proves the run finishes: suppose the run stops with ranks stuck. Give each stuck rank the
    time by which the witness has it moving on: the I of the compute it waits at, or of the instruction
    after the send it blocks at (unbounded for a rank's last send). Take the stuck rank r with the
    smallest. What it waits for is a match M smaller than that time, so both ends have I < it. Every
    instruction with such an I is issued: on r because it lies before r's position, on another rank q
    because q is finished or stuck at a position of at least r's time, and everything before (and the
    send or exchange q blocks at) is issued. So the message matched and r is not stuck: a contradiction.
    (When every stuck rank waits at its last send, every instruction is issued and all of them match.)
    A witness that fails proves nothing; `dry_run` then runs the event loop."""
    n = len(cols.act)
    if n == 0:
        return True
    if not cols.local_in_order or len(op_round) <= cols.own.max(initial=-1):
        return False
    idx = np.arange(n)
    start = cols.offsets[:-1][cols.rank]
    compute_at = np.where(cols.own >= 0, idx, -1)
    last = np.maximum.accumulate(compute_at)
    before = last < start  # no compute yet on this rank
    big = int(np.diff(cols.offsets).max()) + 2
    base = np.where(before, -1, op_round[cols.own[np.maximum(last, 0)]])
    t = base * big + np.where(before, idx - start + 1, idx - last)
    inner = cols.rank[1:] == cols.rank[:-1]
    if not (np.diff(t)[inner] > 0).all():
        return False
    # Pair the two ends of every message: the same channel and position, one instruction on each rank.
    p2p = np.flatnonzero(cols.act >= RECV)
    if len(p2p):
        pos = cols.chan[p2p] * big + cols.k[p2p]
        by = p2p[np.argsort(pos, kind="stable")]
        if len(by) % 2:
            return False
        a, b = by[0::2], by[1::2]
        if not ((cols.chan[a] == cols.chan[b]) & (cols.k[a] == cols.k[b]) & (cols.rank[a] != cols.rank[b])).all():
            return False
        match = np.empty(n, dtype=np.int64)
        match[a] = match[b] = np.maximum(t[a], t[b])
        sends = p2p[cols.act[p2p] % 2 == 1]
        nxt = sends + 1 + cols.group[sends]
        has_next = nxt < cols.offsets[1:][cols.rank[sends]]
        if not (t[nxt[has_next]] > match[sends[has_next]]).all():
            return False
    else:
        match = np.zeros(n, dtype=np.int64)
    waits = np.flatnonzero(cols.act == ARRIVAL)
    if len(waits):
        at = cols.recv[waits]
        if (at < 0).any() or not (t[waits] > match[at]).all():
            return False
    return True


def check_channels(prog: Program) -> None:
    """Both ends of every rank pair issue the same messages in the same order (E404). Peers are right
    by then: `validate` checked that each transfer names the owner of the stage at its other end.

    One pass over all ranks' transfers (`_channels_match`: one sort by channel, position and direction);
    only when it finds a mismatch does the pair-by-pair walk below name the first one."""
    if _channels_match(prog):
        return
    S, m = prog.num_stages, prog.num_microbatches
    seqs: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    for r, rp in enumerate(prog.ranks):
        comm = np.flatnonzero(IS_P2P[rp.op])
        op, s = rp.op[comm], rp.stage[comm]
        other = rp.other[comm] if rp.other is not None else None
        keys = message_key(op, rp.mb[comm], s, S, m, other, prog.graph) * 2 + IS_SEND[op]
        by_peer = np.argsort(rp.peer[comm], kind="stable")
        peers = rp.peer[comm][by_peer]
        # runs of one peer in the sorted order (np.unique would import numpy.ma: 20 ms of a fresh compile)
        starts = np.flatnonzero(np.r_[True, peers[1:] != peers[:-1]]) if len(peers) else np.zeros(0, np.int64)
        for lo, hi in zip(starts.tolist(), [*starts[1:].tolist(), len(peers)]):
            sel = by_peer[lo:hi]
            seqs[(r, int(peers[lo]))] = (keys[sel], comm[sel])
    for (a, b), (mine, where_a) in seqs.items():
        theirs, where_b = seqs.get((b, a), (np.zeros(0, np.int64), np.zeros(0, np.int64)))
        if a > b and (b, a) in seqs:
            continue
        # The same messages, each a send on one side and a receive on the other: keys differ by the flag.
        n = min(len(mine), len(theirs))
        bad = np.flatnonzero((mine[:n] // 2 != theirs[:n] // 2) | (mine[:n] % 2 == theirs[:n] % 2))
        if len(bad) or len(mine) != len(theirs):
            k = int(bad[0]) if len(bad) else n
            raise _mismatch(prog, a, b, k, where_a, where_b)


def _channels_match(prog: Program) -> bool:
    """Whether every channel's two ends issue the same messages in the same order, all ranks at once: each
    transfer's position k among its rank's transfers to that peer (a stable sort by directed channel), then
    one sort by (channel, k, direction) puts the two ends of each position side by side; they must be one
    message (its key) sent on one side and received on the other. False proves nothing (`check_channels`
    then walks the pairs to name the first mismatch)."""
    R = prog.num_ranks
    ops = [rp.op for rp in prog.ranks]
    if not ops:
        return True
    op = np.concatenate(ops).astype(np.int64)
    comm = np.flatnonzero(IS_P2P[op])
    if not len(comm):
        return True
    lengths = [len(x) for x in ops]
    rank = np.repeat(np.arange(R, dtype=np.int64), lengths)[comm]
    peer = np.concatenate([rp.peer for rp in prog.ranks]).astype(np.int64)[comm]
    if ((peer < 0) | (peer >= R) | (peer == rank)).any():
        return False
    op = op[comm]
    mb = np.concatenate([rp.mb for rp in prog.ranks]).astype(np.int64)[comm]
    s = np.concatenate([rp.stage for rp in prog.ranks]).astype(np.int64)[comm]
    other = None
    if prog.graph is not None:
        other = np.concatenate([rp.other if rp.other is not None else np.full(len(rp), -1) for rp in prog.ranks])
        other = other.astype(np.int64)[comm]
    key = message_key(op, mb, s, prog.num_stages, prog.num_microbatches, other, prog.graph)
    n = len(comm)
    directed = rank * R + peer
    by = np.argsort(directed, kind="stable")
    d = directed[by]
    starts = np.flatnonzero(np.r_[True, d[1:] != d[:-1]])
    k = np.empty(n, dtype=np.int64)
    k[by] = np.arange(n) - np.repeat(starts, np.diff(np.r_[starts, n]))
    chan = np.minimum(rank, peer) * R + np.maximum(rank, peer)
    up = (rank > peer).astype(np.int64)
    if R * R * 2 * (n + 1) < 2**62:
        order = np.argsort((chan * (n + 1) + k) * 2 + up, kind="stable")
    else:
        order = np.lexsort((up, k, chan))
    if n % 2:
        return False
    a, b = order[0::2], order[1::2]
    same_slot = (chan[a] == chan[b]) & (k[a] == k[b]) & (up[a] == 0) & (up[b] == 1)
    return bool((same_slot & (key[a] == key[b]) & (IS_SEND[op[a]] != IS_SEND[op[b]])).all())


def _mismatch(prog: Program, a: int, b: int, k: int, where_a, where_b) -> PipecError:
    def say(r: int, q: int, where) -> str:
        if k >= len(where):
            return f"rank {r} issues no message {k} to rank {q}"
        instr = _instr_at(prog, r, int(where[k]))
        edge = ""
        if prog.graph is not None and instr.other >= 0:
            lo, hi = sorted((instr.stage, instr.other))
            edge = f" (edge {lo} -> {hi})"
        return f"rank {r}'s message {k} with rank {q} is `{instr}`{edge}{_unit_text(_sliced(prog), instr.mb)}"

    return error(
        "E404",
        f"ranks {a} and {b} issue their messages to each other in different orders; NCCL would hang",
        notes=(say(a, b, where_a), say(b, a, where_b)),
    )


def dry_run(prog: Program, witness: np.ndarray | None = None) -> DryRun:
    """Run the Program under the rules above (after `validate` and `check_channels`). `witness`: a round
    per compute op key from the caller's own execution of the schedule (the lowering passes its global
    order); when it satisfies the rules the run is proven without replaying it (`_witnessed`), else, and
    without one, the event loop below runs every instruction."""
    validate(prog)
    check_channels(prog)
    stuck = local_fan_in(prog)
    if stuck is not None:
        return stuck
    cols = _columns(prog)
    if witness is not None and _witnessed(cols, witness):
        return DryRun(True, ())
    return _rendezvous_replay(prog, cols)


def _rendezvous_replay(prog: Program, cols: _Columns) -> DryRun:
    """The rendezvous replay: each instruction visited once under the matching rules above, a blocked rank
    asleep until what it waits for (a match, an arrival, a local compute)."""
    S, m, R = prog.num_stages, prog.num_microbatches, prog.num_ranks
    offsets = cols.offsets.tolist()
    acts, dep1s, dep2s, owns, chans, ks, outs, backs = (
        c.tolist() for c in (cols.act, cols.dep1, cols.dep2, cols.own, cols.chan, cols.k, cols.out, cols.back)
    )
    pc = offsets[:-1]  # global instruction indices, one per rank
    ends = offsets[1:]
    kmax = max((b - a for a, b in zip(offsets, offsets[1:])), default=0) + 1
    issued_upto = list(pc)  # a rank resumed at a blocked send or exchange has issued it already
    computed = bytearray(len(OP_KINDS) * S * m)
    issued = [0] * (R * R)  # issued[a * R + b]: messages a issued towards b
    matched = [0] * (R * R)  # matched[min * R + max]: messages matched between the two
    waiting: dict[int, list[int]] = {}  # channel * kmax + k, or -1 - op key -> ranks
    blocked: dict[int, tuple[str, int]] = {}  # rank -> (event, instruction or op key)
    queue = deque(range(R))

    while queue:
        r = queue.popleft()
        j, end = pc[r], ends[r]
        while j < end:
            a = acts[j]
            if a == NOTHING:
                j += 1
                continue
            if a <= LOCAL:  # a compute
                if a != LOCAL:
                    k = ks[j]
                    if k < 0 or matched[chans[j]] <= k:
                        blocked[r] = ("arrival", j)
                        if k >= 0:
                            waiting.setdefault(chans[j] * kmax + k, []).append(r)
                        break
                    if a == ARRIVAL:
                        j += 1
                        continue
                d = dep1s[j]
                if d < 0 or computed[d]:
                    d = dep2s[j]
                if d >= 0 and not computed[d]:
                    blocked[r] = ("compute", d)
                    waiting.setdefault(-1 - d, []).append(r)
                    break
                key = owns[j]
                computed[key] = 1
                if waiting and -1 - key in waiting:
                    for w in waiting.pop(-1 - key):
                        del blocked[w]
                        queue.append(w)
                j += 1
                continue
            last = j + 1 if a >= EXCHANGE_RECV else j  # a batched exchange of two (validate allows no other)
            if issued_upto[r] <= j:
                for x in range(j, last + 1):
                    ox = outs[x]
                    mine = issued[ox] + 1
                    issued[ox] = mine
                    theirs = issued[backs[x]]
                    c = chans[x]
                    done = mine if mine < theirs else theirs
                    while matched[c] < done:
                        if waiting:
                            for w in waiting.pop(c * kmax + matched[c], ()):
                                del blocked[w]
                                queue.append(w)
                        matched[c] += 1
                issued_upto[r] = last + 1
            if a == RECV:  # posting a receive never blocks
                j += 1
                continue
            stuck = -1  # sends block until matched
            for x in range(j, last + 1):
                if acts[x] % 2 and matched[chans[x]] <= ks[x]:
                    stuck = x
                    break
            if stuck >= 0:
                blocked[r] = ("match", stuck)
                waiting.setdefault(chans[stuck] * kmax + ks[stuck], []).append(r)
                j = stuck
                break
            j = last + 1
        pc[r] = j

    if pc == ends:
        return DryRun(True, ())
    waits = []
    sl = _sliced(prog)
    for r in range(R):
        if pc[r] == ends[r]:
            continue
        event, at = blocked[r]
        if event == "compute":
            rest, mb = divmod(at, m)
            kind, stage = divmod(rest, S)
            what, peer = f"{OPCODES[COMPUTE_OF_KIND[kind]]} {mb} {stage}{_unit_text(sl, mb)}", r
        else:
            rest, mb = divmod(int(cols.msg[at]), m)
            if prog.graph is None:
                kind, stage = divmod(rest, S)
                where = f"from stage {stage}"
            else:
                kind, edge = divmod(rest, prog.graph.num_edges)
                u, v = prog.graph.edges[edge]
                where = f"on edge {u} -> {v}"
            what, peer = f"the {MESSAGE_NOUNS[kind]} of {_mb_text(sl, mb)} {where}", int(cols.peer[at])
        j = int(cols.real[pc[r]])
        instr = _instr_at(prog, r, j)
        unit = _unit_text(sl, instr.mb) if instr.mb >= 0 else ""
        waits.append(Wait(r, j, instr, event, peer, what, unit))
    return DryRun(False, tuple(waits))


def _sliced(prog: Program) -> Slicing | None:
    """The Program's token slices when it has more than one per micro-batch (what the messages name)."""
    sl = getattr(prog, "slicing", None)
    return sl if sl is not None and sl.slices > 1 else None


def _mb_text(sl: Slicing | None, mb: int) -> str:
    """`micro-batch 3`; with token slices (pipec.ir.schedule.Slicing) `micro-batch 1, slice 2` of unit mb."""
    if sl is None:
        return f"micro-batch {mb}"
    i, j = sl.split(mb)
    return f"micro-batch {i}, slice {j}"


def _unit_text(sl: Slicing | None, mb: int) -> str:
    """After an instruction's text, with token slices, what its unit is: ` (micro-batch 1, slice 2)`."""
    return "" if sl is None else f" ({_mb_text(sl, mb)})"


def _instr_at(prog: Program, r: int, j: int) -> Instr:
    rp = prog.ranks[r]
    other = int(rp.other[j]) if rp.other is not None else -1
    return Instr(OPCODES[int(rp.op[j])], int(rp.mb[j]), int(rp.stage[j]), int(rp.peer[j]), bool(rp.group[j]), other)


def deadlock_error(run: DryRun, span: Span | None = None, source: Source | None = None) -> PipecError:
    """E403 for a dry run that did not complete: the cycle of waits, rank by rank. Each stuck rank waits
    on one peer, so following those waits from any stuck rank reaches the cycle."""
    by_rank = {w.rank: w for w in run.waits}
    r, seen = run.waits[0].rank, []
    while r in by_rank and r not in seen:
        seen.append(r)
        r = by_rank[r].peer
    cycle = seen[seen.index(r) :] if r in seen else seen
    notes = tuple(by_rank[r].describe() for r in cycle)
    return error(
        "E403",
        "the lowered program can deadlock when sends block until the peer posts its receive",
        span,
        source,
        notes,
    )


def prove(prog: Program) -> None:
    """Everything a Program must pass before it runs: `validate` (E502), one message order per channel
    (E404) and the strict rendezvous dry run (E403). For Programs read from files; compiled ones are
    proven while they are lowered."""
    run = dry_run(prog)
    if not run.completed:
        raise deadlock_error(run)
