"""The step-by-rank text grid of a Schedule, for `pipec show`."""

from __future__ import annotations

from pipec.schedule import Schedule


def cells(sched: Schedule, rank: int) -> list[str]:
    """One cell per step of a rank: `F3`, or `F3.5` (op 3 on stage 5) when the rank has several stages.

    Overlapped pairs share one cell, joined by `&`.
    """
    multi = len(sched.stages_of(rank)) > 1
    r = sched.ranks[rank]
    out: list[str] = []
    join = False
    for k, i, s, paired in zip(r.kind.tolist(), r.mb.tolist(), r.stage.tolist(), r.paired.tolist()):
        text = f"{sched.kinds[k]}{i}" + (f".{s}" if multi else "")
        if join:
            out[-1] += "&" + text
        else:
            out.append(text)
        join = paired
    return out


def format_grid(sched: Schedule, ranks: list[int] | None = None) -> str:
    ranks = list(range(sched.num_ranks)) if ranks is None else ranks
    cols = [cells(sched, r) for r in ranks]
    steps = max((len(c) for c in cols), default=0)
    heads = [f"Rank {r}" for r in ranks]
    width = max([len(h) for h in heads] + [len(x) for c in cols for x in c] + [1])
    label = len(f"Step {max(steps - 1, 0):02d}")
    lines = [" " * (label + 1) + " ".join(h.ljust(width) for h in heads).rstrip()]
    for t in range(steps):
        row = " ".join((c[t] if t < len(c) else "").ljust(width) for c in cols).rstrip()
        lines.append(f"Step {t:02d}".ljust(label) + " " + row)
    return "\n".join(lines)
