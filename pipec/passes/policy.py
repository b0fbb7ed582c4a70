"""Policy schedules: per-rank orders derived from a policy by deterministic list scheduling.

A policy says how a rank chooses among its ready ops; the list scheduler plays
the whole pipeline forward under a cost model and records, per rank, the order
in which the ops ran. The machine is the simulator's (`pipec.sim.machine`), stepped
by the same code: a rank runs one compute op at a time (`Ranks.run`); an op is
ready when its inputs by `pipec.ir.rules` are (its local inputs have run, its remote
input has arrived); messages are timed by `CostModel.wire` and `Links` (per
pair of ranks in issue order, shared cross-datacenter links dividing their
bandwidth); the `overhead` of each send and receive is the Program's, read from
the simulator's `Plan` of the lowered orders (see `derive`). So the times the
scheduler reports are the times `pipec simulate` reports for the order it
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

import bisect
import dataclasses
import functools
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pipec.ir.opcodes import KIND_OF, OUT_MSG, OUT_PEER_STAGE
from pipec.ir.rules import active, feeds, needs
from pipec.ir.schedule import Policy, RankOps, Schedule
from pipec.sim.costs import CostModel
from pipec.sim.machine import Links, Ranks, shared_links
from pipec.sim.memory import compute_deltas
from pipec.sim.plan import Plan, plan
from pipec.sim.simulate import simulate

KINDS = ("F", "B", "W")
W_MODES = ("idle", "fit")


class PolicyStuck(Exception):
    """The policy cannot finish: no rank may run any of its remaining ops."""

    def __init__(self, message: str, rank: int, notes: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.message, self.rank, self.notes = message, rank, notes


@dataclass(frozen=True)
class Machine:
    """What the list scheduler needs of a schedule and its cost and memory models (plain arrays), and
    the cost model and schedule shape themselves: the simulator's machine model reads them."""

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
    costs: CostModel | None = None  # the whole cost model (overhead, shared links): `machine` sets it
    shape: Schedule | None = None  # the schedule without its orders, to lower derived orders


def machine(sched: Schedule, costs: CostModel, memory: dict[str, np.ndarray]) -> Machine:
    """A Machine from a Schedule's shape, a `pipec.sim.costs.CostModel` and a `pipec.sim.memory.memory_model`."""
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
        costs=costs,
        shape=dataclasses.replace(sched, ranks=()),
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
        """The longest rank's span (`Stats.cost`, synth's tie-break after the makespan)."""
        return max((e[-1] - s[0] for s, e in zip(self.start, self.end) if e), default=0.0)


# How many times derive re-plays the policy with the overhead of its previous orders' Program (below).
SETTLE_ROUNDS = 6


def derive(mc: Machine, policy: Policy) -> Derived:
    """List-schedule every op under the policy; raises PolicyStuck when the policy cannot finish.

    The times are the simulator's for the Program of the derived orders. Without `overhead` the
    scheduler's own times are (it times each op with the simulator's pieces, in time order). With it,
    each receive costs its rank time where the lowering posts it, which depends on every rank's whole
    order (`pipec.passes.lower`): so the policy plays again with the overhead of the Program of its
    previous orders (`pipec.sim.plan.Plan`) until the orders settle (then its times are that
    Program's, exactly); if they do not within SETTLE_ROUNDS, the last orders get the simulator's times.
    """
    if mc.costs is None or mc.shape is None:
        raise ValueError("derive needs a Machine built by `machine` (its cost model and schedule shape)")
    d = _ListScheduler(mc, policy, None).run()
    if not mc.costs.overhead:
        return d
    for _ in range(SETTLE_ROUNDS):
        pl = plan(_lowered(mc, d.orders), mc.costs)
        again = _ListScheduler(mc, policy, _Overheads.of(pl)).run()
        if again.orders == d.orders:
            return again
        d = again
    tl = simulate(_lowered(mc, d.orders), mc.costs)
    sel = [np.flatnonzero(tl.rank == r) for r in range(mc.num_ranks)]
    return Derived(
        d.orders, tuple(tuple(tl.start[x].tolist()) for x in sel), tuple(tuple(tl.end[x].tolist()) for x in sel), d.peak
    )


def _lowered(mc: Machine, orders: Sequence[Sequence[tuple[int, int, int]]]):
    """The Program of these orders (pipec.passes.lower, as `pipec compile` would lower them)."""
    from pipec.passes.lower import lower

    ranks = []
    for ops in orders:
        a = np.asarray(ops, dtype=np.int64).reshape(-1, 3)
        z = np.zeros(len(a), np.int64)
        ranks.append(RankOps(a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy(), z, np.zeros(len(a), dtype=bool)))
    return lower(dataclasses.replace(mc.shape, ranks=tuple(ranks)))


@dataclass(frozen=True)
class _Overheads:
    """The overhead of a Program (`Plan.off`, `tail`, `head`) keyed by op and message, not position."""

    after: dict[tuple[int, int, int], float]  # (kind, mb, stage): the rank's time on the transfers after it
    leave: dict[tuple[int, int, int], float]  # (message, stage, mb): how long after its producer's end it leaves
    head: tuple[float, ...]  # per rank: the time on transfers before its first compute op

    @classmethod
    def of(cls, pl: Plan) -> _Overheads:
        kinds = KIND_OF[pl.c_op].tolist()
        after = dict(zip(zip(kinds, pl.c_mb.tolist(), pl.c_stage.tolist()), pl.tail or ()))
        leave = dict(zip(zip(pl.m_kind.tolist(), pl.m_stage.tolist(), pl.m_mb.tolist()), pl.off or ()))
        return cls(after, leave, tuple(pl.head or ()))


class _ListScheduler:
    """One play of the pipeline under a policy: the ranks' state as time goes forward, and its steps.

    Decisions and network events run in time order from one heap of (time, kind, who, version): kind 0
    a shared link's event, 1 a message leaving its rank (onto a contended shared link), 2 rank `who`
    deciding; at one time links first, then ranks by number, so the result is a pure function of the
    inputs. Messages are timed by the simulator's `Links` (and `CostModel.wire`, `shared_links`).
    """

    def __init__(self, mc: Machine, policy: Policy, overheads: _Overheads | None) -> None:
        S, R, m = mc.num_stages, mc.num_ranks, mc.num_microbatches
        self.S, self.R, self.m, self.place = S, R, m, mc.placement
        split = mc.split
        self.kinds = 3 if split else 2
        prio = {k: i for i, k in enumerate(policy.prefer)}
        if not split:
            prio.pop("W", None)
        if set(prio) != set(KINDS[: self.kinds]):
            raise ValueError(f"prefer must order {', '.join(KINDS[: self.kinds])}, got {', '.join(policy.prefer)}")
        if policy.w_mode not in W_MODES:
            raise ValueError(f"w_mode must be one of {W_MODES}")
        self.pr = [prio["F"], prio["B"], prio.get("W", 9)]
        self.dur = [mc.F.tolist(), mc.B.tolist(), mc.W.tolist()]
        # each op's device change, the memory walk's (pipec.sim.memory.compute_deltas): [kind][mb][stage]
        model = {"act": mc.act, "wact": mc.wact, "ckpt": mc.act, "params": 0 * mc.act}
        if mc.shape is not None and mc.shape.slicing is not None:  # sequence lengths: a unit's token share
            model["unit_share"] = mc.shape.slicing.share()
        self.delta = compute_deltas(model, m, split).tolist()
        self.limit = [math.inf if not (x == x) else float(x) for x in (mc.limit.tolist() or [math.nan] * R)]
        self.params = mc.params.tolist()
        self.inflight = [math.inf] * R if policy.inflight is None else [float(x) for x in policy.inflight]
        self.st_inflight = (
            [math.inf] * S if policy.stage_inflight is None else [float(x) for x in policy.stage_inflight]
        )
        self.lag = [0] * R if policy.w_lag is None else list(policy.w_lag)
        self.fit = policy.w_mode == "fit"
        self.overheads = overheads
        self.slices = mc.shape.slicing.slices if mc.shape is not None and mc.shape.slicing else 1
        self.rules = active(self.kinds, self.slices)  # the dependency rule, pipec.ir.rules
        self.graph = mc.shape.graph if mc.shape is not None else None  # the stage graph (None: the chain)
        self._network(mc)

        # Candidates per rank: ops whose inputs are all known, with their ready time; those needing none first.
        self.cand: list[dict[tuple[int, int, int], float]] = [{} for _ in range(R)]
        # The same candidates by (kind, stage), their micro-batches in order: `_choose` walks each only until
        # its first op that could run now, so a choice costs the kinds and stages, not the ops (m = 1,000 took
        # minutes when every choice scanned every ready forward).
        self.buckets: list[dict[tuple[int, int], list[int]]] = [{} for _ in range(R)]
        self.need_uniform = [len({self.delta[0][i][s] for i in range(m)}) <= 1 for s in range(S)]
        self.pending: dict[tuple[int, int, int], list] = {}  # op -> [inputs still missing, ready time]
        for s in range(S):
            for i in range(m):
                for k in range(self.kinds):
                    if not needs(k, i, s, S, self.rules, self.slices, self.graph):
                        self._candidate((k, i, s), 0.0)
        self.ranks = Ranks([0.0] * R if overheads is None else list(overheads.head))  # the machine's step
        self.live = [0] * R  # activations on the rank
        self.live_stage = [0] * S
        self.mem = [0.0] * R
        self.peak = list(self.params)
        self.b_done = [[False] * m for _ in range(S)]
        self.b_count = [0] * S  # B done per stage
        self.left = [0] * R
        for s in range(S):
            self.left[self.place[s]] += self.kinds * m
        self.orders: list[list[tuple[int, int, int]]] = [[] for _ in range(R)]
        self.starts: list[list[float]] = [[] for _ in range(R)]
        self.ends: list[list[float]] = [[] for _ in range(R)]
        self.heap: list[tuple[float, int, int, int]] = []
        self.version = [0] * R

    def _network(self, mc: Machine) -> None:
        """Per message class (kind of the op that sends it, its stage, the stage it goes to: one per edge and
        direction, pipec.ir.graph): the simulator's wire terms."""
        S, R, place = self.S, self.R, np.asarray(self.place, dtype=np.int64)
        if self.graph is None:
            cls = [(k, s, s + OUT_PEER_STAGE[k]) for k in (0, 1) for s in range(S) if 0 <= s + OUT_PEER_STAGE[k] < S]
        else:
            cls = [(0, u, v) for u, v in self.graph.edges] + [(1, v, u) for u, v in self.graph.edges]
        k_arr = np.array([k for k, _, _ in cls], dtype=np.int64)
        s_arr = np.array([s for _, s, _ in cls], dtype=np.int64)
        t_arr = np.array([t for _, _, t in cls], dtype=np.int64)
        src, dst = place[s_arr], place[t_arr]
        other = t_arr if self.graph is not None else None  # a graph's gradient: its edge's activation bytes
        _, txd, lat = mc.costs.wire(OUT_MSG[k_arr], s_arr, src, dst, other=other)
        group = shared_links(mc.costs, src, dst, txd) if len(cls) else None
        self.contended = group is not None
        self.wire = {
            c: (int(a) * R + int(b), g, float(t), float(la))
            for c, a, b, g, t, la in zip(cls, src, dst, group or [-1] * len(cls), txd, lat)
        }
        self.to: list[tuple[tuple[int, int, int], int]] = []  # per message: the op it feeds, its rank
        self.links = Links([], [], [], [], [], max(group or [-1]) + 1, self._link_at, self._arrived)

    def _link_at(self, t: float, g: int, version: int) -> None:
        heapq.heappush(self.heap, (t, 0, g, version))

    def _arrived(self, x: int) -> None:
        op, dst = self.to[x]
        self._deliver(op, self.links.arrival[x])
        if self.contended:  # an event: the receiver may act now
            self._push(dst)

    def run(self) -> Derived:
        for r in range(self.R):
            self._push(r)
        heap, links = self.heap, self.links
        while heap:
            t, kind, who, ver = heapq.heappop(heap)
            if kind == 0:
                links.link_event(who, ver, t)
                continue
            if kind == 1:
                links.send(who, t)
                continue
            r = who
            if ver != self.version[r]:
                continue
            t2, op = self._choose(r)
            if op is None:
                continue
            if t2 != t:  # state changed since pushed; re-queue at the new time
                heapq.heappush(heap, (t2, 2, r, ver))
                continue
            for rr in self._run_op(r, op, t):
                self._push(rr)
        if any(self.left):
            raise self._stuck()
        return Derived(
            tuple(tuple(o) for o in self.orders),
            tuple(tuple(x) for x in self.starts),
            tuple(tuple(x) for x in self.ends),
            tuple(self.peak),
        )

    def _push(self, r: int) -> None:
        self.version[r] += 1
        t, _ = self._choose(r)
        if t < math.inf:
            heapq.heappush(self.heap, (t, 2, r, self.version[r]))

    def _deliver(self, op: tuple[int, int, int], t: float) -> None:
        """One input of `op` is available at t."""
        k, i, s = op
        st = self.pending.get(op)
        if st is None:
            st = self.pending[op] = [len(needs(k, i, s, self.S, self.rules, self.slices, self.graph)), 0.0]
        st[0] -= 1
        if t > st[1]:
            st[1] = t
        if st[0] == 0:
            del self.pending[op]
            self._candidate(op, st[1])

    def _candidate(self, op: tuple[int, int, int], ready: float) -> None:
        k, i, s = op
        r = self.place[s]
        self.cand[r][op] = ready
        bisect.insort(self.buckets[r].setdefault((k, s), []), i)

    def _w_allowed(self, r: int, i: int, s: int) -> bool:
        g = self.lag[r]
        if g <= 0:
            return True
        return (i + g < self.m and self.b_done[s][i + g]) or self.b_count[s] == self.m

    def _choose(self, r: int) -> tuple[float, tuple[int, int, int] | None]:
        """The time rank r acts next and the op it runs then (None: nothing it may run is known)."""
        c = self.cand[r]
        if not c:
            return math.inf, None
        need, pr, clock, buckets = self.delta[0], self.pr, self.ranks.clock[r], self.buckets[r]
        room = self.limit[r] - self.params[r] + 1e-9 - self.mem[r]
        f_live_ok = self.live[r] < self.inflight[r]
        # Memory pressure: a forward is held back by memory and a W could free some: W passes run
        # whatever the W mode and lag say.
        pressure = any(k == 2 for k, _ in buckets) and any(
            k == 0 and any(need[i][s] > room for i in (mbs[:1] if self.need_uniform[s] else mbs))
            for (k, s), mbs in buckets.items()
        )
        # The eligible ops that could matter: in each bucket, in micro-batch order, those ready earlier than
        # every eligible one before them (a later micro-batch ready no earlier loses every tie and never sets
        # the time), up to the first ready by the rank's clock.
        elig = []
        for (k, s), mbs in buckets.items():
            ok = None
            if k == 0:
                if not (f_live_ok and self.live_stage[s] < self.st_inflight[s]):
                    continue
                if self.need_uniform[s]:
                    if need[mbs[0]][s] > room:
                        continue
                else:
                    ok = functools.partial(_fits, need, s, room)
            elif k == 2 and not pressure and self.lag[r] > 0:
                ok = functools.partial(self._w_allowed, r, s=s)
            low = math.inf
            for i in mbs:
                if ok is not None and not ok(i):
                    continue
                ready = c[(k, i, s)]
                if ready < low:
                    elig.append((ready, (k, i, s)))
                    low = ready
                    if low <= clock:
                        break
        if not elig:
            return math.inf, None
        t = max(self.ranks.clock[r], min(x[0] for x in elig))
        while True:
            op = min((o for ready, o in elig if ready <= t), key=_tie(pr))
            if op[0] != 2 or not self.fit or pressure:
                return t, op
            # W in "fit" mode: only if it ends before every better op the rank knows is coming.
            better = [ready for ready, o in elig if pr[o[0]] < pr[2] and ready > t]
            if not better or t + self.dur[2][op[2]] <= min(better) + 1e-12:
                return t, op
            t = min(better)

    def _run_op(self, r: int, op: tuple[int, int, int], start: float) -> set[int]:
        """Rank r runs op from `start`: its effects on memory and on the ops it feeds; the ranks touched."""
        k, i, s = op
        del self.cand[r][op]
        mbs = self.buckets[r][k, s]
        del mbs[bisect.bisect_left(mbs, i)]
        if not mbs:
            del self.buckets[r][k, s]
        ov = self.overheads
        start, end = self.ranks.run(r, start, self.dur[k][s], 0.0 if ov is None else ov.after.get(op, 0.0))
        self.orders[r].append(op)
        self.starts[r].append(start)
        self.ends[r].append(end)
        self.left[r] -= 1
        touched = {r}
        mem, params, peak = self.mem, self.params, self.peak
        mem[r] += self.delta[k][i][s]
        if mem[r] + params[r] > peak[r]:
            peak[r] = mem[r] + params[r]
        if k == 0:
            self.live[r] += 1
            self.live_stage[s] += 1
        elif k == 1:
            self.live[r] -= 1
            self.live_stage[s] -= 1
            self.b_done[s][i] = True
            self.b_count[s] += 1
        for rule, nxt in feeds(k, i, s, self.S, self.rules, self.slices, self.graph):  # the ops that need it
            if rule.message is None:  # on its own stage
                self._deliver(nxt, end)
            else:
                touched.add(self._send(r, op, end, nxt))
        return touched

    def _send(self, r: int, op: tuple[int, int, int], end: float, nxt: tuple[int, int, int]) -> int:
        """The output of `op` (ended at `end`) to `nxt` on the stage next to it in its direction; the rank it
        goes to."""
        k, i, s = op
        dst = self.place[nxt[2]]
        if dst == r:  # handed over locally
            self._deliver(nxt, end)
            return dst
        chan, group, txd, lat = self.wire[k, s, nxt[2]]
        x = self.links.add(chan, group, txd, lat)
        self.to.append((nxt, dst))
        ov = self.overheads
        leave = end if ov is None else end + ov.leave.get((int(OUT_MSG[k]), s, i), 0.0)
        if self.contended:
            heapq.heappush(self.heap, (leave, 1, x, 0))
        else:
            self.links.send(x, leave)  # per-pair order only: its arrival is known now
        return dst

    def _stuck(self) -> PolicyStuck:
        stuck = [r for r in range(self.R) if self.left[r]]
        notes = []
        for rr in stuck[:4]:
            why = _why_stuck(
                rr, self.cand[rr], self.live[rr], self.inflight[rr], self.mem[rr] + self.params[rr], self.limit[rr]
            )
            notes.append(f"rank {rr}: {self.left[rr]} op(s) left; {why}")
        return PolicyStuck(
            f"the policy cannot finish: ranks {', '.join(map(str, stuck))} can run none of their ops",
            stuck[0],
            tuple(notes),
        )


def _fits(need: list[list[float]], s: int, room: float, i: int) -> bool:
    return need[i][s] <= room


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


def resolve(sched: Schedule) -> Schedule:
    """The schedule with its `order` block's orders derived (`derive`, under its own costs and memory) and
    `Schedule.order` cleared; a schedule without one as it is. The front end leaves the block as a `Policy`
    (`pipec.frontend.evaluate`); `pipec.driver.build` calls this before any check reads the orders. A policy
    that cannot finish is E213, at the `order` block."""
    if sched.order is None:
        return sched
    from pipec.errors import error
    from pipec.sim.costs import cost_model
    from pipec.sim.memory import memory_model

    try:
        shape = dataclasses.replace(sched, order=None, order_ranks=None)
        d = derive(machine(shape, cost_model(shape), memory_model(shape)), sched.order)
    except PolicyStuck as e:
        raise error("E213", e.message, sched.decl_spans.get("order"), sched.source, e.notes) from None
    wanted = set(range(sched.num_ranks)) if sched.order_ranks is None else set(sched.order_ranks)
    ranks = []
    for r, ops in enumerate(d.orders):
        a = np.asarray(ops, dtype=np.int64).reshape(-1, 3)
        if r not in wanted:
            a = a[:0]
        ranks.append(
            RankOps(
                a[:, 0].copy(),
                a[:, 1].copy(),
                a[:, 2].copy(),
                np.full(len(a), _order_sid(sched), np.int64),
                np.zeros(len(a), dtype=bool),
            )
        )
    return dataclasses.replace(sched, ranks=tuple(ranks), order=None, order_ranks=None)


def _order_sid(sched: Schedule) -> int:
    """The source id of the `order` block (what its derived ops point at in diagnostics)."""
    span = sched.decl_spans.get("order")
    return sched.spans.index(span) if span is not None and span in sched.spans else 0
