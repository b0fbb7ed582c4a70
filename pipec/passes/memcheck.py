"""The memory check (E402 on the device pool, E406 on the host pool) and the per-rank table of `pipec check
--memory`: the diagnostics over the memory walk's reports (`pipec.sim.memory.RankMemory`). The walk itself
is the machine model's (`pipec.sim.memory`); this module only says when a report breaks a limit, where
that is in the source, and how the reports read as a table."""

from __future__ import annotations

from pipec.errors import error
from pipec.ir.schedule import Schedule
from pipec.sim.memory import RankMemory, fmt_memory


def _span(sched: Schedule, rank: int, memop: int, index: int):
    if memop >= 0 and rank < len(sched.memops) and sched.memops[rank][memop].span is not None:
        return sched.memops[rank][memop].span
    return sched.span_of(rank, index) if sched.spans and index >= 0 else None


def _pairs(keys: tuple[tuple[int, int], ...], rep: RankMemory) -> str:
    more = "" if len(keys) <= 16 else f" and {len(keys) - 16} more"
    return ", ".join(f"{rep.unit_text(i)}@{s}" for i, s in keys[:16]) + more


def check_memory(sched: Schedule, reports: list[RankMemory]) -> None:
    """Raise E402 for the first rank whose device peak exceeds its limit, else E406 for the first whose
    host pool does (located at the OFFLOAD that passes the host limit)."""
    for rep in reports:
        if rep.limit is not None and rep.peak > rep.limit + 1e-9:
            span = _span(sched, rep.rank, rep.peak_memop, rep.peak_index)
            notes = [f"live activations (micro-batch@stage): {_pairs(rep.live_act, rep)}"]
            if rep.live_wact:
                notes.append("waiting for W: " + ", ".join(f"{rep.unit_text(i)}@{s}" for i, s in rep.live_wact[:16]))
            if rep.gathered:
                stages = ", ".join(map(str, rep.gathered))
                shards = fmt_memory(rep.params, rep.unit)
                notes.append(f"fsdp: parameter shards {shards}, and stages {stages} gathered at the peak")
            where = rep.at_text if rep.peak_memop < 0 or rep.peak_op is None else _memop_text(sched, rep)
            raise error(
                "E402",
                f"rank {rep.rank} needs {fmt_memory(rep.peak, rep.unit)} memory at `{where}`, above its limit "
                f"{fmt_memory(rep.limit, rep.unit)}",
                span,
                sched.source,
                tuple(notes),
            )
    for rep in reports:
        if rep.host_limit is not None and rep.host_peak > rep.host_limit + 1e-9:
            raise error(
                "E406",
                f"rank {rep.rank} needs {fmt_memory(rep.host_peak, rep.unit)} of host memory at `{rep.host_op}`, "
                f"above its host limit {fmt_memory(rep.host_limit, rep.unit)}",
                _span(sched, rep.rank, rep.host_memop, -1),
                sched.source,
                (f"offloaded there (micro-batch@stage): {_pairs(rep.live_host, rep)}",),
            )


def _memop_text(sched: Schedule, rep: RankMemory) -> str:
    m = sched.memops[rep.rank][rep.peak_memop]
    return f"{m.op} {m.mb} {m.stage}"


def format_table(reports: list[RankMemory]) -> str:
    """The per-rank table `pipec check --memory` prints, amounts by `fmt_memory` (GiB/MiB in bytes); a
    `gathered` column (fsdp) when any rank has one, host columns when any rank offloads."""
    fsdp = any(rep.gathered for rep in reports)
    host = any(rep.host_op is not None for rep in reports)
    rows = [("rank", "peak", "params", "limit", "at op", "live micro-batches (@stage)")]
    for rep in reports:
        u = rep.unit
        several = len({st for _, st in rep.live_act}) > 1  # name the stage too when the rank holds several
        shown = [f"{rep.unit_text(i)}@{st}" if several else rep.unit_text(i) for i, st in rep.live_act[:12]]
        live = ",".join(shown) + ("..." if len(rep.live_act) > 12 else "")
        if rep.live_wact:
            live += f" (+{len(rep.live_wact)} awaiting W)"
        rows.append(
            (
                str(rep.rank),
                fmt_memory(rep.peak, u),
                fmt_memory(rep.params, u),
                "-" if rep.limit is None else fmt_memory(rep.limit, u),
                rep.at_text or "-",
                live or "-",
            )
        )
    if fsdp:  # after params: the stages gathered at the peak
        cells = ["gathered"] + [",".join(map(str, rep.gathered)) or "-" for rep in reports]
        rows = [(*row[:3], cell, *row[3:]) for row, cell in zip(rows, cells)]
    if host:  # after the device limit: the host pool's peak and limit
        at = rows[0].index("limit") + 1
        cells = [("host peak", "host limit")] + [
            (
                fmt_memory(rep.host_peak, rep.unit),
                "-" if rep.host_limit is None else fmt_memory(rep.host_limit, rep.unit),
            )
            for rep in reports
        ]
        rows = [(*row[:at], *cell, *row[at:]) for row, cell in zip(rows, cells)]
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
