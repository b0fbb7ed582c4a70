"""Schedule to Program: explicit sends and receives around each rank's compute.

NCCL runs the point-to-point operations between two ranks in the order they
were issued, so both ranks must issue their messages to each other in one
order, or they hang (the cross-node send-before-recv deadlocks users hit in
torch, pytorch/pytorch#172668). The lowering makes that hold by
construction: it takes one dependency-respecting execution of the whole
schedule in rounds (`deadlock.global_order`: all ranks step together, one op
per round), gives every op and message a time in that execution, and places
each send and receive at its time on both ends, so each channel is ordered by
message time on both sides.

- A send goes right after the compute that produces it.
- A receive is posted at the receiving rank's point in that timeline when
  the message is sent: after its last op that ran earlier, so a sender that
  keeps to the timeline never waits, and always before the consuming
  compute (which ran later).
- A send and a receive with the same peer, side by side, form one batched
  exchange (one `batch_isend_irecv`, Megatron's `send_forward_recv_backward`).
- Stages on the same rank hand tensors over locally: no instruction.

`pipec.passes.dryrun` then proves the result under rendezvous sends. Built with
numpy per rank: slot keys, one sort, masks.
"""

from __future__ import annotations

import numpy as np

from pipec.opcodes import (
    COMPUTE_OF_KIND,
    HAS_SEND,
    IN_MSG,
    IN_STAGE,
    IS_COMPUTE,
    IS_P2P,
    OUT_PEER_STAGE,
    PRODUCER_KIND,
    RECV_OF_KIND,
    REDUCE_GRAD,
    SEND_OF_KIND,
    STEP,
    may_group,
)
from pipec.passes.deadlock import global_order
from pipec.passes.dryrun import DryRun, dry_run
from pipec.program import Program, RankProgram
from pipec.schedule import RankOps, Schedule


def lower(sched: Schedule) -> Program:
    """One instruction stream per rank (the schedule must have passed `check_schedule`)."""
    return lower_with_proof(sched)[0]


def lower_with_proof(sched: Schedule) -> tuple[Program, DryRun]:
    """The Program and a strict rendezvous dry run of it; E401 when the schedule itself deadlocks."""
    times = global_order(sched)
    S, m, K = sched.num_stages, sched.num_microbatches, len(sched.kinds)
    time_of = np.zeros(K * S * m, dtype=np.int64)  # op key -> completion time
    for ops, t in zip(sched.ranks, times):
        time_of[(ops.kind * S + ops.stage) * m + ops.mb] = t
    placement = np.asarray(sched.placement, dtype=np.int64)
    ranks = tuple(
        _lower_rank(sched, r, ops, t, time_of, placement) for r, (ops, t) in enumerate(zip(sched.ranks, times))
    )
    prog = Program(
        name=sched.name,
        params=sched.params,
        num_stages=S,
        num_ranks=sched.num_ranks,
        num_microbatches=m,
        split_backward=sched.split_backward,
        placement=sched.placement,
        ranks=ranks,
    )
    return prog, dry_run(prog, witness=time_of)  # the order above, checked against every rule


def _lower_rank(
    sched: Schedule, rank: int, ops: RankOps, times: np.ndarray, time_of: np.ndarray, placement: np.ndarray
) -> RankProgram:
    S, m = sched.num_stages, sched.num_microbatches
    n = len(ops)
    kind, mb, stage = ops.kind, ops.mb, ops.stage
    # Step index: the two ops of an overlapped pair share a step.
    second = np.zeros(n, dtype=bool)
    second[1:] = ops.paired[:-1]
    step = np.cumsum(~second) - 1

    # What each op receives and sends, from the instruction table: its input comes from stage
    # s + IN_STAGE, its output goes to s + OUT_PEER_STAGE; a neighbour on this rank is a local hand-off.
    src, dst = stage + IN_STAGE[kind], stage + OUT_PEER_STAGE[kind]
    src_owner, dst_owner = placement[np.clip(src, 0, S - 1)], placement[np.clip(dst, 0, S - 1)]
    recv = (RECV_OF_KIND[kind] >= 0) & (src >= 0) & (src < S) & (src_owner != rank)
    send = HAS_SEND[kind] & (dst >= 0) & (dst < S) & (dst_owner != rank)
    recv_peer, send_peer = src_owner, dst_owner
    # A message's time: when its producer completes (the producer of B(i,s)'s gradient is B(i,s+1)).
    producer = PRODUCER_KIND[np.maximum(IN_MSG[kind], 0)]
    recv_time = time_of[(producer * S + np.clip(src, 0, S - 1)) * m + mb]

    # Slot keys (primary, secondary): compute of step g at 4g+1 and its sends at 4g+2, both after their
    # time; a receive of a message produced at time t right after this rank's last op before t.
    r_idx, s_idx = np.flatnonzero(recv), np.flatnonzero(send)
    before = np.searchsorted(times, recv_time[r_idx]) - 1
    recv_primary = np.where(before >= 0, 4 * step[np.maximum(before, 0)] + 2, -1)
    recv_code = RECV_OF_KIND[kind[r_idx]]
    send_code = SEND_OF_KIND[kind[s_idx]]
    compute_code = COMPUTE_OF_KIND[kind]
    primary = np.concatenate([recv_primary, 4 * step + 1, 4 * step[s_idx] + 2])
    secondary = np.concatenate([recv_time[r_idx], times, times[s_idx]])
    code = np.concatenate([recv_code, compute_code, send_code])
    peer = np.concatenate([recv_peer[r_idx], np.full(n, -1), send_peer[s_idx]])
    src = np.concatenate([r_idx, np.arange(n), s_idx])
    order = np.lexsort((secondary, primary))
    code, peer, src = code[order], peer[order], src[order]

    group = np.zeros(len(code), dtype=bool)
    comp = np.flatnonzero(IS_COMPUTE[code])
    group[comp] = ops.paired[src[comp]]  # overlapped compute pairs
    group = _bind_exchanges(code, peer, group)

    own = np.asarray(sched.stages_of(rank), dtype=np.int64)[::-1]
    tail = np.concatenate([np.full(len(own), REDUCE_GRAD), np.full(len(own), STEP)])
    z = np.full(len(tail), -1)
    return RankProgram(
        op=np.concatenate([code, tail]).astype(np.int64),
        mb=np.concatenate([mb[src], z]).astype(np.int64),
        stage=np.concatenate([stage[src], own, own]).astype(np.int64),
        peer=np.concatenate([peer, z]).astype(np.int64),
        group=np.concatenate([group, np.zeros(len(tail), dtype=bool)]),
    )


def _bind_exchanges(code: np.ndarray, peer: np.ndarray, group: np.ndarray) -> np.ndarray:
    """A send and a receive with the same peer, side by side, become one batched exchange (the table's
    exchange group)."""
    comm = IS_P2P[code]
    pair = comm[:-1] & comm[1:] & may_group(code[:-1], code[1:], peer[:-1], peer[1:])
    taken = -2
    for j in np.flatnonzero(pair).tolist():
        if j > taken + 1:  # never chain three into one group
            group[j] = True
            taken = j
    return group
