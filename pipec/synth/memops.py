"""Memory ops under a limit below 1F1B's (docs/synth.md, "Under a memory limit"): recomputation seeds,
`repair` (offloads or recomputations added at a fixed order's peaks until it fits), the one-micro-batch
plan and the least memory any schedule reaches (`memory_floor`, E703 below it). Apart from the solver,
which places memory ops itself from the `HostModel` kept here."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from pipec.errors import error
from pipec.ir.schedule import MemOp
from pipec.passes.policy import Derived, Machine
from pipec.sim.costs import cost_model
from pipec.sim.memory import memory_model, rank_memory
from pipec.synth.evaluate import _fits, evaluate_orders
from pipec.synth.seeds import Candidate, _try, library_seeds, policy_grid
from pipec.synth.spec import MEMOP_KINDS, MemOps, Progress, Spec, _g, shape, spec_machine, to_schedule


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
