"""Expert parallelism's all-to-alls: the expert group, the dispatch and combine of an MoE layer's tokens,
and every check and emulated delay on them.

The expert group (pipec.ir.experts says why it is folded into "dp"): `size` consecutive data-parallel
replicas of one pipeline rank, each holding `num / size` experts of every MoE layer. An experts module
(pipec.runtime.model.moe finds and shards them) is called with the tokens grouped by expert and the count
of each; `ExpertGroup.forward` then

1. dispatches the tokens to the ranks holding their experts: the token counts per expert first (an
   all-to-all of int64: the receivers size their buffers from them, as torchtitan's and Megatron-LM's
   token dispatchers do), then the rows, as soon as the counts have arrived;
2. runs the local experts on what arrived, regrouped by local expert;
3. combines: sends each result back where its token came from (the reverse all-to-all).

1 and 3 are `AllToAll`, an autograd Function whose backward is the reverse all-to-all of the gradient (its
sizes known from the forward, so without counts), so the backward of an MoE layer issues two all-to-alls as
well, in reverse order (on the thread that calls backward: for CPU tensors autograd runs the graph on the
calling thread). These are the all-to-alls that pipec.ir.experts.all_to_alls counts, pair_order orders and
a2a_latencies times (a dispatch: two latencies, its counts and its rows).

Each all-to-all goes through `ExpertGroup.exchange`, which

- counts it against the op that issues it (`running`: the executor names the instruction, its stage and
  how many all-to-alls its kind and the stage's MoE layers imply); one too many is an error naming the
  rank, instruction and stage, and so is one too few when the op ends;
- hands it to the group's transfer thread (`_submit`: one thread, so the group's collectives go out in the
  order the ops issue them, the same on every member), which sends a dispatch's counts, waits for them and
  sends the rows, so a dispatch's second message never waits for its op's turn;
- prefixes each destination's rows (and a dispatch's counts) with a header (step, instruction index,
  all-to-all number, stage, opcode, emulated arrival time, rows) and checks the headers it receives: a
  peer of the expert group that issued a different all-to-all at this place (a model whose layers differ
  between replicas, a Program that differs) is an error naming both ranks and both instructions, instead
  of mixed-up tokens;
- with an overlapped pair (`running(..., baton=...)`), hands the baton to the pair's other op right after
  issuing and waits for its turn before waiting on the transfer (pipec.runtime.exec.pairs);
- waits with the run's timeout, and an error naming the rank and the instruction;
- with an emulated expert link (pipec.runtime.exec.links, `Links.replica`), holds the result until the
  slowest source's emulated arrival: issue (or when the wire to that peer is free again) + bytes /
  bandwidth + latency, as `EmulatedComm` does for pipeline messages; a dispatch's rows leave when its
  counts arrive (issue + latency), so a dispatch takes two latencies.

Header rows travel in the payload's dtype, so only float32 and float64 payloads are supported (the time
stamp is cut in a whole and a fractional part so float32 keeps it to a microsecond).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from pipec.runtime.errors import CollectiveError, PipelineError

HEADER = 8  # values: step, instruction, all-to-all number, stage, opcode, arrival (whole, fraction), rows
DTYPES = (torch.float32, torch.float64)


@dataclass
class OpRun:
    """The op (one compute instruction) a thread is running: what its all-to-alls are counted against."""

    index: int  # instruction index in the rank's stream
    label: str  # the instruction as text, e.g. `FWD 3 1`
    stage: int
    opcode: int
    expected: int  # all-to-alls its kind and its stage's MoE layers imply (pipec.ir.experts.all_to_alls)
    baton: Any = None  # pipec.runtime.exec.pairs.Baton when it runs in an overlapped pair
    slot: int = 0  # its place in the pair (0: the first op)
    count: int = 0  # all-to-alls issued so far
    mb: int = -1  # its micro-batch (for the measured record)


@dataclass(frozen=True)
class Tag:
    """One all-to-all as its op issued it: what the transfer thread needs to name, check and time it."""

    op: OpRun | None
    number: int  # its place among its op's all-to-alls (-1: outside an op)
    what: str
    issued: float  # time.monotonic(): the emulated link's clock
    perf: float  # time.perf_counter(): the measured events' clock


class ExpertGroup:
    """This rank's expert group: the process group of its `size` members (consecutive "dp" replicas of one
    pipeline rank), its place in it, and the state of the all-to-alls in flight.

    `rank`, `dp_rank` and `where()` name this process in errors; `members` are the job ranks of the group
    (in group order); `link`: per (source, destination) member pair the emulated (latency s, bandwidth
    bytes/s) or None (pipec.runtime.exec.links.Links.replica, the replicas' datacenters)."""

    def __init__(
        self,
        pg: Any,
        members: list[int],
        index: int,
        *,
        rank: int,
        dp_rank: int,
        timeout: float,
        where: Callable[[], str],
        link: tuple[tuple[tuple[float, float] | None, ...], ...] | None = None,
    ) -> None:
        self.pg, self.members, self.index, self.size = pg, members, index, len(members)
        self.rank, self.dp_rank, self.timeout, self.where = rank, dp_rank, timeout, where
        self.link = link
        self.free: dict[int, float] = {}  # per destination member: when the emulated wire to it is free
        self.local = threading.local()
        self.step = 0
        # the executor's measured events of this step, when recording: ("alltoall", opcode, mb, stage, number,
        # issued, done, bytes sent, the transfer thread's CPU) per all-to-all, on time.perf_counter() like the
        # others (exec/measure.py)
        self.record: list[tuple] | None = None
        self.pool: ThreadPoolExecutor | None = None  # the transfer thread (`_submit`)

    # ---- which op is running on this thread -----------------------------------------------------
    @contextmanager
    def running(self, op: OpRun) -> Iterator[OpRun]:
        """Count the all-to-alls of `op` on this thread while it runs; error when they fall short."""
        prev = getattr(self.local, "op", None)
        self.local.op = op
        try:
            yield op
        finally:
            self.local.op = prev
        if op.count != op.expected:
            raise PipelineError(
                f"{self._who(op)} issued {op.count} all-to-all(s), but its stage's MoE layers imply {op.expected} "
                "(does the model call its experts a different number of times than it has MoE layers?)"
            )

    def _op(self) -> OpRun | None:
        return getattr(self.local, "op", None)

    def _who(self, op: OpRun | None) -> str:
        me = (
            f"pipeline rank {self.rank}, replica {self.dp_rank} (job rank {self.members[self.index]}, member "
            f"{self.index} of its expert group)"
        )
        if op is None:
            return f"{me} at {self.where()}"
        return f"{me} at step {self.step + 1}, instruction #{op.index} `{op.label}` (stage {op.stage})"

    def _fail(self, what: str, op: OpRun | None, e: BaseException) -> CollectiveError:
        from pipec.runtime.exec.comm import short_error

        msg = short_error(e, self.timeout)
        peers = [m for i, m in enumerate(self.members) if i != self.index]
        return CollectiveError(f"{self._who(op)}: {what} failed: {msg}", peers)

    def _wait(self, work: Any, what: str, op: OpRun | None) -> None:
        try:
            work.wait(timedelta(seconds=self.timeout))
        except Exception as e:
            raise self._fail(what, op, e) from e

    # ---- the MoE layer's forward through the group ----------------------------------------------
    def forward(self, local: Callable[[torch.Tensor, list[int]], torch.Tensor], tokens: torch.Tensor, counts: Any):
        """An experts module's forward under expert parallelism: `tokens` grouped by (global) expert with
        `counts` per expert; `local(tokens, counts)` the module's own forward over the experts it holds."""
        counts = [int(c) for c in (counts.tolist() if isinstance(counts, torch.Tensor) else counts)]
        n = self.size
        if len(counts) % n:
            raise PipelineError(f"{self._who(self._op())}: {len(counts)} expert counts do not split over {n} ranks")
        held = len(counts) // n
        send_counts = [counts[i * held : (i + 1) * held] for i in range(n)]  # [destination][its expert]
        box: dict[str, Any] = {}
        got = AllToAll.apply(tokens, self, send_counts, None, "dispatch", box)  # rows grouped [source][expert]
        recv_counts = torch.tensor(box["counts"], dtype=torch.int64)  # [source, my expert]
        # regroup by my expert ([expert][source]), run them, and put the rows back
        order = _regroup(recv_counts).to(tokens.device)
        out = local(got[order], recv_counts.sum(0).tolist())
        back = torch.empty_like(out).index_copy(0, order, out) if len(order) else out
        return AllToAll.apply(back, self, box["recv"], [sum(c) for c in send_counts], "combine", None)

    # ---- one all-to-all ---------------------------------------------------------------------------
    def exchange(
        self, x: torch.Tensor, send: list[int], recv: list[int] | None, what: str, counts: list[list[int]] | None = None
    ) -> tuple[torch.Tensor, list[int], list[list[int]] | None]:
        """Rows of `x` (send[i] to member i) to their destinations: the rows received (recv[i] from i), `recv`,
        and None. A dispatch (`recv` None, `counts[i]` the rows for each expert of member i) first exchanges
        the counts: it returns the rows, the rows from each member and the counts [member][my expert]."""
        op = self._op()
        if x.dtype not in DTYPES:
            raise PipelineError(
                f"{self._who(op)}: expert parallelism sends float32 or float64 tokens, got {x.dtype} ({what})"
            )
        if op is not None:
            if op.count >= op.expected:
                raise PipelineError(
                    f"{self._who(op)} issues all-to-all #{op.count + 1} ({what}), but its stage's MoE layers imply "
                    f"{op.expected} for this instruction"
                )
            number = op.count
            op.count += 1
        else:
            number = -1
        x = x.reshape(x.shape[0], -1).contiguous()
        if not x.shape[1]:
            raise PipelineError(f"{self._who(op)}: cannot send tokens of width 0 ({what})")
        tag = Tag(op, number, what, time.monotonic(), time.perf_counter())
        job = self._submit(lambda: self._transfer(x, send, recv, counts, tag))
        if op is not None and op.baton is not None:  # the pair's other op computes while this one travels
            op.baton.handoff(op.slot)
        try:
            out, recv, got_counts, latest, cpu = job.result(timeout=3 * self.timeout + 5.0)
        except PipelineError:
            raise
        except Exception as e:
            raise self._fail(f"the {what} all-to-all", op, e) from e
        self._hold(latest, op, what)
        if self.record is not None:
            width = x.shape[1]
            sent = (sum(send) - (send[self.index] if self.index < len(send) else 0)) * width * x.element_size()
            mb = op.mb if op is not None else -1
            opcode, stage = (op.opcode, op.stage) if op is not None else (-1, -1)
            self.record.append(("alltoall", opcode, mb, stage, number, tag.perf, time.perf_counter(), sent, cpu))
        return out, recv, got_counts

    def _submit(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the group's transfer thread: one thread, first in first out, so the group's collectives
        go out in the order the ops issue them (the pair's order: the same on every member)."""
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipec-a2a")
        return self.pool.submit(fn)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None

    def _transfer(
        self, x: torch.Tensor, send: list[int], recv: list[int] | None, counts: list[list[int]] | None, tag: Tag
    ) -> tuple[torch.Tensor, list[int], list[list[int]] | None, float, float]:
        """On the transfer thread: (a dispatch's counts first, then) the rows' all-to-all; the rows received,
        the rows from each member, the counts received, the latest emulated arrival (0: none), and the CPU
        this thread spent on it (the op's, for the in-situ profile: pipec.runtime.profile.insitu)."""
        c0 = time.thread_time()
        op, number, what = tag.op, tag.number, tag.what
        width = x.shape[1]
        depart = tag.issued
        got_counts = None
        if recv is None:  # a dispatch: the receivers size their buffers from the counts
            assert counts is not None
            got_counts, depart = self._counts(counts, tag, x.device)
            recv = [sum(c) for c in got_counts]
        rows = max(1, math.ceil(HEADER / width))
        arrival = self._arrivals(depart, send, width * x.element_size())
        opcode = op.opcode if op is not None else -1
        index = op.index if op is not None else -1
        stage = op.stage if op is not None else -1
        parts, at = [], 0
        for i, k in enumerate(send):
            head = torch.zeros(rows * width, dtype=x.dtype, device=x.device)
            t = arrival[i]
            whole = math.floor(t)
            head[:HEADER] = torch.tensor(
                [self.step, index, number, stage, opcode, whole, t - whole, k], dtype=x.dtype
            ).to(x.device)  # rows * width >= HEADER
            parts += [head.view(rows, width), x[at : at + k]]
            at += k
        buf = torch.cat(parts)
        out = torch.empty(sum(recv) + rows * self.size, width, dtype=x.dtype, device=x.device)
        try:
            work = torch.distributed.all_to_all_single(
                out,
                buf,
                output_split_sizes=[r + rows for r in recv],
                input_split_sizes=[s + rows for s in send],
                group=self.pg,
                async_op=True,
            )
        except Exception as e:
            raise self._fail(f"issuing the {what} all-to-all", op, e) from e
        self._wait(work, f"the {what} all-to-all", op)
        pieces, at, latest = [], 0, 0.0
        for i, r in enumerate(recv):
            head = out[at : at + rows].reshape(-1)[:HEADER].tolist()
            self._check(head, i, op, number, what)
            latest = max(latest, head[5] + head[6])
            pieces.append(out[at + rows : at + rows + r])
            at += rows + r
        return torch.cat(pieces), recv, got_counts, latest, time.thread_time() - c0

    def _counts(self, counts: list[list[int]], tag: Tag, device: torch.device) -> tuple[list[list[int]], float]:
        """A dispatch's first all-to-all: the rows for each expert, per member, with the step, instruction and
        all-to-all number (checked as the rows' headers are) and the emulated arrival, in nanoseconds. Returns
        the counts received [member][my expert] and when the last of them arrives (emulated; `tag.issued`
        without an emulated link): the rows leave then, as the receivers size their buffers from the counts."""
        op, number, what = tag.op, tag.number, tag.what
        n, held = self.size, len(counts[0])
        index, stage = (op.index, op.stage) if op is not None else (-1, -1)
        send = torch.zeros(n, held + 5, dtype=torch.int64)
        for i in range(n):
            hop = self.link[self.index][i] if self.link is not None and i != self.index else None
            arrive = round((tag.issued + hop[0]) * 1e9) if hop is not None else 0
            send[i] = torch.tensor([*counts[i], self.step, index, number, stage, arrive])
        got = torch.empty_like(send).to(device)
        try:
            work = torch.distributed.all_to_all_single(got, send.to(device), group=self.pg, async_op=True)
        except Exception as e:
            raise self._fail(f"issuing the {what} counts' all-to-all", op, e) from e
        self._wait(work, f"the {what} counts' all-to-all", op)
        rows = got.cpu().tolist()
        for i, r in enumerate(rows):
            self._check([r[held], r[held + 1], r[held + 2], r[held + 3]], i, op, number, f"{what} counts")
        last = max((r[held + 4] for r in rows), default=0) / 1e9
        return [r[:held] for r in rows], max(tag.issued, last)

    def _arrivals(self, now: float, send: list[int], row_bytes: int) -> list[float]:
        """Per destination member: the emulated arrival of its rows (0 where its link is not emulated), sent
        at `now` or when the wire to it is free; on the transfer thread only (it owns `free`). The thread
        takes the all-to-alls in issue order, so each arrives after the rows sent before it, as messages on
        one channel of the simulator's do (pipec.sim.machine)."""
        out = [0.0] * self.size
        if self.link is None:
            return out
        for i, k in enumerate(send):
            hop = self.link[self.index][i]
            if i == self.index or hop is None:
                continue
            lat, bw = hop
            start = max(now, self.free.get(i, 0.0))
            end = start + k * row_bytes / bw
            self.free[i] = end
            out[i] = end + lat
        return out

    def _check(self, head: list[float], src: int, op: OpRun | None, number: int, what: str) -> None:
        mine = (self.step, op.index if op is not None else -1, number)
        theirs = (int(head[0]), int(head[1]), int(head[2]))
        if theirs == mine:
            return
        peer = self.members[src]
        their_label = f"instruction #{theirs[1]}" if theirs[1] >= 0 else "no instruction"
        raise CollectiveError(
            f"{self._who(op)}: the all-to-all orders of the expert group differ: this rank issued its "
            f"all-to-all #{number + 1} ({what}) of step {self.step + 1}, but job rank {peer} (member {src}) "
            f"issued all-to-all #{theirs[2] + 1} of {their_label} (stage {int(head[3])}) of step {theirs[0] + 1} "
            "at the same place (every rank of an expert group must issue the same all-to-alls in the same order: "
            "do the replicas build the same MoE layers?)",
            [peer],
        )

    def _hold(self, arrival: float, op: OpRun | None, what: str) -> None:
        if arrival <= 0:
            return
        delay = arrival - time.monotonic()
        if delay > self.timeout:
            raise PipelineError(
                f"{self._who(op)}: the {what} all-to-all would arrive {delay:.1f} s from now over the emulated "
                f"expert link, past the run's timeout of {self.timeout:g} s"
            )
        if delay > 0:
            time.sleep(delay)

    # ---- gradients and gathers --------------------------------------------------------------------
    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """The whole tensor of an expert parameter (or its gradient) sharded over the group along dim 0."""
        parts = [torch.empty_like(t) for _ in range(self.size)]
        try:
            work = torch.distributed.all_gather(parts, t.contiguous(), group=self.pg, async_op=True)
        except Exception as e:
            raise self._fail("gathering an expert parameter", None, e) from e
        self._wait(work, "gathering an expert parameter", None)
        return torch.cat(parts)


class AllToAll(torch.autograd.Function):
    """One all-to-all of an MoE layer (dispatch or combine): forward sends rows `send[i]` to member i and
    receives `recv[i]` from it; backward sends the gradient back the same way reversed. A dispatch passes
    `send` as the rows per member and expert and `recv` None, and gets back in `box` the rows per member
    (`recv`) and the counts per member and expert (`counts`) its counts' all-to-all brought."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ExpertGroup, send: list, recv: list[int] | None, what: str, box: Any):
        counts = send if recv is None else None
        sums = [sum(c) for c in send] if recv is None else send
        out, got, got_counts = group.exchange(x, sums, recv, what, counts)
        if box is not None:
            box.update(recv=got, counts=got_counts)
        ctx.group, ctx.send, ctx.recv, ctx.what, ctx.shape = group, sums, got, what, x.shape[1:]
        return out.reshape(-1, *x.shape[1:])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        g, _, _ = ctx.group.exchange(grad, ctx.recv, ctx.send, f"{ctx.what} gradient")
        return g.reshape(-1, *ctx.shape), None, None, None, None, None


def _regroup(recv_counts: torch.Tensor) -> torch.Tensor:
    """Row indices that reorder rows grouped [source][expert] (recv_counts[source, expert] rows each) into
    rows grouped [expert][source]."""
    n, held = recv_counts.shape
    starts = torch.cumsum(recv_counts.reshape(-1), 0) - recv_counts.reshape(-1)
    starts = starts.view(n, held)
    idx = [
        torch.arange(int(starts[s, e]), int(starts[s, e] + recv_counts[s, e]))
        for e in range(held)
        for s in range(n)
        if int(recv_counts[s, e])
    ]
    return torch.cat(idx) if idx else torch.zeros(0, dtype=torch.int64)
