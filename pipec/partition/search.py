"""The exact search for contiguous layer splits: the simulated step of the schedule, minimised under per-rank
memory limits, on ranks of different speeds.

The parts, each its own module of `pipec.partition`: the problem and one split's costs and simulation
(`problem`), the dependency graph and its paths (`graph`), the lower bounds (`bounds`), the incumbent's
local search (`local_search`), the branch and bound (`branch`) and E806's closest split (`closest`).
This module runs them in order and says why the result is optimal.

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
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipec.partition.bounds import _work_bound, fluid_bound
from pipec.partition.branch import _branch, _Rows
from pipec.partition.closest import closest, no_fit
from pipec.partition.graph import KINDS
from pipec.partition.local_search import _balanced, _kick, _local_search
from pipec.partition.problem import Problem, Split


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


def search(pb: Problem, time_limit: float = 10.0, starts: Sequence[Sequence[int]] = ()) -> Result:
    """The best contiguous split (module docstring), with the uniform split for comparison; E806 when no
    split fits the memory limits. First the fluid bound (`fluid_bound`) and local searches (`_local_search`,
    then kicks) from its rounded split, the uniform split, the bottleneck split and `starts` (more splits to
    start from) give a bound, a good incumbent and many paths (when none of them fits, from the split closest
    to fitting, `closest`: E806 at once when that is proven not to fit); then the branch and bound (`_branch`)
    proves it optimal or improves it, until `time_limit` seconds have passed (then the bound reached is reported,
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
    given = [pb.evaluate(tuple(int(x) for x in b)) for b in starts]
    starts = [pb.evaluate(b) for b in (fluid.rounded,) if b is not None] + [uniform, pb.evaluate(_balanced(pb))]
    starts += given
    near = None
    if not any(x.fits for x in starts):  # the branch and bound alone may not find a split that fits in its time
        near = closest(pb, max(1.0, time_limit / 4))
        start = pb.evaluate(near[0])
        if not start.fits and near[1]:
            raise no_fit(pb, near)  # proven: the least excess over every split is above 0
        starts.append(start)
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
    if best is None:  # the tree exhausted (proven: none fits), or out of time with the closest split unproven
        raise no_fit(pb, (near[0], near[1] or proven) if near else None)
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
