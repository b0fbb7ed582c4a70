"""An exact dry run of a Program under rendezvous sends: the strictest NCCL behaviour.

A send completes only once the peer has posted the matching receive; posting a
receive never blocks; a compute waits until its remote inputs have arrived (a
send completed) and its local inputs were computed. Within a batched group
every receive is posted before any send waits. A Program that finishes under
these rules finishes under any buffering. Event-driven: each instruction is
visited once and a blocked rank sleeps until the event it waits for.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pipec.program import (
    BWD,
    FWD,
    OPCODES,
    RECV_ACT,
    RECV_GRAD,
    SEND_ACT,
    SEND_GRAD,
    WGRAD,
    Instr,
    Program,
)


@dataclass(frozen=True)
class Wait:
    """A rank stuck at an instruction, waiting for `event` ("post", "arrival" or "compute") from `peer`."""

    rank: int
    index: int
    instr: Instr
    event: str
    peer: int
    what: str  # human description of the awaited message or op


@dataclass(frozen=True)
class DryRun:
    completed: bool
    waits: tuple[Wait, ...]  # for each stuck rank, what it waits on (empty when completed)
    hoists: tuple[tuple[int, int, int], ...] = ()  # (rank, receive index, post it before this index)


def dry_run(prog: Program, repair: bool = False) -> DryRun:
    """Run the Program; with `repair`, when every rank is stuck, post the receives that blocked sends
    wait for at the receiving rank's current position (as late as possible) and go on, returning those
    moves for the lowering to apply."""
    S, m = prog.num_stages, prog.num_microbatches
    placement = prog.placement
    R = prog.num_ranks
    cols = [
        (rp.op.tolist(), rp.mb.tolist(), rp.stage.tolist(), rp.peer.tolist(), rp.group.tolist()) for rp in prog.ranks
    ]
    ends = [len(c[0]) for c in cols]
    pc = [0] * R
    posted: set[int] = set()
    arrived: set[int] = set()
    computed: set[int] = set()
    waiters: dict[tuple[int, int], list[int]] = {}
    blocked: dict[int, tuple[str, int, int]] = {}  # rank -> (event, key, peer)
    group_posted = [-1] * R  # index of the group whose receives are already posted

    def msg(kind: int, mb: int, send_stage: int) -> int:
        return (kind * S + send_stage) * m + mb

    def comp(k: int, mb: int, stage: int) -> int:
        return (k * S + stage) * m + mb

    def wake(event: int, key: int, queue: deque) -> None:
        for r in waiters.pop((event, key), ()):
            blocked.pop(r, None)
            queue.append(r)

    POST, ARRIVE, DONE = 0, 1, 2
    queue = deque(range(R))
    hoists: list[tuple[int, int, int]] = []
    recv_at: dict[int, tuple[int, int]] | None = None
    while True:
        if not queue:
            if not repair or not blocked:
                break
            if recv_at is None:
                recv_at = _receive_index(cols, msg)
            for _, (event, key, peer) in sorted(blocked.items()):
                if event != "post" or key in posted or key not in recv_at:
                    continue
                owner, index = recv_at[key]
                if owner != peer or index < pc[peer]:
                    continue
                start = pc[peer]
                while start > 0 and cols[peer][4][start - 1]:
                    start -= 1
                hoists.append((peer, index, start))
                posted.add(key)
                wake(POST, key, queue)
            if not queue:
                break
            continue
        r = queue.popleft()
        ops, mbs, stages, peers, groups = cols[r]
        j, end = pc[r], ends[r]
        while j < end:
            o = ops[j]
            # At the start of a batched group, post all of its receives first.
            if groups[j] and group_posted[r] < j and (j == 0 or not groups[j - 1]):
                g = j
                while True:
                    if ops[g] == RECV_ACT or ops[g] == RECV_GRAD:
                        key = msg(0, mbs[g], stages[g] - 1) if ops[g] == RECV_ACT else msg(1, mbs[g], stages[g] + 1)
                        posted.add(key)
                        wake(POST, key, queue)
                    if not groups[g]:
                        break
                    g += 1
                group_posted[r] = j
            mb, s = mbs[j], stages[j]
            if o == RECV_ACT or o == RECV_GRAD:
                key = msg(0, mb, s - 1) if o == RECV_ACT else msg(1, mb, s + 1)
                if key not in posted:
                    posted.add(key)
                    wake(POST, key, queue)
            elif o == SEND_ACT or o == SEND_GRAD:
                key = msg(0 if o == SEND_ACT else 1, mb, s)
                if key not in posted:
                    blocked[r] = ("post", key, peers[j])
                    waiters.setdefault((POST, key), []).append(r)
                    break
                arrived.add(key)
                wake(ARRIVE, key, queue)
            elif o == FWD or o == BWD or o == WGRAD:
                need = None
                if o == FWD and s > 0:
                    need = (msg(0, mb, s - 1), comp(0, mb, s - 1), placement[s - 1])
                elif o == BWD and s < S - 1:
                    need = (msg(1, mb, s + 1), comp(1, mb, s + 1), placement[s + 1])
                if need is not None:
                    mkey, ckey, owner = need
                    if owner == r:
                        if ckey not in computed:
                            blocked[r] = ("compute", ckey, r)
                            waiters.setdefault((DONE, ckey), []).append(r)
                            break
                    elif mkey not in arrived:
                        blocked[r] = ("arrival", mkey, owner)
                        waiters.setdefault((ARRIVE, mkey), []).append(r)
                        break
                local = None
                if o == BWD:
                    local = comp(0, mb, s)
                elif o == WGRAD:
                    local = comp(1, mb, s)
                if local is not None and local not in computed:
                    blocked[r] = ("compute", local, r)
                    waiters.setdefault((DONE, local), []).append(r)
                    break
                key = comp(o, mb, s)
                computed.add(key)
                wake(DONE, key, queue)
            j += 1
        pc[r] = j

    if all(pc[r] == ends[r] for r in range(R)):
        return DryRun(True, (), tuple(hoists))
    waits = []
    for r in range(R):
        if pc[r] == ends[r]:
            continue
        event, key, peer = blocked[r]
        rest, mb = divmod(key, m)
        kind, stage = divmod(rest, S)
        if event == "compute":
            what = f"{('FWD', 'BWD', 'WGRAD')[kind]} {mb} {stage}"
        else:
            what = f"the {'activation' if kind == 0 else 'gradient'} of micro-batch {mb} from stage {stage}"
        instr = _instr_at(prog, r, pc[r])
        waits.append(Wait(r, pc[r], instr, event, peer, what))
    return DryRun(False, tuple(waits), tuple(hoists))


def _receive_index(cols, msg) -> dict[int, tuple[int, int]]:
    """Message key -> (rank, index) of the receive instruction that posts it."""
    out = {}
    for r, (ops, mbs, stages, _, _) in enumerate(cols):
        for j, o in enumerate(ops):
            if o == RECV_ACT:
                out[msg(0, mbs[j], stages[j] - 1)] = (r, j)
            elif o == RECV_GRAD:
                out[msg(1, mbs[j], stages[j] + 1)] = (r, j)
    return out


def _instr_at(prog: Program, r: int, j: int) -> Instr:
    rp = prog.ranks[r]
    return Instr(OPCODES[int(rp.op[j])], int(rp.mb[j]), int(rp.stage[j]), int(rp.peer[j]), bool(rp.group[j]))
