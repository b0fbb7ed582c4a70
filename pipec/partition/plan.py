"""The partition of a layer table over a schedule's stages (`partition`), its printed report and its
file's document: what `pipec partition` and `pipec.partition`'s API call (the package docstring says
the whole flow)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from pipec.formats.partition_files import LayerTable, Ranks, partition_doc
from pipec.ir.units import fmt_bytes
from pipec.partition.problem import Problem, Split
from pipec.partition.search import Result, search


@dataclass(frozen=True)
class Outcome:
    problem: Problem
    result: Result
    speed: tuple[float, ...]
    limit: tuple[float, ...]

    def stages(self, split: Split) -> list[list[str]]:
        names = self.problem.table.names
        return [list(names[a:b]) for a, b in zip(split.bounds, split.bounds[1:])]


def partition(
    sched,
    program,
    table: LayerTable,
    ranks: Ranks | None = None,
    limit: float | None = None,
    cost_docs: Sequence[Mapping] = (),
    time_limit: float = 10.0,
) -> Outcome:
    """Search the best split of `table`'s layers over the schedule's stages (see pipec.partition.search),
    within about `time_limit` seconds. `limit` (bytes) applies to every rank without one of its own in
    `ranks`."""
    R = sched.num_ranks
    ranks = ranks or Ranks()
    speed = ranks.speeds(R)
    lim = ranks.limits(R)
    if limit is not None:
        lim = np.where(np.isnan(lim), limit, np.fmin(lim, limit))
    t0 = time.perf_counter()
    pb = Problem(sched, program, table, speed, lim, cost_docs)
    left = time_limit - (time.perf_counter() - t0)  # the limit covers the set-up too
    return Outcome(pb, search(pb, left), tuple(speed.tolist()), tuple(lim.tolist()))


def _s(x: float) -> str:
    return f"{x:.6g}"


def _ranges(split: Split, names: Sequence[str]) -> list[str]:
    out = []
    for a, b in zip(split.bounds, split.bounds[1:]):
        out.append(f"{a}-{b - 1}" if b - a > 1 else f"{a}")
        if names:
            shown = names[a] if b - a == 1 else f"{names[a]} .. {names[b - 1]}"
            out[-1] += f" ({shown})"
    return out


def report_lines(out: Outcome) -> list[str]:
    """What `pipec partition` prints: the split per stage, then the predicted step and memory per rank,
    uniform beside it."""
    pb, res = out.problem, out.result
    best, uni = res.best, res.uniform
    names = pb.table.names
    lines = [
        f"{pb.sched.name} ({' '.join(f'{k}={v}' for k, v in pb.sched.params)}): {pb.L} layers over {pb.S} stages "
        f"on {pb.R} ranks",
    ]
    rows = [("stage", "rank", "speed", "layers", "F", "B", "W", "uniform layers")]
    ub = _ranges(uni, ())
    for s, text in enumerate(_ranges(best, names)):
        r = int(pb.placement[s])
        times = [_s(best.stage_times[k][s]) for k in ("F", "B", "W")]
        rows.append((str(s), str(r), _s(out.speed[r]), text, *times, ub[s]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    gain = uni.step / best.step if best.step > 0 else math.inf
    lines.append(
        f"predicted step {_s(best.step)} s; uniform split {_s(uni.step)} s"
        f"{'' if uni.fits else ' (does not fit the memory limits)'}: {gain:.3f}x, "
        f"{100 * (1 - best.step / uni.step) if uni.step else 0:.1f}% less"
    )
    rows = [("rank", "memory", "uniform", "limit")]
    for r in range(pb.R):
        lim = out.limit[r]
        limit = "-" if math.isnan(lim) else fmt_bytes(lim)
        rows.append((str(r), fmt_bytes(best.memory[r]), fmt_bytes(uni.memory[r]), limit))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    # the fluid bound: what no split beats even with layers cut between stages (pipec.partition.search)
    fluid = ", the fluid bound" if res.lower_bound == res.fluid_bound else ""
    how = (
        "optimal (the lower bound equals it)"
        if res.optimal
        else f"not proven optimal: lower bound {_s(res.lower_bound)} s "
        f"({100 * (1 - res.lower_bound / best.step):.2f}% below{fluid}) when the time limit ran out"
    )
    lines.append(
        f"search: {how}; {res.simulations} simulations, {res.paths} paths, {res.nodes} branch-and-bound nodes, "
        f"{res.seconds:.2f} s"
    )
    return lines


def to_doc(out: Outcome) -> dict:
    """The partition file's document (pipec.formats.partition_files.partition_doc) for this outcome."""
    pb, res = out.problem, out.result

    def num(x: float):
        return None if math.isnan(x) else x

    return partition_doc(
        pb.table,
        pb.sched.name,
        dict(pb.sched.params),
        out.stages(res.best),
        placement=list(pb.sched.placement),
        ranks={"speed": list(out.speed), "memory_limit": [num(x) for x in out.limit]},
        predicted={
            "step": res.best.step,
            "uniform_step": res.uniform.step,
            "memory": list(res.best.memory),
            "uniform_memory": list(res.uniform.memory),
            "lower_bound": res.lower_bound,
            "optimal": res.optimal,
            "layers_per_stage": list(res.best.sizes),
        },
    )
