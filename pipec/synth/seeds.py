"""The heuristic phase: a grid over the list scheduler's policies (`pipec.passes.policy`), a local search on
the best point's in-flight limits, and the library schedules of the spec's shape as seeds, so the search
starts no worse than the hand-written schedules. `Candidate` is what every later step starts from."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import numpy as np

from pipec.errors import error
from pipec.ir.schedule import Policy, Schedule
from pipec.passes.policy import Derived, Machine, PolicyStuck, derive
from pipec.synth.spec import MemOps, Progress, Spec, _g, shape, spec_machine, to_schedule


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
    """The best policy of the grid, then per-rank in-flight limits tuned one rank at a time; both stop after
    `budget_s` seconds (the grid once some policy fits), so a large m answers in the time asked for."""
    mc = spec_machine(spec)
    t0 = time.monotonic()
    best: Candidate | None = None
    tried = 0
    grid = policy_grid(spec)
    for pol in grid:
        if best is not None and time.monotonic() - t0 > budget_s:
            if progress:
                progress(f"heuristic: time limit {budget_s:g} s reached after {tried} of {len(grid)} policies")
            break
        c = _try(mc, pol)
        tried += 1
        if c is not None and (best is None or c.key < best.key):
            best = c
            if progress:
                progress(f"heuristic: makespan {_g(c.derived.makespan)} with policy {pol.describe()}")
    for seed in library_seeds(spec, t0 + budget_s, progress):
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


def library_seeds(spec: Spec, until: float | None = None, progress: Progress | None = None) -> list[Candidate]:
    """The library schedules of the spec's shape (sizes, placement, op kinds) that fit its memory limit,
    with their simulated times: the search starts no worse than the hand-written schedules. `until`: a
    `time.monotonic()` after which the rest are left out (said through `progress`)."""
    from pipec.driver import build, param_names, simulation
    from pipec.errors import PipecError
    from pipec.frontend import library

    out = []
    want = shape(spec)
    for k, name in enumerate(SEED_NAMES):
        if until is not None and time.monotonic() > until:
            if progress:
                progress(f"heuristic: time limit reached; library seeds {', '.join(SEED_NAMES[k:])} not tried")
            break
        try:
            source = library.read(name)
            known = set(param_names(source))
            params = {k: v for k, v in (("p", spec.p), ("m", spec.m), ("v", spec.v)) if k in known}
            sched = build(source, params)
        except PipecError:
            continue
        if sched.placement != want.placement or sched.kinds != want.kinds or sched.graph is not None:
            continue  # a stage graph seeds no chain
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
