"""Writing torch.distributed.pipelining's schedule CSV: the one writer of the format.

`export_csv` writes a checked Schedule in the compute-only format, or with its lowered Program the
compute+communication format; what torch cannot run as pipec means it is an error (E610 to E616, E217
for a stage graph), never a CSV that runs otherwise. pipec.formats.torchtitan hands its CSV to
torchtitan through here. The format and its action types are pipec.formats.torch_actions'; reading a
CSV is pipec.formats.torch_csv_reader's. Plain text only: nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipec.errors import PipecError, error
from pipec.formats.graph_limits import refuse_graph
from pipec.formats.torch_actions import NO_MB, OPCODE_OF, torch_name
from pipec.ir.opcodes import BY_NAME, COMPUTE_OF_KIND, COMPUTE_RES, IS_MEMOP, MEMOPS, OP_KINDS, OPCODES
from pipec.ir.schedule import MemOp, Schedule


def _letter(kind: str, split: bool) -> str:
    """torch's action type for a Schedule op kind (F, B, W)."""
    return torch_name(OPCODES[COMPUTE_OF_KIND[OP_KINDS.index(kind)]], split)


def compute_rows(sched: Schedule, drop_memops: bool = False) -> list[list[str]]:
    """Each rank's compute actions as torch writes them (the compute-only format). Raises E610/E611
    for what torch cannot run as pipec means it, E614 for a memory op unless `drop_memops`."""
    _check_exportable(sched, drop_memops)
    split = sched.split_backward
    rows = []
    for r in range(sched.num_ranks):
        ops = sched.ops(r)
        paired = sched.ranks[r].paired.tolist()
        cells: list[str] = []
        j = 0
        while j < len(ops):
            if not paired[j]:
                o = ops[j]
                cells.append(f"{o.stage}{_letter(o.kind, split)}{o.mb}")
                j += 1
                continue
            f, b = ops[j], ops[j + 1]
            if f.kind != "F":
                f, b = b, f
            w = ops[j + 2] if j + 2 < len(ops) else None
            full = split and w is not None and w.kind == "W" and (w.mb, w.stage) == (b.mb, b.stage)
            letter = torch_name("BWD", split and not full)  # torch's full backward B when its W follows the pair
            cells.append(f"({f.stage}F{f.mb};{b.stage}{letter}{b.mb})OVERLAP_F_B")
            j += 3 if full else 2
        rows.append(cells)
    return rows


def _merged(sched: Schedule) -> set[tuple[int, int]]:
    """(micro-batch, stage) of the backwards written as torch's full backward `B` in a split schedule:
    the backward of a pair whose W comes right after the pair."""
    out: set[tuple[int, int]] = set()
    if not sched.split_backward:
        return out
    for r in range(sched.num_ranks):
        ops, paired = sched.ops(r), sched.ranks[r].paired.tolist()
        for j in range(len(ops) - 2):
            if paired[j]:
                b = ops[j + 1] if ops[j].kind == "F" else ops[j]
                w = ops[j + 2]
                if w.kind == "W" and (w.mb, w.stage) == (b.mb, b.stage):
                    out.add((b.mb, b.stage))
    return out


def check_unsliced(sched: Schedule, program=None) -> None:
    """E615 for token slices, E616 for micro-batches of different lengths (pipec.ir.schedule.Slicing): torch's
    actions name a stage and a micro-batch, nothing smaller, and its runtime fixes every micro-batch's
    shapes at the first step, so neither has a CSV (nor a torchtitan config) that runs as pipec means it."""
    sl = sched.slicing or getattr(program, "slicing", None)
    if sl is None:
        return
    if sl.slices > 1:
        raise error(
            "E615",
            f"token slices have no torch form: torch.distributed.pipelining's actions run whole micro-batches, "
            f"and this schedule cuts each of its {sl.sequences} micro-batches into {sl.slices} slices",
            sched.decl_spans.get("slices"),
            sched.source,
            (
                "a slice's forward attends to the keys and values of the earlier slices on its stage; torch's "
                "stages keep no such cache between actions (docs/terapipe.md)",
                "export the schedule without `slices` (one unit per micro-batch), or run it with pipec's runtime",
            ),
        )
    if len(set(sl.lengths)) > 1:
        shown = ", ".join(map(str, sl.lengths[:8])) + (", ..." if len(sl.lengths) > 8 else "")
        raise error(
            "E616",
            "micro-batches of different lengths have no torch form: torch.distributed.pipelining fixes every "
            "micro-batch's shapes at the first step",
            sched.decl_spans.get("length"),
            sched.source,
            (f"lengths: {shown}", "pad the micro-batches to one length, or run the schedule with pipec's runtime"),
        )


# Why a torch CSV cannot hold a stage graph (E217): said once, for the torch CSV and torchtitan.
TORCH_GRAPH_LIMIT = (
    "torch.distributed.pipelining's runtime sends each stage's output to the next stage only (stage s to s + 1) "
    "and its actions name no edge, so a skip connection or a fan-in would run as a chain"
)
TORCH_GRAPH_HINT = "run the schedule with pipec's runtime (`pipec run`), which executes every edge"


def refuse_graph_for_torch(sched: Schedule, program=None, tool: str = "the torch CSV writer") -> None:
    """E217 for a schedule or Program with a stage graph: torch has no form for one."""
    refuse_graph(sched, tool, TORCH_GRAPH_LIMIT, TORCH_GRAPH_HINT)
    if program is not None:
        refuse_graph(program, tool, TORCH_GRAPH_LIMIT, TORCH_GRAPH_HINT, sched.source)


def _check_exportable(sched: Schedule, drop_memops: bool = False, program=None) -> None:
    refuse_graph_for_torch(sched, program)
    check_unsliced(sched, program)
    if not drop_memops:
        _check_memops(sched, program)
    for r in range(sched.num_ranks):
        ops, paired = sched.ops(r), sched.ranks[r].paired.tolist()
        for j in range(len(ops) - 1):
            if paired[j] and sorted((ops[j].kind, ops[j + 1].kind)) != ["B", "F"]:
                raise _at(
                    sched,
                    r,
                    j,
                    "E610",
                    f"the pair `{ops[j]} & {ops[j + 1]}` on rank {r} has no torch form: torch's OVERLAP_F_B "
                    "overlaps one forward with one backward",
                )
    for r in range(sched.num_ranks):
        if not sched.stages_of(r):
            raise error(
                "E612",
                f"rank {r} holds no stage: torch's runtime needs at least one stage on every rank",
                sched.decl_spans.get("place"),
                sched.source,
            )
    last = sched.num_stages - 1
    r = sched.placement[last]
    seen = 0
    for j, o in enumerate(sched.ops(r)):
        if o.kind == "F" and o.stage == last:
            if o.mb != seen:
                raise _at(
                    sched,
                    r,
                    j,
                    "E611",
                    f"the last stage runs `{o}` as its forward number {seen}: torch's runtime indexes each "
                    "micro-batch's loss by the order the last stage ran its forwards, so its losses and "
                    "gradients would be wrong",
                    ("export only schedules whose last stage runs its forwards in micro-batch order",),
                )
            seen += 1


def _check_memops(sched: Schedule, program=None) -> None:
    """E614: torch.distributed.pipelining has no action for RECOMPUTE, OFFLOAD or RELOAD (its runtime
    neither recomputes nor offloads a stage's activations), so a schedule or Program holding one has no
    CSV that runs as pipec means it; `--drop-memops` writes the schedule without them."""
    found = next(((r, x) for r, row in enumerate(sched.memops) for x in row), None)
    if found is None and program is not None:
        for r, rp in enumerate(program.ranks):
            at = np.flatnonzero(IS_MEMOP[rp.op])
            if len(at):
                i = rp.instructions()[int(at[0])]
                found = (r, MemOp(i.op, i.mb, i.stage, -1))
                break
    if found is None:
        return
    r, x = found
    raise error(
        "E614",
        f"`{x.op} {x.mb} {x.stage}` on rank {r} has no torch form: torch.distributed.pipelining's actions "
        "neither recompute a forward nor move activations to host memory",
        x.span,
        sched.source,
        (
            "export with --drop-memops to write the schedule without its memory ops (torch then keeps every "
            "forward's activations on the device)",
        ),
    )


def _at(sched: Schedule, r: int, j: int, code: str, message: str, notes: tuple[str, ...] = ()) -> PipecError:
    span = sched.span_of(r, j) if sched.spans else None
    return error(code, message, span, sched.source, notes)


def comms_rows(sched: Schedule, program, drop_memops: bool = False) -> list[list[str]]:
    """Each rank's compute and communication actions (torch's compute+comms format), from pipec's
    Program: its proven order of sends and receives, a batched exchange split so that the lower rank
    posts its receive first (torch issues one action at a time), REDUCE_GRAD where the Program has it;
    an fsdp Program's own UNSHARD and RESHARD where it has them, else (ddp) UNSHARD of each stage before
    its first use and RESHARD right after its REDUCE_GRAD, as torch's runtime expects of every stage;
    STEP (the optimizer) is not a torch action. The result is proven again by pipec's strict dry run
    (E613 if it could deadlock). A memory op is E614, or with `drop_memops` left out."""
    from pipec.ir.program import Program, RankProgram
    from pipec.passes.dryrun import dry_run

    _check_exportable(sched, drop_memops, program)
    merged = _merged(sched)
    split = sched.split_backward
    unbatched = []
    for rp in program.ranks:
        instrs = [x for x in rp.instructions() if x.op not in MEMOPS]  # E614 above unless dropped
        out = []
        j = 0
        while j < len(instrs):
            x = instrs[j]
            if x.group and BY_NAME[x.op].resource != COMPUTE_RES:
                group = [x]
                while group[-1].group and j + 1 < len(instrs):
                    j += 1
                    group.append(instrs[j])
                out += [type(g)(g.op, g.mb, g.stage, g.peer, False) for g in group]
            else:
                out.append(x)
            j += 1
        unbatched.append(out)
    check = Program(
        name=program.name,
        params=program.params,
        num_stages=program.num_stages,
        num_ranks=program.num_ranks,
        num_microbatches=program.num_microbatches,
        split_backward=program.split_backward,
        placement=program.placement,
        ranks=tuple(RankProgram.from_instructions(x) for x in unbatched),
        dp=program.dp,
        dp_kind=program.dp_kind,
    )
    run = dry_run(check)
    if not run.completed:
        raise error(
            "E613",
            "torch issues sends and receives one at a time, and without pipec's batched exchanges this "
            "program could deadlock",
            None,
            sched.source,
            tuple(f"rank {w.rank} blocks at `{w.instr}`" for w in run.waits),
        )
    rows = []
    own_windows = program.dp_kind == "fsdp"
    for instrs in unbatched:
        cells: list[str] = []
        unsharded: list[int] = [] if not own_windows else list(range(program.num_stages))  # fsdp: its own
        j = 0
        while j < len(instrs):
            x = instrs[j]
            op = BY_NAME[x.op]
            if op.resource == COMPUTE_RES:
                if x.stage not in unsharded:
                    unsharded.append(x.stage)
                    cells.append(f"{x.stage}UNSHARD")
                if x.op == "WGRAD" and (x.mb, x.stage) in merged:
                    j += 1
                    continue
                if x.group:
                    y = instrs[j + 1]
                    if y.stage not in unsharded:
                        unsharded.append(y.stage)
                        cells.append(f"{y.stage}UNSHARD")
                    f, b = (x, y) if x.op == "FWD" else (y, x)
                    letter = torch_name("BWD", split and (b.mb, b.stage) not in merged)
                    cells.append(f"({f.stage}F{f.mb};{b.stage}{letter}{b.mb})OVERLAP_F_B")
                    j += 2
                    continue
                cells.append(f"{x.stage}{torch_name(x.op, split)}{x.mb}")
            elif op.side is not None:
                cells.append(f"{x.stage}{torch_name(x.op, split)}{x.mb}")
            elif x.op == "REDUCE_GRAD":
                cells.append(f"{x.stage}REDUCE_GRAD")
                if not own_windows:
                    cells.append(f"{x.stage}RESHARD")
            elif x.op in OPCODE_OF and x.op in NO_MB:  # the Program's own UNSHARD, RESHARD (fsdp)
                cells.append(f"{x.stage}{x.op}")
            j += 1
        rows.append(cells)
    return rows


def format_rows(rows: Sequence[Sequence[str]]) -> str:
    """CSV text: one line per rank, cells joined by commas (what csv.writer writes for these cells)."""
    return "".join(",".join(row) + "\n" for row in rows)


def export_csv(sched: Schedule, program=None, drop_memops: bool = False) -> str:
    """The compute-only CSV of a checked schedule, or with `program` (its lowered Program) the
    compute+communication CSV. A memory op (RECOMPUTE, OFFLOAD, RELOAD) has no torch action: E614, or
    with `drop_memops` the CSV without them."""
    if program is None:
        return format_rows(compute_rows(sched, drop_memops))
    return format_rows(comms_rows(sched, program, drop_memops))
