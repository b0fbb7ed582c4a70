"""The Pareto picture: every candidate's step time against its peak bytes, the front, the plan and the two
baselines marked (matplotlib, written as PNG and SVG). Why a module of its own: matplotlib loads only when
a picture is asked for (`pipec plan -o DIR`)."""

from __future__ import annotations

import os

from pipec.planner.report import pareto
from pipec.planner.search import Plan


def write_pareto(plan: Plan, directory: str, title: str = "") -> list[str]:
    """`pareto.png` and `pareto.svg` in `directory`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [p for p in plan.points if p.split is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    ax.scatter([p.peak / 2**20 for p in pts], [p.step for p in pts], s=12, c="#999999", label="candidates")
    front = pareto(pts)
    ax.plot([p.peak / 2**20 for p in front], [p.step for p in front], "-o", c="#1f77b4", ms=4, label="Pareto front")
    marks = [("(a) Megatron-LM default", plan.megatron, "s", "#2ca02c", 120)]
    marks += [
        ("(b) best library + partition", plan.library, "^", "#ff7f0e", 120),
        ("plan", plan.best, "*", "#d62728", 90),
    ]
    for name, pt, marker, color, size in marks:  # the plan last, on top of a baseline it may coincide with
        if pt is not None:
            label = f"{name}: {pt.candidate.label}"
            ax.scatter([pt.peak / 2**20], [pt.step], marker=marker, s=size, c=color, label=label, zorder=3)
    ax.set_xlabel("peak memory on the fullest rank (MiB)")
    ax.set_ylabel("simulated step (s)")
    ax.set_title(title or "pipec plan: step time against peak bytes")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = []
    for ext in ("png", "svg"):
        path = os.path.join(directory, f"pareto.{ext}")
        fig.savefig(path)
        out.append(path)
    plt.close(fig)
    return out
