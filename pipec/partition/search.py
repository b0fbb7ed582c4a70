"""The exact search for contiguous layer splits: the simulated step of the schedule, minimised under per-rank
memory limits, on ranks of different speeds.

A split gives stage s the layers [c_s, c_{s+1}) (0 = c_0 < c_1 < ... < c_S = L, every stage non-empty,
stages in pipeline order, so V and interleaved placements wrap the model across the ranks as their
placement says). Stage s's F, B and W are the sums of its layers' times divided by the speed of the rank
that owns it; its memory is the memory walk's (pipec.sim.memory.positions): parameters, gradients and
optimizer state held throughout, `act` bytes per micro-batch live from F to B (`ckpt`, act / 8 of the
memory model's default, until its RECOMPUTE where the schedule recomputes; on the host between an
OFFLOAD and its RELOAD) and, with split backward, `wact` from B to W, counted along the rank's own order
of ops and memory ops. The objective is `pipec.sim.simulate`'s makespan of the
schedule's Program under these per-stage costs (and the links of any cost documents given).

Why the result is optimal (a cutting-plane method with the simulator as the objective):

1. Every op of the Program has a predecessor on its rank (the op before it) and, but for a first F, a data
   predecessor (F(i, s-1) for F(i, s); B(i, s+1), or on the last stage F(i, S-1), for B(i, s); B(i, s) for
   W(i, s)). The simulator never starts an op before both have ended, plus the message's latency and fixed
   `comm` time when they are on two ranks. So for any path P through this graph and any split x, the
   simulated step T(x) >= len_P(x), the sum of the durations on P plus its message delays; and len_P(x) is
   a sum over stages of (number of F, B, W ops of stage s on P) x (stage s's F, B, W time): additive over
   the stages, a linear function of the split's prefix sums.
2. The fluid bound (`fluid_bound`): one linear program over the whole graph, layers allowed to split
   between neighbouring stages, gives the relaxation's bound in one solve; its dual flow, taken apart into
   real paths, makes it exact (an integer dynamic program). Its rounded split, the uniform and the
   bottleneck splits start local searches and kicks (`_local_search`, `_kick`), the incumbent.
3. The branch and bound (`_branch`): depth-first over the boundaries' domains, each node narrowed by
   `_propagate` with every path of K (the rank chains, the fluid bound's weighted paths as one row, the
   paths near the incumbent, every leaf's paths) held to one unit below the incumbent's step, and every
   memory position to its limit; each row is additive over the stages, so a forward and a backward
   dynamic program per row say which values of each boundary some split within the domains can take.
   A node with an empty domain holds no split faster than the incumbent (some path of each is at least
   the incumbent's step). A leaf whose graph longest path is below the budget is simulated. So every
   split is pruned or simulated: an exhausted tree proves the incumbent optimal, for any cost model
   (with bandwidths or overheads the simulator's step is only at least the graph's, which is all that is
   used). When the time limit ends it first, the bound is the best of the fluid bound, the open nodes'
   bounds and the work bound (`Result.optimal` False). What separates the fluid bound from the best
   split at 96 layers over 16 stages (about 4%, docs/partition.md) is the layers' granularity; the
   tree does not close it in seconds there.

Times are quantized to a power-of-two unit u about 2^-24 of a rank's whole step, so that the solver's
integers and the simulator's floats are the same numbers exactly (sums of multiples of u below 2^53 are
exact); the quantized cost of stage s is Q_s[c_{s+1}] - Q_s[c_s], Q_s the rounded prefix sums of its
rank's layer times: a relative change of about 1e-7, far below any measurement's noise.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from pipec.errors import brief, error
from pipec.formats.partition_files import LayerTable
from pipec.ir.program import Program
from pipec.ir.rules import dependencies
from pipec.ir.schedule import Schedule
from pipec.ir.units import fmt_bytes
from pipec.sim.memory import CKPT_OF_ACT, positions

KINDS = ("F", "B", "W")
# The memory rows' scale (`Problem.memory_rows`): 8 makes ckpt = act / 8 whole, so rows are exact without slices.
MEM_SCALE = 8


@dataclass(frozen=True)
class Split:
    """A split's boundaries (S + 1 of them) and what it costs: the simulated step (seconds), each rank's
    memory peak (bytes), whether every rank is within its limit, and the per-stage times it was simulated
    with."""

    bounds: tuple[int, ...]
    step: float
    memory: tuple[float, ...]
    fits: bool
    stage_times: Mapping[str, tuple[float, ...]]

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.bounds, self.bounds[1:]))


@dataclass(frozen=True)
class Result:
    best: Split
    uniform: Split
    lower_bound: float  # seconds: no contiguous split within the limits simulates below it
    optimal: bool  # the best's step equals the bound
    nodes: int  # branch-and-bound nodes (`_branch`)
    paths: int  # distinct paths of the dependency graph in the branch and bound's rows at the end
    simulations: int
    seconds: float
    cpu_seconds: float = 0.0  # the process's CPU time in the search, the solvers' threads included
    fluid_bound: float = 0.0  # seconds: the fluid bound alone (`fluid_bound`), part of lower_bound


class Problem:
    """The schedule, its Program, the layer table, the ranks' speeds and limits, and everything the search
    precomputes from them (quantized prefix tables, the dependency graph, each rank's memory positions)."""

    def __init__(
        self,
        sched: Schedule,
        program: Program,
        table: LayerTable,
        speed: np.ndarray,
        limit: np.ndarray,
        cost_docs: Sequence[Mapping] = (),
    ) -> None:
        from pipec.sim.costs import cost_model

        S, R, L = sched.num_stages, sched.num_ranks, table.num_layers
        if S > L:
            raise error(
                "E805",
                f"`{brief(sched.name)}` has {S} stages, more than the model's {L} layers (every stage needs one)",
            )
        self.sched, self.program, self.table = sched, program, table
        self.S, self.R, self.L, self.m = S, R, L, sched.num_microbatches
        self.speed = np.asarray(speed, dtype=float)
        self.limit = np.asarray(limit, dtype=float)
        self.placement = np.asarray(sched.placement, dtype=np.int64)
        self.cost_docs = tuple(cost_docs)
        split = sched.split_backward
        times = {"F": table.F, "B": table.B if split else table.full_backward, "W": table.W if split else 0 * table.F}
        stage_speed = self.speed[self.placement]
        whole = max(float(sum(times[k].sum() for k in KINDS)) / float(self.speed.min()), 1e-30) * self.m
        self.unit = 2.0 ** (math.floor(math.log2(whole)) - 24)
        self.Q = {}  # kind -> (S, L + 1) int64: quantized prefix sums of stage s's rank's times
        for k in KINDS:
            pre = np.concatenate([[0.0], np.cumsum(times[k])])
            self.Q[k] = np.rint(pre[None, :] / stage_speed[:, None] / self.unit).astype(np.int64)
        held = 2 * table.param_bytes + table.state_bytes  # weights, gradients, optimizer state
        self.P = {
            "act": _prefix(table.act_bytes),
            "wact": _prefix(table.wact_bytes if split else 0 * table.act_bytes),
            "params": _prefix(held),
        }
        self.positions = positions(sched)
        base = cost_model(sched, self.cost_docs)
        self.graph = _Graph(sched, base, self.unit)
        self.simulations = 0

    # ---- one split --------------------------------------------------------------

    def stage_units(self, bounds: Sequence[int]) -> dict[str, np.ndarray]:
        c = np.asarray(bounds)
        s = np.arange(self.S)
        return {k: self.Q[k][s, c[1:]] - self.Q[k][s, c[:-1]] for k in KINDS}

    def batch_units(self, bounds: np.ndarray) -> dict[str, np.ndarray]:
        """`stage_units` of many splits at once: bounds (n, S + 1), each kind's units (n, S)."""
        c = np.asarray(bounds, dtype=np.int64)
        s = np.arange(self.S)
        return {k: self.Q[k][s, c[:, 1:]] - self.Q[k][s, c[:, :-1]] for k in KINDS}

    def stage_bytes(self, bounds: Sequence[int]) -> dict[str, np.ndarray]:
        c = np.asarray(bounds)
        return {k: (v[c[1:]] - v[c[:-1]]).astype(float) for k, v in self.P.items()}

    def memory(self, bounds: Sequence[int]) -> np.ndarray:
        """Each rank's peak bytes: the memory walk's (`pipec.sim.memory.positions`) for the split's sizes, so
        equal to `pipec.sim.memory.rank_memory` of `memory_schedule`."""
        b = self.stage_bytes(bounds)
        ckpt = b["act"] * CKPT_OF_ACT
        return np.array([pos.peak(b["act"], b["wact"], ckpt, b["params"]) for pos in self.positions])

    def memory_rows(self, r: int) -> list[tuple[np.ndarray, int]]:
        """Rank r's memory at each of its positions as an integer row over the split: (wq, lim) with wq (S,
        L + 1) such that every split within r's limit has sum_s wq[s, c_{s+1}] - wq[s, c_s] <= lim (empty
        without a limit). Each row is MEM_SCALE times the position's bytes, rounded per stage and boundary
        (so non-decreasing in the boundary); where the scaled coefficients are not whole (token shares) the
        rounding may add up to one per stage, which the limit allows for: a row is then a relaxation, and
        the splits it lets through are checked by `memory` itself."""
        pos = self.positions[r]
        if math.isnan(self.limit[r]) or not len(pos.stages):
            return []
        k, P = MEM_SCALE, {key: v.astype(float) for key, v in self.P.items()}
        out = []
        for a, w, c in zip(pos.act, pos.wact, pos.ckpt):
            x = a + c * CKPT_OF_ACT  # the split's ckpt is its act / 8
            whole = np.allclose(k * x, np.rint(k * x), rtol=0, atol=1e-9) and np.allclose(k * w, np.rint(k * w))
            wq = np.zeros((self.S, self.L + 1), dtype=np.int64)
            for xs, ws, s in zip(x.tolist(), w.tolist(), pos.stages.tolist()):
                wq[s] = np.rint(k * (P["params"] + xs * P["act"] + ws * P["wact"])).astype(np.int64)
            slack = 0 if whole else len(pos.stages)
            out.append((wq, math.floor(k * self.limit[r]) + slack))
        return out

    def cost_doc(self, bounds: Sequence[int]) -> dict:
        """The per-stage cost document the simulator gets for this split."""
        u = self.stage_units(bounds)
        last = np.asarray(bounds[1:]) - 1
        return {
            "F": (u["F"] * self.unit).tolist(),
            "B": (u["B"] * self.unit).tolist(),
            "W": (u["W"] * self.unit).tolist(),
            "act_bytes": self.table.out_bytes[last].tolist(),
            "param_bytes": self._param_bytes(bounds),
            "_from": "pipec partition: the split's layer sums",
        }

    def _param_bytes(self, bounds: Sequence[int]) -> list[float]:
        pre = _prefix(self.table.param_bytes)
        c = np.asarray(bounds)
        return (pre[c[1:]] - pre[c[:-1]]).astype(float).tolist()

    def simulate(self, bounds: Sequence[int]):
        """The Timeline of the schedule's Program under this split's costs (`pipec.driver.timeline`)."""
        from pipec.driver import timeline

        self.simulations += 1
        return timeline(self.sched, self.program, [*self.cost_docs, self.cost_doc(bounds)])

    def evaluate(self, bounds: Sequence[int]) -> Split:
        from pipec.sim.simulate import stats

        tl = self.simulate(bounds)
        mem = self.memory(bounds)
        fits = bool(np.all(np.isnan(self.limit) | (mem <= self.limit + 1e-9)))
        u = self.stage_units(bounds)
        times = {k: tuple((u[k] * self.unit).tolist()) for k in KINDS}
        return Split(tuple(int(x) for x in bounds), float(stats(tl).makespan), tuple(mem.tolist()), fits, times)

    def uniform(self) -> tuple[int, ...]:
        """Layers as evenly as they go, the first stages taking one fewer when L is not a multiple of S."""
        return tuple(int(self.L * s // self.S) for s in range(self.S + 1))

    def memory_schedule(self, bounds: Sequence[int]) -> Schedule:
        """The schedule with this split's bytes as its memory declarations (for pipec.sim.memory)."""
        b = self.stage_bytes(bounds)
        mem = {k: tuple(v.tolist()) for k, v in b.items()}
        mem["ckpt"] = tuple((b["act"] * CKPT_OF_ACT).tolist())
        mem["limit"] = tuple(self.limit.tolist())
        return replace(self.sched, memory=mem)


def _prefix(x: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.rint(np.asarray(x, dtype=float)).astype(np.int64))])


class _Graph:
    """The Program's dependency graph (module docstring, point 1): each op's predecessor on its rank and its
    data predecessor, with the message delay (latency + comm, in units, rounded down) between them."""

    def __init__(self, sched: Schedule, costs, unit: float) -> None:
        S = sched.num_stages
        kinds = sched.kinds
        kind_index = np.array([KINDS.index(k) for k in kinds], dtype=np.int64)
        slices = sched.slicing.slices if sched.slicing else 1
        kind = np.concatenate([kind_index[r.kind] for r in sched.ranks]) if sched.ranks else np.zeros(0, np.int64)
        mb = np.concatenate([r.mb for r in sched.ranks]).astype(np.int64)
        stage = np.concatenate([r.stage for r in sched.ranks]).astype(np.int64)
        rank = np.repeat(np.arange(len(sched.ranks)), [len(r) for r in sched.ranks])
        info = list(zip(kind.tolist(), stage.tolist(), rank.tolist(), mb.tolist()))  # (kind 0..2, stage, rank, mb)
        n, m = len(info), sched.num_microbatches
        ident = np.full(len(KINDS) * S * m, -1, dtype=np.int64)
        ident[(kind * S + stage) * m + mb] = np.arange(n)
        rank_pred = np.full(n, -1, dtype=np.int64)
        data_pred = np.full(n, -1, dtype=np.int64)
        delay = np.zeros(n, dtype=np.int64)
        first = 0
        for ops in sched.ranks:
            for j in range(1, len(ops)):
                rank_pred[first + j] = first + j - 1
            first += len(ops)
        # The data predecessor: the op's input from another rank by the dependency rule (pipec.ir.rules; a
        # kind receives at most one). An input on the op's own rank, the slice rules' included, ends before
        # the rank's previous op does (E304 holds them earlier in its order), so the rank chain carries it.
        for _, dk, dmb, ds, valid in dependencies(kind, mb, stage, S, len(kinds) == 3, slices):
            u = np.where(valid, ident[(dk * S + np.clip(ds, 0, S - 1)) * m + np.clip(dmb, 0, m - 1)], -1)
            remote = (u >= 0) & (rank[np.maximum(u, 0)] != rank)
            data_pred = np.where(remote, u, data_pred)
        for v in np.flatnonzero(data_pred >= 0).tolist():
            u, r = int(data_pred[v]), info[v][2]
            ru = info[u][2]
            d = float(costs.latency[ru, r]) + float(costs.comm[info[u][1]])
            delay[v] = math.floor(d / unit) if math.isfinite(d) else 0
        # a topological order: advance each rank while its next op's data predecessor is done
        order, done = [], np.zeros(n, dtype=bool)
        heads = []
        first = 0
        for ops in sched.ranks:
            heads.append([first, first + len(ops)])
            first += len(ops)
        progress = True
        while progress:
            progress = False
            for h in heads:
                while h[0] < h[1] and (data_pred[h[0]] < 0 or done[data_pred[h[0]]]):
                    done[h[0]] = True
                    order.append(h[0])
                    h[0] += 1
                    progress = True
        self.order = order
        self.kind = np.array([x[0] for x in info], dtype=np.int64)
        self.stage = np.array([x[1] for x in info], dtype=np.int64)
        self.rank = np.array([x[2] for x in info], dtype=np.int64)
        self.rank_pred, self.data_pred, self.delay = rank_pred.tolist(), data_pred.tolist(), delay.tolist()
        self.last_of_rank = [h[1] - 1 for h in heads if h[1] > 0]
        self.S = S

    def rank_chains(self, R: int) -> list[tuple[int, np.ndarray]]:
        """Each rank's whole order as a path: the sum of its ops (a rank computes one op at a time)."""
        out = []
        for r in range(R):
            counts = np.zeros((3, self.S), dtype=np.int64)
            sel = self.rank == r
            np.add.at(counts, (self.kind[sel], self.stage[sel]), 1)
            out.append((0, counts))
        return out

    def lengths(self, units: Mapping[str, np.ndarray]) -> np.ndarray:
        """The longest path's length (units) for each of a batch of splits, units[k] of shape (n, S):
        `paths`' first value for each, in one pass over the graph with numpy."""
        dur = np.stack([units[k] for k in KINDS])[self.kind, :, self.stage]  # (ops, n)
        end = np.empty_like(dur)
        rp, dp, dl = self.rank_pred, self.data_pred, self.delay
        for v in self.order:
            a = end[rp[v]] if rp[v] >= 0 else 0
            if dp[v] >= 0:
                a = np.maximum(a, end[dp[v]] + dl[v])
            end[v] = a + dur[v]
        return end.max(axis=0) if len(end) else np.zeros(dur.shape[1], dtype=np.int64)

    def paths(self, units: dict[str, np.ndarray]) -> tuple[int, list[tuple[int, np.ndarray]]]:
        """The longest path's length (units) at these per-stage durations, and the paths to cut with: the
        longest one, and the longest one ending at each rank's last op, as (constant, counts[kind, stage])."""
        dur = np.stack([units[k] for k in KINDS])[self.kind, self.stage].tolist()
        n = len(dur)
        end = [0] * n
        via = [-1] * n
        rp, dp, dl = self.rank_pred, self.data_pred, self.delay
        for v in self.order:
            a = end[rp[v]] if rp[v] >= 0 else 0
            b = end[dp[v]] + dl[v] if dp[v] >= 0 else -1
            if b > a:
                end[v], via[v] = b + dur[v], dp[v]
            else:
                end[v], via[v] = a + dur[v], rp[v]
        tips = [int(np.argmax(end)), *self.last_of_rank]
        out = []
        for t in dict.fromkeys(tips):
            counts = np.zeros((3, self.S), dtype=np.int64)
            const, v = 0, t
            while v >= 0:
                counts[self.kind[v], self.stage[v]] += 1
                u = via[v]
                if u >= 0 and u == dp[v]:
                    const += dl[v]
                v = u
            out.append((const, counts))
        return max(end), out


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


def search(pb: Problem, time_limit: float = 10.0) -> Result:
    """The best contiguous split (module docstring), with the uniform split for comparison; E806 when no
    split fits the memory limits. First the fluid bound (`fluid_bound`) and local searches (`_local_search`,
    then kicks) from its rounded split, the uniform split and the bottleneck split give a bound, a good
    incumbent and many paths; then the branch and bound (`_branch`) proves it
    optimal or improves it, until `time_limit` seconds have passed (then the bound reached is reported,
    `Result.optimal` False)."""
    t0, c0 = time.perf_counter(), time.process_time()
    paths: dict[tuple[int, bytes], tuple[int, np.ndarray]] = {}  # every path the simulated splits had

    def cut(bounds: Sequence[int]) -> None:
        for const, counts in pb.graph.paths(pb.stage_units(bounds))[1]:
            paths.setdefault((const, counts.tobytes()), (const, counts))

    fluid = fluid_bound(pb)
    uniform = pb.evaluate(pb.uniform())
    cut(uniform.bounds)
    best = None
    starts = [pb.evaluate(b) for b in (fluid.rounded,) if b is not None] + [uniform, pb.evaluate(_balanced(pb))]
    # half the time left to the local searches, shared out as they go, the rest to the branch and bound
    phase_end = t0 + (time_limit + time.perf_counter() - t0) / 2
    for n, start in enumerate(starts):
        cut(start.bounds)
        if start.fits:
            now = time.perf_counter()
            found = _local_search(pb, start, cut, now + (phase_end - now) / (len(starts) - n))
            best = found if best is None or found.step < best.step else best
    # What the starts left: kicks, until 30 in a row find nothing better (small problems are the branch and bound's
    # to prove) or the fluid bound proves the incumbent.
    rng, stall = np.random.default_rng(0), 0  # the same answer on every run of the same problem
    while best is not None and stall < 30 and time.perf_counter() < phase_end and best.step > fluid.bound * pb.unit:
        kicked = _kick(best.bounds, rng)
        if kicked is not None:
            found = _local_search(pb, pb.evaluate(kicked), cut, phase_end)
            stall = 0 if found.fits and found.step < best.step else stall + 1
            best = found if found.fits and found.step < best.step else best
    rows = _Rows(pb)
    rows.add([(w, c, k) for w, (c, k) in zip(fluid.weights, fluid.paths)])
    near = _near(pb, best, paths.values())
    for const, counts in [*pb.graph.rank_chains(pb.R), *near]:
        rows.add([(1, const, counts)])
    rows.add_memory()
    best, proven, nodes, open_bound = _branch(pb, best, rows, t0 + time_limit)
    if best is None:
        raise no_fit(pb)
    # a bound of the tree's open nodes, the fluid bound and the work bound all hold for every split
    lower = best.step if proven else min(max(fluid.bound, open_bound, _work_bound(pb)) * pb.unit, best.step)
    return Result(
        best=best,
        uniform=uniform,
        lower_bound=lower,
        optimal=lower >= best.step,
        nodes=nodes,
        paths=len(rows.paths),
        simulations=pb.simulations,
        seconds=time.perf_counter() - t0,
        cpu_seconds=time.process_time() - c0,
        fluid_bound=min(fluid.bound * pb.unit, best.step),
    )


def _near(pb: Problem, best: Split | None, paths) -> list[tuple[int, np.ndarray]]:
    """The paths within 3% of the incumbent's step at the incumbent: the rows the branch and bound starts
    with besides the rank chains and the fluid bound's. Why: a node costs time in proportion to the rows,
    and a path far below the budget at the best split found rarely removes a value near it (the leaves
    add the paths they need; at 96 layers x 16 stages this doubles the nodes searched in the time)."""
    paths = list(paths)
    if best is None or not paths:
        return paths
    u = pb.stage_units(best.bounds)
    d = np.stack([u[k] for k in KINDS])  # (3, S)
    length = np.array([c + int((k * d).sum()) for c, k in paths])
    keep = length >= 0.97 * best.step / pb.unit
    return [p for p, k in zip(paths, keep.tolist()) if k]


_BIG = np.int64(1) << 60  # "no split": above every row's limit, and far enough from int64's end to add to


class _Rows:
    """Linear rows over a split for the branch and bound (`_branch`): row v is satisfied by the boundaries
    c when sum_s (wq[v, s, c_{s+1}] - wq[v, s, c_s]) <= lim[v]. A path P (or a non-negative integer
    combination of paths, weights w) is a row with wq = sum_P w_P sum_k counts_P[k, s] Q_k[s] and the
    limit sum_P w_P (budget - const_P): every path at most `budget` units implies it. A rank's memory at one
    position of its order is a row on its stages' byte prefix sums with its limit. Every wq[v, s] is
    non-decreasing in the boundary (times and bytes are non-negative), so a partial sum above the limit
    stays above it."""

    def __init__(self, pb: Problem) -> None:
        self.pb = pb
        self.wq = np.zeros((0, pb.S, pb.L + 1), dtype=np.int64)
        self.weight = np.zeros(0, dtype=np.int64)  # sum of the path weights; 0 for a memory row
        self.const = np.zeros(0, dtype=np.int64)  # sum_P w_P const_P, or minus the memory limit
        self.paths: set[tuple[int, bytes]] = set()
        self._keys: set[tuple[int, bytes]] = set()

    def limits(self, budget: int) -> np.ndarray:
        return self.weight * budget - self.const

    def _append(self, wq: np.ndarray, weight: int, const: int) -> bool:
        key = (weight, const, wq.tobytes())
        if key in self._keys:
            return False
        self._keys.add(key)
        self.wq = np.concatenate([self.wq, wq[None]])
        self.weight = np.append(self.weight, np.int64(weight))
        self.const = np.append(self.const, np.int64(const))
        return True

    def add(self, weighted: Sequence[tuple[int, int, np.ndarray]]) -> bool:
        """A row from paths with integer weights, (weight, const, counts[kind, stage]) each."""
        pb = self.pb
        weighted = [(int(w), int(c), k) for w, c, k in weighted if w > 0]
        for _, c, k in weighted:
            self.paths.add((c, k.tobytes()))
        if not weighted:
            return False
        per = sum(w * k.astype(np.int64) for w, _, k in weighted)  # (3, S)
        wq = sum(per[i][:, None] * pb.Q[k] for i, k in enumerate(KINDS))
        return self._append(wq, sum(w for w, _, _ in weighted), sum(w * c for w, c, _ in weighted))

    def add_memory(self) -> None:
        """One row per memory position of every rank with a limit (`Problem.memory_rows`)."""
        for r in range(self.pb.R):
            for wq, lim in self.pb.memory_rows(r):
                self._append(wq, 0, -lim)


def _propagate(rows: _Rows, allowed: np.ndarray, budget: int) -> int | None:
    """Remove from `allowed` ((S + 1, L + 1) booleans: the values each boundary may still take) every value
    that no split within the domains can take with every row satisfied at this budget, row by row: for
    each row, the least partial sum up to c_t = j (forward) plus the least from it to the end (backward),
    both dynamic programs over the domains, vectorised over the rows; repeated until nothing changes.
    Returns None when some boundary has no value left (no split here has every path within the budget),
    else the node's lower bound: the most, over the path rows, of their least weighted mean (units,
    rounded up: the longest path is an integer at least that mean)."""
    pb = rows.pb
    S = pb.S
    wq, lim = rows.wq, rows.limits(budget)[:, None]
    n = len(lim)
    while True:
        if not allowed.any(axis=1).all():
            return None
        lo = allowed.argmax(axis=1)
        hi = pb.L - allowed[:, ::-1].argmax(axis=1)
        fwd = [np.zeros((n, 1), dtype=np.int64)]
        for s in range(S):
            a0, a1, b0, b1 = lo[s], hi[s] + 1, lo[s + 1], hi[s + 1] + 1
            run = np.minimum.accumulate(fwd[-1] - wq[:, s, a0:a1], axis=1)
            idx = np.minimum(np.arange(b0, b1) - 1, a1 - 1) - a0  # the last a < b
            f = run[:, np.maximum(idx, 0)] + wq[:, s, b0:b1]
            f[:, (idx < 0) | ~allowed[s + 1, b0:b1]] = _BIG
            f[f > lim] = _BIG
            fwd.append(f)
        if fwd[-1].max() >= _BIG:
            return None
        least = fwd[-1][:, 0]
        changed = False
        g = np.zeros((n, 1), dtype=np.int64)
        for s in range(S - 1, -1, -1):
            a0, a1, b0, b1 = lo[s], hi[s] + 1, lo[s + 1], hi[s + 1] + 1
            suf = np.minimum.accumulate((g + wq[:, s, b0:b1])[:, ::-1], axis=1)[:, ::-1]
            idx = np.maximum(np.arange(a0, a1) + 1, b0) - b0  # the first b > a
            g = suf[:, np.minimum(idx, b1 - b0 - 1)] - wq[:, s, a0:a1]
            g[:, idx >= b1 - b0] = _BIG
            ok = np.all(g + fwd[s] <= lim, axis=0) & allowed[s, a0:a1]
            if not ok.any():
                return None
            if (ok != allowed[s, a0:a1]).any():
                changed = True
                allowed[s, a0:a1] = ok
            g[:, ~ok] = _BIG
            g[g > lim] = _BIG
        if not changed:
            w = rows.weight > 0
            return int(np.max(-((-(least[w] + rows.const[w])) // rows.weight[w]), initial=0))


def _branch(pb: Problem, best: Split | None, rows: _Rows, deadline: float) -> tuple[Split | None, bool, int, int]:
    """Depth-first branch and bound over the boundaries: a node is a domain per boundary, narrowed by
    `_propagate` with every path's budget one unit below the incumbent's step; the boundary with the
    fewest values left is branched on, the values nearest the incumbent's first. At a leaf (one split),
    the graph's longest path says whether it can beat the incumbent; if so it is simulated, and its paths
    become rows either way (so the leaf, if the graph was longer than the rows said, is cut off next
    time). Every split is either in a pruned node (its step at least the incumbent's: a path of it is
    at least the budget + 1) or simulated, so an exhausted tree proves the incumbent optimal, whatever
    the cost model's messages. Returns (best, proven, nodes, the least bound of the nodes left open)."""
    S, L = pb.S, pb.L
    delays = sum(pb.graph.delay)
    # without an incumbent, a budget no split exceeds: every op at its slowest stage, every delay
    slowest = sum(int(np.diff(q, axis=1).max(axis=0).sum()) for q in pb.Q.values()) * max(pb.m, 1) + delays
    budget = int(math.ceil(best.step / pb.unit)) - 1 if best else slowest
    root = np.zeros((S + 1, L + 1), dtype=bool)
    root[0, 0] = root[S, L] = True
    for t in range(1, S):
        root[t, t : L - S + t + 1] = True
    stack = [(root, 0)]  # (domains, the parent's bound)
    nodes = 0
    while stack and time.perf_counter() < deadline:
        allowed, _ = stack.pop()
        nodes += 1
        bound = _propagate(rows, allowed, budget)
        if bound is None or bound > budget:
            continue
        size = allowed.sum(axis=1)
        if (size == 1).all():
            bounds = tuple(int(np.flatnonzero(allowed[t])[0]) for t in range(S + 1))
            length, cuts = pb.graph.paths(pb.stage_units(bounds))
            for const, counts in cuts:
                rows.add([(1, const, counts)])
            if length <= budget:
                cand = pb.evaluate(bounds)
                if cand.fits and (best is None or cand.step < best.step):
                    best, budget = cand, int(math.ceil(cand.step / pb.unit)) - 1
            continue
        t = int(np.argmin(np.where(size > 1, size, L + 2)))
        near = best.bounds[t] if best else (L * t) // S
        for j in sorted(np.flatnonzero(allowed[t]).tolist(), key=lambda j: -abs(j - near)):
            child = allowed.copy()
            child[t] = False
            child[t, j] = True
            stack.append((child, bound))
    return best, not stack, nodes, min((b for _, b in stack), default=budget + 1)


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


def _balanced(pb: Problem) -> tuple[int, ...]:
    """The split whose slowest stage (F + B + W of one micro-batch on its rank) is fastest: the classic
    bottleneck partition, by dynamic programming over (stage, boundary); a starting point only."""
    load = sum(pb.Q[k] for k in KINDS).astype(float)  # (S, L + 1) prefix sums per stage's rank
    L, S = pb.L, pb.S
    inf = float("inf")
    best = np.full(L + 1, inf)
    best[0] = 0.0
    choice = np.zeros((S, L + 1), dtype=np.int64)
    idx = np.arange(L + 1)
    for s in range(S):
        # cost[a, c] = max(best[a], load of layers a..c on stage s), for a < c
        seg = load[s][None, :] - load[s][:, None]
        cost = np.maximum(best[:, None], seg)
        cost[idx[:, None] >= idx[None, :]] = inf
        choice[s] = np.argmin(cost, axis=0)
        best = cost[choice[s], idx]
    bounds = [L]
    for s in range(S - 1, 0, -1):
        bounds.append(int(choice[s][bounds[-1]]))
    return tuple([0, *reversed(bounds)])


def _local_search(pb: Problem, start: Split, cut, deadline: float) -> Split:
    """Steepest descent over the neighbours of the split (one boundary moved by one or two layers, or two
    boundaries by one each), until none fits and simulates faster (or the deadline). Why the batch: the
    dependency graph's longest path, a lower bound on the simulated step (equal with free messages), is
    computed for every neighbour at once; only those it puts below the incumbent are simulated, the
    shortest first, and every split simulated adds its paths to the branch and bound's rows."""
    best = start
    while time.perf_counter() < deadline:
        cands = _neighbours(best.bounds)
        if not len(cands):
            break
        lengths = pb.graph.lengths(pb.batch_units(cands))
        improved = False
        for i in np.argsort(lengths, kind="stable").tolist():
            if lengths[i] * pb.unit >= best.step or time.perf_counter() > deadline:
                break
            b = tuple(int(x) for x in cands[i])
            if not bool(np.all(np.isnan(pb.limit) | (pb.memory(b) <= pb.limit + 1e-9))):
                continue
            cand = pb.evaluate(b)
            cut(cand.bounds)
            if cand.fits and cand.step < best.step:
                best, improved = cand, True
                break
        if not improved:
            break
    return best


def _kick(bounds: Sequence[int], rng: np.random.Generator) -> tuple[int, ...] | None:
    """A random split near this one (three boundaries moved by one to three layers), for the local search
    to start from again: an iterated local search, out of the minima one move cannot leave."""
    b = list(bounds)
    S = len(b) - 1
    if S < 2:
        return None
    for t in rng.choice(np.arange(1, S), size=min(3, S - 1), replace=False).tolist():
        b[t] += int(rng.choice([-3, -2, -1, 1, 2, 3]))
    return tuple(b) if all(x < y for x, y in zip(b, b[1:])) and b[0] == 0 and b[-1] == bounds[-1] else None


def _neighbours(bounds: Sequence[int]) -> np.ndarray:
    """The splits one move away (`_local_search`), as an (n, S + 1) array of boundaries."""
    c = np.asarray(bounds, dtype=np.int64)
    S = len(c) - 1
    single = [(t, d) for t in range(1, S) for d in (-1, 1)]
    moves = [[m] for m in single] + [[(t, 2 * d)] for t, d in single]
    moves += [[a, b] for n, a in enumerate(single) for b in single[n + 1 :] if a[0] != b[0]]
    out = np.repeat(c[None, :], len(moves), axis=0)
    for row, ms in zip(out, moves):
        for t, d in ms:
            row[t] += d
    return out[np.all(np.diff(out, axis=1) > 0, axis=1)]


def no_fit(pb: Problem):
    """E806: no split fits; names the split that comes closest (the least excess over any rank's limit)."""
    master = Master(pb, memory=False)
    M = master.model
    worst_bytes = (int(sum(int(v[-1]) for v in pb.P.values())) * max(pb.m, 1) + 1) * MEM_SCALE + pb.S
    excess = M.NewIntVar(-worst_bytes, worst_bytes, "excess")
    for r in range(pb.R):
        for lim, const, expr in master.memory_rows(r):
            M.Add(excess >= const + expr - lim)
    M.Minimize(excess)
    solver = master.cp.CpSolver()
    solver.parameters.max_time_in_seconds = 10.0
    solver.parameters.num_workers = 2
    solver.Solve(M)
    bounds = [0] + [sum(int(solver.Value(x)) for x in master.v[t]) for t in range(1, pb.S)] + [pb.L]
    mem = pb.memory(bounds)
    worst = int(np.nanargmax(np.where(np.isnan(pb.limit), -np.inf, mem - pb.limit)))
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    return error(
        "E806",
        f"no split of the {pb.L} layers into {pb.S} stages fits the memory limits: the closest, layers per stage "
        f"{', '.join(map(str, sizes))}, needs {fmt_bytes(mem[worst])} on rank {worst} "
        f"(limit {fmt_bytes(pb.limit[worst])})",
        notes=(
            "per rank: " + ", ".join(f"{fmt_bytes(x)}" for x in mem.tolist()),
            "raise the limits, take a schedule that holds fewer micro-batches, or more ranks",
        ),
    )
