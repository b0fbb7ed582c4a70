"""The step-by-rank text grid of a Schedule, for `pipec show`."""

from __future__ import annotations

from pipec.ir.schedule import Schedule, Slicing, unit_label

# How a memory op is marked in the grid: R3 recomputes micro-batch 3's forward, O3 offloads its saved
# activations, L3 reloads them (L: load back; R is taken).
MEMOP_MARKS = {"RECOMPUTE": "R", "OFFLOAD": "O", "RELOAD": "L"}


def grid_title(sched: Schedule) -> str:
    """`pipec show`'s first line: the schedule, its parameters and shape; with token slices the micro-batches
    as sequences and their slices (`2 micro-batches x 4 slices of 512 tokens`); on a stage graph its edges
    (`; stage graph 0->1, 0->3, 1->2, 2->3`: the grid's cells name ops, not the edges between them)."""
    params = " ".join(f"{k}={v}" for k, v in sched.params)
    head = f"{sched.name} ({params}): {sched.num_stages} stages on {sched.num_ranks} ranks, "
    sl = sched.slicing
    g = sched.graph
    edges = f"; stage graph {g.describe()}" if g is not None and not g.is_chain else ""
    if sl is None or sl.slices == 1:
        return head + f"{sched.num_microbatches} micro-batches" + edges
    shape = f"{sl.sequences} micro-batches x {sl.slices} slices of {tokens_text(sl)} (cells: F<mb>s<slice>)"
    return head + shape + edges


def tokens_text(sl: Slicing) -> str:
    """`512 tokens`, or `5, 5, 4 tokens` when the slices differ (the first 8, then `...`)."""
    if len(set(sl.tokens)) == 1:
        return f"{sl.tokens[0]} tokens"
    shown = ", ".join(map(str, sl.tokens[:8])) + (", ..." if len(sl.tokens) > 8 else "")
    return f"{shown} tokens"


def cells(sched: Schedule, rank: int) -> list[str]:
    """One cell per step of a rank: `F3`, or `F3.5` (op 3 on stage 5) when the rank has several stages;
    with token slices `F1s2` (`unit_label`: slice 2 of micro-batch 1), `F1s2.5` on stage 5.

    Overlapped pairs share one cell, joined by `&`. The memory ops a schedule places (`Schedule.memops`)
    lead the cell of the op they are issued before, each ending in `+`: `R3+B3` recomputes F3 and then
    runs B3, `O2+L0+B1` offloads micro-batch 2 and reloads 0 before B1; memory ops after the rank's last
    op take a cell of their own. The steps stay the ops' steps, so the ranks' columns line up as before.
    """
    multi = len(sched.stages_of(rank)) > 1
    r = sched.ranks[rank]
    mems = sched.memops[rank] if sched.memops else ()
    sl = sched.slicing
    lead: dict[int, str] = {}
    for x in mems:
        mark = f"{MEMOP_MARKS[x.op]}{unit_label(sl, x.mb)}" + (f".{x.stage}" if multi else "")
        lead[x.before] = lead.get(x.before, "") + mark + "+"
    out: list[str] = []
    join = False
    for j, (k, i, s, paired) in enumerate(zip(r.kind.tolist(), r.mb.tolist(), r.stage.tolist(), r.paired.tolist())):
        text = lead.get(j, "") + f"{sched.kinds[k]}{unit_label(sl, i)}" + (f".{s}" if multi else "")
        if join:
            out[-1] += "&" + text
        else:
            out.append(text)
        join = paired
    if len(r) in lead:
        out.append(lead[len(r)].rstrip("+"))
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
