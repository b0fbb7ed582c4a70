"""A candidate's lower bound and improvement when `pipec.partition.search` is too slow for it. Why a module
of its own: the partition search starts with its fluid bound, one linear program over the whole dependency
graph, which takes seconds at p = 8 but minutes at p = 64 (about 460 s for 1F1B at p = 64, m = 64, 200
layers on the development machine); the planner still needs a bound for every candidate there.

The bound (`path_bound`) is the branch and bound's root (`pipec.partition.branch._propagate`) bisected on
the budget: rows for every rank's whole order and for the paths of the splits simulated so far (each path's
length is additive over the stages, so a split with step T has every such row at most T), and every memory
position held to its limit. When propagation empties a boundary's domain at budget T, no split within the
limits has every row at most T, so every split's step exceeds T. Bisection keeps the largest T proven so.
The work bound (`pipec.partition.bounds._work_bound`) is its floor. When the rows are infeasible even at a
budget no split exceeds, no split fits the limits at all.

The bounds on every candidate, built or not (`work_bound`, `layer_bound`, `universal_bound`), need only the
layer table and the ranks: they hold for the schedule and m pairs a short time limit never screened.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from pipec.partition.bounds import _work_bound
from pipec.partition.branch import _propagate, _Rows
from pipec.partition.graph import KINDS
from pipec.partition.local_search import _kick, _local_search, single_moves
from pipec.partition.problem import Problem, Split

if TYPE_CHECKING:
    from pipec.planner.search import Inputs

# Above this many stages the local search moves one boundary at a time (`_single_moves`): the partition
# search's neighbourhood (pairs of boundaries too) is about S^2 splits, whose longest paths it computes as one
# (ops x splits) array: 1.5 GB at p = 64, m = 128.
LOCAL_SEARCH_STAGES = 16

# Rows x stages x boundaries above which `path_bound` does not propagate (one pass over them would take
# tens of seconds and gigabytes: DualPipe-V at p = 64, m = 256, 200 layers) and returns its floor instead.
MAX_ROW_CELLS = 20_000_000

# Above this many ops a candidate is refined by `improve` and bounded by `path_bound` instead of
# `pipec.partition.search` (whose fluid bound's linear program grows too slow beyond it).
SEARCH_OPS = 1500


def _root(pb: Problem) -> np.ndarray:
    S, L = pb.S, pb.L
    root = np.zeros((S + 1, L + 1), dtype=bool)
    root[0, 0] = root[S, L] = True
    for t in range(1, S):
        root[t, t : L - S + t + 1] = True
    return root


def _slowest(pb: Problem) -> int:
    """A budget (units) no split's step exceeds: every op at its slowest stage, plus every delay."""
    return sum(int(np.diff(q, axis=1).max(axis=0).sum()) for q in pb.Q.values()) * max(pb.m, 1) + int(
        sum(pb.graph.delay)
    )


def rows_of(pb: Problem, splits: Iterable[Sequence[int]], deadline: float = math.inf, memory: bool = True) -> _Rows:
    """The rows: each rank's order, the paths of these splits, and (`memory`) the memory positions. Stacked once
    (`_Rows.add` concatenates row by row, quadratic in the rows at p = 64)."""
    paths: dict[tuple[int, bytes], tuple[int, np.ndarray]] = {}
    for const, counts in pb.graph.rank_chains(pb.R):
        paths.setdefault((const, counts.tobytes()), (const, counts))
    for n, bounds in enumerate(splits):
        if n and time.perf_counter() > deadline:  # each split's paths walk the whole graph in Python
            break
        for const, counts in pb.graph.paths(pb.stage_units(bounds))[1]:
            paths.setdefault((const, counts.tobytes()), (const, counts))
    wq, weight, const = [], [], []
    for c, k in paths.values():
        wq.append(sum(k[i].astype(np.int64)[:, None] * pb.Q[kind] for i, kind in enumerate(KINDS)))
        weight.append(1)
        const.append(c)
    for r in range(pb.R if memory else 0):
        for w, lim in pb.memory_rows(r):
            wq.append(w)
            weight.append(0)
            const.append(-lim)
    rows = _Rows(pb)
    rows.wq = np.stack(wq) if wq else rows.wq
    rows.weight = np.asarray(weight, dtype=np.int64)
    rows.const = np.asarray(const, dtype=np.int64)
    rows.paths = set(paths)
    return rows


def path_bound(
    pb: Problem, rows: _Rows, upper: float | None, steps: int = 10, floor: float = 0.0, deadline: float = math.inf
) -> tuple[float, bool]:
    """(a lower bound in seconds on every split's step within the limits, proven that no split fits): the
    module docstring's bisection, `steps` halvings between the work bound (or `floor`, seconds, a bound
    already proven) and `upper` (seconds; None: a budget no split exceeds)."""
    lo = max(_work_bound(pb), int(math.floor(floor / pb.unit)))
    if rows.wq.size > MAX_ROW_CELLS or time.perf_counter() > deadline:  # one propagation would take too long
        return lo * pb.unit, False
    top = _slowest(pb)
    hi = min(int(math.ceil(upper / pb.unit)), top) if upper is not None else top
    root = _root(pb)
    got = _propagate(rows, root.copy(), top)
    if got is None:
        return math.inf, True  # even the slowest budget: the memory rows alone exclude every split
    lo = max(lo, min(got, hi))
    if _propagate(rows, root.copy(), lo) is None:
        lo += 1
    for _ in range(steps):
        if hi - lo <= 1 or time.perf_counter() > deadline:
            break
        mid = (lo + hi) // 2
        if _propagate(rows, root.copy(), mid) is None:
            lo = mid + 1  # no split has every row within mid: every step is above it
        else:
            hi = mid
    return lo * pb.unit, False


def improve(pb: Problem, start: Split, deadline: float) -> tuple[Split, list[tuple[int, ...]]]:
    """The partition search's incumbent phase alone (`pipec.partition.local_search`: steepest descent, then
    kicks until 30 in a row find nothing better or the deadline), from `start`; with the splits simulated,
    whose paths `path_bound` takes as rows."""
    seen: list[tuple[int, ...]] = [start.bounds]

    def cut(bounds: Sequence[int]) -> None:
        if len(seen) < 64:
            seen.append(tuple(bounds))

    descend = _local_search if pb.S <= LOCAL_SEARCH_STAGES else _single_moves
    best = descend(pb, start, cut, deadline)
    rng, stall = np.random.default_rng(0), 0
    while stall < 30 and time.perf_counter() < deadline:
        kicked = _kick(best.bounds, rng)
        if kicked is None:
            break
        found = descend(pb, pb.evaluate(kicked), cut, deadline)
        better = found.fits and found.step < best.step
        stall = 0 if better else stall + 1
        best = found if better else best
    return best, seen


def _single_moves(pb: Problem, start: Split, cut, deadline: float) -> Split:
    """Steepest descent over the splits one boundary moved by one or two layers
    (`pipec.partition.local_search._local_search`'s rule, on fewer neighbours)."""
    return _local_search(pb, start, cut, deadline, neighbours=single_moves)


# ---- bounds on every candidate, built or not ----------------------------------------------------------


def work_bound(inputs: Inputs) -> float:
    """Seconds no plan beats, whatever its schedule, m or split: the whole step's work (every layer's F and
    its backward, split or not, for the global batch) over the ranks' speeds together, as if no rank ever
    waited."""
    t = inputs.table
    work = float((t.F + np.minimum(t.B + t.W, t.full_backward)).sum()) * inputs.global_batch / inputs.table_mbs
    return work / float(np.sum(inputs.speed))


def layer_bound(inputs: Inputs, m: int, split: bool) -> float:
    """Seconds no plan with m micro-batches (and a split backward or not) beats, whatever its schedule or
    split: a layer lives on one rank, which runs its m forwards and m backwards one at a time at most at the
    fastest speed, and its first forward waits for micro-batch 0's forwards through every layer before it
    (in order, on ranks no faster); without a split backward its last backward is followed by that
    micro-batch's backwards through every layer before it (with one, a W may end the step instead). The most
    over the layers, and at least the work bound."""
    t = inputs.table
    s = float(np.max(inputs.speed))
    f = t.F * inputs.global_batch / (m * inputs.table_mbs) / s
    b = (t.B + t.W if split else t.full_backward) * inputs.global_batch / (m * inputs.table_mbs) / s
    before_f = np.concatenate([[0.0], np.cumsum(f)[:-1]])
    before_b = (
        np.concatenate([[0.0], np.cumsum(t.full_backward)[:-1]]) * inputs.global_batch / (m * inputs.table_mbs) / s
    )
    per = before_f + m * (f + b) + (0.0 if split else before_b)
    return max(float(per.max()), work_bound(inputs))


def universal_bound(inputs: Inputs) -> float:
    """`layer_bound` at its least over the micro-batch counts tried and both kinds of backward: below every
    candidate, screened or not."""
    return min(layer_bound(inputs, m, split) for m in inputs.microbatches for split in (False, True))
