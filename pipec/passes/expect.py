"""A schedule's own promises (`expect`), checked against what pipec measures for these parameters.

An `expect` states a bound the schedule's author (or its paper) promises, for
example `expect bubble <= (p - 1) / (m + p - 1)`, or in the rank block
`expect peak_memory(r) <= p - r`. Inside an `expect`, these names are defined:

- `makespan`: simulated time of one step, first op to last;
- `bubble`: the bubble rate, `(makespan - ideal) / makespan` (one definition,
  `pipec.sim.simulate.Stats`); `bubble_time`: `makespan - ideal`; `ideal`: the
  busiest rank's compute time, `m (T_F + T_B + T_W)` with uniform costs;
- `overlap_gain`: what overlapping each pair's all-to-alls gains, `1 - makespan / makespan without
  overlap` (each pair run one op after the other), simulated with the schedule's MoE layers (its
  `cost moe_layers`, else 1 per stage) over an expert group of 2 ranks, each all-to-all taking its `cost
  a2a` (else one forward segment of its stage, `F / (2 L + 1)`: what an overlap just hides); 0 for a
  schedule without overlapped pairs (docs/moe.md);
- `peak_memory(r)`: rank r's peak memory under the memory model;
- `in_flight(r)`: the most micro-batches rank r holds at once, counted per
  stage: F done, and the last backward piece (B, or W when split) not yet
  (on the device or, offloaded, on the host).

Expectations are promises of the schedule text, so they are measured under
the schedule's own declarations (its `cost` and `memory` lines, else the
defaults of `pipec.sim.costs` and `pipec.sim.memory`); command-line overrides such as
`--mem` or `--cost` do not apply to them. The simulation runs only when an
expectation that applies names a time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from pipec.errors import PipecError, error
from pipec.ir.program import Program
from pipec.ir.schedule import Expectation, Schedule

if TYPE_CHECKING:
    from pipec.sim.simulate import Stats


class Metrics:
    """What an `expect` can read, computed on first use. The times come from `measure` (the schedule and its
    Program, None when not lowered yet, to its Stats): `pipec.driver.metrics` passes the driver's pipeline,
    which lives above this floor; `stats`, when the caller has them already, saves the simulation."""

    def __init__(
        self,
        sched: Schedule,
        program: Program | None = None,
        stats: Stats | None = None,
        measure: Callable[[Schedule, Program | None], Stats] | None = None,
        overlap: Callable[[Schedule], float] | None = None,
    ) -> None:
        self.sched = sched
        self._program = program
        self._given_stats = stats
        self._measure = measure
        self._overlap = overlap

    @functools.cached_property
    def overlap_gain(self) -> float:
        if self._overlap is None:
            raise ValueError("`overlap_gain` needs the driver's simulation (pipec.driver.metrics)")
        return self._overlap(self.sched)

    @functools.cached_property
    def stats(self) -> Stats:
        if self._given_stats is not None:
            return self._given_stats
        if self._measure is None:
            raise ValueError("an expectation that names a time needs the driver's measure (pipec.driver.metrics)")
        return self._measure(self.sched, self._program)

    @property
    def makespan(self) -> float:
        return self.stats.makespan

    @property
    def bubble(self) -> float:
        return self.stats.bubble_rate

    @property
    def bubble_time(self) -> float:
        return self.stats.bubble_time

    @property
    def ideal(self) -> float:
        return self.stats.ideal

    @functools.cached_property
    def _peaks(self) -> list[float]:
        from pipec.sim.memory import rank_memory

        return [rep.peak for rep in rank_memory(self.sched)]

    @functools.cached_property
    def _in_flight(self) -> list[int]:
        return in_flights(self.sched)  # one walk of every rank: per rank it would be quadratic in ranks

    def _rank(self, what: str, r: int, sid: int) -> int:
        R = self.sched.num_ranks
        if not 0 <= r < R:
            sched = self.sched
            span = sched.spans[sid] if sched.spans else None
            raise error("E405", f"`{what}({r})`: rank {r} is not in 0..{R - 1}", span, sched.source)
        return r

    def peak_memory(self, r: int, sid: int = -1) -> float:
        return self._peaks[self._rank("peak_memory", r, sid)]

    def in_flight(self, r: int, sid: int = -1) -> int:
        return self._in_flight[self._rank("in_flight", r, sid)]


def in_flight(sched: Schedule, r: int) -> int:
    """The most (micro-batch, stage) pairs rank r holds at once along its order: F done, and its last
    backward piece (B, or W when the backward is split) not yet, on the device or the host. The memory
    walk of both pools (`pipec.sim.memory.walk`) under `counting_model`, where every pair weighs one."""
    return in_flights(sched, (r,))[0]


def in_flights(sched: Schedule, ranks: Sequence[int] | None = None) -> list[int]:
    """`in_flight` of each rank of `ranks` (default: all), from one walk of those ranks."""
    from pipec.sim.memory import counting_model, walk

    walks = walk(sched, counting_model(sched.num_stages), ranks)
    return [int(round(max(float(np.cumsum(w.device + w.host).max(initial=0.0)), 0.0))) for w in walks]


def _text(sched: Schedule, e: Expectation) -> str:
    """The condition as written (one line; long conditions are shortened)."""
    src, sp = sched.source, e.cond_span
    if src is None:
        return "the expectation"
    lines = src.text.splitlines()[sp.line - 1 : sp.end_line]
    if not lines:
        return "the expectation"
    if len(lines) == 1:
        # A parenthesised operand's span leaves its parentheses out: take them back in.
        line, lo, hi = lines[0], sp.col - 1, sp.end_col - 1
        depth = lowest = 0
        for c in line[lo:hi]:
            depth += (c == "(") - (c == ")")
            lowest = min(lowest, depth)
        for _ in range(-lowest):  # unmatched `)`: their `(` come before
            if not line[:lo].rstrip().endswith("("):
                break
            lo = line.rindex("(", 0, lo)
        for _ in range(depth - lowest):  # unmatched `(`: their `)` come after
            if not line[hi:].lstrip().startswith(")"):
                break
            hi = line.index(")", hi) + 1
        text = line[lo:hi]
    else:
        text = " ".join([lines[0][sp.col - 1 :]] + [x.strip() for x in lines[1:-1]] + [lines[-1][: sp.end_col - 1]])
    text = " ".join(text.split())
    return text if len(text) <= 100 else text[:97] + "..."


def _g(x) -> str:
    if isinstance(x, float):
        return f"{x:.6g}"
    return str(x)


def failed(sched: Schedule, metrics: Metrics) -> list[tuple[Expectation, PipecError]]:
    """Every expectation that does not hold, with its diagnostic (E405), in source order."""
    out = []
    params = ", ".join(f"{k}={v}" for k, v in sched.params)
    for e in sched.expects:
        ok, left, right = e.test(metrics)
        if ok:
            continue
        text = _text(sched, e)
        who = f" on rank {e.rank}" if e.rank is not None else ""
        message = f"expectation not met{who}: {e.message}" if e.message else f"expectation not met{who}: `{text}`"
        notes = []
        if e.message:
            notes.append(f"expected `{text}`")
        if left is not None:
            notes.append(f"measured {_g(left)}, bound {_g(right)}")
        notes.append(f"with {params}" if params else "with the defaults")
        out.append((e, error("E405", message, e.span, sched.source, tuple(notes))))
    return out


def check_expectations(
    sched: Schedule,
    program: Program | None = None,
    stats: Stats | None = None,
    measure: Callable[[Schedule, Program | None], Stats] | None = None,
    overlap: Callable[[Schedule], float] | None = None,
) -> int:
    """Raise E405 for the first expectation that does not hold; return how many were checked.

    `program` (the lowered schedule) and `stats` (a `pipec.sim.simulate.Stats` under the schedule's own
    costs) save work when the caller has them already; otherwise `measure` gives the stats
    (`pipec.driver.check_expectations` passes the driver's).
    """
    if not sched.expects:
        return 0
    bad = failed(sched, Metrics(sched, program, stats, measure, overlap))
    if bad:
        raise bad[0][1]
    return len(sched.expects)
