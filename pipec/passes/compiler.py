"""All checks after evaluation, then lowering: a Schedule becomes a proven-safe Program.

Order: memory (E402); the schedule's own wait-for relation (E401, found while
lowering takes its global order); lowering; a strict dry run of the Program
(E404 when two ranks would issue messages to each other in different orders,
E403 when the Program can still deadlock, a lowering bug this check exists to
catch).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import networkx as nx

from pipec.passes.dryrun import DryRun
from pipec.errors import PipecError, error
from pipec.schedule import Schedule
from pipec.passes.lower import lower_with_proof
from pipec.passes.memory import RankMemory, check_memory, rank_memory
from pipec.program import Program


@dataclass(frozen=True)
class CompiledSchedule:
    schedule: Schedule
    program: Program
    memory: tuple[RankMemory, ...]


def compile_schedule(sched: Schedule, memory: Mapping[str, float] | None = None) -> CompiledSchedule:
    """Check memory and deadlock freedom and lower; raises PipecError (E401/E402/E403)."""
    reports = rank_memory(sched, memory)
    check_memory(sched, reports)
    prog, run = lower_with_proof(sched)  # E401 when the schedule itself deadlocks
    if not run.completed:
        raise program_deadlock_error(sched, run)
    return CompiledSchedule(sched, prog, tuple(reports))


def program_deadlock_error(sched: Schedule, run: DryRun) -> PipecError:
    by_rank = {w.rank: w for w in run.waits}
    graph = nx.DiGraph((w.rank, w.peer) for w in run.waits)
    try:
        cycle = [a for a, _ in nx.find_cycle(graph, source=run.waits[0].rank)]
    except nx.NetworkXNoCycle:
        cycle = [w.rank for w in run.waits]
    notes = []
    for r in cycle:
        w = by_rank[r]
        if w.event == "match":
            notes.append(f"rank {r} blocks at `{w.instr}` until rank {w.peer} issues the matching receive")
        elif w.event == "arrival":
            notes.append(f"rank {r} blocks at `{w.instr}` waiting for {w.what} from rank {w.peer}")
        else:
            notes.append(f"rank {r} blocks at `{w.instr}` waiting for its own `{w.what}`, which comes later")
    return error(
        "E403",
        "the lowered program can deadlock when sends block until the peer posts its receive",
        sched.decl_spans.get("rank"),
        sched.source,
        tuple(notes),
    )
