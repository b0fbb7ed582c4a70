"""The branch and bound that proves a split optimal: linear rows over a split (paths held to a budget,
memory positions to their limits), their propagation over the boundaries' domains, and the depth-first
tree (`pipec.partition.search`'s docstring, point 3). Why a module of its own: it is the proof, and the
only part whose exhaustion says `Result.optimal`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np

from pipec.partition.graph import KINDS
from pipec.partition.problem import Problem, Split

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
