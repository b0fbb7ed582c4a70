"""E806, no split fits the memory limits: the diagnostic names the split that comes closest, found by a
CP-SAT model of the splits (`Master`). Why a module of its own: it is the search's one user error, and
the only part that needs CP-SAT.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from pipec.errors import error
from pipec.ir.units import fmt_bytes
from pipec.partition.graph import KINDS
from pipec.partition.problem import MEM_SCALE, Problem, Split


class Master:
    """A CP-SAT model of the splits (now used by `no_fit` for the closest split) that grows by one
    constraint per path. Boundary c_t is encoded in unary, v[t][j] = [c_t >= j] for j = 1 .. L, so that
    a prefix sum Q[c_t] = sum_j (Q[j] - Q[j-1]) v[t][j] and every path's length and every memory position
    are linear in the booleans (whose ordering constraints alone make an integral polytope: the LP
    relaxation the solver bounds with is the fractional split, not the weak one of table look-ups)."""

    def __init__(self, pb: Problem, memory: bool = True) -> None:
        from ortools.sat.python import cp_model

        self.cp = cp_model
        self.pb = pb
        M = self.model = cp_model.CpModel()
        S, L = pb.S, pb.L
        one = M.NewConstant(1)
        zero = M.NewConstant(0)
        # v[t][j], t = 0..S, j = 1..L (index j - 1): c_0 = 0, c_S = L, t <= c_t <= L - S + t
        v = (
            [[zero] * L]
            + [
                [one if j <= t else zero if j > L - S + t else M.NewBoolVar(f"v{t}_{j}") for j in range(1, L + 1)]
                for t in range(1, S)
            ]
            + [[one] * L]
        )
        for t in range(1, S):
            for j in range(1, L):
                M.AddImplication(v[t][j], v[t][j - 1])  # c_t >= j + 1 implies c_t >= j
        for t in range(1, S - 1):
            for j in range(1, L):
                M.AddImplication(v[t][j - 1], v[t + 1][j])  # c_{t+1} >= c_t + 1
        self.v = v
        self.dq = {k: np.diff(pb.Q[k], axis=1) for k in KINDS}  # (S, L): stage s's quantized time of layer j
        if memory:
            for r in range(pb.R):
                for lim, const, expr in self.memory_rows(r):
                    M.Add(expr <= lim - const)
        hi = int(sum(int(pb.Q[k][:, -1].max()) for k in KINDS)) * max(pb.m, 1) * 4 + sum(pb.graph.delay) + 1
        self.z = M.NewIntVar(0, hi, "z")
        M.Minimize(self.z)
        self.cuts: set[tuple] = set()
        self.paths: list[tuple[int, np.ndarray]] = []
        self.upper: int | None = None

    def path_bound(self) -> int:
        """max over the paths P so far of min over all contiguous splits of len_P (units): a lower bound
        on the master's optimum (min max >= max min) that needs no solver, each minimum an exact dynamic
        program over (stage, boundary) in O(S L) with prefix minima, since len_P is additive over stages."""
        best = 0
        S, L = self.pb.S, self.pb.L
        for const, counts in self.paths:
            cost = np.zeros(L + 1)
            cost[1:] = np.inf  # before stage 0: only boundary 0
            for s in range(S):
                w = sum(float(counts[i, s]) * self.pb.Q[k][s].astype(float) for i, k in enumerate(KINDS))
                w = w if isinstance(w, np.ndarray) else np.zeros(L + 1)
                run = np.minimum.accumulate(cost - w)  # min over a <= c of cost[a] - W[a]
                nxt = np.full(L + 1, np.inf)
                nxt[1:] = w[1:] + run[:-1]  # a < c: a non-empty stage
                cost = nxt
            best = max(best, int(math.floor(cost[L])) + const)
        return best

    def memory_rows(self, r: int):
        """Rank r's memory rows (`Problem.memory_rows`) as (limit, constant, linear expression)."""
        for wq, lim in self.pb.memory_rows(r):
            stages = self.pb.positions[r].stages.tolist()
            yield (lim, *self._linear({s: np.diff(wq[s]) for s in stages}))

    def _linear(self, weight: Mapping[int, np.ndarray]):
        """sum over stages s of sum over its layers of weight[s][layer], as a constant plus a linear
        expression in the booleans: layer j - 1 is in stage s when v[s+1][j] - v[s][j] = 1."""
        L, S = self.pb.L, self.pb.S
        coef = np.zeros((S + 1, L), dtype=np.int64)
        for s, w in weight.items():
            coef[s + 1] += w
            coef[s] -= w
        const = int(coef[S].sum())  # v[S][j] = 1
        terms, weights = [], []
        for t in range(1, S):
            for j in range(L):
                if coef[t, j] == 0:
                    continue
                terms.append(self.v[t][j])
                weights.append(int(coef[t, j]))
        return const, self.cp.LinearExpr.WeightedSum(terms, weights)

    def add(self, const: int, counts: np.ndarray) -> bool:
        key = (int(const), counts.tobytes())
        if key in self.cuts:
            return False
        self.cuts.add(key)
        self.paths.append((int(const), counts))
        weight = {}
        for s in range(self.pb.S):
            w = sum(int(counts[i, s]) * self.dq[k][s] for i, k in enumerate(KINDS) if counts[i, s])
            if not isinstance(w, int):
                weight[s] = w
        c, expr = self._linear(weight)
        self.model.Add(self.z >= int(const) + c + expr)
        return True

    def solve(self, hint: Sequence[int] | None, seconds: float, best: Split | None = None):
        """(status, bound in units, boundaries or None); with an incumbent, only splits below its step
        (so "infeasible" then proves it optimal)."""
        M = self.model
        M.ClearHints()
        if best is not None:
            below = int(math.ceil(best.step / self.pb.unit)) - 1
            if self.upper is None or below < self.upper:
                M.Add(self.z <= below)
                self.upper = below
        if hint is not None:
            for t in range(1, self.pb.S):
                for j, var in enumerate(self.v[t], start=1):
                    if var.Name().startswith("v"):
                        M.AddHint(var, int(hint[t] >= j))
        solver = self.cp.CpSolver()
        solver.parameters.max_time_in_seconds = max(seconds, 0.05)
        solver.parameters.num_workers = 2
        st = solver.Solve(M)
        if st == self.cp.INFEASIBLE:
            return "infeasible", None, None
        if st not in (self.cp.OPTIMAL, self.cp.FEASIBLE):  # out of time: the bound the solver proved so far
            bound = solver.BestObjectiveBound()
            return "unknown", int(math.ceil(bound)) if math.isfinite(bound) else None, None
        bounds = [0]
        for t in range(1, self.pb.S):
            bounds.append(sum(int(solver.Value(var)) for var in self.v[t]))
        bounds.append(self.pb.L)
        bound = int(solver.ObjectiveValue()) if st == self.cp.OPTIMAL else int(math.ceil(solver.BestObjectiveBound()))
        return ("optimal" if st == self.cp.OPTIMAL else "feasible"), bound, tuple(bounds)


def closest(pb: Problem, time_limit: float = 10.0) -> tuple[tuple[int, ...], bool]:
    """The split with the least excess of any rank's memory over its limit (CP-SAT over the memory rows), and
    whether the solver proved it least. Its excess at most 0: a split that fits (the search starts from it
    when its own starts do not fit); above 0 and proven: no split fits (the rows are exact, or a relaxation)."""
    master = Master(pb, memory=False)
    M = master.model
    worst_bytes = (int(sum(int(v[-1]) for v in pb.P.values())) * max(pb.m, 1) + 1) * MEM_SCALE + pb.S
    excess = M.NewIntVar(-worst_bytes, worst_bytes, "excess")
    for r in range(pb.R):
        for lim, const, expr in master.memory_rows(r):
            M.Add(excess >= const + expr - lim)
    M.Minimize(excess)
    solver = master.cp.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.num_workers = 2
    status = solver.Solve(M)
    if status not in (master.cp.OPTIMAL, master.cp.FEASIBLE):  # out of time before any split: the uniform one
        return pb.uniform(), False
    bounds = [0] + [sum(int(solver.Value(x)) for x in master.v[t]) for t in range(1, pb.S)] + [pb.L]
    return tuple(bounds), status == master.cp.OPTIMAL


def no_fit(pb: Problem, near: tuple[tuple[int, ...], bool] | None = None):
    """E806: no split fits; names the split that comes closest (`closest`, or `near` when already found).
    When that is not proven (the solver's or the search's time ended first), a note says so."""
    bounds, proven = near or closest(pb)
    mem = pb.memory(bounds)
    worst = int(np.nanargmax(np.where(np.isnan(pb.limit), -np.inf, mem - pb.limit)))
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    unproven = () if proven else ("not proven: the search's time ended first; a longer time limit may find a split",)
    return error(
        "E806",
        f"no split of the {pb.L} layers into {pb.S} stages fits the memory limits: the closest, layers per stage "
        f"{', '.join(map(str, sizes))}, needs {fmt_bytes(mem[worst])} on rank {worst} "
        f"(limit {fmt_bytes(pb.limit[worst])})",
        notes=(
            "per rank: " + ", ".join(f"{fmt_bytes(x)}" for x in mem.tolist()),
            *unproven,
            "raise the limits, take a schedule that holds fewer micro-batches, or more ranks",
        ),
    )
