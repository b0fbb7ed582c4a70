"""Policy schedules: per-rank orders derived from a policy by deterministic list scheduling.

A policy says how a rank chooses among its ready ops; the list scheduler plays
the whole pipeline forward under a cost model and records, per rank, the order
in which the ops ran. The machine is the simulator's (`pipec.sim.simulate`): a rank
runs one compute op at a time; an op is ready when its inputs are (its local
inputs have run, its remote input has arrived); a message from stage s leaves
when the op producing it ends and travels `bytes / bandwidth`, then
`latency + comm[s]`, in issue order per pair of ranks. So the times the
scheduler sees are exactly the times `pipec simulate` reports for the order it
derives under the same costs.

The policy, per rank r:

- `prefer`: the op kinds in priority order (`B, F, W`: a ready B first, then
  a ready F, then a W). Ties among ops of one kind: the lowest micro-batch, then
  the op closest to finishing its micro-batch (the later stage for F, the
  earlier for B and W).
- `inflight[r]`: at most this many activations live on rank r (an F has
  started, its B has not ended); an F that would exceed it waits.
- `stage_inflight[s]`: the same limit per stage (for ranks holding several).
- the memory limit (from the memory model): an F starts only if the rank's
  memory after it stays within the limit; a W frees memory, so when an F is
  held back by memory a pending W runs first.
- `w_mode`: when a W may run if nothing before it in `prefer` is ready:
  "idle" (whenever the rank would otherwise idle), or "fit" (only when it ends
  before the next F or B the rank already knows will arrive; W passes that
  never fit run once nothing else is left or memory needs them).
- `w_lag[r]`: W(i, s) waits until B(i + lag, s) has run (or no later B is left),
  Zero Bubble's ZB-H1 and ZB-H2 delay.

Every decision is made at the earliest time any rank can act, ties broken by
rank number, so the result is a pure function of the inputs.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

KINDS = ("F", "B", "W")
W_MODES = ("idle", "fit")


class PolicyStuck(Exception):
    """The policy cannot finish: no rank may run any of its remaining ops."""

    def __init__(self, message: str, rank: int, notes: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.message, self.rank, self.notes = message, rank, notes


@dataclass(frozen=True)
class Policy:
    prefer: tuple[str, ...] = ("B", "F", "W")
    inflight: tuple[float, ...] | None = None  # per rank; None or inf: no limit
    stage_inflight: tuple[float, ...] | None = None  # per stage
    w_mode: str = "idle"
    w_lag: tuple[int, ...] | None = None  # per rank

    def describe(self) -> str:
        parts = ["prefer " + ", ".join(self.prefer)]
        if self.inflight is not None:
            parts.append("inflight " + " ".join(_num(x) for x in self.inflight))
        if self.stage_inflight is not None:
            parts.append("stage inflight " + " ".join(_num(x) for x in self.stage_inflight))
        if self.w_lag is not None:
            parts.append("W lag " + " ".join(str(x) for x in self.w_lag))
        parts.append(f"W {self.w_mode}")
        return "; ".join(parts)


def _num(x: float) -> str:
    return "-" if x is None or math.isinf(x) else f"{x:g}"


@dataclass(frozen=True)
class Machine:
    """What the list scheduler needs of a schedule and its cost and memory models (plain arrays)."""

    num_stages: int
    num_ranks: int
    num_microbatches: int
    placement: tuple[int, ...]
    split: bool  # ops F, B, W
    F: np.ndarray  # per stage compute times
    B: np.ndarray  # the full backward when not split
    W: np.ndarray
    comm: np.ndarray  # per stage, per message
    act_bytes: np.ndarray
    grad_bytes: np.ndarray
    latency: np.ndarray  # (R, R)
    bandwidth: np.ndarray  # (R, R) bytes/s
    act: np.ndarray  # memory per stage
    wact: np.ndarray
    params: np.ndarray  # per rank
    limit: np.ndarray = field(default_factory=lambda: np.zeros(0))  # per rank; NaN: none


def machine(sched, costs, memory: dict[str, np.ndarray]) -> Machine:
    """A Machine from a Schedule's shape, a `pipec.sim.costs.CostModel` and a `pipec.passes.memory.memory_model`."""
    R, S = sched.num_ranks, sched.num_stages
    params = np.zeros(R)
    for s, r in enumerate(sched.placement):
        params[r] += memory["params"][s]
    full_b = costs.B if costs.split_backward else costs.B + costs.W
    return Machine(
        num_stages=S,
        num_ranks=R,
        num_microbatches=sched.num_microbatches,
        placement=tuple(sched.placement),
        split=sched.split_backward,
        F=np.asarray(costs.F, float),
        B=np.asarray(full_b, float),
        W=np.asarray(costs.W, float),
        comm=np.asarray(costs.comm, float),
        act_bytes=np.asarray(costs.act_bytes, float),
        grad_bytes=np.asarray(costs.grad_bytes, float),
        latency=np.asarray(costs.latency, float),
        bandwidth=np.asarray(costs.bandwidth, float),
        act=np.asarray(memory["act"], float),
        wact=np.asarray(memory["wact"], float),
        params=params,
        limit=np.asarray(memory["limit"], float),
    )


@dataclass(frozen=True, eq=False)
class Derived:
    """Per rank, the ops in the order they ran: (kind index, micro-batch, stage), with their times."""

    orders: tuple[tuple[tuple[int, int, int], ...], ...]
    start: tuple[tuple[float, ...], ...]
    end: tuple[tuple[float, ...], ...]
    peak: tuple[float, ...]  # per rank, params included

    @property
    def makespan(self) -> float:
        return max((e[-1] for e in self.end if e), default=0.0)

    @property
    def cost(self) -> float:
        """The longest rank's span (Zero Bubble's objective, `Stats.cost`)."""
        return max((e[-1] - s[0] for s, e in zip(self.start, self.end) if e), default=0.0)


def derive(mc: Machine, policy: Policy) -> Derived:
    """List-schedule every op under the policy; raises PolicyStuck when the policy cannot finish."""
    S, R, m = mc.num_stages, mc.num_ranks, mc.num_microbatches
    split = mc.split
    kinds = 3 if split else 2
    place = mc.placement
    prio = {k: i for i, k in enumerate(policy.prefer)}
    if not split:
        prio.pop("W", None)
    if set(prio) != set(KINDS[:kinds]):
        raise ValueError(f"prefer must order {', '.join(KINDS[:kinds])}, got {', '.join(policy.prefer)}")
    pr = [prio["F"], prio["B"], prio.get("W", 9)]
    dur = [mc.F.tolist(), mc.B.tolist(), mc.W.tolist()]
    act, wact = mc.act.tolist(), (mc.wact.tolist() if split else [0.0] * S)
    limit = [math.inf if not (x == x) else float(x) for x in (mc.limit.tolist() or [math.nan] * R)]
    params = mc.params.tolist()
    inflight = [math.inf] * R if policy.inflight is None else [float(x) for x in policy.inflight]
    st_inflight = [math.inf] * S if policy.stage_inflight is None else [float(x) for x in policy.stage_inflight]
    lag = [0] * R if policy.w_lag is None else list(policy.w_lag)
    fit = policy.w_mode == "fit"
    if policy.w_mode not in W_MODES:
        raise ValueError(f"w_mode must be one of {W_MODES}")
    lat = mc.latency.tolist()
    bw = mc.bandwidth.tolist()
    comm = mc.comm.tolist()
    abytes, gbytes = mc.act_bytes.tolist(), mc.grad_bytes.tolist()

    # Candidates per rank: ops whose inputs are all scheduled, as [ready time, kind, mb, stage].
    # F(0..m-1, s) of a first stage, and every op once its inputs are known.
    cand: list[dict[tuple[int, int, int], float]] = [{} for _ in range(R)]
    pending_inputs: dict[tuple[int, int, int], list] = {}  # op -> [inputs still missing, ready time]
    for s in range(S):
        if s == 0:
            for i in range(m):
                cand[place[0]][(0, i, 0)] = 0.0
    clock = [0.0] * R
    live = [0] * R  # activations on the rank
    live_stage = [0] * S
    mem = [0.0] * R
    peak = list(params)
    b_done = [[False] * m for _ in range(S)]
    b_count = [0] * S  # B done per stage
    left = [0] * R
    for s in range(S):
        left[place[s]] += kinds * m
    orders: list[list[tuple[int, int, int]]] = [[] for _ in range(R)]
    starts: list[list[float]] = [[] for _ in range(R)]
    ends: list[list[float]] = [[] for _ in range(R)]
    chan_tx: dict[tuple[int, int], float] = {}
    chan_arr: dict[tuple[int, int], float] = {}

    def inputs_needed(k: int, i: int, s: int) -> int:
        if k == 0:
            return 1 if s > 0 else 0
        if k == 1:
            return 2 if s < S - 1 else 1
        return 1

    def deliver(op: tuple[int, int, int], t: float) -> None:
        """One input of `op` is available at t."""
        k, i, s = op
        st = pending_inputs.get(op)
        if st is None:
            st = pending_inputs[op] = [inputs_needed(k, i, s), 0.0]
        st[0] -= 1
        if t > st[1]:
            st[1] = t
        if st[0] == 0:
            del pending_inputs[op]
            cand[place[s]][op] = st[1]

    def send(src_rank: int, dst_rank: int, s: int, nbytes: float, t: float) -> float:
        if src_rank == dst_rank:
            return t
        key = (src_rank, dst_rank)
        b = bw[src_rank][dst_rank]
        tx = nbytes / b if (nbytes > 0 and b != math.inf) else 0.0
        t0 = max(t, chan_tx.get(key, 0.0))
        te = t0 + tx
        chan_tx[key] = te
        a = max(te + lat[src_rank][dst_rank] + comm[s], chan_arr.get(key, -1.0))
        chan_arr[key] = a
        return a

    def w_allowed(r: int, i: int, s: int) -> bool:
        g = lag[r]
        if g <= 0:
            return True
        return (i + g < m and b_done[s][i + g]) or b_count[s] == m

    def choose(r: int) -> tuple[float, tuple[int, int, int] | None]:
        """The time rank r acts next and the op it runs then (None: nothing it may run is known)."""
        c = cand[r]
        if not c:
            return math.inf, None
        room = limit[r] - params[r] + 1e-9 - mem[r]
        f_live_ok = live[r] < inflight[r]
        # Memory pressure: a forward is held back by memory and a W could free some: W passes run
        # whatever the W mode and lag say.
        pressure = any(op[0] == 2 for op in c) and any(op[0] == 0 and act[op[2]] > room for op in c)
        elig = []
        for op, ready in c.items():
            k, i, s = op
            if k == 0:
                if not (f_live_ok and live_stage[s] < st_inflight[s] and act[s] <= room):
                    continue
            elif k == 2 and not pressure and not w_allowed(r, i, s):
                continue
            elig.append((ready, op))
        if not elig:
            return math.inf, None
        t = max(clock[r], min(x[0] for x in elig))
        while True:
            op = min((o for ready, o in elig if ready <= t), key=_tie(pr))
            if op[0] != 2 or not fit or pressure:
                return t, op
            # W in "fit" mode: only if it ends before every better op the rank knows is coming.
            better = [ready for ready, o in elig if pr[o[0]] < pr[2] and ready > t]
            if not better or t + dur[2][op[2]] <= min(better) + 1e-12:
                return t, op
            t = min(better)

    heap: list[tuple[float, int, int]] = []
    version = [0] * R

    def push(r: int) -> None:
        version[r] += 1
        t, _ = choose(r)
        if t < math.inf:
            heapq.heappush(heap, (t, r, version[r]))

    for r in range(R):
        push(r)
    done = 0
    total = sum(left)
    while heap:
        t, r, ver = heapq.heappop(heap)
        if ver != version[r]:
            continue
        t2, op = choose(r)
        if op is None:
            continue
        if t2 != t:  # state changed since pushed; re-queue at the new time
            heapq.heappush(heap, (t2, r, ver))
            continue
        k, i, s = op
        del cand[r][op]
        start = t
        end = start + dur[k][s]
        clock[r] = end
        orders[r].append(op)
        starts[r].append(start)
        ends[r].append(end)
        left[r] -= 1
        done += 1
        touched = {r}
        if k == 0:
            live[r] += 1
            live_stage[s] += 1
            mem[r] += act[s]
            if mem[r] + params[r] > peak[r]:
                peak[r] = mem[r] + params[r]
            deliver((1, i, s), end)  # B(i, s) needs F(i, s)
            if s < S - 1:
                dst = place[s + 1]
                deliver((0, i, s + 1), send(r, dst, s, abytes[s], end))
                touched.add(dst)
        elif k == 1:
            live[r] -= 1
            live_stage[s] -= 1
            mem[r] += wact[s] - act[s]
            if mem[r] + params[r] > peak[r]:
                peak[r] = mem[r] + params[r]
            b_done[s][i] = True
            b_count[s] += 1
            if split:
                deliver((2, i, s), end)
            if s > 0:
                dst = place[s - 1]
                deliver((1, i, s - 1), send(r, dst, s, gbytes[s], end))
                touched.add(dst)
        else:
            mem[r] -= wact[s]
        for rr in touched:
            push(rr)
    if done != total:
        stuck = [r for r in range(R) if left[r]]
        r = stuck[0]
        notes = []
        for rr in stuck[:4]:
            why = _why_stuck(rr, cand[rr], live[rr], inflight[rr], mem[rr] + params[rr], limit[rr])
            notes.append(f"rank {rr}: {left[rr]} op(s) left; {why}")
        raise PolicyStuck(
            f"the policy cannot finish: ranks {', '.join(map(str, stuck))} can run none of their ops", r, tuple(notes)
        )
    return Derived(
        tuple(tuple(o) for o in orders),
        tuple(tuple(x) for x in starts),
        tuple(tuple(x) for x in ends),
        tuple(peak),
    )


def _tie(pr: list[int]):
    """Priority order among ready ops: kind by `prefer`, then micro-batch, then closest to finishing."""

    def key(op: tuple[int, int, int]):
        k, i, s = op
        return (pr[k], i, -s if k == 0 else s)

    return key


def _why_stuck(r: int, cand: dict, live: int, inflight: float, mem: float, limit: float) -> str:
    fs = [op for op in cand if op[0] == 0]
    if fs and live >= inflight:
        return f"its next forward waits for in-flight micro-batches to drop below {inflight:g} ({live} live)"
    if fs:
        return f"its next forward needs more memory than the limit {limit:g} allows (it holds {mem:g})"
    return "its remaining ops wait for inputs that never come"


def policies_equal_orders(a: Derived, b: Derived) -> bool:
    return a.orders == b.orders


def orders_from_schedule(sched) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    return tuple(tuple(zip(r.kind.tolist(), r.mb.tolist(), r.stage.tolist())) for r in sched.ranks)


def per_rank(value, n: int) -> tuple[float, ...] | None:
    """A number or a sequence to one value per rank (None stays None)."""
    if value is None:
        return None
    if isinstance(value, Sequence):
        if len(value) != n:
            raise ValueError(f"expected {n} values, got {len(value)}")
        return tuple(float(x) for x in value)
    return tuple(float(value) for _ in range(n))
