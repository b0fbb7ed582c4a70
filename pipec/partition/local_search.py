"""The incumbent: starting splits (the bottleneck partition) and the iterated local search from them
(steepest descent over one- and two-boundary moves, then random kicks). Why a module of its own: a good
incumbent early sets the branch and bound's budget and gives it paths near the optimum
(`pipec.partition.search`'s docstring, point 2); none of it is needed for the proof.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from pipec.partition.graph import KINDS
from pipec.partition.problem import Problem, Split


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


def _local_search(pb: Problem, start: Split, cut, deadline: float, neighbours=None) -> Split:
    """Steepest descent over the neighbours of the split (one boundary moved by one or two layers, or two
    boundaries by one each), until none fits and simulates faster (or the deadline). Why the batch: the
    dependency graph's longest path, a lower bound on the simulated step (equal with free messages), is
    computed for every neighbour at once; only those it puts below the incumbent are simulated, the
    shortest first, and every split simulated adds its paths to the branch and bound's rows. `neighbours`:
    another neighbourhood (bounds -> (n, S + 1) array), as the planner's single moves."""
    best = start
    while time.perf_counter() < deadline:
        cands = (neighbours or _neighbours)(best.bounds)
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


def single_moves(bounds: Sequence[int]) -> np.ndarray:
    """The splits one boundary moved by one or two layers (a neighbourhood for `_local_search`)."""
    c = np.asarray(bounds, dtype=np.int64)
    moves = [(t, d) for t in range(1, len(c) - 1) for d in (-2, -1, 1, 2)]
    out = np.repeat(c[None, :], len(moves), axis=0)
    for row, (t, d) in zip(out, moves):
        row[t] += d
    return out[np.all(np.diff(out, axis=1) > 0, axis=1)]


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
