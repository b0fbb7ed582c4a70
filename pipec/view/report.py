"""Simulations for people: the tables and JSON `pipec simulate` prints.

A pure layer between the CLI and the driver (`pipec.driver.simulation` makes the Simulation): it returns
strings and dicts; the CLI prints them.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from pipec.driver import Simulation
from pipec.ir.schedule import Schedule
from pipec.sim.memory import fmt_memory
from pipec.sim.memtime import MemoryCurves, memory_curves, timeline_curves


def curves_of(sim: Simulation) -> MemoryCurves:
    """The Simulation's memory curves: computed from its Program and memory model when not kept, from the
    Timeline alone when it has no Program."""
    if sim.curves is not None:
        return sim.curves
    prog = getattr(sim.compiled, "program", None)
    mc = timeline_curves(sim.timeline, sim.memory) if prog is None else memory_curves(sim.timeline, prog, sim.memory)
    object.__setattr__(sim, "curves", mc)  # a cache of what its fields determine: the reports ask per rank
    return mc


def _mem(sim: Simulation, x: float | None) -> str:
    return fmt_memory(x or 0.0, curves_of(sim).unit)


def _peak(sim: Simulation, rank: int | None = None) -> float:
    """The device peak of one rank, or of the busiest, from the curves (memory ops included)."""
    p = curves_of(sim).device_peak
    return float(p[rank]) if rank is not None else float(p.max()) if len(p) else 0.0


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
    mc = curves_of(sim)
    limit, hlimit = mc.limit, mc.host_limit
    peak = float(mc.device_peak.max()) if len(mc.device_peak) else None
    host_peak = float(mc.host_peak.max()) if len(mc.host_peak) else 0.0

    def curve(c) -> list:
        return [[_num(t), _num(v)] for t, v in zip(*(a.tolist() for a in c))]

    def host(r: int) -> dict:  # the host pool, where anything is offloaded
        if not mc.offloads:
            return {}
        return {
            "host_peak_memory": _num(float(mc.host_peak[r])),
            "host_peak_memory_text": fmt_memory(float(mc.host_peak[r]), mc.unit),
            "host_memory_limit": None if np.isnan(hlimit[r]) else _num(float(hlimit[r])),
            "host_memory_curve": curve(mc.host[r]),
        }

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
        "peak_memory": None if peak is None else _num(peak),
        "memory_unit": mc.unit,
        "peak_memory_text": fmt_memory(peak or 0.0, mc.unit),
        "host_peak_memory": _num(host_peak),
        "host_peak_memory_text": fmt_memory(host_peak, mc.unit),
        "compute_ops": int(len(tl.rank)),
        "messages": int(len(tl.msg_send)),
        "message_bytes": _num(float(tl.msg_bytes.sum())) if len(tl.msg_bytes) else 0,
        "collectives": int(len(tl.coll_rank)),
        "collective_busy": _num(sum(r.collective_busy for r in st.ranks)),
        "collective_exposed": _num(max((r.collective_exposed for r in st.ranks), default=0.0)),
        **experts_json(sim),
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
                "peak_memory": _num(float(mc.device_peak[r.rank])),
                "peak_memory_text": fmt_memory(float(mc.device_peak[r.rank]), mc.unit),
                "memory_limit": None if np.isnan(limit[r.rank]) else _num(float(limit[r.rank])),
                "memory_curve": curve(mc.device[r.rank]),
                **host(r.rank),
            }
            for r in st.ranks
        ],
    }


def experts_json(sim: Simulation) -> dict:
    """`experts` of a JSON summary, only for a Program with expert parallelism or MoE layers: the expert
    group, the experts and MoE layers per stage, whether pairs overlapped, and the all-to-alls (how many,
    the busiest expert link's time)."""
    prog, tl = sim.compiled.program, sim.timeline
    if prog.experts.size == 1 and not any(prog.moe_layers):
        return {}
    busy = np.bincount(tl.a2a_rank, weights=tl.a2a_end - tl.a2a_start, minlength=tl.num_ranks)
    return {
        "experts": {
            "ep": prog.experts.size,
            "experts": prog.experts.num,
            "moe_layers": list(prog.moe_layers),
            "overlap": sim.overlap,
            "all_to_alls": int(len(tl.a2a_rank)),
            "a2a_busy": _num(float(busy.max()) if len(busy) else 0.0),
        }
    }


def _experts_text(sim: Simulation) -> str | None:
    e = experts_json(sim).get("experts")
    if e is None:
        return None
    from pipec.ir.experts import layers_text
    from pipec.ir.opcodes import IS_COMPUTE

    pairs = any(rp.group[IS_COMPUTE[rp.op]].any() for rp in sim.compiled.program.ranks)
    how = "" if not pairs else ", overlapped pairs" if e["overlap"] else ", pairs one op after the other (--no-overlap)"
    return (
        f"experts: {e['experts']} over an expert group of {e['ep']}, MoE layers {layers_text(e['moe_layers'])}, "
        f"{e['all_to_alls']} all-to-alls (busiest expert link {_g(e['a2a_busy'])}){how}"
    )


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
        + f", bubble time {_g(st.bubble_time)}, peak memory {_mem(sim, _peak(sim))}"
        + (f", host {_mem(sim, float(curves_of(sim).host_peak.max()))}" if curves_of(sim).offloads else "")
    )
    c = sim.costs
    full = "" if c.split_backward else " (full backward B+W)"
    link = "free communication" if c.free_comm else "communication as costed"
    if len(sim.timeline.coll_rank):
        link += ", free collectives" if c.free_collectives else ", collectives as costed"
    if c.shares_cores:
        link += f", {c.ranks_per_node} ranks per node share its {c.cores_per_node} cores"
    desc = sim.costs.describe()

    def short(v) -> str:
        return _g(v) if not isinstance(v, list) else "per stage"

    costs = f"costs: F={short(desc['F'])} B={short(desc['B'])} W={short(desc['W'])}{full}, {link}"
    sliced = slices_text(s)
    if sliced:
        costs += "\n" + sliced
    moe = _experts_text(sim)
    if moe:
        costs += "\n" + moe
    rows = [("rank", "first", "last", "busy", "idle", "peak memory")]
    mc = curves_of(sim)
    if mc.offloads:
        rows[0] += ("host peak",)
    coll = len(sim.timeline.coll_rank) > 0  # data parallelism: the collective stream's columns too
    if coll:
        rows[0] += ("collectives", "exposed")
    for r in st.ranks:
        rows.append((str(r.rank), _g(r.first), _g(r.last), _g(r.busy), _g(r.idle), _mem(sim, _peak(sim, r.rank))))
        if mc.offloads:
            rows[-1] += (_mem(sim, float(mc.host_peak[r.rank])),)
        if coll:
            rows[-1] += (_g(r.collective_busy), _g(r.collective_exposed))
    return "\n".join([head, costs, _table(rows, right={1, 2, 3, 4, 5, 6, 7, 8})])


def slices_text(s: Schedule) -> str | None:
    """With token slices, the line that says what the ops are: `slices: 2 micro-batches x 4 slices of 512
    tokens (8 units, each costed by its tokens and context)`; None without (the report reads as before)."""
    sl = s.slicing
    if sl is None or sl.slices == 1:
        return None
    from pipec.view.grid import tokens_text

    return (
        f"slices: {sl.sequences} micro-batches x {sl.slices} slices of {tokens_text(sl)} ({sl.num_units} units, "
        "each costed by its tokens and context)"
    )


def compare_text(sims: Sequence[Simulation]) -> str:
    """Several schedules side by side under one cost model."""
    rows = [("schedule", "params", "makespan", "bubble", "bubble time", "peak mem", "peak memory per rank")]
    host = any(curves_of(sim).offloads for sim in sims)
    if host:
        rows[0] += ("host peak",)
    for sim in sims:
        st = sim.stats
        sep = ", " if curves_of(sim).unit == "bytes" else " "
        per = sep.join(_mem(sim, _peak(sim, r.rank)) for r in st.ranks)
        rows.append(
            (
                sim.schedule.name,
                params_text(sim.schedule),
                _g(st.makespan),
                f"{st.bubble_rate:.2%}",
                _g(st.bubble_time),
                _mem(sim, _peak(sim)),
                per,
            )
        )
        if host:
            rows[-1] += (_mem(sim, float(curves_of(sim).host_peak.max())),)
    return _table(rows, right={2, 3, 4, 5})


def panel_title(sim: Simulation) -> str:
    """A picture's title (`pipec simulate --plot`, `pipec show --timeline`): the schedule, its figures and,
    on a stage graph, its edges (`stage graph 0->1, 0->3, ...`)."""
    st = sim.stats
    graph = sim.compiled.program.graph
    edges = f"; stage graph {graph.describe()}" if graph is not None and not graph.is_chain else ""
    return (
        f"{sim.schedule.name} ({params_text(sim.schedule)}): makespan {_g(st.makespan)}, "
        f"bubble {st.bubble_rate:.1%}, peak memory {_mem(sim, _peak(sim))}{edges}"
    )


def panel(sim: Simulation, with_memory: bool = True):
    from pipec.view.render import Panel

    mc = curves_of(sim) if with_memory else None
    if mc is None:
        return Panel(sim.timeline, panel_title(sim))
    lim = None if np.isnan(mc.limit).all() else float(np.nanmax(mc.limit))
    hlim = None if np.isnan(mc.host_limit).all() else float(np.nanmax(mc.host_limit))
    host = list(mc.host) if mc.offloads else None
    return Panel(sim.timeline, panel_title(sim), list(mc.device), lim, host, hlim, mc.unit)


def plan_table(reports, plan, resident: Sequence[float], live: Sequence[float] | None = None) -> str:
    """`pipec check --memory`'s buffer-plan table: per rank the walk's device peak beside the plan's bytes
    (its pools' slots at their classes' sizes, with the resident parameters the walk's peak includes), the
    difference, what one arena packed by the same lifetimes would hold (`live`), slots and pools; then a
    line for each bounded class kind (variable sizes: the slot is an upper bound)."""
    u = plan.unit
    rows = [("rank", "peak", "plan", "plan - peak", "packed", "slots", "pools", "host plan")]
    for rep, rp, res in zip(reports, plan.ranks, resident):
        total = rp.amount() + float(res)
        diff = total - rep.peak
        sign = "+" if diff > 1e-12 else "-" if diff < -1e-12 else ""
        rows.append(
            (
                str(rep.rank),
                fmt_memory(rep.peak, u),
                fmt_memory(total, u),
                sign + fmt_memory(abs(diff), u),
                "-" if live is None else fmt_memory(live[rep.rank] + float(res), u),
                str(rp.slots),
                str(sum(not p.host for p in rp.pools)),
                fmt_memory(rp.amount(True), u) if any(p.host for p in rp.pools) else "-",
            )
        )
    out = _table(rows, right={1, 2, 3, 4, 5, 6})
    why = sorted({p.bound for p in plan.bounded})
    if why:
        out += "\n" + "\n".join(f"upper bound: {w}" for w in why)
    return out
