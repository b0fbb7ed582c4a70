"""Pictures of Timelines: a matplotlib Gantt chart (`plot_timelines`) and a compact text Gantt (`text_gantt`).

The trace writer lives in `pipec.formats.trace`. matplotlib is imported inside the
plotting function, so `import pipec` stays light.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipec.ir.opcodes import OFFLOAD, RECOMPUTE, REDUCE_GRAD, RELOAD, RESHARD, UNSHARD
from pipec.ir.program import BWD, FWD, WGRAD
from pipec.ir.schedule import unit_label
from pipec.ir.units import BINARY
from pipec.sim.timeline import Timeline

# Colour per op kind; a rank's second chunk (stage) is drawn lighter, its third darker again, and so on.
COLORS = {FWD: "#4878d0", BWD: "#6acc64", WGRAD: "#ee854a", RECOMPUTE: "#8fa8d8"}
LIGHT = {FWD: "#a9c2ef", BWD: "#b9e8b5", WGRAD: "#f7c6a6", RECOMPUTE: "#cfdaf0"}
LETTER = {FWD: "F", BWD: "B", WGRAD: "W", RECOMPUTE: "R"}  # R: a forward run again (memory ops)
# Collectives (data parallelism): a thin lane under each rank's compute row; waits for them in the row.
COLL_COLORS = {REDUCE_GRAD: "#8c61c9", UNSHARD: "#2aa198", RESHARD: "#333333"}
COLL_LETTER = {REDUCE_GRAD: "R", UNSHARD: "U", RESHARD: "|"}
COLL_NAMES = {REDUCE_GRAD: "reduce grad", UNSHARD: "unshard", RESHARD: "reshard"}
WAIT_COLOR = "#e9a3a3"
# Memory ops on the host link (the Timeline's `host_*` rows): a lane of their own at the bottom of each row.
HOST_COLORS = {OFFLOAD: "#b07aa1", RELOAD: "#59a14f"}
HOST_NAMES = {OFFLOAD: "offload", RELOAD: "reload"}
# Expert parallelism's all-to-alls (the Timeline's `a2a_*` rows), by the op that issues them: a lane too.
A2A_COLORS = {FWD: "#d65f5f", BWD: "#c4ad66"}
A2A_NAMES = {FWD: "all-to-all (F)", BWD: "all-to-all (B)"}


@dataclass(frozen=True)
class Panel:
    """One Gantt chart: a Timeline, its title, and optionally its memory curves (per rank (times, values)):
    the device pool's (`memory`, with its `limit`) and the host pool's (`host`, `host_limit`; drawn in a
    thin panel of its own when given), in `unit` ("bytes": axes in GiB, MiB or KiB; else abstract units).
    `pipec.view.report.panel` fills them from `pipec.sim.memtime`."""

    timeline: Timeline
    title: str = ""
    memory: list[tuple[np.ndarray, np.ndarray]] | None = None
    limit: float | None = None
    host: list[tuple[np.ndarray, np.ndarray]] | None = None
    host_limit: float | None = None
    unit: str = "units"


def _scale(curves: Sequence[tuple[np.ndarray, np.ndarray]], limit: float | None, unit: str) -> tuple[float, str]:
    """The divisor and axis name for memory values: the largest binary unit under the curves' top in bytes."""
    if unit != "bytes":
        return 1.0, "memory"
    top = max([float(v.max()) for _, v in curves if len(v)] + [limit or 0.0, 0.0])
    for name, size in BINARY:
        if top >= size:
            return size, name
    return 1.0, "bytes"


def _chunks(tl: Timeline) -> np.ndarray:
    """For each compute event, the index of its stage among its rank's stages (0 for the first chunk)."""
    out = np.zeros(len(tl.rank), dtype=np.int64)
    for r in range(tl.num_ranks):
        sel = np.flatnonzero(tl.rank == r)
        if len(sel):
            stages = np.unique(tl.stage[sel])
            if len(stages) > 1:
                # Order chunks by their first appearance, so chunk 0 is the one the rank starts with.
                first = {s: np.min(np.flatnonzero(tl.stage[sel] == s)) for s in stages.tolist()}
                rank_of = {s: i for i, s in enumerate(sorted(first, key=first.get))}
                out[sel] = [rank_of[s] for s in tl.stage[sel].tolist()]
    return out


def _slice_shade(color: str, j: int, n: int) -> str:
    """With token slices, a kind's colour lightened by the slice's place in its sequence: slice 0 the kind's
    own colour, the last slice mixed half with white, so a sequence reads dark to light."""
    f = 0.5 * j / max(n - 1, 1)
    rgb = [int(color[k : k + 2], 16) for k in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * f):02x}" for c in rgb)


def _labels(tl: Timeline) -> list[str]:
    """Each compute event's micro-batch as the boxes and the text gantt name it (`3`, or `1s2` for slice 2
    of micro-batch 1: `pipec.view.grid.unit_label`)."""
    return [unit_label(tl.slicing, u) for u in tl.mb.tolist()]


def plot_timelines(panels: Sequence[Panel], path: str | Path, *, width: float | None = None, dpi: int = 110) -> None:
    """Draw Gantt charts, one per panel, stacked with a shared time axis, to PNG, SVG or PDF (by suffix).

    One row per rank (rank 0 on top), a box per compute op coloured by kind with its micro-batch number
    inside when it fits, lighter boxes for a rank's second chunk; with token slices the number is
    `1s2` (slice 2 of micro-batch 1) and a sequence's slices go from the kind's colour to a lighter one;
    a memory curve per rank under each chart when the panel has one (the device pool, then the host pool
    in a thinner panel when given).
    The width (inches) defaults to what gives the shorter ops room for their numbers, between 12 and 24.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    horizon = max((p.timeline.makespan for p in panels), default=1.0) or 1.0
    if width is None:
        durs = np.concatenate([p.timeline.end - p.timeline.start for p in panels] + [np.zeros(0)])
        durs = durs[durs > 0]
        short = float(np.percentile(durs, 10)) if len(durs) else horizon
        width = float(np.clip(horizon / short * 0.2 / 0.86, 12.0, 24.0))
    heights = []
    for p in panels:
        heights.append(0.42 * p.timeline.num_ranks + 0.9)
        if p.memory is not None:
            heights.append(1.6)
        if p.host is not None:
            heights.append(1.0)
    fig, axes = plt.subplots(
        len(heights),
        1,
        figsize=(width, sum(heights) + 0.6),
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
        sharex=True,
    )
    axes = list(axes[:, 0])
    plot_w_in = width * 0.86  # inches of axis width, for fitting labels
    ai = 0
    for p in panels:
        full = p.timeline
        tl = full.computed()  # ops cut at their all-to-alls as their segments
        ax = axes[ai]
        ai += 1
        R = tl.num_ranks
        chunk = _chunks(tl)
        sl = tl.slicing if tl.slicing is not None and tl.slicing.slices > 1 else None
        labels = _labels(tl)
        boxes, colors = [], []
        y0 = tl.rank.astype(float)
        has_coll = len(tl.coll_rank) > 0
        h_rank = getattr(tl, "host_rank", np.zeros(0, np.int64))
        has_host = len(h_rank) > 0
        has_a2a = len(full.a2a_rank) > 0
        low = -0.2 if has_coll or has_host or has_a2a else -0.42  # collectives and host transfers: lanes at the bottom
        for j in range(len(tl.rank)):
            s, e, y = float(tl.start[j]), float(tl.end[j]), R - 1 - y0[j]
            boxes.append([(s, y + low), (s, y + 0.42), (e, y + 0.42), (e, y + low)])
            op = int(tl.op[j])
            color = (LIGHT if chunk[j] % 2 else COLORS).get(op, "#999999")
            if sl is not None:
                color = _slice_shade(color, int(tl.mb[j]) % sl.slices, sl.slices)
            colors.append(color)
        for j in range(len(tl.wait_rank)):
            s, e, y = float(tl.wait_start[j]), float(tl.wait_end[j]), R - 1 - float(tl.wait_rank[j])
            boxes.append([(s, y + low), (s, y + 0.42), (e, y + 0.42), (e, y + low)])
            colors.append(WAIT_COLOR)
        ax.add_collection(PolyCollection(boxes, facecolors=colors, edgecolors="white", linewidths=0.6))
        lane, lane_colors = [], []
        c_top = -0.33 if has_host else -0.26  # with both, collectives below and host transfers above them
        for j in range(len(tl.coll_rank)):
            s, e, y = float(tl.coll_start[j]), float(tl.coll_end[j]), R - 1 - float(tl.coll_rank[j])
            e = max(e, s + horizon * 1e-3)  # an instant (RESHARD) as a tick
            lane.append([(s, y - 0.42), (s, y + c_top), (e, y + c_top), (e, y - 0.42)])
            lane_colors.append(COLL_COLORS.get(int(tl.coll_op[j]), "#999999"))
        h_bot = -0.31 if has_coll else -0.42
        for j in range(len(h_rank)):
            s, e, y = float(tl.host_start[j]), float(tl.host_end[j]), R - 1 - float(h_rank[j])
            lane.append([(s, y + h_bot), (s, y - 0.22), (e, y - 0.22), (e, y + h_bot)])
            lane_colors.append(HOST_COLORS.get(int(tl.host_op[j]), "#999999"))
        a_bot = -0.31 if has_coll or has_host else -0.42  # all-to-alls: a lane of their own, like the host link
        for j in range(len(full.a2a_rank)):
            s, e, y = float(full.a2a_start[j]), float(full.a2a_end[j]), R - 1 - float(full.a2a_rank[j])
            lane.append([(s, y + a_bot), (s, y - 0.22), (e, y - 0.22), (e, y + a_bot)])
            lane_colors.append(A2A_COLORS.get(int(full.a2a_op[j]), "#999999"))
        if lane:
            ax.add_collection(PolyCollection(lane, facecolors=lane_colors, edgecolors="none"))
        # Micro-batch numbers: font size from the narrowest box, skipped when boxes are too thin.
        durs = tl.end - tl.start
        if len(durs):
            pts_per_s = plot_w_in * 72 / horizon
            small = float(np.percentile(durs[durs > 0], 10)) if (durs > 0).any() else 0.0
            digits = max(map(len, labels)) if labels else 1
            size = min(9.0, 0.82 * small * pts_per_s / (0.62 * digits + 0.2), 0.42 * 72 * 0.9)
            if size >= 4.5:
                for j in range(len(tl.rank)):
                    if durs[j] * pts_per_s >= size * (0.6 * digits + 0.1):
                        ax.text(
                            (tl.start[j] + tl.end[j]) / 2,
                            R - 1 - y0[j],
                            labels[j],
                            ha="center",
                            va="center",
                            fontsize=size,
                            color="#111111",
                        )
        ax.set_ylim(-0.6, R - 0.4)
        ax.set_yticks(range(R))
        ax.set_yticklabels([f"rank {R - 1 - y}" for y in range(R)], fontsize=8)
        ax.set_xlim(0, horizon)
        ax.set_title(p.title, fontsize=10, loc="left")
        ax.tick_params(axis="x", labelsize=8)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        ax.set_facecolor("#f4f4f4")
        kinds = sorted(set(tl.op.tolist()))
        names = {**LETTER, RECOMPUTE: "recompute"}
        handles = [Patch(color=COLORS[k], label=names[k]) for k in kinds if k in COLORS]
        if (chunk > 0).any():
            handles += [Patch(color=LIGHT[k], label=f"{LETTER[k]}, chunk 2") for k in kinds if k in LIGHT]
        if sl is not None:
            last = sl.slices - 1
            handles += [
                Patch(color=_slice_shade(COLORS[k], last, sl.slices), label=f"{LETTER[k]}, slice {last}")
                for k in kinds
                if k in COLORS
            ]
        for k in sorted(set(tl.coll_op.tolist())):
            handles.append(Patch(color=COLL_COLORS.get(k, "#999999"), label=COLL_NAMES.get(k, str(k))))
        for k in sorted(set(getattr(tl, "host_op", np.zeros(0, np.int64)).tolist())):
            handles.append(Patch(color=HOST_COLORS.get(k, "#999999"), label=HOST_NAMES.get(k, str(k))))
        if len(tl.wait_rank):
            handles.append(Patch(color=WAIT_COLOR, label="wait for collective"))
        for k in sorted(set(full.a2a_op.tolist())):
            handles.append(Patch(color=A2A_COLORS.get(k, "#999999"), label=A2A_NAMES.get(k, str(k))))
        ax.legend(
            handles=handles,
            loc="upper left",
            bbox_to_anchor=(1.0, 1.0),
            fontsize=7,
            frameon=False,
            handlelength=1.2,
        )
        pools = [(p.memory, p.limit, "", 1.2), (p.host, p.host_limit, "host ", 1.0)]
        for curves, limit, pool, lw in pools:
            if curves is None:
                continue
            mx = axes[ai]
            ai += 1
            div, name = _scale(curves, limit, p.unit)
            cmap = plt.get_cmap("viridis")
            for r, (t, v) in enumerate(curves):
                tt = np.concatenate([t, [horizon]])
                vv = np.concatenate([v, [v[-1] if len(v) else 0.0]]) / div
                mx.step(tt, vv, where="post", lw=lw, color=cmap(r / max(R - 1, 1)), label=f"rank {r}")
            if limit is not None:
                mx.axhline(limit / div, color="#c03030", lw=0.8, ls="--", label=f"{pool}limit")
            label = f"{pool}memory" if p.unit != "bytes" else f"{pool or 'device '}({name})"
            mx.set_ylabel(label, fontsize=8)
            mx.tick_params(labelsize=8)
            mx.set_ylim(bottom=0)
            for side in ("top", "right"):
                mx.spines[side].set_visible(False)
            ncol = 1 if R <= 8 else 2
            mx.legend(loc="upper left", bbox_to_anchor=(1.0, 1.05), fontsize=6, frameon=False, ncol=ncol)
    axes[-1].set_xlabel("time (s)", fontsize=9)
    fig.subplots_adjust(left=0.06, right=0.9, top=1 - 0.35 / (sum(heights) + 0.6), bottom=0.5 / sum(heights))
    from pipec.files import atomic_write

    try:
        with atomic_write(path, "wb") as f:  # all or nothing: a kill midway leaves the old picture
            if str(path).lower().endswith(".png"):
                _save_small_png(fig, f, dpi)
            else:
                fig.savefig(f, dpi=dpi, format=str(path).rsplit(".", 1)[-1].lower())
    finally:
        plt.close(fig)


def _save_small_png(fig, out, dpi: int) -> None:
    """Flat colours compress well once quantised to a palette: a third of the size, no visible change."""
    import io

    from PIL import Image  # a dependency of matplotlib

    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format="png")
    buf.seek(0)
    with Image.open(buf) as im:
        im.convert("RGB").quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(out, format="PNG", optimize=True)


def text_gantt(tl: Timeline, width: int = 120, ranks: Sequence[int] | None = None) -> str:
    """A compact text Gantt: one row per rank, each op its kind letter and micro-batch (`F3`, `B12`; with
    token slices `F1s2`, slice 2 of micro-batch 1) from its start column, `.` where the rank is idle;
    lower-case letters mark a rank's second (odd) chunk. The time
    scale gives the shortest op room for its label; a long schedule wraps into bands of `width` columns.
    With data parallelism each rank's row has a `coll` row under it: `R1` where stage 1's gradient
    reduction runs, `U1` its all-gather, `|` a reshard; `~` in the rank's row where it waits for one. With
    expert parallelism ops cut at their all-to-alls show as their segments, and an `a2a` row under each
    rank shows its all-to-alls (`F3=` while one of F3's runs on the expert link)."""
    full = tl
    tl = tl.computed()
    R = tl.num_ranks
    shown = list(range(R)) if ranks is None else list(ranks)
    label_w = len(f"rank {max(shown, default=0)}") + 1
    cols = max(width - label_w, 16)
    horizon = tl.makespan
    if horizon <= 0 or len(tl.rank) == 0:
        return "\n".join(f"rank {r}" for r in shown)
    durs = tl.end - tl.start
    labels = _labels(tl)
    digits = max(map(len, labels))
    small = float(durs[durs > 0].min()) if (durs > 0).any() else horizon
    scale = (digits + 2) / small  # columns per second
    total = int(math.ceil(horizon * scale - 1e-9))
    chunk = _chunks(tl)
    lines = [["."] * total for _ in range(R)]
    for j in range(len(tl.rank)):
        a, b = int(math.floor(tl.start[j] * scale + 1e-9)), int(math.floor(tl.end[j] * scale + 1e-9))
        if b <= a:
            continue
        letter = LETTER.get(int(tl.op[j]), "?")
        if chunk[j] % 2:
            letter = letter.lower()
        label = f"{letter}{labels[j]}"
        if len(label) > b - a:
            label = letter
        lines[int(tl.rank[j])][a:b] = list(label.ljust(b - a))
    for j in range(len(tl.wait_rank)):
        a, b = int(math.floor(tl.wait_start[j] * scale + 1e-9)), int(math.floor(tl.wait_end[j] * scale + 1e-9))
        row = lines[int(tl.wait_rank[j])]
        row[a:b] = ["~" if c == "." else c for c in row[a:b]]
    coll = None
    if len(tl.coll_rank):
        total = max(total, int(math.ceil(float(tl.coll_end.max()) * scale - 1e-9)))
        for row in lines:
            row.extend(["."] * (total - len(row)))
        coll = [[" "] * total for _ in range(R)]
        for j in range(len(tl.coll_rank)):
            a = int(math.floor(tl.coll_start[j] * scale + 1e-9))
            b = max(int(math.floor(tl.coll_end[j] * scale + 1e-9)), a + 1)
            letter = COLL_LETTER.get(int(tl.coll_op[j]), "?")
            label = letter if letter == "|" else f"{letter}{int(tl.coll_stage[j])}"
            row = coll[int(tl.coll_rank[j])]
            if letter == "|":  # an instant: only where no collective runs
                if a < total and row[a] == " ":
                    row[a] = "|"
                continue
            label = (label if len(label) <= b - a else letter).ljust(b - a, "=")
            row[a : min(b, total)] = list(label[: total - a])
    a2a = None
    if len(full.a2a_rank):
        total = max(total, int(math.ceil(float(full.a2a_end.max()) * scale - 1e-9)))
        for row in lines:
            row.extend(["."] * (total - len(row)))
        if coll is not None:
            for row in coll:
                row.extend([" "] * (total - len(row)))
        a2a = [[" "] * total for _ in range(R)]
        for j in range(len(full.a2a_rank)):
            a = int(math.floor(full.a2a_start[j] * scale + 1e-9))
            b = max(int(math.floor(full.a2a_end[j] * scale + 1e-9)), a + 1)
            label = f"{LETTER.get(int(full.a2a_op[j]), '?')}{int(full.a2a_mb[j])}"
            label = (label if len(label) <= b - a else label[0]).ljust(b - a, "=")
            a2a[int(full.a2a_rank[j])][a : min(b, total)] = list(label[: total - a])
    # Time ticks every ~10 columns, at round times.
    ticks = [" "] * (total + 16)
    step = _nice_step(10 / scale)
    k = 0
    while k * step <= horizon + 1e-9:
        x, text = int(math.floor(k * step * scale + 1e-9)), f"{k * step:g}"
        if all(c == " " for c in ticks[max(x - 1, 0) : x + len(text) + 1]):
            ticks[x : x + len(text)] = list(text)
        k += 1
    out = []
    for lo in range(0, total, cols):
        if lo:
            out.append("")
        out.append(" " * label_w + "".join(ticks[lo : lo + cols]).rstrip())
        for r in shown:
            out.append((f"rank {r}".ljust(label_w) + "".join(lines[r][lo : lo + cols])).rstrip())
            if coll is not None:
                out.append((" coll".ljust(label_w) + "".join(coll[r][lo : lo + cols])).rstrip())
            if a2a is not None:
                out.append((" a2a".ljust(label_w) + "".join(a2a[r][lo : lo + cols])).rstrip())
    return "\n".join(out)


def _nice_step(raw: float) -> float:
    """The smallest of 1, 2, 5 times a power of ten at least `raw`."""
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    for f in (1, 2, 5, 10):
        if raw <= f * mag:
            return f * mag
    return 10 * mag
