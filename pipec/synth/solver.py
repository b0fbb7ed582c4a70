"""The exact improvement: the per-rank orders as an OR-Tools CP-SAT model (one interval per op, no overlap
per rank, the dependency rule with message delays, cumulative device and host memory, optional memory
ops), warm-started from a candidate. Kept apart because it alone needs OR-Tools (the extra pipec[synth]),
imported only when it runs."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from pipec.ir.rules import active, needs
from pipec.ir.schedule import MemOp
from pipec.passes.policy import Derived, Machine
from pipec.sim.memory import Hold, unit_holds
from pipec.synth.memops import host_model
from pipec.synth.spec import MemOps, Progress, Spec, _g, spec_machine


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
