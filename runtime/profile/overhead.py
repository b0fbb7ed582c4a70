"""The cost file's `overhead`: what one send or receive instruction costs a rank in pipec's own executor.

The simulator charges `overhead` (LogP's o) to the rank for each SEND and each RECV instruction, and
nothing else between two compute ops. So it is measured as it is charged: two gloo processes (as
`pipec profile`'s link measurement starts them, bound like a run's ranks) run a GPipe Program through
`Runner`, the runtime's executor, on a model whose stages only keep the CPU busy for set times and pass
on a message of the profiled size. The executor's trace gives, between consecutive compute ops of a
rank, the time not spent computing, and the Program the send and receive instructions in between. Only
gaps whose consumed message had been sent well before count (no waiting in them), each divided by its
instructions; o is the mean over gaps of sends only, averaged with that over gaps of receives only. It
covers everything the executor does for a transfer: the instruction loop, posting receives (and the
next ones ahead), checking shapes, issuing the send, the wait call. `pipec profile --in-situ` applies the
same estimate to steps of the profiled schedule on the model itself (pipec.runtime.profile.insitu).

The stages are lopsided so that the receiving side is always behind: stage 0's forward is short and its
backward long, stage 1 the other way round, so activations and gradients arrive before they are needed.

Message delivery lives here too (`deliveries`: send to receive done, for receivers that were waiting), since
both of its users time runs of the runtime: the same GPipe run with the lopsidedness reversed gives the
link's latency and bandwidth on the transport runs take (`delivery`, for pipec.runtime.profile.links), and
`pipec profile --in-situ` reads the schedule's own runs with it.
"""

from __future__ import annotations

import statistics
import time

import torch

# a message's sender must have sent it this long before the gap began for the gap to count as no-wait
EARLY = 2e-4
# more than this per instruction is a stall (the scheduler, a late transport thread), not an overhead
STALL = 1e-3


def _spin(seconds: float) -> None:
    a = torch.ones(64, 64, dtype=torch.float64)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a


class _Spin(torch.autograd.Function):
    """y = x * w, with a forward and a backward that take set times."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, fwd: float, bwd: float) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.bwd = bwd
        _spin(fwd)
        return x * w

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w = ctx.saved_tensors
        _spin(ctx.bwd)
        return g * w, (g * x).sum().reshape(w.shape), None, None


class Busy(torch.nn.Module):
    def __init__(self, fwd: float, bwd: float) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones((), dtype=torch.float64))
        self.fwd, self.bwd = fwd, bwd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Spin.apply(x, self.w, self.fwd, self.bwd)


def instruction_overhead(rank: int, nbytes: int, reps: int, gap: float, steps: int = 3) -> float | None:
    """Run on both ranks of an initialised 2-process gloo group; rank 0 gets o in seconds (None if no gap
    qualified), rank 1 None. `reps` micro-batches of `nbytes` per message, `gap` seconds per short op."""
    program, tl = _gpipe_run(rank, nbytes, reps, gap, steps, receiver_behind=True)
    return None if tl is None else per_instruction(program, [tl])


def delivery(rank: int, nbytes: int, reps: int, gap: float, steps: int = 3) -> dict | None:
    """Message delivery on the transport a run uses between two local ranks (shared memory where
    `pipec run` would take it, else gloo): the same GPipe run with the stages' lopsidedness reversed, so that
    every receiver waits, and then, on rank 0, `deliveries` of its step: the
    median time from a send to its receive's completion. Why not a gloo ping-pong: runs between local
    ranks go through shared memory, whose delivery is a fraction of loopback TCP's (docs/runtime.md)."""
    _, tl = _gpipe_run(rank, nbytes, reps, gap, steps, receiver_behind=False)
    return None if tl is None else deliveries([tl])


def _gpipe_run(rank: int, nbytes: int, reps: int, gap: float, steps: int, receiver_behind: bool):
    """GPipe p=2 through the runtime's `Runner` on Busy stages (m = `reps` micro-batches, one message of
    `nbytes` each); (Program, the last step's measured Timeline) on rank 0, (Program, None) on rank 1.
    `receiver_behind`: each message arrives before its receiver needs it (the overhead's gaps hold no wait);
    otherwise each receiver waits for its message (a delivery)."""
    import torch.distributed as dist

    from pipec.driver import build
    from pipec.frontend import library
    from pipec.passes.compiler import compile_schedule
    from pipec.runtime.exec.measure import timeline
    from pipec.runtime.runner import Runner, StageOptions

    m = max(2, reps)
    program = compile_schedule(build(library.read("gpipe"), [("p", 2), ("m", m)])).program
    short, long = (gap, 2 * gap) if receiver_behind else (2 * gap, gap)

    def build_stage(stage: int, num_stages: int) -> torch.nn.Module:
        return Busy(short, long) if stage == 0 else Busy(long, short)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return out.sum()

    runner = Runner(program, build_stage, loss_fn, rank=rank, options=StageOptions(dtype=torch.float64))
    batch = torch.ones(m, max(1, nbytes // 8), dtype=torch.float64)  # one row per micro-batch: one message
    for step in range(steps):  # the first step does the shape handshake and the first allocations
        runner.step(batch, batch, record=step == steps - 1)
    events: list = [None, None]
    dist.all_gather_object(events, runner.events())
    del runner
    return program, (timeline(program, events) if rank == 0 else None)


def per_instruction(program, timelines, stall: float = STALL) -> float | None:
    """o from measured steps (Timelines of `program`): the mean time per instruction of the gaps holding
    only sends, and of those holding only receives, averaged (the simulator charges o to each end of a
    message, so their sum per message is what counts). Only gaps whose consumed message, if any, was sent
    EARLY before the gap began count, and none over `stall` per instruction (a stall, not an overhead; with
    `stall` infinite the stalls count too: where ranks share cores a sender's stall after waking its peer
    is part of every send's expected cost, docs/runtime.md)."""
    sends, recvs = [], []
    for tl in timelines:
        for kind, per in no_wait_gaps(program, tl):
            if per < stall:
                (sends if kind == "send" else recvs).append(per)
    parts = [statistics.fmean(x) for x in (sends, recvs) if x]
    return statistics.fmean(parts) if parts else None


def no_wait_gaps(program, tl) -> list[tuple[str, float]]:
    """("send" or "recv", gap per instruction) for the gaps between consecutive compute ops of a rank that
    hold only sends or only receives and whose consumed message (if any) was sent EARLY before the gap."""
    from pipec.ir.opcodes import IS_COMPUTE, IS_P2P, IS_SEND, NEEDS_MSG, NEEDS_STAGE

    keys = zip(tl.msg_kind.tolist(), tl.msg_mb.tolist(), tl.msg_stage.tolist())
    sent = dict(zip(keys, tl.msg_send.tolist()))
    out = []
    for r in range(program.num_ranks):
        between: list[int] = []
        held = []  # the send and receive instructions before each compute op, since the previous one
        for op in program.ranks[r].op.tolist():
            if IS_COMPUTE[op]:
                held.append(between)
                between = []
            elif IS_P2P[op]:
                between.append(op)
        mine = sorted((i for i in range(len(tl.op)) if int(tl.rank[i]) == r), key=lambda i: float(tl.start[i]))
        for k in range(1, len(mine)):
            prev, cur, ops = mine[k - 1], mine[k], held[k]
            kinds = {"send" if IS_SEND[op] else "recv" for op in ops}
            if len(kinds) != 1:
                continue
            op, mb, s = int(tl.op[cur]), int(tl.mb[cur]), int(tl.stage[cur])
            # the message it consumes (the instruction table's `needs`), if any
            key = (int(NEEDS_MSG[op]), mb, s + int(NEEDS_STAGE[op])) if NEEDS_MSG[op] >= 0 else None
            if key in sent and sent[key] > float(tl.end[prev]) - EARLY:
                continue  # it may have waited for its message
            out.append((kinds.pop(), (float(tl.start[cur]) - float(tl.end[prev])) / len(ops)))
    return out


def deliveries(timelines: list) -> dict | None:
    """Message delivery as it happens in the run: for each message whose receiver had nothing left to
    compute when it was sent (its last compute op before the message's arrival ended before the send, so it
    was waiting), the time from the send to the receive's completion. An idle ping-pong between two
    processes leaves out what a run's ranks add (their gloo threads and the executor sharing the CPUs
    with the compute of other ranks); these are the simulator's `latency` in a run. {"median_s",
    "bytes": the median message's bytes, "count"}; None without any such message."""
    import numpy as np

    samples, sizes = [], []
    for tl in timelines:
        for r in range(tl.num_ranks):
            ends = np.sort(tl.end[tl.rank == r])
            mine = np.flatnonzero(tl.msg_dst == r)
            if not len(mine):
                continue
            send, arrival = tl.msg_send[mine], tl.msg_arrival[mine]
            before = np.searchsorted(ends, arrival, side="right") - 1  # its last compute ending by the arrival
            busy_until = np.where(before >= 0, ends[np.maximum(before, 0)], -np.inf)
            waiting = (busy_until <= send) & (arrival > send)
            samples += (arrival - send)[waiting].tolist()
            sizes += tl.msg_bytes[mine][waiting].tolist()
    if not samples:
        return None
    return {"median_s": statistics.median(samples), "bytes": statistics.median(sizes), "count": len(samples)}
