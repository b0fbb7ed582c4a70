"""An exact dry run of a Program under the strictest NCCL behaviour.

The rules: between two ranks, messages match in the order each side issued
them (NCCL runs one pair's operations in issue order), so both sides must
issue the same sequence (checked first, E404). Posting a receive never
blocks; a send blocks its rank until the matching receive is posted and every
earlier message between the two ranks has matched (rendezvous); a batched
group issues all of its operations before its sends wait; a compute waits
until the receive of its input has completed and its local inputs were
computed. A Program that finishes under these rules finishes under any
buffering. Event-driven: each instruction is visited once, a blocked rank
sleeps until the event it waits for; per-instruction keys come from numpy.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from pipec.errors import PipecError, Source, Span, error
from pipec.opcodes import (
    AFTER_KIND,
    COMPUTE_OF_KIND,
    IS_COMPUTE,
    IS_P2P,
    IS_RECV,
    IS_SEND,
    KIND_OF,
    MESSAGE_NOUNS,
    NEEDS_MSG,
    NEEDS_STAGE,
    OP_KINDS,
    OPCODES,
    PRODUCER_KIND,
    message_key,
)
from pipec.program import Instr, Program
from pipec.validate import validate


@dataclass(frozen=True)
class Wait:
    """A rank stuck at an instruction, waiting for `event` ("match", "arrival" or "compute") from `peer`."""

    rank: int
    index: int
    instr: Instr
    event: str
    peer: int
    what: str  # human description of what it waits for

    def describe(self, at: str | None = None) -> str:
        """One line of a deadlock's chain of waits; `at` names the instruction (default: its text)."""
        at = at or f"`{self.instr}`"
        if self.event == "match":
            return f"rank {self.rank} blocks at {at} until rank {self.peer} posts the matching receive"
        if self.event == "arrival":
            return f"rank {self.rank} blocks at {at} waiting for {self.what}, sent by rank {self.peer}"
        return f"rank {self.rank} blocks at {at} waiting for its own `{self.what}`, which comes later"


@dataclass(frozen=True)
class DryRun:
    completed: bool
    waits: tuple[Wait, ...]  # for each stuck rank, what it waits on (empty when completed)


def _columns(prog: Program) -> tuple[list[int], tuple[list, ...], bool]:
    """Per rank and instruction: message key it issues or awaits; local ops it needs (a BWD needs its
    forward and, when the next stage shares the rank, that stage's backward); key of the op it
    computes; its position k on the channel with its peer (for a compute: the k of the receive it
    awaits); the channel (pair of ranks) and the directed counters it touches. Computed for all ranks
    at once. Message key: (kind * S + sending stage) * m + mb; op key: (kind * S + stage) * m + mb."""
    S, m, R = prog.num_stages, prog.num_microbatches, prog.num_ranks
    lengths = [len(rp) for rp in prog.ranks]
    offsets = np.cumsum([0] + lengths)
    if offsets[-1] == 0:
        return offsets.tolist(), tuple([] for _ in range(10)), True
    placement = np.asarray(prog.placement, dtype=np.int64)
    op = np.concatenate([rp.op for rp in prog.ranks])
    mb = np.concatenate([rp.mb for rp in prog.ranks])
    s = np.concatenate([rp.stage for rp in prog.ranks])
    group = np.concatenate([rp.group for rp in prog.ranks])
    peer = np.concatenate([rp.peer for rp in prog.ranks])
    rank = np.repeat(np.arange(R), lengths)
    none = np.full(len(op), -1, dtype=np.int64)
    # A compute's input (the table's `needs`): a message from the stage beside it, received from a peer
    # or, when that stage shares the rank, handed over locally (a dependency on the op that produced it).
    kind = KIND_OF[op]
    src = s + NEEDS_STAGE[op]
    has_in = (NEEDS_MSG[op] >= 0) & (src >= 0) & (src < S)
    src_c = np.clip(src, 0, S - 1)
    local_in = placement[src_c] == rank
    remote = has_in & ~local_in
    msg = np.where(remote, (NEEDS_MSG[op] * S + src_c) * m + mb, message_key(op, mb, s, S, m))
    dep1 = np.where(has_in & local_in, (PRODUCER_KIND[np.maximum(NEEDS_MSG[op], 0)] * S + src_c) * m + mb, none)
    after = AFTER_KIND[np.maximum(kind, 0)]
    dep2 = np.where((kind >= 0) & (after >= 0), (after * S + s) * m + mb, none)
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
    if len(needs):
        peer[needs] = placement[src_c[needs]]
        if len(recvs):  # a message key names one message: look its receive up directly
            k_of = np.full(2 * S * m, -1, dtype=np.int64)
            rank_of = np.full(2 * S * m, -1, dtype=np.int64)
            k_of[msg[recvs]] = k[recvs]
            rank_of[msg[recvs]] = rank[recvs]
            k[needs] = np.where(rank_of[msg[needs]] == rank[needs], k_of[msg[needs]], -1)
    q = np.clip(peer, 0, R - 1)
    chan = np.minimum(rank, q) * R + np.maximum(rank, q)
    out, back = rank * R + q, q * R + rank
    # When every local input is computed earlier on its own rank, no compute can wait for one: the run
    # then tracks remote inputs only (and leaves the three local-dependency columns empty).
    computes = np.flatnonzero(IS_COMPUTE[op])
    where_own = np.full(len(OP_KINDS) * S * m, -1, dtype=np.int64)
    where_own[own[computes]] = computes
    local_in_order = True
    for dep in (dep1, dep2):
        at = np.flatnonzero(dep >= 0)
        src = where_own[dep[at]]
        local_in_order &= bool(((src >= 0) & (src < at) & (rank[np.maximum(src, 0)] == rank[at])).all())
    if local_in_order:
        dep1 = dep2 = own = np.zeros(0, dtype=np.int64)
    cols = tuple(c.tolist() for c in (op, msg, dep1, dep2, own, group, chan, k, out, back))
    return offsets.tolist(), cols, local_in_order


def check_channels(prog: Program) -> None:
    """Both ends of every rank pair issue the same messages in the same order (E404). Peers are right
    by then: `validate` checked that each transfer names the owner of the stage at its other end."""
    S, m = prog.num_stages, prog.num_microbatches
    seqs: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    for r, rp in enumerate(prog.ranks):
        comm = np.flatnonzero(IS_P2P[rp.op])
        op, s = rp.op[comm], rp.stage[comm]
        keys = message_key(op, rp.mb[comm], s, S, m) * 2 + IS_SEND[op]
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


def _mismatch(prog: Program, a: int, b: int, k: int, where_a, where_b) -> PipecError:
    def say(r: int, q: int, where) -> str:
        if k >= len(where):
            return f"rank {r} issues no message {k} to rank {q}"
        return f"rank {r}'s message {k} with rank {q} is `{_instr_at(prog, r, int(where[k]))}`"

    return error(
        "E404",
        f"ranks {a} and {b} issue their messages to each other in different orders; NCCL would hang",
        notes=(say(a, b, where_a), say(b, a, where_b)),
    )


def dry_run(prog: Program) -> DryRun:
    """Run the Program under the rules above (after `validate` and `check_channels`)."""
    validate(prog)
    check_channels(prog)
    S, m, R = prog.num_stages, prog.num_microbatches, prog.num_ranks
    offsets, cols, local_in_order = _columns(prog)
    ops, msgs, dep1s, dep2s, owns, groups, chans, ks, outs, backs = cols
    pc = offsets[:-1]  # global instruction indices, one per rank
    ends = offsets[1:]
    kmax = max((b - a for a, b in zip(offsets, offsets[1:])), default=0) + 1
    issued_upto = list(pc)
    computed = bytearray(len(OP_KINDS) * S * m)
    is_compute, is_local, is_send = (c.tolist() for c in (IS_COMPUTE, ~(IS_COMPUTE | IS_P2P), IS_SEND))
    issued = [0] * (R * R)  # issued[a * R + b]: messages a issued towards b
    matched = [0] * (R * R)  # matched[min * R + max]: messages matched between the two
    waiting: dict[int, list[int]] = {}  # channel * kmax + k, or -1 - op key -> ranks
    blocked: dict[int, tuple[str, int, int]] = {}  # rank -> (event, key, peer)
    queue = deque(range(R))

    while queue:
        r = queue.popleft()
        j, end = pc[r], ends[r]
        while j < end:
            o = ops[j]
            if is_compute[o]:
                if msgs[j] >= 0:
                    k = ks[j]
                    if k < 0 or matched[chans[j]] <= k:
                        blocked[r] = ("arrival", msgs[j], outs[j] % R)
                        if k >= 0:
                            waiting.setdefault(chans[j] * kmax + k, []).append(r)
                        break
                if local_in_order:
                    j += 1
                    continue
                d = dep1s[j]
                if d < 0 or computed[d]:
                    d = dep2s[j]
                if d >= 0 and not computed[d]:
                    blocked[r] = ("compute", d, r)
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
            if is_local[o]:  # REDUCE_GRAD, STEP
                j += 1
                continue
            if not groups[j]:  # a lone send or receive: the common case, kept short
                if issued_upto[r] <= j:
                    ox = outs[j]
                    mine = issued[ox] + 1
                    issued[ox] = mine
                    theirs = issued[backs[j]]
                    c = chans[j]
                    done = mine if mine < theirs else theirs
                    while matched[c] < done:
                        if waiting:
                            for w in waiting.pop(c * kmax + matched[c], ()):
                                del blocked[w]
                                queue.append(w)
                        matched[c] += 1
                    issued_upto[r] = j + 1
                if is_send[o]:
                    if matched[chans[j]] <= ks[j]:
                        blocked[r] = ("match", msgs[j], outs[j] % R)
                        waiting.setdefault(chans[j] * kmax + ks[j], []).append(r)
                        break
                j += 1
                continue
            last = j + 1  # a batched exchange of two (validate allows no other group of transfers)
            if issued_upto[r] <= j:
                for x in range(j, last + 1):
                    issued[outs[x]] += 1
                    c = chans[x]
                    done = min(issued[outs[x]], issued[backs[x]])
                    while matched[c] < done:
                        for w in waiting.pop(c * kmax + matched[c], ()):
                            del blocked[w]
                            queue.append(w)
                        matched[c] += 1
                issued_upto[r] = last + 1
            stuck = -1  # its sends block until matched
            for x in range(j, last + 1):
                if is_send[ops[x]] and matched[chans[x]] <= ks[x]:
                    stuck = x
                    break
            if stuck >= 0:
                blocked[r] = ("match", msgs[stuck], outs[stuck] % R)
                waiting.setdefault(chans[stuck] * kmax + ks[stuck], []).append(r)
                j = stuck
                break
            j = last + 1
        pc[r] = j

    if pc == ends:
        return DryRun(True, ())
    waits = []
    for r in range(R):
        if pc[r] == ends[r]:
            continue
        event, key, peer = blocked[r]
        rest, mb = divmod(key, m)
        kind, stage = divmod(rest, S)
        if event == "compute":
            what = f"{OPCODES[COMPUTE_OF_KIND[kind]]} {mb} {stage}"
        else:
            what = f"the {MESSAGE_NOUNS[kind]} of micro-batch {mb} from stage {stage}"
        j = pc[r] - offsets[r]
        waits.append(Wait(r, j, _instr_at(prog, r, j), event, peer, what))
    return DryRun(False, tuple(waits))


def _instr_at(prog: Program, r: int, j: int) -> Instr:
    rp = prog.ranks[r]
    return Instr(OPCODES[int(rp.op[j])], int(rp.mb[j]), int(rp.stage[j]), int(rp.peer[j]), bool(rp.group[j]))


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
