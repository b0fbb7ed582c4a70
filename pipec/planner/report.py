"""What `pipec plan` shows and writes, as data and text (nothing here prints): the plan beside the baselines,
the Pareto front of step time against peak bytes, why the winner wins (bubble, imbalance, recomputation),
and the settings that express the plan for `pipec run`, Megatron-LM and torchtitan. Why a module of its
own: the command, `--json` and the benchmarks read the same figures (`Row`, `pareto`, `explain`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipec.ir.units import fmt_bytes
from pipec.partition.problem import Problem, Split
from pipec.planner.search import Plan, Point, prove
from pipec.planner.space import Candidate, layer_kinds, stage_layers


@dataclass(frozen=True)
class Why:
    """The simulated step taken apart: `bubble`, the share of the ranks' time idle (1 - mean busy / step);
    `imbalance`, the busiest rank's compute over the mean rank's, less one; `recompute`, the seconds the
    busiest rank spends running forwards again; `busy`, each rank's compute seconds (recomputation
    included)."""

    step: float
    bubble: float
    imbalance: float
    recompute: float
    busy: tuple[float, ...]
    peaks: tuple[float, ...]


def explain(pb: Problem, split: Split) -> Why:
    """The figures of `Why` for this split, from the one simulation of the plan (`prove`, which also runs the
    memory check) and the split's per-stage times."""
    sim = prove(pb, split)
    F = np.asarray(split.stage_times["F"])
    rec = np.zeros(pb.R)
    for r, mem in enumerate(pb.sched.memops or ()):
        for x in mem:
            if x.op == "RECOMPUTE":
                rec[r] += F[x.stage]
    busy = np.array([rs.busy for rs in sim.stats.ranks], dtype=float)
    step = float(sim.stats.makespan)
    mean = float(busy.mean()) if len(busy) else 0.0
    return Why(
        step,
        1 - mean / step if step > 0 else 0.0,
        float(busy.max()) / mean - 1 if mean > 0 else 0.0,
        float(rec[int(np.argmax(busy))]) if len(busy) else 0.0,
        tuple(busy.tolist()),
        tuple(float(x) for x in sim.stats.ranks and [r.peak_memory or 0.0 for r in sim.stats.ranks]),
    )


def pareto(points: Sequence[Point]) -> list[Point]:
    """The points no other beats on both step time and peak bytes (ties kept once), fastest first."""
    pts = sorted((p for p in points if p.split is not None), key=lambda p: (p.step, p.peak))
    out: list[Point] = []
    for p in pts:
        if not out or p.peak < out[-1].peak:
            out.append(p)
    return out


def sizes(split: Split) -> str:
    return ",".join(str(x) for x in stage_layers(split.bounds).tolist())


def _s(x: float) -> str:
    return f"{x:.4g}"


def table_lines(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [headers, *rows]]


def comparison(plan: Plan) -> list[tuple[str, Point | None]]:
    """The plan and the two baselines, named as the report names them."""
    return [
        ("plan", plan.best),
        ("(a) Megatron-LM default", plan.megatron),
        ("(b) best library + partition", plan.library),
    ]


def gain(plan: Plan, other: Point | None) -> float:
    return other.step / plan.best.step if other is not None and plan.best.step > 0 else math.nan


def report_lines(plan: Plan, whys: dict[str, Why], limit_text: str) -> list[str]:
    """The printed report: the comparison, why, the Pareto front and the search's bound."""
    best = plan.best
    rows = []
    for name, pt in comparison(plan):
        if pt is None:
            rows.append((name, "(does not fit)", "-", "-", "-", "-"))
            continue
        rows.append(
            (name, pt.candidate.label, sizes(pt.split), _s(pt.step), fmt_bytes(pt.peak), f"{gain(plan, pt):.3f}x")
        )
    lines = [f"memory limit {limit_text}; {len(plan.points)} candidates evaluated in {plan.seconds:.1f} s"]
    lines += table_lines(("", "schedule", "layers per stage", "step s", "peak", "vs plan"), rows)
    lines.append("")
    wrows = []
    for name, _ in comparison(plan):
        w = whys.get(name)
        if w is not None:
            wrows.append(
                (name, f"{100 * w.bubble:.1f}%", f"{100 * w.imbalance:.1f}%", _s(w.recompute), _s(max(w.busy)))
            )
    lines += table_lines(("why", "bubble", "imbalance", "recompute s", "busiest rank s"), wrows)
    lines += ["", *why_sentences(plan, whys), ""]
    front = pareto(plan.points)
    lines.append(f"Pareto front (step time against peak bytes), {len(front)} of {len(plan.points)} candidates:")
    lines += table_lines(
        ("schedule", "layers per stage", "step s", "peak"),
        [(p.candidate.label, sizes(p.split), _s(p.step), fmt_bytes(p.peak)) for p in front],
    )
    gap = best.step / plan.lower_bound - 1 if plan.lower_bound > 0 else math.inf
    lines.append(
        f"bound: no plan in the space steps below {_s(plan.lower_bound)} s"
        + (" (the plan is optimal)" if gap <= 1e-9 else f" (the plan is within {100 * gap:.2f}% of it)")
    )
    for s in plan.skipped:
        lines.append(f"  not tried: {s}")
    return lines


def why_sentences(plan: Plan, whys: dict[str, Why]) -> list[str]:
    """One sentence per baseline: which of bubble, imbalance and recomputation the plan gains its time on."""
    w = whys.get("plan")
    out = []
    for name, pt in comparison(plan)[1:]:
        o = whys.get(name)
        if o is None or w is None or pt is None:
            continue
        parts = []
        d_busy = max(o.busy) - max(w.busy)
        if abs(d_busy) > 1e-3 * o.step:
            parts.append(f"its busiest rank computes {_s(abs(d_busy))} s {'less' if d_busy > 0 else 'more'}")
        d_rec = o.recompute - w.recompute
        if abs(d_rec) > 1e-3 * o.step:
            parts.append(f"{_s(abs(d_rec))} s {'less' if d_rec > 0 else 'more'} of it recomputation")
        d_idle = (o.step - max(o.busy)) - (w.step - max(w.busy))
        if abs(d_idle) > 1e-3 * o.step:
            parts.append(f"that rank waits {_s(abs(d_idle))} s {'less' if d_idle > 0 else 'more'} (bubble)")
        text = "; ".join(parts) or "the same step"
        out.append(f"vs {name}: {gain(plan, pt):.3f}x: {text}.")
    return out


# ---- the plan in other systems' terms -------------------------------------------------------------------


def megatron_settings(plan: Plan, pb: Problem, global_batch: int) -> tuple[str, list[str]]:
    """Megatron-LM's flags for the plan (a `--pipeline-model-parallel-layout` of `E`mbedding, `t`ransformer
    layers and `L`oss per stage) and what they cannot express."""
    cand, split = plan.best.candidate, plan.best.split
    kinds = layer_kinds(pb.table.names)
    stages = ["".join(kinds[a:b]) for a, b in zip(split.bounds, split.bounds[1:])]
    layout = "|".join(stages)
    p, m = pb.R, cand.m
    flags = [
        f"--pipeline-model-parallel-size {p}",
        f'--pipeline-model-parallel-layout "{layout}"',
        f"--global-batch-size {global_batch} --micro-batch-size {global_batch // m}",
    ]
    cannot = []
    if pb.S > p:
        flags.append(f"--num-virtual-stages-per-pipeline-rank {pb.S // p}")
    interleaved = pb.S > p and list(pb.sched.placement) == [s % p for s in range(pb.S)]
    if cand.schedule not in ("1f1b", "interleaved-1f1b") or (pb.S > p and not interleaved):
        cannot.append(
            f"the schedule `{cand.schedule}`: Megatron-LM runs 1F1B, or interleaved 1F1B over the looped placement"
        )
    if cand.memop == "recompute" or "recompute" in cand.schedule:
        ranks = cand.memop_ranks if cand.memop else p
        flags.append("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
        if ranks < p:
            which = f"ranks 0-{ranks - 1}" if ranks > 1 else "rank 0"
            cannot.append(f"recomputation on {which} only: Megatron-LM recomputes on every stage alike")
    if cand.memop == "offload" or "offload" in cand.schedule:
        cannot.append("offloading chosen forwards' activations: Megatron-LM's --cpu-offloading is per layer, for all")
    if any(x not in "Lt" for s in stages[1:] for x in s) or any(x not in "Et" for s in stages[:-1] for x in s):
        cannot.append("an embedding or loss layer away from the first or last stage")
    if len(set(plan.problems[cand].speed.tolist())) > 1:
        cannot.append("ranks of different speeds (the layout is what adapts the split to them)")
    return " ".join(flags), cannot


def torchtitan_settings(plan: Plan, pb: Problem, global_batch: int) -> tuple[str, str, list[str]]:
    """torchtitan's settings for the plan: the schedule class and CSV (`pipec.formats.torchtitan`, memory ops
    dropped), the micro-batch size and each stage's modules (`module_fqns_per_model_part`); and what it
    cannot express."""
    from pipec.errors import PipecError
    from pipec.formats.torchtitan import export_torchtitan

    cand, split = plan.best.candidate, plan.best.split
    cannot = []
    try:
        exp = export_torchtitan(pb.sched, "plan.csv", microbatch_size=global_batch // cand.m, drop_memops=True)
    except PipecError as e:
        return "", "", [f"the schedule: {e.diagnostics[0].message}"]
    names = pb.table.names
    parts = [[q for n in names[a:b] for q in n.split("+")] for a, b in zip(split.bounds, split.bounds[1:])]
    fqns = "module_fqns_per_model_part = [\n" + "".join(f"  {parts_text(x)},\n" for x in parts) + "]\n"
    text = exp.toml.replace("\n[training]", "\n" + fqns + "\n[training]", 1)
    if pb.sched.memops and any(pb.sched.memops):
        cannot.append(
            "per-stage recomputation or offload: torchtitan's [activation_checkpoint] mode applies to every layer"
        )
    return text, exp.csv, cannot


def parts_text(names: Sequence[str]) -> str:
    return "[" + ", ".join(f'"{n}"' for n in names) + "]"


def point_json(pt: Point | None, gain_: float = math.nan) -> dict | None:
    if pt is None:
        return None
    c: Candidate = pt.candidate
    return {
        "label": c.label,
        "schedule": c.schedule,
        "m": c.m,
        "v": c.v or None,
        "memop": c.memop or None,
        "memop_ranks": c.memop_ranks or None,
        "ranks": list(c.ranks) or None,
        "layers_per_stage": stage_layers(pt.split.bounds).tolist() if pt.split else None,
        "step": pt.step if pt.split else None,
        "peak": pt.peak if pt.split else None,
        "lower_bound": pt.lower_bound,
        "optimal": pt.optimal,
        "refined": pt.refined,
        **({"gain": gain_} if not math.isnan(gain_) else {}),
    }
