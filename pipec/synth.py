"""Schedule search: from sizes, costs and a memory limit to a schedule, written back as a `.pipe` file.

Two phases, both under the simulator's machine and cost model (`pipec.passes.policy`):

1. a heuristic: a grid over the policy space of `pipec.passes.policy` (which kind a
   rank prefers among its ready ops, how many micro-batches it keeps in
   flight, when a W may fill an idle gap), every point list-scheduled under
   the memory limit, then a local search on per-rank in-flight limits around
   the best point (seconds);
2. an exact improvement for small cases: the per-rank order as a constraint
   program (OR-Tools CP-SAT: one interval per op, no overlap per rank, the
   data dependencies with their message delays, a cumulative memory profile
   per rank), warm-started from the heuristic's schedule, under a time limit.
   Without OR-Tools installed (`pip install pipec[synth]`) the heuristic's
   result stands and `Result.solver_note` says why.

Under a memory limit below 1F1B's peak (or one no plain policy meets), the search may also place memory ops
(`Spec.memops`: recomputation, offload to the host; docs/memory.md): seeds list-scheduled with every forward
of some ranks recomputed (`recompute_candidates`), library and heuristic orders with offloads (or
recomputations) added at their peaks until pipec's memory check and the simulated memory curve both fit
(`repair`), and, in the solver, a choice per (micro-batch, stage) of a RECOMPUTE interval on the rank's
compute, or an OFFLOAD and a RELOAD on its host link, with the device and host pools as cumulative
profiles. Candidates then rank by (makespan, number of memory ops, cost), so memory ops appear only where
they shorten the step or are needed to fit. The least memory any such schedule reaches is `memory_floor`
(one micro-batch at a time); a limit below it is E703.

The objective is the simulated makespan, then Zero Bubble's cost (the longest
rank's span): among schedules with the same step time, and so the same bubble
(`Stats.bubble_rate` is on the makespan), the one whose ranks are busy over the
shortest span wins. `write_pipe` turns the per-rank orders into a readable
schedule file (`pipec.formats.pipe_text`, the writer `pipec import` uses too)
whose header records the inputs and figures; the file declares its whole cost
model (topology included), memory model and limit, and `expect`s its figures,
so `pipec check` re-proves them and `pipec simulate` reproduces them.

Pure: nothing here prints; progress goes to a callback (`pipec synth` prints it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction

import numpy as np

from pipec.errors import error
from pipec.formats.pipe_text import (
    Step,
    per_stage_expr,
    rank_block,
    rank_lines,
    schedule_head,
    schedule_steps,
    topology_lines,
)
from pipec.frontend.names import MEMORY_KEYS
from pipec.ir.rules import active, needs
from pipec.ir.schedule import Datacenter, MemOp, Policy, RankOps, Schedule, Topology
from pipec.passes.policy import Derived, Machine, PolicyStuck, derive, machine
from pipec.sim.costs import cost_model
from pipec.sim.memory import Hold, memory_model, rank_memory, unit_holds

Progress = Callable[[str], None]
MEMOP_KINDS = ("recompute", "offload")
MemOps = tuple[tuple[MemOp, ...], ...]  # per rank, as `Schedule.memops`


@dataclass(frozen=True)
class Spec:
    """What to search for: sizes, placement, cost documents, memory model and limit, topology."""

    p: int
    m: int
    v: int = 1
    placement: str = "loop"  # "loop": stage s on rank s % p; "v": chunks in a V (v = 2)
    split: bool = True  # ops F, B, W
    cost_docs: tuple[Mapping, ...] = ()
    memory: Mapping[str, float] = field(default_factory=dict)  # act, wact, params for a rank's share
    limit: tuple[float, ...] | None = None  # per rank
    topology: Topology | None = None
    host_limit: tuple[float, ...] | None = None  # per rank: the host pool that OFFLOAD fills (None: no limit)
    memops: tuple[str, ...] = MEMOP_KINDS  # the memory ops the search may place under a limit ("recompute", "offload")

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    def place(self) -> tuple[int, ...]:
        p, S = self.p, self.num_stages
        if self.placement == "v":
            return tuple((s % p) if (s // p) % 2 == 0 else p - 1 - s % p for s in range(S))
        return tuple(s % p for s in range(S))


def shape(spec: Spec, ranks: Sequence[RankOps] | None = None, name: str = "synth", memops: MemOps = ()) -> Schedule:
    """A Schedule with the spec's sizes, placement and declarations (and these per-rank ops and memory ops,
    or none)."""
    S, R = spec.num_stages, spec.p
    z = np.zeros(0, dtype=np.int64)
    empty = RankOps(z, z, z, z, np.zeros(0, dtype=bool))
    # act, wact and params are given for a rank's share of the model, as pipec.sim.memory's defaults are
    mem = {k: (float(v) * R / S,) * S for k, v in spec.memory.items() if k != "limit"}
    if spec.limit is not None:
        mem["limit"] = tuple(float(x) for x in spec.limit)
    if spec.host_limit is not None:
        mem["host_limit"] = tuple(float(x) for x in spec.host_limit)
    return Schedule(
        name=name,
        params=(("p", spec.p), ("m", spec.m)) + ((("v", spec.v),) if spec.v > 1 else ()),
        num_stages=S,
        num_ranks=R,
        num_microbatches=spec.m,
        kinds=("F", "B", "W") if spec.split else ("F", "B"),
        placement=spec.place(),
        ranks=tuple(ranks) if ranks is not None else tuple(empty for _ in range(R)),
        memory=mem,
        topology=spec.topology,
        memops=tuple(tuple(x) for x in memops) if any(memops) else (),
    )


def spec_machine(spec: Spec) -> Machine:
    sched = shape(spec)
    return machine(sched, cost_model(sched, spec.cost_docs), memory_model(sched))


def to_schedule(
    spec: Spec, orders: Sequence[Sequence[tuple[int, int, int]]], name: str = "synth", memops: MemOps = ()
) -> Schedule:
    """The spec's Schedule with these per-rank orders (kind index, micro-batch, stage) and memory ops."""
    ranks = []
    for ops in orders:
        a = np.asarray(ops, dtype=np.int64).reshape(-1, 3)
        ranks.append(
            RankOps(
                a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy(), np.zeros(len(a), np.int64), np.zeros(len(a), dtype=bool)
            )
        )
    return shape(spec, ranks, name, memops)


# ---- the heuristic -------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Candidate:
    policy: Policy | None  # None: a library schedule's order (`origin` names it)
    derived: Derived
    origin: str = "policy"
    memops: MemOps = ()  # the memory ops placed in `derived.orders` (pipec.ir.schedule.MemOp)
    label: str | None = None  # how it was made, when neither a plain policy nor a library order

    def describe(self) -> str:
        if self.label is not None:
            return self.label
        return f"policy `{self.policy.describe()}`" if self.policy is not None else f"the order of `{self.origin}`"

    @property
    def key(self) -> tuple[float, float]:
        return (round(self.derived.makespan, 9), round(self.derived.cost, 9))


def policy_grid(spec: Spec) -> list[Policy]:
    """The policy space searched: priorities x in-flight limits x W modes (deterministic order)."""
    p, S = spec.p, spec.num_stages
    prefers = [("B", "F", "W"), ("F", "B", "W")] if spec.split else [("B", "F"), ("F", "B")]
    modes = ["idle", "fit"] if spec.split else ["idle"]
    shapes: list[tuple[float, ...] | None] = [None]
    for a in (1, 2, 3):
        for b in (-1, 0, 1, 2):
            lim = tuple(max(1, a * (p - r) + b) for r in range(p))
            if lim not in shapes:
                shapes.append(lim)
    for c in sorted({p, 2 * p, 3 * p, p + 1, 2 * p - 1}):
        lim = tuple(float(c) for _ in range(p))
        if lim not in shapes:
            shapes.append(lim)
    out = []
    for prefer in prefers:
        for mode in modes:
            for lim in shapes:
                if spec.v > 1 and lim is not None:
                    # several stages per rank: the same limit per stage as well, so no chunk starves
                    per_stage = tuple(lim[spec.place()[s]] for s in range(S))
                    out.append(Policy(prefer, None, per_stage, mode))
                out.append(Policy(prefer, lim, None, mode))
    return out


def heuristic(spec: Spec, progress: Progress | None = None, budget_s: float = 30.0) -> Candidate:
    """The best policy of the grid, then per-rank in-flight limits tuned one rank at a time."""
    mc = spec_machine(spec)
    t0 = time.monotonic()
    best: Candidate | None = None
    tried = 0
    for pol in policy_grid(spec):
        c = _try(mc, pol)
        tried += 1
        if c is not None and (best is None or c.key < best.key):
            best = c
            if progress:
                progress(f"heuristic: makespan {_g(c.derived.makespan)} with policy {pol.describe()}")
    for seed in library_seeds(spec):
        tried += 1
        if best is None or seed.key < best.key:
            best = seed
            if progress:
                progress(f"heuristic: makespan {_g(seed.derived.makespan)} with {seed.describe()}")
    if best is None:
        raise error(
            "E701",
            "no policy fits these sizes under the memory limit",
            notes=("every point of the policy grid ran out of memory; raise the limit or lower the activations",),
        )
    # Local search: one rank's (or stage's) in-flight limit up or down, while it helps.
    improved = True
    while improved and best.policy is not None and time.monotonic() - t0 < budget_s:
        improved = False
        pol = best.policy
        field_name = "stage_inflight" if pol.stage_inflight is not None else "inflight"
        base = getattr(pol, field_name)
        if base is None:
            base = tuple(float(math.ceil(max(best.derived.peak))) + 1 for _ in range(spec.p))
        for j in range(len(base)):
            for delta in (-1, 1, 2):
                lim = list(base)
                lim[j] = max(1, lim[j] + delta)
                c = _try(mc, replace(pol, **{field_name: tuple(lim)}))
                tried += 1
                if c is not None and c.key < best.key:
                    best, improved = c, True
                    if progress:
                        progress(f"heuristic: makespan {_g(c.derived.makespan)} with policy {c.policy.describe()}")
                    break
            if improved or time.monotonic() - t0 > budget_s:
                break
    if progress:
        progress(f"heuristic: {tried} policies in {time.monotonic() - t0:.1f} s")
    return best


SEED_NAMES = ("1f1b", "zb-h1", "zb-h2", "zb-v", "v-half", "v-min", "interleaved-1f1b", "crossdc-1f1b", "crossdc-zb")


def library_seeds(spec: Spec) -> list[Candidate]:
    """The library schedules of the spec's shape (sizes, placement, op kinds) that fit its memory limit,
    with their simulated times: the search starts no worse than the hand-written schedules."""
    from pipec.driver import build, param_names, simulation
    from pipec.errors import PipecError
    from pipec.frontend import library

    out = []
    want = shape(spec)
    for name in SEED_NAMES:
        try:
            source = library.read(name)
            known = set(param_names(source))
            params = {k: v for k, v in (("p", spec.p), ("m", spec.m), ("v", spec.v)) if k in known}
            sched = build(source, params)
        except PipecError:
            continue
        if sched.placement != want.placement or sched.kinds != want.kinds:
            continue
        if spec.topology is None and sched.topology is not None:
            continue  # a schedule made for a network the spec does not have
        seeded = to_schedule(spec, _orders(sched), name)
        try:
            sim = simulation(seeded, spec.cost_docs)
        except PipecError:  # over the memory limit
            continue
        out.append(Candidate(None, _derived_from(sim), name))
    return out


def _orders(sched: Schedule):
    return tuple(tuple(zip(r.kind.tolist(), r.mb.tolist(), r.stage.tolist())) for r in sched.ranks)


def _derived_from(sim) -> Derived:
    tl = sim.timeline
    orders, starts, ends = [], [], []
    for r in range(tl.num_ranks):
        sel = np.flatnonzero(tl.rank == r)
        sel = sel[np.argsort(tl.start[sel], kind="stable")]
        orders.append(tuple((int(tl.op[j]), int(tl.mb[j]), int(tl.stage[j])) for j in sel))
        starts.append(tuple(float(tl.start[j]) for j in sel))
        ends.append(tuple(float(tl.end[j]) for j in sel))
    peak = tuple(float(r.peak_memory or 0.0) for r in sim.stats.ranks)
    return Derived(tuple(orders), tuple(starts), tuple(ends), peak)


def _try(mc: Machine, pol: Policy) -> Candidate | None:
    try:
        return Candidate(pol, derive(mc, pol))
    except PolicyStuck:
        return None


# ---- memory ops: recomputation and offload under a limit ---------------------------------------------------


@dataclass(frozen=True)
class HostModel:
    """What the memory ops keep and cost, per stage (docs/memory.md): `ckpt`, what a recomputed F keeps (its
    input); `seconds`, one OFFLOAD or RELOAD on the rank's host link; per rank, the host pool's limit (NaN:
    none). The device pool's `act`, `wact` and `params` are the Machine's."""

    ckpt: np.ndarray
    seconds: np.ndarray
    host_limit: np.ndarray


def host_model(spec: Spec) -> HostModel:
    """The spec's HostModel, from the memory model (`ckpt`, default act / 8) and the cost model (`offload`)."""
    sched = shape(spec)
    mem = memory_model(sched)
    cm = cost_model(sched, spec.cost_docs)
    ckpt = np.asarray(mem["ckpt"], float) if "ckpt" in mem else np.asarray(mem["act"], float) / 8
    seconds = _host_seconds(cm, spec)
    R = spec.p
    host = np.full(R, np.nan) if spec.host_limit is None else np.asarray(spec.host_limit, float)
    return HostModel(ckpt, seconds, host)


def _host_seconds(cm, spec: Spec) -> np.ndarray:
    """Per stage, the seconds of one OFFLOAD or RELOAD: the cost model's, as the simulator charges them."""
    S = spec.num_stages
    return np.asarray(cm.host_time(np.arange(S), np.zeros(S, dtype=bool)), float)


def memops_of(text: str) -> tuple[str, ...]:
    """`--memops`: a comma-separated list of MEMOP_KINDS, or `none` (ValueError otherwise)."""
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if names == ("none",):
        return ()
    bad = [x for x in names if x not in MEMOP_KINDS]
    if bad or not names:
        raise ValueError(f"expected recompute, offload, recompute,offload or none, got `{text}`")
    return tuple(k for k in MEMOP_KINDS if k in names)


def recompute_machine(mc: Machine, hm: HostModel, stages: Sequence[int]) -> Machine:
    """The list scheduler's machine when these stages recompute every forward just before its backward: such a
    F keeps `ckpt`, its B runs the forward again first (B + F), and the rank's limit leaves room for the one
    full activation a recomputation holds (a rank runs one at a time)."""
    on = np.zeros(mc.num_stages, dtype=bool)
    on[list(stages)] = True
    act = np.where(on, np.minimum(hm.ckpt, mc.act), mc.act)
    extra = np.zeros(mc.num_ranks)
    for s in np.flatnonzero(on):
        r = mc.placement[s]
        extra[r] = max(extra[r], mc.act[s] - act[s])
    limit = mc.limit - extra if len(mc.limit) else mc.limit
    return replace(mc, B=np.where(on, mc.B + mc.F, mc.B), act=act, limit=limit)


def recompute_memops(orders, stages: Sequence[int]) -> MemOps:
    """A RECOMPUTE just before every B of these stages."""
    on = set(stages)
    return tuple(
        tuple(MemOp("RECOMPUTE", i, s, j) for j, (k, i, s) in enumerate(ops) if k == 1 and s in on) for ops in orders
    )


def recompute_candidates(spec: Spec, progress: Progress | None = None, budget_s: float = 10.0) -> list[Candidate]:
    """Recomputation seeds: the policy grid list-scheduled with every forward of some stages recomputed (the
    stages of ranks 0..k-1 for each k, where 1F1B-like orders hold the most), under the limit."""
    mc = spec_machine(spec)
    hm = host_model(spec)
    if "recompute" not in spec.memops or not np.any(hm.ckpt < mc.act):
        return []
    t0 = time.monotonic()
    place = spec.place()
    out = []
    for k in range(spec.p, 0, -1):
        stages = [s for s in range(spec.num_stages) if place[s] < k and hm.ckpt[s] < mc.act[s]]
        if not stages:
            continue
        tmc = recompute_machine(mc, hm, stages)
        best = None
        for pol in policy_grid(spec):
            c = _try(tmc, pol)
            if c is not None and (best is None or c.key < best.key):
                best = c
            if time.monotonic() - t0 > budget_s:
                break
        if best is not None:
            ranks = f"ranks 0..{k - 1}" if k > 1 else "rank 0"
            label = f"policy `{best.policy.describe()}` with every forward of {ranks} recomputed"
            out.append(replace(best, memops=recompute_memops(best.derived.orders, stages), label=label))
            if progress:
                progress(f"memory ops: makespan {_g(best.derived.makespan)} (list scheduler) with {label}")
        if time.monotonic() - t0 > budget_s:
            break
    return out


def repair(
    spec: Spec,
    orders,
    memops: MemOps = (),
    label: str = "",
    hm: HostModel | None = None,
    rounds: int | None = None,
    prefer: str = "offload",
) -> Candidate | None:
    """Memory ops added to fixed orders until the limit holds: on the rank over its limit, the activation live
    at its peak (pipec's memory check, `rank_memory`) that stays longest until its B is offloaded (its
    RELOAD issued early enough, by the ops' times, for the host link to hide it) or recomputed just before
    its B, whichever `prefer` names first that the spec allows and the host has room for; the peak is checked
    again, on the order and on the simulated memory curve, until both fit. None when it cannot fit."""
    from pipec.errors import PipecError

    if spec.limit is None:
        return None
    hm = hm or host_model(spec)
    mc = spec_machine(spec)
    dur = [mc.F, mc.B, mc.W]
    mem = [list(r) for r in memops] if memops else [[] for _ in range(spec.p)]
    done = {(x.mb, x.stage) for r in mem for x in r if x.op in ("OFFLOAD", "RECOMPUTE")}
    slack = [0.0] * spec.p  # how far below its limit a rank's order must go for its curve to fit too
    limit = list(spec.limit)
    host_lim = [math.inf if not x == x else float(x) for x in hm.host_limit]
    act_unit = float(mc.act.max()) if len(mc.act) else 1.0
    rounds = rounds if rounds is not None else 2 * spec.num_stages * spec.m + 8
    for _ in range(rounds):
        sched = to_schedule(replace(spec, limit=None, host_limit=None), orders, "repair", tuple(map(tuple, mem)))
        reps = rank_memory(sched)
        over = [rep for rep in reps if rep.peak > limit[rep.rank] - slack[rep.rank] + 1e-9]
        if not over:
            try:
                _, fig = evaluate_orders(spec, orders, memops=tuple(map(tuple, mem)))
            except PipecError:
                return None
            if _fits(spec, fig):
                cand_memops = tuple(tuple(r) for r in mem)
                return Candidate(None, Derived(tuple(orders), (), (), fig.peak), "repair", cand_memops, label)
            bad = [r for r, (pk, lim) in enumerate(zip(fig.peak, limit)) if pk > lim + 1e-9]
            if not bad:
                return None  # the host pool: nothing left to trade here
            for r in bad:
                slack[r] += act_unit / 2
            continue
        rep = over[0]
        r = rep.rank
        ops = orders[r]
        index = {op: j for j, op in enumerate(ops)}
        live = [(i, s) for i, s in rep.live_act if (i, s) not in done]
        if not live:
            # every activation at the peak is offloaded already, some reloaded before it: issue one RELOAD later
            if not _later_reload(mem[r], rep, index):
                return None
            continue
        i, s = max(live, key=lambda x: (index[(1, x[0], x[1])] - max(index[(0, x[0], x[1])], rep.peak_index), -x[0]))
        f, b = index[(0, i, s)], index[(1, i, s)]
        done.add((i, s))
        can_offload = "offload" in spec.memops and rep.host_peak + mc.act[s] <= host_lim[r] + 1e-9
        can_recompute = "recompute" in spec.memops and hm.ckpt[s] < mc.act[s]
        if can_offload and (prefer == "offload" or not can_recompute):
            # the RELOAD as early as the ops before B hide it, but after the OFFLOAD and the peak
            need, j = float(hm.seconds[s]), b
            while j > f + 1 and need > 1e-12 and j - 1 > rep.peak_index:
                j -= 1
                k, _, s2 = ops[j]
                need -= float(dur[k][s2])
            mem[r] += [MemOp("OFFLOAD", i, s, f + 1), MemOp("RELOAD", i, s, j)]
        elif can_recompute:
            mem[r].append(MemOp("RECOMPUTE", i, s, b))
        else:
            continue
        mem[r].sort(key=_memop_order)
    return None


def _memop_order(x: MemOp) -> tuple[int, int]:
    """Memops in issue order: by the op they precede, then an OFFLOAD, a RELOAD, a RECOMPUTE (which runs
    from what the RELOAD brought back)."""
    return x.before, ("OFFLOAD", "RELOAD", "RECOMPUTE").index(x.op)


def _later_reload(mem: list[MemOp], rep, index: dict) -> bool:
    """Move the RELOAD of an activation live at the peak (`rep`) to just after it, before its B, when one is
    issued before the peak: the one whose B is furthest. Whether one moved."""
    j = rep.peak_index
    movable = [
        (index[(1, x.mb, x.stage)], n)
        for n, x in enumerate(mem)
        if x.op == "RELOAD" and (x.mb, x.stage) in set(rep.live_act) and x.before <= j < index[(1, x.mb, x.stage)]
    ]
    if not movable:
        return False
    b, n = max(movable)
    x = mem[n]
    mem[n] = MemOp("RELOAD", x.mb, x.stage, min(j + 1, b))
    mem.sort(key=_memop_order)
    return True


def repair_candidates(spec: Spec, plain: Sequence[Candidate], progress: Progress | None = None) -> list[Candidate]:
    """Memory ops added (`repair`) to the library schedules of the spec's shape whatever their memory, and to
    the plain candidates found under the limit."""
    hm = host_model(spec)
    out = []
    starts = [(c.derived.orders, c.describe()) for c in plain if not c.memops]
    starts += [(c.derived.orders, c.describe()) for c in library_seeds(replace(spec, limit=None, host_limit=None))]
    seen = set()
    for orders, what in starts:
        if orders in seen:
            continue
        seen.add(orders)
        for prefer in spec.memops:
            label = f"{what}, with memory ops added at its peaks ({prefer} first)"
            c = repair(spec, orders, label=label, hm=hm, prefer=prefer)
            if c is not None:
                out.append(c)
                if progress:
                    n = sum(len(x) for x in c.memops)
                    progress(f"memory ops: {n} added to {what} ({prefer} first)")
    return out


def sequential_plan(spec: Spec, hm: HostModel | None = None, prefer: str = "offload"):
    """One micro-batch at a time through the whole pipeline (F down, then B and W back), what a forward keeps
    while its rank runs a later stage of the same micro-batch offloaded (host room permitting) or recomputed,
    whichever `prefer` names first and the spec allows. (orders, memops)."""
    hm = hm or host_model(spec)
    mc = spec_machine(spec)
    place, S, m = spec.place(), spec.num_stages, spec.m
    orders: list[list[tuple[int, int, int]]] = [[] for _ in range(spec.p)]
    for i in range(m):
        for s in range(S):
            orders[place[s]].append((0, i, s))
        for s in reversed(range(S)):
            orders[place[s]].append((1, i, s))
            if spec.split:
                orders[place[s]].append((2, i, s))
    kinds = [k for k in ((prefer,) + MEMOP_KINDS) if k in spec.memops]
    memops: list[list[MemOp]] = [[] for _ in range(spec.p)]
    for r, ops in enumerate(orders):
        index = {op: j for j, op in enumerate(ops)}
        room = math.inf if not hm.host_limit[r] == hm.host_limit[r] else float(hm.host_limit[r])
        mine = [s for s in range(S) if place[s] == r]
        held = [s for s in mine if any(t > s for t in mine)]  # its F is followed by a later F of the mb here
        for i in range(m):
            used = 0.0
            for s in held:
                f, b = index[(0, i, s)], index[(1, i, s)]
                for k in kinds:
                    if k == "offload" and used + mc.act[s] <= room + 1e-9:
                        used += mc.act[s]
                        memops[r] += [MemOp("OFFLOAD", i, s, f + 1), MemOp("RELOAD", i, s, b)]
                        break
                    if k == "recompute" and hm.ckpt[s] < mc.act[s]:
                        memops[r].append(MemOp("RECOMPUTE", i, s, b))
                        break
        memops[r].sort(key=lambda x: (x.before, x.op != "OFFLOAD"))
    return tuple(tuple(o) for o in orders), tuple(tuple(x) for x in memops)


def least_plan(spec: Spec):
    """The sequential plan (`sequential_plan`) holding the least memory per rank, by pipec's memory check of
    its order and by its simulated memory curve (the larger of the two: during an OFFLOAD's transfer both
    pools hold the micro-batch, so a fast host link beats recomputation and a slow one does not): each rank
    takes the variant, offload or recompute first, whose peak is lower. (orders, memops, per-rank peaks)."""
    free = replace(spec, limit=None, host_limit=spec.host_limit)
    hm = host_model(spec)
    variants = []
    for prefer in MEMOP_KINDS if spec.memops else ("offload",):
        orders, memops = sequential_plan(spec, hm, prefer)
        variants.append((memops, _peaks(free, orders, memops)))
    pick = [min(range(len(variants)), key=lambda v: variants[v][1][r]) for r in range(spec.p)]
    memops = tuple(variants[v][0][r] for r, v in enumerate(pick))
    return orders, memops, _peaks(free, orders, memops)


def _peaks(spec: Spec, orders, memops: MemOps) -> tuple[float, ...]:
    sched = to_schedule(spec, orders, "floor", memops)
    order = [float(rep.peak) for rep in rank_memory(sched)]
    _, fig = evaluate_orders(spec, orders, memops=memops)
    return tuple(max(a, b) for a, b in zip(order, fig.peak))


def memory_floor(spec: Spec) -> tuple[float, ...]:
    """Per rank, the least memory the search can always reach with the memory ops the spec allows: the peak
    of `least_plan` (a forward holds its stage's activations while it runs, so no schedule holds less than
    the largest of them)."""
    return least_plan(spec)[2]


def check_floor(spec: Spec) -> tuple[float, ...]:
    """The floor, or E703 when the limit is below it on some rank."""
    floor = memory_floor(spec)
    if spec.limit is None:
        return floor
    over = [r for r, (f, lim) in enumerate(zip(floor, spec.limit)) if f > lim + 1e-9]
    if over:
        r = over[0]
        ops = (
            " and ".join({"recompute": "recomputation", "offload": "offload"}[k] for k in spec.memops)
            or "no memory ops"
        )
        raise error(
            "E703",
            f"no schedule fits memory limit {_g(spec.limit[r])} on rank {r}: the least it can hold is {_g(floor[r])}",
            notes=(
                f"the least per rank, with {ops}: {' '.join(_g(x) for x in floor)} (one micro-batch at a time; a "
                "forward holds its stage's activations while it runs)",
                f"give --memory-limit {_g(max(floor[x] for x in over))} or more",
            ),
        )
    return floor


# ---- exact improvement (CP-SAT) ---------------------------------------------------------


def memory_demands(
    model: Mapping[str, np.ndarray], stage: int, mb: int, split: bool, variants: Sequence[str | None]
) -> list[tuple[Hold, tuple[str | None, ...]]]:
    """What (micro-batch `mb`, stage `stage`) holds in each pool under each of these variants (None: plain,
    "RECOMPUTE", "OFFLOAD"): the memory walk's intervals (`pipec.sim.memory.unit_holds`), each once with
    the variants it occurs in (the B-to-W hold, for one, occurs in all). The solver's cumulative demands."""
    seen: dict[Hold, list[str | None]] = {}
    for v in variants:
        for hold in unit_holds(model, stage, mb, split, v):
            seen.setdefault(hold, []).append(v)
    return [(hold, tuple(vs)) for hold, vs in seen.items()]


def solver_available() -> str | None:
    """None when OR-Tools' CP-SAT can be imported, else why not."""
    try:
        from ortools.sat.python import cp_model  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        return f"OR-Tools is not installed ({e}); install the extra: pip install 'pipec[synth]'"
    return None


def _scale(values: Sequence[float], limit: int = 1000) -> int:
    """The smallest integer k <= limit making every value * k an integer (to 1e-9), else `limit`."""
    fr = [Fraction(v).limit_denominator(limit) for v in values if v]
    k = 1
    for f in fr:
        k = k * f.denominator // math.gcd(k, f.denominator)
        if k > limit:
            return limit
    return k


@dataclass(frozen=True)
class SolveResult:
    orders: tuple[tuple[tuple[int, int, int], ...], ...] | None
    status: str  # "optimal", "improved", "no better", "unavailable", "skipped"
    bound: float | None  # proven lower bound on the makespan (scaled back), when known
    seconds: float
    memops: MemOps = ()  # the memory ops of `orders`


Times = Mapping[tuple, float]  # start times: (kind index, mb, stage) for F, B, W; (memop name, mb, stage) for memops


def start_times(d: Derived) -> tuple[float, dict]:
    """The makespan and start times of a list-scheduled candidate, for the solver's warm start."""
    times: dict[tuple, float] = {}
    for ops, starts in zip(d.orders, d.start):
        for op, t in zip(ops, starts):
            times[op] = t
    return d.makespan, times


def sim_times(sim) -> tuple[float, dict]:
    """The makespan and start times of a simulated schedule (`pipec.driver.simulation`), its memory ops'
    included, for the solver's warm start."""
    from pipec.ir.opcodes import KIND_OF, OPCODES

    tl = sim.timeline
    times: dict[tuple, float] = {}
    for op, i, s, a in zip(tl.op.tolist(), tl.mb.tolist(), tl.stage.tolist(), tl.start.tolist()):
        k = int(KIND_OF[op])
        times[(k, i, s) if k >= 0 else (OPCODES[op], i, s)] = a
    for op, i, s, a in zip(tl.host_op.tolist(), tl.host_mb.tolist(), tl.host_stage.tolist(), tl.host_start.tolist()):
        times[(OPCODES[op], i, s)] = a
    return float(sim.stats.makespan), times


def _recompute_shifted(mc: Machine, times: dict, memops: MemOps) -> dict:
    """A list-scheduled recomputation seed's times (`recompute_candidates`: B ran as B + F): each RECOMPUTE
    starts where its merged B did, and the B after it."""
    out = dict(times)
    for x in (x for rank in memops for x in rank if x.op == "RECOMPUTE"):
        b = (1, x.mb, x.stage)
        if b in out:
            out[("RECOMPUTE", x.mb, x.stage)] = out[b]
            out[b] = out[b] + float(mc.F[x.stage])
    return out


def improve(
    spec: Spec,
    start: Derived,
    time_limit: float,
    progress: Progress | None = None,
    workers: int = 2,
    memops: MemOps = (),
    times: tuple[float, Times] | None = None,
    decide_memops: bool | None = None,
) -> SolveResult:
    """CP-SAT from a candidate (`start`, its memory ops, or explicit start times): a schedule with a smaller
    (makespan, memory ops, cost), if it finds one. Under a memory limit with memory ops allowed, each
    (micro-batch, stage) may be recomputed or offloaded (docs/synth.md, "Under a memory limit"), unless
    `decide_memops` is False."""
    why = solver_available()
    if why is not None:
        return SolveResult(None, "unavailable", None, 0.0)
    from ortools.sat.python import cp_model

    t0 = time.monotonic()
    mc = spec_machine(spec)
    S, R, m = mc.num_stages, mc.num_ranks, mc.num_microbatches
    place = mc.placement
    split = mc.split
    kinds = 3 if split else 2
    delays = _delays(mc)
    limited = len(mc.limit) > 0 and bool(np.any(mc.limit == mc.limit))
    use_mem = limited and bool(spec.memops) and decide_memops is not False
    hm = host_model(spec) if use_mem else None
    rc_ok = use_mem and "recompute" in spec.memops
    off_ok = use_mem and "offload" in spec.memops
    host_s = list(hm.seconds) if off_ok else []
    k_t = _scale(list(mc.F) + list(mc.B) + list(mc.W) + list(delays.values()) + host_s)
    mem_vals = list(mc.act) + (list(mc.wact) if split else []) + (list(hm.ckpt) if rc_ok else [])
    host_lim = [x for x in hm.host_limit if x == x] if off_ok else []
    k_m = _scale(mem_vals + [x for x in mc.limit if x == x] + list(mc.params) + host_lim, 100)
    mem_model = {"act": mc.act, "wact": mc.wact, "ckpt": hm.ckpt if rc_ok else mc.act, "params": 0 * mc.act}

    def T(x: float) -> int:
        return int(round(x * k_t))

    if times is None:
        times = start_times(start)
        if memops:
            times = (times[0], _recompute_shifted(mc, dict(times[1]), memops))
    ms0, hint = times
    dur = [[T(x) for x in mc.F], [T(x) for x in mc.B], [T(x) for x in mc.W]]
    horizon = T(ms0) if not use_mem else int(math.ceil(T(ms0) * 1.25)) + max(max(d) for d in dur)
    model = cp_model.CpModel()
    st, en, iv = {}, {}, {}
    for s in range(S):
        for i in range(m):
            for k in range(kinds):
                d = dur[k][s]
                a = model.NewIntVar(0, horizon - d, f"s{k}_{i}_{s}")
                st[k, i, s] = a
                en[k, i, s] = a + d
                iv[k, i, s] = model.NewFixedSizeIntervalVar(a, d, f"i{k}_{i}_{s}")
    rules = active(kinds)  # the dependency rule (pipec.ir.rules), a message's delay between stages
    for s in range(S):
        for i in range(m):
            for k in range(kinds):
                for k2, i2, s2 in needs(k, i, s, S, rules):
                    model.Add(st[k, i, s] >= en[k2, i2, s2] + (T(delays.get((k2, s2), 0.0)) if s2 != s else 0))
    # Memory ops: per (micro-batch, stage), a RECOMPUTE on the rank's compute between F and B, or an OFFLOAD
    # after F and its RELOAD before B on the rank's host link.
    rc, rcs, off, ofs, rls = {}, {}, {}, {}, {}
    compute_extra: dict[int, list] = {r: [] for r in range(R)}
    host_ivs: dict[int, list] = {r: [] for r in range(R)}
    for s in range(S):
        r = place[s]
        for i in range(m):
            if rc_ok and hm.ckpt[s] < mc.act[s]:
                b = rc[i, s] = model.NewBoolVar(f"rc{i}_{s}")
                a = rcs[i, s] = model.NewIntVar(0, horizon, f"rcs{i}_{s}")
                compute_extra[r].append(model.NewOptionalFixedSizeIntervalVar(a, dur[0][s], b, f"rci{i}_{s}"))
                model.Add(a >= en[0, i, s]).OnlyEnforceIf(b)
                model.Add(a + dur[0][s] <= st[1, i, s]).OnlyEnforceIf(b)
            if off_ok:
                h = T(hm.seconds[s])
                o = off[i, s] = model.NewBoolVar(f"off{i}_{s}")
                a = ofs[i, s] = model.NewIntVar(0, horizon, f"ofs{i}_{s}")
                c = rls[i, s] = model.NewIntVar(0, horizon, f"rls{i}_{s}")
                host_ivs[r].append(model.NewOptionalFixedSizeIntervalVar(a, h, o, f"ofi{i}_{s}"))
                host_ivs[r].append(model.NewOptionalFixedSizeIntervalVar(c, h, o, f"rli{i}_{s}"))
                model.Add(a >= en[0, i, s]).OnlyEnforceIf(o)
                model.Add(c >= a + h).OnlyEnforceIf(o)
                model.Add(c + h <= st[1, i, s]).OnlyEnforceIf(o)
            if (i, s) in rc and (i, s) in off:
                model.AddBoolOr([rc[i, s].Not(), off[i, s].Not()])
    for r in range(R):
        mine = [s for s in range(S) if place[s] == r]
        model.AddNoOverlap([iv[k, i, s] for s in mine for i in range(m) for k in range(kinds)] + compute_extra[r])
        if host_ivs[r]:
            model.AddNoOverlap(host_ivs[r])
        lim = mc.limit[r] if len(mc.limit) else math.nan
        if lim == lim:
            cap = int(math.floor((lim - mc.params[r]) * k_m + 1e-9))
            ivs: list = []
            dem: list[int] = []

            host: list = []
            host_dem: list[int] = []

            def held(a, e, d, lit, name, ivs=ivs, dem=dem):
                """Demand d from a to e, when lit (None: always)."""
                length = model.NewIntVar(0, horizon, name)
                if lit is None:
                    model.Add(length == e - a)
                    ivs.append(model.NewIntervalVar(a, length, e, name + "i"))
                else:
                    model.Add(length == e - a).OnlyEnforceIf(lit)
                    ivs.append(model.NewOptionalIntervalVar(a, length, e, lit, name + "i"))
                dem.append(d)

            # What each (micro-batch, stage) holds, and when: the memory walk's (`memory_demands`), per variant
            # (plain, recomputed, offloaded), at this model's start and end times of its instructions.
            for s in mine:
                for i in range(m):
                    lits = {"RECOMPUTE": rc.get((i, s)), "OFFLOAD": off.get((i, s))}
                    lits = {v: x for v, x in lits.items() if x is not None}
                    if lits:
                        lits[None] = model.NewBoolVar(f"plain{i}_{s}")
                        model.Add(sum(lits.values()) == 1)
                    at = {("FWD", "start"): st[0, i, s], ("BWD", "end"): en[1, i, s]}
                    if split:
                        at["WGRAD", "end"] = en[2, i, s]
                    if (i, s) in rc:
                        at["RECOMPUTE", "start"] = rcs[i, s]
                    if (i, s) in off:
                        h = T(hm.seconds[s])
                        at["OFFLOAD", "start"], at["OFFLOAD", "end"] = ofs[i, s], ofs[i, s] + h
                        at["RELOAD", "start"], at["RELOAD", "end"] = rls[i, s], rls[i, s] + h
                    variants = tuple(lits) or (None,)
                    for n, (hold, where) in enumerate(memory_demands(mem_model, s, i, split, variants)):
                        d = int(round(hold.amount * k_m))
                        if d == 0:
                            continue
                        lit = None
                        if len(where) < len(variants):
                            lit = lits[where[0]]
                            if len(where) > 1:  # the variants exclude each other: one of these
                                lit = model.NewBoolVar(f"v{n}_{i}_{s}")
                                model.Add(lit == sum(lits[v] for v in where))
                        a, e = at[hold.since], at[hold.until]
                        if hold.pool == "device":
                            held(a, e, d, lit, f"m{n}_{i}_{s}")
                        else:
                            held(a, e, d, lit, f"h{n}_{i}_{s}", host, host_dem)
            model.AddCumulative(ivs, dem, cap)
            hlim = hm.host_limit[r] if off_ok else math.nan
            if host and hlim == hlim:
                model.AddCumulative(host, host_dem, int(math.floor(hlim * k_m + 1e-9)))
    makespan = model.NewIntVar(0, horizon, "makespan")
    cost = model.NewIntVar(0, horizon, "cost")
    ends = [en[kinds - 1, i, s] for s in range(S) for i in range(m)] + [en[1, i, s] for s in range(S) for i in range(m)]
    model.AddMaxEquality(makespan, ends)
    for r in range(R):
        mine = [s for s in range(S) if place[s] == r]
        first = model.NewIntVar(0, horizon, f"first{r}")
        model.AddMinEquality(first, [st[0, i, s] for s in mine for i in range(m)])
        end_r = model.NewIntVar(0, horizon, f"end{r}")
        model.AddMaxEquality(end_r, [en[k, i, s] for s in mine for i in range(m) for k in range(kinds)])
        model.Add(cost >= end_r - first)
    # Lexicographic: the makespan, then the number of memory ops (none unless they shorten the step or fit
    # the limit), then the cost.
    n_mem = len(rc) + len(off)
    per_ms = (horizon + 1) * (n_mem + 1)
    model.Minimize(makespan * per_ms + (sum(rc.values()) + sum(off.values())) * (horizon + 1) + cost)
    # Warm start: the candidate's times and memory ops.
    placed = {(x.op, x.mb, x.stage) for rank in memops for x in rank}
    for key, a in st.items():
        if key in hint:
            model.AddHint(a, T(hint[key]))
    for (i, s), b in rc.items():
        model.AddHint(b, ("RECOMPUTE", i, s) in placed)
        if ("RECOMPUTE", i, s) in hint:
            model.AddHint(rcs[i, s], T(hint["RECOMPUTE", i, s]))
    for (i, s), o in off.items():
        model.AddHint(o, ("OFFLOAD", i, s) in placed)
        for name, var in (("OFFLOAD", ofs), ("RELOAD", rls)):
            if (name, i, s) in hint:
                model.AddHint(var[i, s], T(hint[name, i, s]))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.1, time_limit)
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = 0

    class Cb(cp_model.CpSolverSolutionCallback):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def on_solution_callback(self) -> None:
            self.n += 1
            if progress:
                ms = self.Value(makespan) / k_t
                c = self.Value(cost) / k_t
                bound = self.BestObjectiveBound() // per_ms / k_t
                n = sum(self.Value(x) for x in rc.values()) + sum(self.Value(x) for x in off.values())
                extra = f", {n} memory ops" if use_mem else ""
                progress(
                    f"solver: makespan {_g(ms)} (cost {_g(c)}{extra}), bound {_g(bound)}, {time.monotonic() - t0:.1f} s"
                )

    status = solver.Solve(model, Cb())
    secs = time.monotonic() - t0
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return SolveResult(None, "no better", None, secs)
    bound = (solver.BestObjectiveBound() // per_ms) / k_t
    orders, placed_ops = [], []
    for r in range(R):
        mine = [s for s in range(S) if place[s] == r]
        ops = [(k, i, s) for s in mine for i in range(m) for k in range(kinds)]
        ops.sort(key=lambda o: (solver.Value(st[o]), o[0] != 0, o))
        orders.append(tuple(ops))
        starts = [solver.Value(st[o]) for o in ops]
        ends = [x + dur[o[0]][o[2]] for x, o in zip(starts, ops)]
        index = {o: j for j, o in enumerate(ops)}
        mem: list[tuple[int, int, int, MemOp]] = []
        for s in mine:
            for i in range(m):
                f, b = index[(0, i, s)], index[(1, i, s)]
                if (i, s) in rc and solver.Value(rc[i, s]):
                    a = solver.Value(rcs[i, s])
                    before = min(max(f + 1, sum(1 for x in starts if x < a)), b)
                    mem.append((before, a, 2, MemOp("RECOMPUTE", i, s, before)))
                if (i, s) in off and solver.Value(off[i, s]):
                    a, c = solver.Value(ofs[i, s]), solver.Value(rls[i, s])
                    mem.append((f + 1, a, 0, MemOp("OFFLOAD", i, s, f + 1)))
                    # issued with the op running when it starts (or the next): the stream reaches it in time
                    j = next((j for j, e in enumerate(ends) if e > c), len(ops))
                    before = min(max(f + 1, j), b)
                    mem.append((before, c, 1, MemOp("RELOAD", i, s, before)))
        mem.sort(key=lambda x: x[:3])
        placed_ops.append(tuple(x[3] for x in mem))
    return SolveResult(
        tuple(orders),
        "optimal" if status == cp_model.OPTIMAL else "improved",
        bound,
        secs,
        tuple(placed_ops) if any(placed_ops) else (),
    )


def _delays(mc: Machine) -> dict[tuple[int, int], float]:
    """Message delay after the producing op: (0, s) activation s -> s+1, (1, s) gradient s -> s-1.
    Latency + comm + bytes / bandwidth, without the queueing of back-to-back messages."""
    out = {}
    S, place = mc.num_stages, mc.placement
    for s in range(S):
        for kind, dst_stage, nbytes in ((0, s + 1, mc.act_bytes[s]), (1, s - 1, mc.grad_bytes[s])):
            if not 0 <= dst_stage < S:
                continue
            a, b = place[s], place[dst_stage]
            if a == b:
                out[kind, s] = 0.0
                continue
            bw = mc.bandwidth[a, b]
            tx = nbytes / bw if nbytes > 0 and np.isfinite(bw) else 0.0
            out[kind, s] = float(mc.latency[a, b] + mc.comm[s] + tx)
    return out


# ---- evaluation of fixed orders --------------------------------------------------------------


@dataclass(frozen=True)
class Figures:
    makespan: float
    cost: float
    bubble: float
    peak: tuple[float, ...]
    host_peak: tuple[float, ...] = ()  # per rank, the host pool's peak (memory ops)
    memops: int = 0  # how many memory ops the schedule places

    @property
    def key(self) -> tuple[float, float]:
        return (round(self.makespan, 9), round(self.cost, 9))

    @property
    def key3(self) -> tuple[float, int, float]:
        """The search's order under a memory limit: makespan, then memory ops, then cost."""
        return (round(self.makespan, 9), self.memops, round(self.cost, 9))


def evaluate_orders(spec: Spec, orders, name: str = "synth", memops: MemOps = ()):
    """Check, lower and simulate these orders (and memory ops) under the spec (pipec.driver.simulation): every
    check runs."""
    from pipec.driver import simulation
    from pipec.passes.checks import check_schedule
    from pipec.view.report import curves_of

    sched = to_schedule(spec, orders, name, memops)
    check_schedule(sched)
    sim = simulation(sched, spec.cost_docs)
    st = sim.stats
    peak = tuple(r.peak_memory or 0.0 for r in st.ranks)
    host = tuple(float(x) for x in curves_of(sim).host_peak)
    fig = Figures(st.makespan, st.cost, st.bubble_rate, peak, host, sum(len(x) for x in memops))
    return sim, fig


@dataclass(frozen=True, eq=False)
class Result:
    spec: Spec
    orders: tuple[tuple[tuple[int, int, int], ...], ...]
    figures: Figures
    heuristic: Candidate
    heuristic_figures: Figures
    solver_status: str
    solver_note: str | None
    bound: float | None
    seconds_heuristic: float
    seconds_solver: float
    memops: MemOps = ()  # per rank, the memory ops the schedule places (pipec.ir.schedule.MemOp)
    floor: tuple[float, ...] | None = None  # per rank, the least memory the search can reach (`memory_floor`)


def synthesize(
    spec: Spec,
    time_limit: float = 30.0,
    use_solver: bool | None = None,
    progress: Progress | None = None,
    max_solver_ops: int = 2000,
) -> Result:
    """Heuristic, then (unless told not to, or the case is too large) CP-SAT from its result.

    Under a memory limit with memory ops allowed (`Spec.memops`), a limit below the floor (`memory_floor`) is
    E703; the plain policies may all fail (E701 only without memory ops); recomputation seeds join the
    candidates, and the schedule that runs one micro-batch at a time stands when nothing else fits; the solver
    decides per (micro-batch, stage) whether to recompute or offload. Candidates rank by (makespan, memory
    ops, cost): memory ops stay out unless they shorten the step or are needed to fit."""
    from pipec.errors import PipecError

    t0 = time.monotonic()
    memory_ops = bool(spec.memops) and spec.limit is not None
    floor = check_floor(spec) if memory_ops else None
    cands: list[Candidate] = []
    try:
        cands.append(heuristic(spec, progress))
    except PipecError as e:
        if not memory_ops or e.code != "E701":
            raise
        if progress:
            progress("heuristic: no policy fits without memory ops")
    # Memory ops are for limits below 1F1B's memory (or ones no plain policy meets): above it they are not
    # searched, and the search is the one of the plain schedules.
    memory_ops = memory_ops and (not cands or below_1f1b(spec))
    if memory_ops:
        cands += recompute_candidates(spec, progress)
        cands += repair_candidates(spec, [c for c in cands if not c.memops], progress)
    scored: list[tuple[Candidate, Figures, object]] = []
    for c in cands:
        try:
            sim, f = evaluate_orders(spec, c.derived.orders, memops=c.memops)
        except PipecError:  # a seed that pipec's own checks refuse (its memory, by the order model)
            continue
        if _fits(spec, f):
            scored.append((c, f, sim))
    if not scored:
        orders, mops, _ = least_plan(spec)
        sim, f = evaluate_orders(spec, orders, memops=mops)
        seq = Candidate(None, Derived(orders, (), (), f.peak), "sequential", mops, "one micro-batch at a time")
        scored.append((seq, f, sim))
        if progress:
            progress(f"memory ops: makespan {_g(f.makespan)} running one micro-batch at a time")
    best, h_fig, best_sim = min(scored, key=lambda x: x[1].key3)
    t_h = time.monotonic() - t0
    orders, memops, fig = best.derived.orders, best.memops, h_fig
    n_ops = spec.num_stages * spec.m * (3 if spec.split else 2)
    status, note, bound, t_s = "skipped", None, None, 0.0
    why = solver_available() if use_solver is not False else None  # (importing OR-Tools takes seconds)
    if use_solver is False:
        note = "solver not asked for (--no-solver)"
    elif why is not None:
        status, note = "unavailable", why
    elif use_solver is None and n_ops > max_solver_ops:
        note = f"solver skipped: {n_ops} ops is above {max_solver_ops} (use --solver to force it)"
    elif time_limit <= 0:
        note = "solver skipped: no time left"
    else:
        if progress:
            what = " with memory-op decisions" if memory_ops else ""
            progress(f"solver: CP-SAT on {n_ops} ops{what}, warm-started, limit {time_limit:g} s")
        times = sim_times(best_sim) if best.memops else None
        res = improve(
            spec, best.derived, time_limit, progress, memops=best.memops, times=times, decide_memops=memory_ops
        )
        status, bound, t_s = res.status, res.bound, res.seconds
        if res.orders is not None:
            try:
                _, f2 = evaluate_orders(spec, res.orders, memops=res.memops)
            except PipecError as e:  # the solver's model is coarser than pipec's checks; keep the heuristic's
                f2 = None
                if progress:
                    progress(f"solver: its orders fail pipec's checks ({e.diagnostics[0].message})")
            if progress and f2 is not None:
                fits = "fits" if _fits(spec, f2) else f"over the limit (peak {_g(max(f2.peak))})"
                progress(f"solver: simulated makespan {_g(f2.makespan)}, {f2.memops} memory ops, {fits}")
            if f2 is not None and not _fits(spec, f2) and memory_ops:
                # the solver's memory is coarser than the simulated curve (the host link runs in issue order):
                # more memory ops where the curve still passes the limit
                fixed = repair(spec, res.orders, res.memops)
                if fixed is not None:
                    _, f2 = evaluate_orders(spec, fixed.derived.orders, memops=fixed.memops)
                    res = replace(res, memops=fixed.memops)
                    if progress:
                        progress(f"solver: repaired to makespan {_g(f2.makespan)} with {f2.memops} memory ops")
            if f2 is not None and _fits(spec, f2) and f2.key3 < fig.key3:
                orders, memops, fig = res.orders, res.memops, f2
            elif status == "improved":
                status = "no better"
    return Result(spec, orders, fig, best, h_fig, status, note, bound, t_h, t_s, memops, floor)


def below_1f1b(spec: Spec) -> bool:
    """Whether the limit is below 1F1B's peak on some rank, under the spec's memory model."""
    from pipec.errors import PipecError

    if spec.limit is None:
        return False
    try:
        rows = library_comparison(replace(spec, limit=None, host_limit=None), ["1f1b"])
    except PipecError:
        return True
    fig = rows[0][2]
    return fig is None or any(lim < p - 1e-9 for lim, p in zip(spec.limit, fig.peak))


def _fits(spec: Spec, fig: Figures) -> bool:
    dev = spec.limit is None or all(p <= lim + 1e-9 for p, lim in zip(fig.peak, spec.limit))
    host = spec.host_limit is None or all(p <= lim + 1e-9 for p, lim in zip(fig.host_peak, spec.host_limit))
    return dev and host


def _g(x: float) -> str:
    return f"{x:.6g}"


# ---- writing the .pipe file -------------------------------------------------------------------


def _fmt_num(x: float) -> str:
    """A number for the header's comments (six significant digits)."""
    return f"{x:g}" if abs(x - round(x, 6)) < 1e-12 else repr(x)


def order_steps(ops: Sequence[tuple[int, int, int]], kinds: Sequence[str] = ("F", "B", "W")) -> list[Step]:
    """A derived order, (kind index, micro-batch, stage) per op, as the steps `pipe_text` writes."""
    return [((kinds[k], i, s),) for k, i, s in ops]


def write_pipe(result: Result, name: str, command: str | None = None, comparison: str | None = None) -> str:
    """The synthesized schedule as a `.pipe` file: header comment, declarations, per-rank orders.

    The declarations are the whole cost model the search used (compute times, message costs and sizes,
    the topology with every link's latency and bandwidth) and its memory model, written so they read
    back as the same floats: `pipec simulate` of the file gives the figures of the header. What the
    language cannot declare (a per-send overhead, per-node links) is named in the header instead."""
    spec, fig = result.spec, result.figures
    sched = shape(spec)
    cm = cost_model(sched, spec.cost_docs)
    full_b = cm.B if spec.split else cm.B + cm.W  # without W, a declared B is the full backward
    mem = memory_model(sched)
    R = spec.p
    sized = bool(np.any(cm.act_bytes) or np.any(cm.grad_bytes))
    dcs = [(d.name, d.lo, d.hi) for d in spec.topology.datacenters] if spec.topology is not None else []
    topology = topology_lines(dcs, cm.latency, cm.bandwidth, sized)
    lines = [
        f"# {name}: synthesized by `pipec synth` for p={spec.p}, m={spec.m}"
        + (f", v={spec.v} ({spec.placement} placement)" if spec.v > 1 else "")
        + "."
    ]
    if command:
        lines.append(f"# Command: {command}")
    per_stage = {"F": cm.F, "B": full_b, "W": cm.W, "comm": cm.comm}
    if any(x.op == "OFFLOAD" for rank in result.memops for x in rank):
        # the seconds of each OFFLOAD and RELOAD as the search charged them (from `offload`, or bytes over the
        # host link's bandwidth, or the default), declared so the file simulates the same without the costs
        per_stage["offload"] = _host_seconds(cm, spec)
    costs = ", ".join(f"{k}={_per_stage_text(v)}" for k, v in per_stage.items())
    lines.append(f"# Costs (per stage): {costs}" + ("" if spec.split else " (B is the full backward)"))
    undeclared = []
    if cm.overhead:
        undeclared.append(f"overhead={_fmt_num(cm.overhead)} s per send and receive")
    if topology is None:
        undeclared.append("links that differ inside a datacenter (ranks_per_node)")
    if spec.host_limit is not None and "host_limit" not in MEMORY_KEYS:
        undeclared.append("the host memory limit (give --host-memory-limit to pipec check)")
    if (
        any(x.op == "RECOMPUTE" for rank in result.memops for x in rank)
        and "ckpt" not in MEMORY_KEYS
        and not np.array_equal(mem["ckpt"], mem["act"] / 8)
    ):
        undeclared.append(f"ckpt={_per_stage_text(mem['ckpt'])} (give --mem ckpt=... to pipec check)")
    if undeclared:
        lines.append(
            "# Not declared below (the language has no declaration for it; give the same --cost to pipec "
            "simulate): " + "; ".join(undeclared)
        )
    lim = "none" if spec.limit is None else " ".join(_fmt_num(x) for x in spec.limit)
    ckpt = f" ckpt={_per_stage_text(mem['ckpt'])}" if result.memops and "ckpt" in mem else ""
    host_lim = "" if spec.host_limit is None else "; host limit per rank: " + " ".join(map(_fmt_num, spec.host_limit))
    lines.append(
        f"# Memory: act={_per_stage_text(mem['act'])} wact={_per_stage_text(mem['wact'])}{ckpt}"
        f" params={_per_stage_text(mem['params'])}; limit per rank: {lim}{host_lim}"
    )
    if result.memops:
        kinds = {}
        for x in (x for rank in result.memops for x in rank):
            kinds[x.op] = kinds.get(x.op, 0) + 1
        what = ", ".join(f"{n} {op}" for op, n in kinds.items())
        floor = "" if result.floor is None else f"; the least memory the search can reach: {_g(max(result.floor))}"
        lines.append(f"# Memory ops: {what} (to meet the limit at the shortest step found){floor}")
    lines.append(
        f"# Simulated: makespan {_g(fig.makespan)}, bubble rate {fig.bubble:.2%} (cost {_g(fig.cost)}),"
        f" peak memory per rank {' '.join(_g(x) for x in fig.peak)}"
    )
    h = result.heuristic
    lines.append(
        f"# Heuristic: {h.describe()}, makespan {_g(result.heuristic_figures.makespan)},"
        f" bubble {result.heuristic_figures.bubble:.2%} ({result.seconds_heuristic:.1f} s)"
    )
    solver = f"# Solver: {result.solver_status}"
    if result.bound is not None:
        solver += f", makespan lower bound {_g(result.bound)}"
    if result.seconds_solver:
        solver += f" ({result.seconds_solver:.1f} s)"
    if result.solver_note:
        solver += f"; {result.solver_note}"
    lines.append(solver)
    if comparison:
        lines.append("# Library schedules under the same costs:")
        lines += ["#   " + x for x in comparison.splitlines()]
    why = f"synthesized for p = {spec.p}, m = {spec.m}: run pipec synth again"
    lines += schedule_head(name, spec.p, spec.m, why, sched.placement, sched.kinds)
    declared = dict(per_stage)
    if not spec.split:
        del declared["W"]
    if not np.any(cm.comm):
        del declared["comm"]
    if sized:
        declared["act_bytes"] = cm.act_bytes
        if not np.array_equal(cm.grad_bytes, np.concatenate([[0.0], cm.act_bytes[:-1]])):
            declared["grad_bytes"] = cm.grad_bytes  # not the default (the activation across the boundary)
    lines += [f"    cost {k} = {per_stage_expr(v)}" for k, v in declared.items()]
    # ckpt only where a RECOMPUTE needs it and it is not its default (act / 8)
    recomputes = any(x.op == "RECOMPUTE" for rank in result.memops for x in rank)
    default_ckpt = np.array_equal(mem["ckpt"], mem["act"] / 8) if "ckpt" in mem else True
    for key in ("act", "wact", "ckpt", "params"):
        if (
            key == "wact"
            and not spec.split
            or key == "ckpt"
            and (not recomputes or default_ckpt or key not in MEMORY_KEYS)
        ):
            continue
        lines.append(f"    memory {key} = {per_stage_expr(mem[key])}")
    if spec.limit is not None:
        lines.append(f"    memory limit = {per_stage_expr(spec.limit, 'r')}")
    if spec.host_limit is not None and "host_limit" in MEMORY_KEYS:
        lines.append(f"    memory host_limit = {per_stage_expr(spec.host_limit, 'r')}")
    lines += topology or []
    lines.append(f'    expect makespan <= {_ceil6(fig.makespan)}, "the makespan pipec synth found"')
    lines.append(f'    expect bubble <= {_ceil6(fig.bubble)}, "the bubble rate pipec synth found"')
    place = sched.placement
    multi = [sum(1 for x in place if x == r) > 1 for r in range(R)]
    found = to_schedule(spec, result.orders, name, result.memops)
    lines += rank_block([rank_lines(schedule_steps(found, r), multi[r]) for r in range(R)])
    lines += ["}", ""]
    return "\n".join(lines)


def _ceil6(x: float) -> str:
    return f"{math.ceil(x * 1e6 - 1e-6) / 1e6:.6f}".rstrip("0").rstrip(".")


def _per_stage_text(arr) -> str:
    vals = [float(x) for x in arr]
    return _fmt_num(vals[0]) if all(v == vals[0] for v in vals) else "[" + ", ".join(map(_fmt_num, vals)) + "]"


# ---- the comparison table -----------------------------------------------------------------------


def library_comparison(spec: Spec, names: Sequence[str] | None = None):
    """The library schedules simulated under the spec's costs and memory model (one stage per rank unless
    they declare chunks): (name, params, Figures or None, note)."""
    from pipec.driver import build, param_names, simulation
    from pipec.errors import PipecError
    from pipec.frontend import library

    if names is None:
        names = ["1f1b", "zb-h1", "zb-h2", "zb-v", "interleaved-1f1b"]
        if spec.topology is not None:
            names += ["crossdc-1f1b", "crossdc-zb"]
    names = list(names)
    mem = {k: float(v) for k, v in spec.memory.items() if k in ("act", "wact", "params")}
    rows = []
    for name in names:
        try:
            source = library.read(name)
            known = set(param_names(source))
            params = {k: v for k, v in (("p", spec.p), ("m", spec.m), ("v", 2)) if k in known}
            sched = build(source, params)
            if spec.topology is not None:  # every schedule on the spec's network
                sched = replace(sched, topology=spec.topology)
            # memory per stage is per rank's share p / S of the model for every schedule
            share = {k: v * sched.num_ranks / sched.num_stages for k, v in mem.items()}
            sim = simulation(sched, spec.cost_docs, share or None)
        except PipecError as e:
            rows.append((name, "", None, e.diagnostics[0].message))
            continue
        st = sim.stats
        fig = Figures(st.makespan, st.cost, st.bubble_rate, tuple(r.peak_memory or 0.0 for r in st.ranks))
        ptext = " ".join(f"{k}={v}" for k, v in sched.params)
        rows.append((name, ptext, fig, ""))
    return rows


def comparison_text(result: Result, rows, name: str) -> str:
    lim = result.spec.limit
    table = [("schedule", "params", "makespan", "bubble", "peak mem", "fits limit")]

    def fits(fig: Figures) -> str:
        if lim is None:
            return "-"
        return "yes" if all(p <= x + 1e-9 for p, x in zip(fig.peak, lim)) else "no"

    f = result.figures
    table.append(
        (name, f"p={result.spec.p} m={result.spec.m}", _g(f.makespan), f"{f.bubble:.2%}", _g(max(f.peak)), fits(f))
    )
    for lib, params, fig, note in rows:
        if fig is None:
            table.append((lib, params, "-", "-", "-", note[:60]))
        else:
            table.append((lib, params, _g(fig.makespan), f"{fig.bubble:.2%}", _g(max(fig.peak)), fits(fig)))
    widths = [max(len(r[c]) for r in table) for c in range(len(table[0]))]
    right = {2, 3, 4}
    return "\n".join(
        "  ".join(c.rjust(w) if j in right else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths))).rstrip()
        for row in table
    )


def topology_of(items: Sequence[tuple[str, int, int]]) -> Topology | None:
    """A topology of datacenters (name, first rank, one past the last) for the cost model."""
    if not items:
        return None
    return Topology(tuple(Datacenter(n, lo, hi) for n, lo, hi in items), ())


def peak_of(spec: Spec, name: str) -> float:
    """The largest per-rank peak memory of a library schedule at the spec's sizes and memory model."""
    rows = library_comparison(replace(spec, limit=None), [name])
    _, _, fig, note = rows[0]
    if fig is None:
        raise error("E702", f"cannot take the memory limit of `{name}`: {note}")
    return max(fig.peak)


def to_json(result: Result, rows, name: str, output: str | None = None) -> dict:
    spec, f = result.spec, result.figures

    def figs(x: Figures) -> dict:
        return {"makespan": x.makespan, "cost": x.cost, "bubble_rate": x.bubble, "peak_memory": list(x.peak)}

    return {
        "schedule": name,
        "output": output,
        "p": spec.p,
        "m": spec.m,
        "v": spec.v,
        "placement": spec.placement,
        "memory_limit": None if spec.limit is None else list(spec.limit),
        "host_memory_limit": None if spec.host_limit is None else list(spec.host_limit),
        **figs(f),
        "host_peak_memory": list(f.host_peak),
        "memops": [[[x.op, x.mb, x.stage, x.before] for x in rank] for rank in result.memops],
        "memory_floor": None if result.floor is None else list(result.floor),
        "heuristic": {
            **figs(result.heuristic_figures),
            "from": result.heuristic.describe(),
            "seconds": result.seconds_heuristic,
        },
        "solver": {
            "status": result.solver_status,
            "note": result.solver_note,
            "bound": result.bound,
            "seconds": result.seconds_solver,
        },
        "library": [
            {"schedule": n, "params": prm, **(figs(x) if x is not None else {"error": note})}
            for n, prm, x, note in rows
        ],
    }
