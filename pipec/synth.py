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

The objective is the simulated makespan, then Zero Bubble's cost (the longest
rank's span): among schedules with the same step time, and so the same bubble
(`Stats.bubble_rate` is on the makespan), the one whose ranks are busy over the
shortest span wins. `write_pipe` turns the per-rank orders into a readable
schedule file (`pipec.interop.pipe_text`, the writer `pipec import` uses too)
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
from pipec.interop.pipe_text import Step, per_stage_expr, rank_block, rank_lines, schedule_head, topology_lines
from pipec.passes.memory import memory_model
from pipec.passes.policy import Derived, Machine, Policy, PolicyStuck, derive, machine
from pipec.schedule import Datacenter, RankOps, Schedule, Topology
from pipec.sim.costs import cost_model

Progress = Callable[[str], None]


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

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    def place(self) -> tuple[int, ...]:
        p, S = self.p, self.num_stages
        if self.placement == "v":
            return tuple((s % p) if (s // p) % 2 == 0 else p - 1 - s % p for s in range(S))
        return tuple(s % p for s in range(S))


def shape(spec: Spec, ranks: Sequence[RankOps] | None = None, name: str = "synth") -> Schedule:
    """A Schedule with the spec's sizes, placement and declarations (and these per-rank ops, or none)."""
    S, R = spec.num_stages, spec.p
    z = np.zeros(0, dtype=np.int64)
    empty = RankOps(z, z, z, z, np.zeros(0, dtype=bool))
    # act, wact and params are given for a rank's share of the model, as pipec.passes.memory's defaults are
    mem = {k: (float(v) * R / S,) * S for k, v in spec.memory.items() if k != "limit"}
    if spec.limit is not None:
        mem["limit"] = tuple(float(x) for x in spec.limit)
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
    )


def spec_machine(spec: Spec) -> Machine:
    sched = shape(spec)
    return machine(sched, cost_model(sched, spec.cost_docs), memory_model(sched))


def to_schedule(spec: Spec, orders: Sequence[Sequence[tuple[int, int, int]]], name: str = "synth") -> Schedule:
    """The spec's Schedule with these per-rank orders (kind index, micro-batch, stage)."""
    ranks = []
    for ops in orders:
        a = np.asarray(ops, dtype=np.int64).reshape(-1, 3)
        ranks.append(
            RankOps(
                a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy(), np.zeros(len(a), np.int64), np.zeros(len(a), dtype=bool)
            )
        )
    return shape(spec, ranks, name)


# ---- the heuristic -------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Candidate:
    policy: Policy | None  # None: a library schedule's order (`origin` names it)
    derived: Derived
    origin: str = "policy"

    def describe(self) -> str:
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


SEED_NAMES = ("1f1b", "zb-h1", "zb-h2", "zb-v", "interleaved-1f1b", "crossdc-1f1b", "crossdc-zb")


def library_seeds(spec: Spec) -> list[Candidate]:
    """The library schedules of the spec's shape (sizes, placement, op kinds) that fit its memory limit,
    with their simulated times: the search starts no worse than the hand-written schedules."""
    from pipec.api import build, param_names
    from pipec.errors import PipecError
    from pipec.frontend import library
    from pipec.sim.report import run

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
            sim = run(seeded, spec.cost_docs)
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


# ---- exact improvement (CP-SAT) ---------------------------------------------------------


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


def improve(
    spec: Spec, start: Derived, time_limit: float, progress: Progress | None = None, workers: int = 2
) -> SolveResult:
    """CP-SAT from the heuristic's schedule: a schedule with a smaller (makespan, cost), if it finds one."""
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
    k_t = _scale(list(mc.F) + list(mc.B) + list(mc.W) + list(delays.values()))
    mem_vals = list(mc.act) + (list(mc.wact) if split else [])
    k_m = _scale(mem_vals + [x for x in mc.limit if x == x] + list(mc.params), 100)

    def T(x: float) -> int:
        return int(round(x * k_t))

    dur = [[T(x) for x in mc.F], [T(x) for x in mc.B], [T(x) for x in mc.W]]
    horizon = T(start.makespan)
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
    for s in range(S):
        for i in range(m):
            if s > 0:
                model.Add(st[0, i, s] >= en[0, i, s - 1] + T(delays.get((0, s - 1), 0.0)))
            model.Add(st[1, i, s] >= en[0, i, s])
            if s < S - 1:
                model.Add(st[1, i, s] >= en[1, i, s + 1] + T(delays.get((1, s + 1), 0.0)))
            if split:
                model.Add(st[2, i, s] >= en[1, i, s])
    for r in range(R):
        mine = [s for s in range(S) if place[s] == r]
        model.AddNoOverlap([iv[k, i, s] for s in mine for i in range(m) for k in range(kinds)])
        lim = mc.limit[r] if len(mc.limit) else math.nan
        if lim == lim:
            cap = int(math.floor((lim - mc.params[r]) * k_m + 1e-9))
            ivs, dem = [], []
            for s in mine:
                a_d = int(round(mc.act[s] * k_m))
                w_d = int(round(mc.wact[s] * k_m)) if split else 0
                for i in range(m):
                    length = model.NewIntVar(0, horizon, f"a{i}_{s}")
                    model.Add(length == en[1, i, s] - st[0, i, s])
                    ivs.append(model.NewIntervalVar(st[0, i, s], length, en[1, i, s], f"act{i}_{s}"))
                    dem.append(a_d)
                    if split and w_d:
                        wl = model.NewIntVar(0, horizon, f"w{i}_{s}")
                        model.Add(wl == en[2, i, s] - en[1, i, s])
                        ivs.append(model.NewIntervalVar(en[1, i, s], wl, en[2, i, s], f"wact{i}_{s}"))
                        dem.append(w_d)
            model.AddCumulative(ivs, dem, cap)
    makespan = model.NewIntVar(0, horizon, "makespan")
    cost = model.NewIntVar(0, horizon, "cost")
    last = "W" if split else "B"
    ends = [en[kinds - 1, i, s] for s in range(S) for i in range(m)] + [en[1, i, s] for s in range(S) for i in range(m)]
    model.AddMaxEquality(makespan, ends)
    for r in range(R):
        mine = [s for s in range(S) if place[s] == r]
        first = model.NewIntVar(0, horizon, f"first{r}")
        model.AddMinEquality(first, [st[0, i, s] for s in mine for i in range(m)])
        end_r = model.NewIntVar(0, horizon, f"end{r}")
        model.AddMaxEquality(end_r, [en[k, i, s] for s in mine for i in range(m) for k in range(kinds)])
        model.Add(cost >= end_r - first)
    del last
    model.Minimize(makespan * (horizon + 1) + cost)
    # Warm start: the heuristic's times.
    for ops, starts in zip(start.orders, start.start):
        for (k, i, s), t in zip(ops, starts):
            model.AddHint(st[k, i, s], T(t))
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
                bound = self.BestObjectiveBound() // (horizon + 1) / k_t
                progress(f"solver: makespan {_g(ms)} (cost {_g(c)}), bound {_g(bound)}, {time.monotonic() - t0:.1f} s")

    status = solver.Solve(model, Cb())
    secs = time.monotonic() - t0
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return SolveResult(None, "no better", None, secs)
    bound = (solver.BestObjectiveBound() // (horizon + 1)) / k_t
    orders = []
    for r in range(R):
        mine = [s for s in range(S) if place[s] == r]
        ops = [(k, i, s) for s in mine for i in range(m) for k in range(kinds)]
        ops.sort(key=lambda o: (solver.Value(st[o]), o[0] != 0, o))
        orders.append(tuple(ops))
    return SolveResult(tuple(orders), "optimal" if status == cp_model.OPTIMAL else "improved", bound, secs)


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

    @property
    def key(self) -> tuple[float, float]:
        return (round(self.makespan, 9), round(self.cost, 9))


def evaluate_orders(spec: Spec, orders, name: str = "synth"):
    """Check, lower and simulate these orders under the spec (pipec.sim.report.run): every check runs."""
    from pipec.passes.checks import check_schedule
    from pipec.sim.report import run

    sched = to_schedule(spec, orders, name)
    check_schedule(sched)
    sim = run(sched, spec.cost_docs)
    st = sim.stats
    fig = Figures(st.makespan, st.cost, st.bubble_rate, tuple(r.peak_memory or 0.0 for r in st.ranks))
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


def synthesize(
    spec: Spec,
    time_limit: float = 30.0,
    use_solver: bool | None = None,
    progress: Progress | None = None,
    max_solver_ops: int = 2000,
) -> Result:
    """Heuristic, then (unless told not to, or the case is too large) CP-SAT from its result."""
    t0 = time.monotonic()
    best = heuristic(spec, progress)
    t_h = time.monotonic() - t0
    _, h_fig = evaluate_orders(spec, best.derived.orders)
    orders, fig = best.derived.orders, h_fig
    n_ops = spec.num_stages * spec.m * (3 if spec.split else 2)
    status, note, bound, t_s = "skipped", None, None, 0.0
    why = solver_available()
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
            progress(f"solver: CP-SAT on {n_ops} ops, warm-started, limit {time_limit:g} s")
        res = improve(spec, best.derived, time_limit, progress)
        status, bound, t_s = res.status, res.bound, res.seconds
        if res.orders is not None:
            try:
                _, f2 = evaluate_orders(spec, res.orders)
            except Exception:  # a solver order that the checks refuse is a bug; keep the heuristic's
                f2 = None
            if f2 is not None and _fits(spec, f2) and f2.key < fig.key:
                orders, fig = res.orders, f2
            elif status == "improved":
                status = "no better"
    return Result(spec, orders, fig, best, h_fig, status, note, bound, t_h, t_s)


def _fits(spec: Spec, fig: Figures) -> bool:
    if spec.limit is None:
        return True
    return all(p <= lim + 1e-9 for p, lim in zip(fig.peak, spec.limit))


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
    costs = ", ".join(f"{k}={_per_stage_text(v)}" for k, v in per_stage.items())
    lines.append(f"# Costs (per stage): {costs}" + ("" if spec.split else " (B is the full backward)"))
    undeclared = []
    if cm.overhead:
        undeclared.append(f"overhead={_fmt_num(cm.overhead)} s per send and receive")
    if topology is None:
        undeclared.append("links that differ inside a datacenter (ranks_per_node)")
    if undeclared:
        lines.append(
            "# Not declared below (the language has no declaration for it; give the same --cost to pipec "
            "simulate): " + "; ".join(undeclared)
        )
    lim = "none" if spec.limit is None else " ".join(_fmt_num(x) for x in spec.limit)
    lines.append(
        f"# Memory: act={_per_stage_text(mem['act'])} wact={_per_stage_text(mem['wact'])}"
        f" params={_per_stage_text(mem['params'])}; limit per rank: {lim}"
    )
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
    for key in ("act", "wact", "params"):
        if key == "wact" and not spec.split:
            continue
        lines.append(f"    memory {key} = {per_stage_expr(mem[key])}")
    if spec.limit is not None:
        lines.append(f"    memory limit = {per_stage_expr(spec.limit, 'r')}")
    lines += topology or []
    lines.append(f'    expect makespan <= {_ceil6(fig.makespan)}, "the makespan pipec synth found"')
    lines.append(f'    expect bubble <= {_ceil6(fig.bubble)}, "the bubble rate pipec synth found"')
    place = sched.placement
    multi = [sum(1 for x in place if x == r) > 1 for r in range(R)]
    lines += rank_block([rank_lines(order_steps(result.orders[r], sched.kinds), multi[r]) for r in range(R)])
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
    from pipec.api import build, param_names
    from pipec.errors import PipecError
    from pipec.frontend import library
    from pipec.sim.report import run

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
            sim = run(sched, spec.cost_docs, share or None)
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
        **figs(f),
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
