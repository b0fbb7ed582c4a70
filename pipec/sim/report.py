"""Simulating schedules for people: compile, cost, simulate, and the tables and JSON `pipec simulate` prints.

A pure layer between the CLI and `pipec.sim.simulate`: it returns strings and
dicts; `pipec.cli` prints them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from pipec.passes.compiler import CompiledSchedule, compile_schedule
from pipec.passes.memory import memory_model
from pipec.schedule import Schedule
from pipec.sim.costs import CostModel, cost_model
from pipec.sim.simulate import Stats, memory_curve, simulate, stats
from pipec.sim.timeline import Timeline


@dataclass(frozen=True)
class Simulation:
    compiled: CompiledSchedule
    costs: CostModel
    memory: dict[str, np.ndarray]
    timeline: Timeline
    stats: Stats

    @property
    def schedule(self) -> Schedule:
        return self.compiled.schedule


def run(sched: Schedule, cost_docs: Sequence[Mapping] = (), memory: Mapping[str, float] | None = None) -> Simulation:
    """Check and lower the schedule (memory overrides as in `pipec check`), then simulate it."""
    compiled = compile_schedule(sched, memory)
    costs = cost_model(sched, cost_docs)
    mem = memory_model(sched, memory)
    tl = simulate(compiled.program, costs)
    return Simulation(compiled, costs, mem, tl, stats(tl, mem))


def fraction(x: float) -> str | None:
    """`3/11` when a small fraction is exactly this float, else None."""
    f = Fraction(x).limit_denominator(100_000)
    return f"{f.numerator}/{f.denominator}" if f.denominator > 1 and float(f) == x else None


def params_text(sched: Schedule) -> str:
    return " ".join(f"{k}={v}" for k, v in sched.params)


def _num(x: float) -> float | int:
    return int(x) if float(x).is_integer() and abs(x) < 2**53 else float(x)


def to_json(sim: Simulation) -> dict:
    s, st, tl = sim.schedule, sim.stats, sim.timeline
    limit = sim.memory["limit"]
    curves = memory_curve(tl, sim.memory)
    return {
        **s.head(),
        "split_backward": s.split_backward,
        "costs": sim.costs.describe(),
        "makespan": _num(st.makespan),
        "cost": _num(st.cost),
        "ideal": _num(st.ideal),
        "bubble_time": _num(st.bubble_time),
        "bubble_rate": st.bubble_rate,
        "bubble_rate_fraction": fraction(st.bubble_rate),
        "peak_memory": None if st.peak_memory is None else _num(st.peak_memory),
        "compute_ops": int(len(tl.rank)),
        "messages": int(len(tl.msg_send)),
        "message_bytes": _num(float(tl.msg_bytes.sum())) if len(tl.msg_bytes) else 0,
        "collectives": int(len(tl.coll_rank)),
        "collective_busy": _num(sum(r.collective_busy for r in st.ranks)),
        "collective_exposed": _num(max((r.collective_exposed for r in st.ranks), default=0.0)),
        "per_rank": [
            {
                "rank": r.rank,
                "first": _num(r.first),
                "last": _num(r.last),
                "span": _num(r.span),
                "busy": _num(r.busy),
                "idle": _num(r.idle),
                "collective_busy": _num(r.collective_busy),
                "collective_exposed": _num(r.collective_exposed),
                "peak_memory": None if r.peak_memory is None else _num(r.peak_memory),
                "memory_limit": None if np.isnan(limit[r.rank]) else _num(float(limit[r.rank])),
                "memory_curve": [[_num(t), _num(v)] for t, v in zip(*(c.tolist() for c in curves[r.rank]))],
            }
            for r in st.ranks
        ],
    }


def _g(x: float) -> str:
    return f"{x:.6g}"


def _table(rows: list[tuple[str, ...]], right: set[int] = frozenset()) -> str:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    out = []
    for row in rows:
        cells = [cell.rjust(w) if c in right else cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths))]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


def summary_text(sim: Simulation) -> str:
    """One schedule: a headline and a per-rank table."""
    s, st = sim.schedule, sim.stats
    frac = fraction(st.bubble_rate)
    head = (
        f"{s.name} ({params_text(s)}): makespan {_g(st.makespan)}, bubble rate {st.bubble_rate:.2%}"
        + (f" (= {frac})" if frac else "")
        + f", bubble time {_g(st.bubble_time)}, peak memory {_g(st.peak_memory or 0)}"
    )
    c = sim.costs
    full = "" if c.split_backward else " (full backward B+W)"
    link = "free communication" if c.free_comm else "communication as costed"
    if len(sim.timeline.coll_rank):
        link += ", free collectives" if c.free_collectives else ", collectives as costed"
    desc = sim.costs.describe()

    def short(v) -> str:
        return _g(v) if not isinstance(v, list) else "per stage"

    costs = f"costs: F={short(desc['F'])} B={short(desc['B'])} W={short(desc['W'])}{full}, {link}"
    rows = [("rank", "first", "last", "busy", "idle", "peak memory")]
    coll = len(sim.timeline.coll_rank) > 0  # data parallelism: the collective stream's columns too
    if coll:
        rows[0] += ("collectives", "exposed")
    for r in st.ranks:
        rows.append((str(r.rank), _g(r.first), _g(r.last), _g(r.busy), _g(r.idle), _g(r.peak_memory or 0)))
        if coll:
            rows[-1] += (_g(r.collective_busy), _g(r.collective_exposed))
    return "\n".join([head, costs, _table(rows, right={1, 2, 3, 4, 5, 6, 7})])


def compare_text(sims: Sequence[Simulation]) -> str:
    """Several schedules side by side under one cost model."""
    rows = [("schedule", "params", "makespan", "bubble", "bubble time", "peak mem", "peak memory per rank")]
    for sim in sims:
        st = sim.stats
        per = " ".join(_g(r.peak_memory or 0) for r in st.ranks)
        rows.append(
            (
                sim.schedule.name,
                params_text(sim.schedule),
                _g(st.makespan),
                f"{st.bubble_rate:.2%}",
                _g(st.bubble_time),
                _g(st.peak_memory or 0),
                per,
            )
        )
    return _table(rows, right={2, 3, 4, 5})


def panel_title(sim: Simulation) -> str:
    st = sim.stats
    return (
        f"{sim.schedule.name} ({params_text(sim.schedule)}): makespan {_g(st.makespan)}, "
        f"bubble {st.bubble_rate:.1%}, peak memory {_g(st.peak_memory or 0)}"
    )


def panel(sim: Simulation, with_memory: bool = True):
    from pipec.sim.render import Panel

    limit = sim.memory["limit"]
    lim = None if np.isnan(limit).all() else float(np.nanmax(limit))
    curve = memory_curve(sim.timeline, sim.memory) if with_memory else None
    return Panel(sim.timeline, panel_title(sim), curve, lim)
