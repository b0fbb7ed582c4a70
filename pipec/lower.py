"""Schedule to Program: explicit sends and receives around each rank's compute.

Placement (the rendezvous-safe order): the receives an op needs are posted
right after the previous compute step, before that step's sends, so a peer
blocked on a send always finds the matching receive posted once it reaches
its own previous step:

    RECV(op0)  C(op0)  RECV(op1)  SEND(op0)  C(op1)  RECV(op2)  SEND(op1) ...

A receive and a send with the same peer that end up adjacent are bound into
one batched exchange (Megatron's `send_forward_recv_backward`), which is
what keeps NCCL from the cross-node send-before-recv deadlock
(pytorch/pytorch#172668). Ops of one stage pair handed between stages on the
same rank need no instruction: the runtime keeps the tensor locally.
Built with numpy per rank: slot positions, one stable sort, masks.
"""

from __future__ import annotations

import numpy as np

from pipec.dryrun import dry_run
from pipec.ir import RankOps, Schedule
from pipec.program import (
    BWD,
    FWD,
    RECV_ACT,
    RECV_GRAD,
    REDUCE_GRAD,
    SEND_ACT,
    SEND_GRAD,
    STEP,
    WGRAD,
    Program,
    RankProgram,
)


def lower(sched: Schedule) -> Program:
    """One instruction stream per rank (the schedule must have passed `check_schedule`).

    The first placement posts each receive one step ahead. Where a send would still wait on a receive
    posted later (interleaved schedules, for example), a repairing dry run finds the latest point at
    which that receive must be posted and moves it there; `pipec.compiler` then proves the result
    with a strict dry run.
    """
    placement = np.asarray(sched.placement, dtype=np.int64)
    prog = _program(sched, tuple(_lower_rank(sched, r, ops, placement) for r, ops in enumerate(sched.ranks)))
    run = dry_run(prog, repair=True)
    if not run.hoists:
        return prog
    return _program(sched, _apply_hoists(prog, run.hoists))


def _program(sched: Schedule, ranks: tuple[RankProgram, ...]) -> Program:
    return Program(
        name=sched.name,
        params=sched.params,
        num_stages=sched.num_stages,
        num_ranks=sched.num_ranks,
        num_microbatches=sched.num_microbatches,
        split_backward=sched.split_backward,
        placement=sched.placement,
        ranks=ranks,
    )


def _apply_hoists(prog: Program, hoists) -> tuple[RankProgram, ...]:
    by_rank: dict[int, list[tuple[int, int]]] = {}
    for r, src, dst in hoists:
        by_rank.setdefault(r, []).append((src, dst))
    ranks = list(prog.ranks)
    for r, moves in by_rank.items():
        rp = ranks[r]
        n = len(rp)
        # Each instruction keeps its index as sort key, except moved receives: just before `dst`,
        # in their original order when several move to one point.
        key = np.arange(n, dtype=float)
        for src, dst in moves:
            key[src] = dst - 0.5 + src / (4.0 * n)
        order = np.argsort(key, kind="stable")
        # Batched exchanges are re-bound on the new order; compute pairs keep theirs.
        group = rp.group & ~np.isin(rp.op, (RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD))
        op, peer = rp.op[order], rp.peer[order]
        ranks[r] = RankProgram(op, rp.mb[order], rp.stage[order], peer, _bind_exchanges(op, peer, group[order]))
    return tuple(ranks)


def _bind_exchanges(code: np.ndarray, peer: np.ndarray, group: np.ndarray) -> np.ndarray:
    """Bind each receive to a directly following send with the same peer: one batched exchange."""
    group = group.copy()
    if len(code) > 1:
        is_recv = (code == RECV_ACT) | (code == RECV_GRAD)
        is_send = (code == SEND_ACT) | (code == SEND_GRAD)
        group[:-1] |= is_recv[:-1] & is_send[1:] & (peer[:-1] == peer[1:])
    return group


def _lower_rank(sched: Schedule, rank: int, ops: RankOps, placement: np.ndarray) -> RankProgram:
    S = sched.num_stages
    n = len(ops)
    kind, mb, stage = ops.kind, ops.mb, ops.stage
    # Step index: the two ops of an overlapped pair share a step.
    second = np.zeros(n, dtype=bool)
    second[1:] = ops.paired[:-1]
    step = np.cumsum(~second) - 1 if n else np.zeros(0, dtype=np.int64)

    is_f, is_b = kind == 0, kind == 1
    prev_owner = placement[np.maximum(stage - 1, 0)]
    next_owner = placement[np.minimum(stage + 1, S - 1)]
    recv_act = is_f & (stage > 0) & (prev_owner != rank)
    recv_grad = is_b & (stage < S - 1) & (next_owner != rank)
    send_act = is_f & (stage < S - 1) & (next_owner != rank)
    send_grad = is_b & (stage > 0) & (prev_owner != rank)

    compute_code = np.where(is_f, FWD, np.where(is_b, BWD, WGRAD))
    recv = recv_act | recv_grad
    send = send_act | send_grad
    recv_code = np.where(is_f, RECV_ACT, RECV_GRAD)
    send_code = np.where(is_f, SEND_ACT, SEND_GRAD)
    recv_peer = np.where(is_f, prev_owner, next_owner)
    send_peer = np.where(is_f, next_owner, prev_owner)
    idx = np.arange(n)

    # Position of each slot: C(step g) at 3g+1, its receives at 3g-1, its sends at 3g+3.
    pos = np.concatenate([3 * step[recv] - 1, 3 * step + 1, 3 * step[send] + 3])
    order_in = np.concatenate([idx[recv], idx, idx[send]])
    code = np.concatenate([recv_code[recv], compute_code, send_code[send]])
    peer = np.concatenate([recv_peer[recv], np.full(n, -1), send_peer[send]])
    src = np.concatenate([idx[recv], idx, idx[send]])
    order = np.lexsort((order_in, pos))
    code, peer, src = code[order], peer[order], src[order]
    out_mb, out_stage = mb[src], stage[src]

    group = np.zeros(len(code), dtype=bool)
    # Overlapped compute pairs.
    is_comp = (code == FWD) | (code == BWD) | (code == WGRAD)
    comp_pos = np.flatnonzero(is_comp)
    paired_src = ops.paired[src[comp_pos]]
    group[comp_pos[paired_src]] = True
    group = _bind_exchanges(code, peer, group)

    own = np.asarray(sched.stages_of(rank), dtype=np.int64)[::-1]
    tail_code = np.concatenate([np.full(len(own), REDUCE_GRAD), np.full(len(own), STEP)])
    tail_stage = np.concatenate([own, own])
    z = np.full(len(tail_code), -1)
    return RankProgram(
        op=np.concatenate([code, tail_code]).astype(np.int64),
        mb=np.concatenate([out_mb, z]).astype(np.int64),
        stage=np.concatenate([out_stage, tail_stage]).astype(np.int64),
        peer=np.concatenate([peer, z]).astype(np.int64),
        group=np.concatenate([group, np.zeros(len(tail_code), dtype=bool)]),
    )
