"""All checks after evaluation, then lowering: a Schedule becomes a proven-safe Program.

Order: memory (E402); the schedule's own wait-for relation (E401, found while
lowering takes its global order); lowering; a strict dry run of the Program
(E404 when two ranks would issue messages to each other in different orders,
E403 when the Program can still deadlock, a lowering bug this check exists to
catch). Under fsdp the memory model needs the Program's UNSHARD .. RESHARD
windows, so memory is checked after lowering (a schedule that both deadlocks
and is over its limit then reports E401).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from pipec.errors import PipecError
from pipec.ir.dataparallel import DataParallel
from pipec.ir.experts import Experts
from pipec.ir.program import Program
from pipec.ir.schedule import Schedule
from pipec.passes.dryrun import DryRun, deadlock_error
from pipec.passes.experts import check_experts
from pipec.passes.lower import lower_with_proof
from pipec.passes.memcheck import check_memory
from pipec.sim.memory import RankMemory, program_memory, rank_memory


@dataclass(frozen=True)
class CompiledSchedule:
    schedule: Schedule
    program: Program
    memory: tuple[RankMemory, ...]


def compile_schedule(
    sched: Schedule,
    memory: Mapping[str, float] | None = None,
    dp: DataParallel | None = None,
    experts: Experts | None = None,
    moe_layers: Sequence[int] = (),
) -> CompiledSchedule:
    """Check memory and deadlock freedom and lower with the data-parallel options `dp` (default: none) and
    the expert parallelism `experts` over stages with `moe_layers` MoE layers each (default: none; the
    Program carries both, its all-to-alls are phases of its FWDs and BWDs); raises PipecError
    (E401/E402/E403, E421/E423 for data parallelism, E425 for experts)."""
    dp = dp or DataParallel()
    experts = experts or Experts()
    check_experts(sched, dp, experts, moe_layers)
    c = _compile(sched, memory, dp)
    if sched.family is not None and not sched.family.is_static:
        c = _with_family(c, sched, memory)
    if experts != Experts() or any(moe_layers):
        c = replace(c, program=replace(c.program, experts=experts, moe_layers=tuple(moe_layers)))
    return c


def _compile(sched: Schedule, memory: Mapping[str, float] | None, dp: DataParallel) -> CompiledSchedule:
    if dp.kind == "fsdp":
        prog, run = lower_with_proof(sched, dp)
        if not run.completed:
            raise program_deadlock_error(sched, run)
        reports = program_memory(prog, sched, memory)
        check_memory(sched, reports)
        return CompiledSchedule(sched, prog, tuple(reports))
    reports = rank_memory(sched, memory)
    check_memory(sched, reports)
    prog, run = lower_with_proof(sched, dp)  # E401 when the schedule itself deadlocks
    if not run.completed:
        raise program_deadlock_error(sched, run)
    return CompiledSchedule(sched, prog, tuple(reports))


def _with_family(c: CompiledSchedule, sched: Schedule, memory: Mapping[str, float] | None) -> CompiledSchedule:
    """A schedule with an order family (`window`, `any`; pipec.passes.family): its static order compiled
    above is the family's deadlock freedom for an executor that runs only ready ops; here its worst-case
    memory (E430 over a limit; the memory reports become the family's) and whether NCCL can run it (a
    channel it may reorder: recorded on the family, refused by the runtime on NCCL, accepted on gloo and
    shared memory, which match by key). The Program carries the family."""
    from pipec.passes.family import family_memory, nccl_reason, prove_family

    prove_family(sched, "gloo", memory)  # E430
    family = replace(sched.family, nccl=nccl_reason(sched))  # the channel check alone: memory is proven above
    return replace(c, program=replace(c.program, family=family), memory=tuple(family_memory(sched, memory)))


def program_deadlock_error(sched: Schedule, run: DryRun) -> PipecError:
    return deadlock_error(run, sched.decl_spans.get("rank"), sched.source)
