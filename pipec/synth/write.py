"""What the search hands back to people: the `.pipe` file (`write_pipe`, through the one `.pipe` writer
`pipec.formats.pipe_text`) whose header records the inputs and figures and whose declarations make
`pipec check` and `pipec simulate` reproduce them, the comparison table with the library, and the JSON
of `pipec synth --json`."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from pipec.formats.pipe_text import (
    Step,
    per_stage_expr,
    rank_block,
    rank_lines,
    schedule_head,
    schedule_steps,
    topology_lines,
)
from pipec.frontend.names import MEMORY_KEYS
from pipec.sim.costs import cost_model
from pipec.sim.memory import memory_model
from pipec.synth.evaluate import Figures
from pipec.synth.memops import _host_seconds
from pipec.synth.search import Result
from pipec.synth.spec import _g, shape, to_schedule


def _fmt_num(x: float) -> str:
    """A number for the header's comments (six significant digits)."""
    return f"{x:g}" if abs(x - round(x, 6)) < 1e-12 else repr(x)


def order_steps(ops: Sequence[tuple[int, int, int]], kinds: Sequence[str] = ("F", "B", "W")) -> list[Step]:
    """A derived order, (kind index, micro-batch, stage) per op, as the steps `pipe_text` writes."""
    return [((kinds[k], i, s),) for k, i, s in ops]


def write_pipe(result: Result, name: str, command: str | None = None, comparison: str | None = None) -> str:
    """The synthesized schedule as a `.pipe` file: header comment, declarations, per-rank orders.

    The declarations are the whole cost model the search used (compute times, message costs and sizes,
    the topology with every link's latency and bandwidth) and its memory model, written so they read
    back as the same floats: `pipec simulate` of the file gives the figures of the header. What the
    language cannot declare (a per-send overhead, per-node links) is named in the header instead."""
    spec, fig = result.spec, result.figures
    sched = shape(spec)
    cm = cost_model(sched, spec.cost_docs)
    full_b = cm.B if spec.split else cm.B + cm.W  # without W, a declared B is the full backward
    mem = memory_model(sched)
    R = spec.p
    sized = bool(np.any(cm.act_bytes) or np.any(cm.grad_bytes))
    dcs = [(d.name, d.lo, d.hi) for d in spec.topology.datacenters] if spec.topology is not None else []
    topology = topology_lines(dcs, cm.latency, cm.bandwidth, sized)
    lines = [
        f"# {name}: synthesized by `pipec synth` for p={spec.p}, m={spec.m}"
        + (f", v={spec.v} ({spec.placement} placement)" if spec.v > 1 else "")
        + "."
    ]
    if command:
        lines.append(f"# Command: {command}")
    per_stage = {"F": cm.F, "B": full_b, "W": cm.W, "comm": cm.comm}
    if any(x.op == "OFFLOAD" for rank in result.memops for x in rank):
        # the seconds of each OFFLOAD and RELOAD as the search charged them (from `offload`, or bytes over the
        # host link's bandwidth, or the default), declared so the file simulates the same without the costs
        per_stage["offload"] = _host_seconds(cm, spec)
    costs = ", ".join(f"{k}={_per_stage_text(v)}" for k, v in per_stage.items())
    lines.append(f"# Costs (per stage): {costs}" + ("" if spec.split else " (B is the full backward)"))
    undeclared = []
    if cm.overhead:
        undeclared.append(f"overhead={_fmt_num(cm.overhead)} s per send and receive")
    if topology is None:
        undeclared.append("links that differ inside a datacenter (ranks_per_node)")
    if spec.host_limit is not None and "host_limit" not in MEMORY_KEYS:
        undeclared.append("the host memory limit (give --host-memory-limit to pipec check)")
    if (
        any(x.op == "RECOMPUTE" for rank in result.memops for x in rank)
        and "ckpt" not in MEMORY_KEYS
        and not np.array_equal(mem["ckpt"], mem["act"] / 8)
    ):
        undeclared.append(f"ckpt={_per_stage_text(mem['ckpt'])} (give --mem ckpt=... to pipec check)")
    if undeclared:
        lines.append(
            "# Not declared below (the language has no declaration for it; give the same --cost to pipec "
            "simulate): " + "; ".join(undeclared)
        )
    lim = "none" if spec.limit is None else " ".join(_fmt_num(x) for x in spec.limit)
    ckpt = f" ckpt={_per_stage_text(mem['ckpt'])}" if result.memops and "ckpt" in mem else ""
    host_lim = "" if spec.host_limit is None else "; host limit per rank: " + " ".join(map(_fmt_num, spec.host_limit))
    lines.append(
        f"# Memory: act={_per_stage_text(mem['act'])} wact={_per_stage_text(mem['wact'])}{ckpt}"
        f" params={_per_stage_text(mem['params'])}; limit per rank: {lim}{host_lim}"
    )
    if result.memops:
        kinds = {}
        for x in (x for rank in result.memops for x in rank):
            kinds[x.op] = kinds.get(x.op, 0) + 1
        what = ", ".join(f"{n} {op}" for op, n in kinds.items())
        floor = "" if result.floor is None else f"; the least memory the search can reach: {_g(max(result.floor))}"
        lines.append(f"# Memory ops: {what} (to meet the limit at the shortest step found){floor}")
    lines.append(
        f"# Simulated: makespan {_g(fig.makespan)}, bubble rate {fig.bubble:.2%} (cost {_g(fig.cost)}),"
        f" peak memory per rank {' '.join(_g(x) for x in fig.peak)}"
    )
    h = result.heuristic
    lines.append(
        f"# Heuristic: {h.describe()}, makespan {_g(result.heuristic_figures.makespan)},"
        f" bubble {result.heuristic_figures.bubble:.2%} ({result.seconds_heuristic:.1f} s)"
    )
    solver = f"# Solver: {result.solver_status}"
    if result.bound is not None:
        solver += f", makespan lower bound {_g(result.bound)}"
    if result.seconds_solver:
        solver += f" ({result.seconds_solver:.1f} s)"
    if result.solver_note:
        solver += f"; {result.solver_note}"
    lines.append(solver)
    if comparison:
        lines.append("# Library schedules under the same costs:")
        lines += ["#   " + x for x in comparison.splitlines()]
    why = f"synthesized for p = {spec.p}, m = {spec.m}: run pipec synth again"
    lines += schedule_head(name, spec.p, spec.m, why, sched.placement, sched.kinds)
    declared = dict(per_stage)
    if not spec.split:
        del declared["W"]
    if not np.any(cm.comm):
        del declared["comm"]
    if sized:
        declared["act_bytes"] = cm.act_bytes
        if not np.array_equal(cm.grad_bytes, np.concatenate([[0.0], cm.act_bytes[:-1]])):
            declared["grad_bytes"] = cm.grad_bytes  # not the default (the activation across the boundary)
    lines += [f"    cost {k} = {per_stage_expr(v)}" for k, v in declared.items()]
    # ckpt only where a RECOMPUTE needs it and it is not its default (act / 8)
    recomputes = any(x.op == "RECOMPUTE" for rank in result.memops for x in rank)
    default_ckpt = np.array_equal(mem["ckpt"], mem["act"] / 8) if "ckpt" in mem else True
    for key in ("act", "wact", "ckpt", "params"):
        if (
            key == "wact"
            and not spec.split
            or key == "ckpt"
            and (not recomputes or default_ckpt or key not in MEMORY_KEYS)
        ):
            continue
        lines.append(f"    memory {key} = {per_stage_expr(mem[key])}")
    if spec.limit is not None:
        lines.append(f"    memory limit = {per_stage_expr(spec.limit, 'r')}")
    if spec.host_limit is not None and "host_limit" in MEMORY_KEYS:
        lines.append(f"    memory host_limit = {per_stage_expr(spec.host_limit, 'r')}")
    lines += topology or []
    lines.append(f'    expect makespan <= {_ceil6(fig.makespan)}, "the makespan pipec synth found"')
    lines.append(f'    expect bubble <= {_ceil6(fig.bubble)}, "the bubble rate pipec synth found"')
    place = sched.placement
    multi = [sum(1 for x in place if x == r) > 1 for r in range(R)]
    found = to_schedule(spec, result.orders, name, result.memops)
    lines += rank_block([rank_lines(schedule_steps(found, r), multi[r]) for r in range(R)])
    lines += ["}", ""]
    return "\n".join(lines)


def _ceil6(x: float) -> str:
    return f"{math.ceil(x * 1e6 - 1e-6) / 1e6:.6f}".rstrip("0").rstrip(".")


def _per_stage_text(arr) -> str:
    vals = [float(x) for x in arr]
    return _fmt_num(vals[0]) if all(v == vals[0] for v in vals) else "[" + ", ".join(map(_fmt_num, vals)) + "]"


# ---- the comparison table -----------------------------------------------------------------------


def comparison_text(result: Result, rows, name: str) -> str:
    lim = result.spec.limit
    table = [("schedule", "params", "makespan", "bubble", "peak mem", "fits limit")]

    def fits(fig: Figures) -> str:
        if lim is None:
            return "-"
        return "yes" if all(p <= x + 1e-9 for p, x in zip(fig.peak, lim)) else "no"

    f = result.figures
    table.append(
        (name, f"p={result.spec.p} m={result.spec.m}", _g(f.makespan), f"{f.bubble:.2%}", _g(max(f.peak)), fits(f))
    )
    for lib, params, fig, note in rows:
        if fig is None:
            table.append((lib, params, "-", "-", "-", note[:60]))
        else:
            table.append((lib, params, _g(fig.makespan), f"{fig.bubble:.2%}", _g(max(fig.peak)), fits(fig)))
    widths = [max(len(r[c]) for r in table) for c in range(len(table[0]))]
    right = {2, 3, 4}
    return "\n".join(
        "  ".join(c.rjust(w) if j in right else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths))).rstrip()
        for row in table
    )


def to_json(result: Result, rows, name: str, output: str | None = None) -> dict:
    spec, f = result.spec, result.figures

    def figs(x: Figures) -> dict:
        return {"makespan": x.makespan, "cost": x.cost, "bubble_rate": x.bubble, "peak_memory": list(x.peak)}

    return {
        "schedule": name,
        "output": output,
        "p": spec.p,
        "m": spec.m,
        "v": spec.v,
        "placement": spec.placement,
        "memory_limit": None if spec.limit is None else list(spec.limit),
        "host_memory_limit": None if spec.host_limit is None else list(spec.host_limit),
        **figs(f),
        "host_peak_memory": list(f.host_peak),
        "memops": [[[x.op, x.mb, x.stage, x.before] for x in rank] for rank in result.memops],
        "memory_floor": None if result.floor is None else list(result.floor),
        "heuristic": {
            **figs(result.heuristic_figures),
            "from": result.heuristic.describe(),
            "seconds": result.seconds_heuristic,
        },
        "solver": {
            "status": result.solver_status,
            "note": result.solver_note,
            "bound": result.bound,
            "seconds": result.seconds_solver,
        },
        "library": [
            {"schedule": n, "params": prm, **(figs(x) if x is not None else {"error": note})}
            for n, prm, x, note in rows
        ],
    }
