"""Lower bounds on every split's simulated step: the fluid bound (one linear program over the whole
dependency graph, layers allowed to split between neighbouring stages, made exact by its dual flow taken
apart into real paths and an integer dynamic program) and the work bound. Why a module of its own: the
search starts from the fluid bound's paths and rounded split, and reports these bounds when its time
limit ends before the branch and bound closes (`pipec.partition.search`'s docstring, point 2); the same
linear model (`step_lp`) with integral boundaries is what `benchmarks/partition_mip.py` hands to MIP solvers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipec.partition.graph import KINDS
from pipec.partition.problem import Problem


@dataclass(frozen=True)
class Fluid:
    """The fluid relaxation's outcome (`fluid_bound`): a proven lower bound in units, the paths it is made
    of (as rows of `_branch`), and the fractional optimum's boundaries rounded to a split (a starting point)."""

    bound: int
    paths: tuple[tuple[int, np.ndarray], ...]
    rounded: tuple[int, ...] | None
    weights: tuple[int, ...] = ()  # each path's weight, scaled to an integer (`_weighted_bound`)


def step_lp(pb: Problem, lp, integral: bool = False):
    """The splits and the schedule's dependency graph as one linear model in `lp` (an OR-Tools
    pywraplp solver), minimising the step: the unary boundaries v[t, j] = [c_t >= j] (fractional unless
    `integral`), each stage's F, B, W durations as sums of its share of every layer, a start time per op
    with every edge `start_v >= end_u + delay`, and the step above every rank's last op. Returns (v, the
    edge constraints into each op as (constraint, from, delay), the rank ends as (constraint, op)).
    Relaxed (GLOP) it is `fluid_bound`'s program; with `integral` it is the exact problem as a mixed integer
    program, which `benchmarks/partition_mip.py` hands to SCIP and CP-SAT to show why they do not prove it
    at 96 layers x 16 stages (docs/partition.md)."""
    S, L, g = pb.S, pb.L, pb.graph
    inf = lp.infinity()
    v: dict[tuple[int, int], object] = {}  # [c_t >= j], a float where fixed
    for t in range(S + 1):
        for j in range(1, L + 1):
            if t == 0 or j > L - S + t:
                v[t, j] = 0.0
            elif t == S or j <= t:
                v[t, j] = 1.0
            else:
                v[t, j] = lp.IntVar(0, 1, "") if integral else lp.NumVar(0, 1, "")

    def at_most(a, b) -> None:  # a <= b
        if isinstance(a, float) and isinstance(b, float):
            return
        c = lp.Constraint(-inf, (b if isinstance(b, float) else 0.0) - (a if isinstance(a, float) else 0.0))
        if not isinstance(a, float):
            c.SetCoefficient(a, 1)
        if not isinstance(b, float):
            c.SetCoefficient(b, -1)

    for t in range(1, S):
        for j in range(2, L + 1):
            at_most(v[t, j], v[t, j - 1])
            if t < S - 1:
                at_most(v[t, j - 1], v[t + 1, j])
    dur = {}  # (kind, stage) -> its duration variable, the stage's share of each layer's time
    for ki, k in enumerate(KINDS):
        dq = np.diff(pb.Q[k], axis=1).astype(float)
        for s in range(S):
            if not dq[s].any():
                continue
            x = dur[ki, s] = lp.NumVar(0, inf, "")
            coef: dict[object, float] = {x: 1.0}
            rhs = 0.0
            for j in np.flatnonzero(dq[s]).tolist():
                for t, sign in ((s + 1, 1.0), (s, -1.0)):
                    y = v[t, j + 1]
                    if isinstance(y, float):
                        rhs += sign * dq[s, j] * y
                    else:
                        coef[y] = coef.get(y, 0.0) - sign * dq[s, j]
            c = lp.Constraint(rhs, rhs)
            for y, a in coef.items():
                c.SetCoefficient(y, a)
    n = len(g.order)
    start = [lp.NumVar(0, inf, "") for _ in range(n)]
    step = lp.NumVar(0, inf, "")
    into: list[list[tuple[object, int, int]]] = [[] for _ in range(n)]  # (constraint, from, delay)
    for i in range(n):
        for u, delay in ((g.rank_pred[i], 0), (g.data_pred[i], g.delay[i])):
            if u < 0:
                continue
            c = lp.Constraint(float(delay), inf)
            c.SetCoefficient(start[i], 1)
            c.SetCoefficient(start[u], -1)
            if (int(g.kind[u]), int(g.stage[u])) in dur:
                c.SetCoefficient(dur[int(g.kind[u]), int(g.stage[u])], -1)
            into[i].append((c, u, delay))
    tips = []
    for i in g.last_of_rank:
        c = lp.Constraint(0, inf)
        c.SetCoefficient(step, 1)
        c.SetCoefficient(start[i], -1)
        if (int(g.kind[i]), int(g.stage[i])) in dur:
            c.SetCoefficient(dur[int(g.kind[i]), int(g.stage[i])], -1)
        tips.append((c, i))
    lp.Minimize(step)
    return v, into, tips


def fluid_bound(pb: Problem) -> Fluid:
    """The bound of the split's linear relaxation, made exact. Why: paths found one at a time only bound the
    splits near the paths found so far, and CP-SAT needs many rounds to reach the relaxation's bound at
    this size; one linear program over the whole dependency graph reaches it at once.

    The program (GLOP) lets layers split fractionally between neighbouring stages (the unary boundaries of
    `Master` in [0, 1]), with a start time per op, every edge of the graph as `start_v >= end_u + delay`
    and the step above every rank's last op. Its duals are a flow of one unit through the graph, which is
    taken apart into paths P with weights w_P >= 0. Whatever the floats' accuracy, these are real paths
    and T(x) >= len_P(x) for each, so T(x) >= sum_P w_P len_P(x) / sum_P w_P for every split x; the
    minimum of that weighted sum over the integral splits is one dynamic program in integers (weights
    scaled to integers), which gives the bound. With exact duals it equals the relaxation's optimum."""
    from ortools.linear_solver import pywraplp

    lp = pywraplp.Solver.CreateSolver("GLOP")
    v, into, tips = step_lp(pb, lp)
    S, L = pb.S, pb.L
    if lp.Solve() not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return Fluid(0, (), None)
    rounded = _round_split(
        [
            sum(float(y if isinstance(y, float) else y.solution_value()) for y in (v[t, j] for j in range(1, L + 1)))
            for t in range(S + 1)
        ],
        L,
    )
    paths = _flow_paths(pb, into, tips)
    weights = tuple(int(w * 2**30) for w, _, _ in paths)
    return Fluid(_weighted_bound(pb, paths), tuple((c, k) for _, c, k in paths), rounded, weights)


def _round_split(c: Sequence[float], L: int) -> tuple[int, ...]:
    """Fractional boundaries rounded to a split: each stage non-empty, 0 first and L last."""
    S = len(c) - 1
    b = [int(round(x)) for x in c]
    b[0], b[S] = 0, L
    for t in range(1, S):
        b[t] = max(b[t], b[t - 1] + 1)
    for t in range(S - 1, 0, -1):
        b[t] = min(b[t], b[t + 1] - 1)
    return tuple(b)


def _flow_paths(pb: Problem, into, tips) -> list[tuple[float, int, np.ndarray]]:
    """The LP's duals taken apart into paths, heaviest first: from the rank end with the most flow left,
    back along the incoming edge with the most, the path's weight its least edge's flow. The weights need
    not add up to the LP's: any non-negative weights on real paths give a valid bound."""
    g = pb.graph
    left = {id(c): max(c.dual_value(), 0.0) for ins in into for c, _, _ in ins}
    tip_left = [max(c.dual_value(), 0.0) for c, _ in tips]
    total = sum(tip_left)
    out = []
    for _ in range(4 * len(g.order)):
        t = int(np.argmax(tip_left)) if tip_left else 0
        if not tip_left or tip_left[t] <= 1e-9 * total:
            break
        v, w, used, const = tips[t][1], tip_left[t], [], 0
        counts = np.zeros((3, pb.S), dtype=np.int64)
        counts[g.kind[v], g.stage[v]] += 1
        while into[v]:
            c, u, delay = max(into[v], key=lambda e: left[id(e[0])])
            if left[id(c)] <= 1e-9 * total:
                break
            used.append(id(c))
            w = min(w, left[id(c)])
            const += delay
            v = u
            counts[g.kind[v], g.stage[v]] += 1
        tip_left[t] -= w
        for e in used:
            left[e] -= w
        out.append((w, const, counts))
    return out


def _weighted_bound(pb: Problem, paths: Sequence[tuple[float, int, np.ndarray]]) -> int:
    """min over all contiguous splits x of sum_P w_P len_P(x) / sum_P w_P (units, rounded down), a lower
    bound on every split's step: in integers, the weights scaled by 2^30 and rounded down (all the ops'
    durations together stay below 2^25 units, so the int64 sums below 2^55), by a dynamic program over
    (stage, boundary) with prefix minima (len_P is additive over the stages; delays are Python ints)."""
    ws = [(int(w * 2**30), c, k) for w, c, k in paths]
    ws = [x for x in ws if x[0] > 0]
    total = sum(w for w, _, _ in ws)
    if not total:
        return 0
    weight = [[sum(w * int(k[i, s]) for w, _, k in ws) for i in range(3)] for s in range(pb.S)]
    const = sum(w * c for w, c, _ in ws)
    big = 1 << 62
    cost = np.full(pb.L + 1, big, dtype=np.int64)
    cost[0] = 0
    for s in range(pb.S):
        wq = np.zeros(pb.L + 1, dtype=np.int64)
        for i, k in enumerate(KINDS):
            if weight[s][i]:
                wq += weight[s][i] * pb.Q[k][s]
        run = np.minimum.accumulate(np.where(cost >= big, big, cost - wq))
        nxt = np.full(pb.L + 1, big, dtype=np.int64)
        nxt[1:] = np.where(run[:-1] < big, wq[1:] + run[:-1], big)
        cost = nxt
    return (int(cost[pb.L]) + const) // total


def _work_bound(pb: Problem) -> int:
    """Some rank computes at least its share of the whole work: sum_r speed_r C_r = m W (each layer's
    work counted once, on its rank's speed), so max_r C_r >= m W / sum_r speed_r; less 3 m S units for the
    rounding of the quantized stage sums. In units."""
    split = pb.sched.split_backward
    t = pb.table
    work = float((t.F + (t.B + t.W if split else t.full_backward)).sum())
    used = sorted(set(pb.placement.tolist()))
    return max(0, int(math.floor(pb.m * work / float(pb.speed[used].sum()) / pb.unit)) - 3 * pb.m * pb.S)
