"""The memory model of DESIGN.md, per rank: live activations along the rank's order.

Per stage: `act` is held from F until B frees it; with split backward, B
holds `wact` until W frees it; `params` (weights, gradients, optimizer state)
is held throughout. Defaults are in units of one micro-batch's activations
for a rank's share of the model: act = p / S per stage (1 with one stage per
rank, 1/v with v chunks, so schedules compare at equal model size), wact =
half of that (W keeps roughly the layer inputs and output gradients, about
half of what B needed), params = 0, no limit. The schedule's `memory` declarations override the defaults, and
command-line overrides override both.

Data parallelism. Under ddp every replica holds its stages' `params` whole.
Under fsdp with N replicas a stage's parameters, gradients and optimizer state
are sharded: the rank holds params / N throughout, and params * (N - 1) / N
more while the stage is gathered, between an `UNSHARD` and its `RESHARD`. The
windows are the Program's, so the fsdp model (`program_memory`) walks the
lowered instruction stream: memory after each instruction is the sharded
parameters, plus the activations live after the last compute so far, plus the
gathered windows open there; its peak is named by the compute at or before it
(the first compute when the peak comes before any).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pipec.errors import error
from pipec.opcodes import IS_COMPUTE, KIND_OF, RESHARD, UNSHARD
from pipec.schedule import Op, Schedule

if TYPE_CHECKING:
    from pipec.program import Program

DEFAULTS = {"act": 1.0, "wact": 0.5, "params": 0.0}  # per rank share; scaled by p / S per stage


@dataclass(frozen=True)
class RankMemory:
    rank: int
    peak: float
    peak_index: int  # index into the rank's ops; -1 when the rank has no ops
    peak_op: Op | None
    live_act: tuple[tuple[int, int], ...]  # (micro-batch, stage) holding activations at the peak
    live_wact: tuple[tuple[int, int], ...]  # (micro-batch, stage) holding W inputs at the peak
    params: float  # the rank's parameters held throughout (fsdp: its shards)
    limit: float | None
    gathered: tuple[int, ...] = ()  # fsdp: the stages gathered (UNSHARD .. RESHARD) at the peak


def memory_model(sched: Schedule, overrides: Mapping[str, float] | None = None) -> dict[str, np.ndarray]:
    """Per-stage act/wact/params and per-rank limit (NaN for none), after defaults and overrides."""
    overrides = dict(overrides or {})
    S, R = sched.num_stages, sched.num_ranks
    out = {}
    share = R / S
    for key, default in DEFAULTS.items():
        if key in overrides:
            out[key] = np.full(S, float(overrides[key]))
        elif key in sched.memory:
            out[key] = np.asarray(sched.memory[key], dtype=float)
        else:
            out[key] = np.full(S, default * share)
    if "limit" in overrides:
        out["limit"] = np.full(R, float(overrides["limit"]))
    elif "limit" in sched.memory:
        out["limit"] = np.asarray(sched.memory["limit"], dtype=float)
    else:
        out["limit"] = np.full(R, np.nan)
    return out


def rank_memory(sched: Schedule, overrides: Mapping[str, float] | None = None) -> list[RankMemory]:
    model = memory_model(sched, overrides)
    act, wact = model["act"], model["wact"]
    split = sched.split_backward
    reports = []
    for r, ops in enumerate(sched.ranks):
        params = float(model["params"][list(sched.stages_of(r))].sum()) if sched.stages_of(r) else 0.0
        limit = None if np.isnan(model["limit"][r]) else float(model["limit"][r])
        if len(ops) == 0:
            reports.append(RankMemory(r, params, -1, None, (), (), params, limit))
            continue
        k, s = ops.kind, ops.stage
        held_after_b = wact[s] if split else 0.0
        delta = np.where(k == 0, act[s], np.where(k == 1, held_after_b - act[s], -wact[s]))
        live = np.cumsum(delta)
        j = int(np.argmax(live))
        peak = params + max(float(live[j]), 0.0)
        live_act, live_wact = _live_at(sched, r, j)
        op = Op(sched.kinds[int(k[j])], int(ops.mb[j]), int(s[j]))
        reports.append(RankMemory(r, peak, j, op, live_act, live_wact, params, limit))
    return reports


def program_memory(prog: Program, sched: Schedule, overrides: Mapping[str, float] | None = None) -> list[RankMemory]:
    """Per-rank peaks of a Program under its data parallelism (see the module docstring): as
    `rank_memory` for ddp; for fsdp, sharded parameters plus the Program's gathered windows. `sched` is
    the Schedule it executes (its memory declarations and spans)."""
    if prog.dp_kind != "fsdp":
        return rank_memory(sched, overrides)
    model = memory_model(sched, overrides)
    act, wact, params = model["act"], model["wact"], model["params"]
    n = prog.dp
    extra = params * (n - 1) / n  # what gathering a stage adds to its shard
    split = prog.split_backward
    reports = []
    for r, rp in enumerate(prog.ranks):
        own = list(sched.stages_of(r))
        base = float(params[own].sum() / n) if own else 0.0
        limit = None if np.isnan(model["limit"][r]) else float(model["limit"][r])
        op, st = rp.op, np.clip(rp.stage, 0, prog.num_stages - 1)
        comp = IS_COMPUTE[op]
        if len(op) == 0 or not comp.any():
            reports.append(RankMemory(r, base, -1, None, (), (), base, limit))
            continue
        k = KIND_OF[op]
        held_after_b = wact[st] if split else 0.0
        d_act = np.where(comp, np.where(k == 0, act[st], np.where(k == 1, held_after_b - act[st], -wact[st])), 0.0)
        d_gather = np.where(op == UNSHARD, extra[st], np.where(op == RESHARD, -extra[st], 0.0))
        live_act = np.cumsum(d_act)
        live = live_act + np.cumsum(d_gather)
        j = int(np.argmax(live))
        peak = base + max(float(live[j]), 0.0)
        ops_before = np.cumsum(comp)  # computes at or before each instruction
        idx = max(int(ops_before[j]) - 1, 0)  # the op at the peak: the compute at or before it
        ops = sched.ranks[r]
        live_a, live_w = _live_at(sched, r, idx)
        gathered = _gathered_at(op[: j + 1], st[: j + 1])
        at = Op(sched.kinds[int(ops.kind[idx])], int(ops.mb[idx]), int(ops.stage[idx]))
        reports.append(RankMemory(r, peak, idx, at, live_a, live_w, base, limit, gathered))
    return reports


def _gathered_at(op: np.ndarray, st: np.ndarray) -> tuple[int, ...]:
    """The stages whose last window instruction in this prefix is an UNSHARD."""
    state: dict[int, bool] = {}
    window = (op == UNSHARD) | (op == RESHARD)
    for o, s in zip(op[window].tolist(), st[window].tolist()):
        state[s] = o == UNSHARD
    return tuple(sorted(s for s, on in state.items() if on))


def _live_at(sched: Schedule, r: int, j: int):
    ops = sched.ranks[r]
    act: dict[tuple[int, int], None] = {}
    wact: dict[tuple[int, int], None] = {}
    for k, i, s in zip(ops.kind[: j + 1].tolist(), ops.mb[: j + 1].tolist(), ops.stage[: j + 1].tolist()):
        if k == 0:
            act[(i, s)] = None
        elif k == 1:
            act.pop((i, s), None)
            if sched.split_backward:
                wact[(i, s)] = None
        else:
            wact.pop((i, s), None)
    return tuple(act), tuple(wact)


def _fmt(x: float) -> str:
    return f"{x:g}"


def check_memory(sched: Schedule, reports: list[RankMemory]) -> None:
    """Raise E402 for the first rank whose peak exceeds its limit."""
    for rep in reports:
        if rep.limit is not None and rep.peak > rep.limit + 1e-9:
            span = sched.span_of(rep.rank, rep.peak_index) if sched.spans and rep.peak_index >= 0 else None
            live = ", ".join(f"{i}@{s}" for i, s in rep.live_act[:16])
            more = "" if len(rep.live_act) <= 16 else f" and {len(rep.live_act) - 16} more"
            notes = [f"live activations (micro-batch@stage): {live}{more}"]
            if rep.live_wact:
                notes.append("waiting for W: " + ", ".join(f"{i}@{s}" for i, s in rep.live_wact[:16]))
            if rep.gathered:
                stages = ", ".join(map(str, rep.gathered))
                notes.append(f"fsdp: parameter shards {_fmt(rep.params)}, and stages {stages} gathered at the peak")
            raise error(
                "E402",
                f"rank {rep.rank} needs {_fmt(rep.peak)} memory at `{rep.peak_op}`, above its limit {_fmt(rep.limit)}",
                span,
                sched.source,
                tuple(notes),
            )


def format_table(reports: list[RankMemory]) -> str:
    """The per-rank table `pipec check --memory` prints; a `gathered` column (fsdp) when any rank has one."""
    fsdp = any(rep.gathered for rep in reports)
    rows = [("rank", "peak", "params", "limit", "at op", "live micro-batches (@stage)")]
    for rep in reports:
        several = len({st for _, st in rep.live_act}) > 1  # name the stage too when the rank holds several
        shown = [f"{i}@{st}" if several else str(i) for i, st in rep.live_act[:12]]
        live = ",".join(shown) + ("..." if len(rep.live_act) > 12 else "")
        if rep.live_wact:
            live += f" (+{len(rep.live_wact)} awaiting W)"
        rows.append(
            (
                str(rep.rank),
                _fmt(rep.peak),
                _fmt(rep.params),
                "-" if rep.limit is None else _fmt(rep.limit),
                str(rep.peak_op) if rep.peak_op else "-",
                live or "-",
            )
        )
    if fsdp:  # after params: the stages gathered at the peak
        cells = ["gathered"] + [",".join(map(str, rep.gathered)) or "-" for rep in reports]
        rows = [(*row[:3], cell, *row[3:]) for row, cell in zip(rows, cells)]
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
