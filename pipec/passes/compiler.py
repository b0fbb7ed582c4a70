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

from pipec.errors import PipecError
from pipec.passes.dryrun import DryRun, deadlock_error
from pipec.passes.lower import lower_with_proof
from pipec.passes.memory import RankMemory, check_memory, rank_memory
from pipec.program import Program
from pipec.schedule import Schedule


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
    return deadlock_error(run, sched.decl_spans.get("rank"), sched.source)
