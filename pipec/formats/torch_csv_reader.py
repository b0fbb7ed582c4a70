"""Reading torch.distributed.pipelining's schedule CSV: a Schedule, checked like any other.

`read_csv` turns a CSV into a Schedule whose spans point at the CSV's cells, so every check and
diagnostic applies to it (E601 to E609 for what is torch's own: actions that do not parse, stages with
gaps, sends and receives that do not match or could deadlock); `to_pipe` writes a Schedule as `.pipe`
text with explicit per-rank orders (`pipec import`). The format and its action types are
pipec.formats.torch_actions'; writing a CSV is pipec.formats.torch_csv_writer's. Plain text only:
nothing here imports torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import PurePath

import numpy as np

from pipec.errors import Source, Span, error
from pipec.formats.pipe_text import rank_block, rank_lines, schedule_head, schedule_steps
from pipec.formats.torch_actions import COMMS, COMPUTE, NO_MB, OPCODE_OF, TORCH_VERSION, torch_name
from pipec.ir.opcodes import BY_NAME, MESSAGE_NOUNS, MESSAGES, OP_KINDS, Opcode
from pipec.ir.schedule import Collective, RankOps, Schedule

MAX_INDEX = 10_000_000  # largest stage or micro-batch index read from a CSV
_TYPES = sorted(COMPUTE + COMMS + NO_MB, key=len, reverse=True)
_SIMPLE = re.compile(r"(\d+)(" + "|".join(_TYPES) + r")(\d*)")
_PAIR = re.compile(r"\((.*)\)OVERLAP_F_B")


def is_torch_csv(source: Source) -> bool:
    """A source read from a `.csv` file is a torch schedule CSV."""
    return PurePath(source.path).suffix.lower() == ".csv"


@dataclass(frozen=True)
class Action:
    """One torch action. `mb` is None for UNSHARD/RESHARD/REDUCE_GRAD; a pair has `subs`."""

    stage: int
    kind: str
    mb: int | None
    span: Span
    subs: tuple[Action, ...] = ()

    def __str__(self) -> str:
        if self.subs:
            return "(" + ";".join(str(a) for a in self.subs) + ")OVERLAP_F_B"
        return f"{self.stage}{self.kind}{'' if self.mb is None else self.mb}"


def _cells(text: str) -> list[list[tuple[str, int]]]:
    """Rows as csv.reader splits them (one per line; a blank line is an empty row), each cell with its
    1-based column. Double-quoted cells are unquoted."""
    rows = []
    for line in text.splitlines():
        row: list[tuple[str, int]] = []
        j = 0
        if line == "":
            rows.append(row)
            continue
        while True:
            if j < len(line) and line[j] == '"':
                end = j + 1
                while end < len(line):
                    if line[end] == '"' and line[end + 1 : end + 2] != '"':
                        break
                    end += 2 if line[end] == '"' else 1
                cell = line[j + 1 : end].replace('""', '"')
                row.append((cell, j + 2))
                j = line.find(",", end)
            else:
                comma = line.find(",", j)
                row.append((line[j : comma if comma >= 0 else len(line)], j + 1))
                j = comma
            if j < 0:
                break
            j += 1
        rows.append(row)
    return rows


def _span(line: int, col: int, text: str) -> Span:
    return Span(line, col, line, col + max(len(text), 1))


def _parse_simple(text: str, line: int, col: int, source: Source) -> Action:
    m = _SIMPLE.fullmatch(text)
    span = _span(line, col, text)
    if m is None:
        raise error(
            "E601",
            f"`{text}` is not a torch action",
            span,
            source,
            (
                "an action is {stage}{type}{micro-batch}, e.g. `0F1`, `2I0`, `1SEND_F2`, `0REDUCE_GRAD`, "
                "or `(0F1;3B0)OVERLAP_F_B`; types: F I B W SEND_F RECV_F SEND_B RECV_B UNSHARD RESHARD REDUCE_GRAD",
            ),
        )
    stage, kind, mb = int(m.group(1)), m.group(2), m.group(3)
    if kind in NO_MB and mb:
        raise error("E602", f"`{text}`: {kind} takes no micro-batch", span, source)
    if kind not in NO_MB and not mb:
        raise error("E602", f"`{text}`: {kind} needs a micro-batch, e.g. `{stage}{kind}0`", span, source)
    for what, value in (("stage", stage), ("micro-batch", int(mb) if mb else 0)):
        if value >= MAX_INDEX:
            raise error("E602", f"`{text}`: {what} {value} is too large (at most {MAX_INDEX - 1})", span, source)
    return Action(stage, kind, int(mb) if mb else None, span)


def _parse_cell(raw: str, line: int, col: int, source: Source) -> Action | None:
    text = raw.strip()
    if not text:
        return None
    col += len(raw) - len(raw.lstrip())
    m = _PAIR.fullmatch(text)
    if m is None:
        return _parse_simple(text, line, col, source)
    subs = []
    at = col + 1
    for part in m.group(1).split(";"):
        sub = part.strip()
        if sub:
            subs.append(_parse_simple(sub, line, at + len(part) - len(part.lstrip()), source))
        at += len(part) + 1
    span = _span(line, col, text)
    if len(subs) != 2 or any(a.kind not in COMPUTE for a in subs):
        raise error(
            "E603",
            f"`{text}`: an overlapped pair holds exactly two compute actions (F, I, B or W)",
            span,
            source,
            ("pipec pairs two ops, like torch's DualPipeV: `(0F7;7B3)OVERLAP_F_B`",),
        )
    return Action(-1, "OVERLAP_F_B", None, span, tuple(subs))


def parse_csv(source: Source) -> list[list[Action]]:
    """Per rank (row), its actions in order; empty cells (bubbles) dropped. Raises E601 to E606."""
    rows = _cells(source.text)
    if not rows:
        raise error("E605", "the CSV has no rows: torch expects one row of actions per rank", None, source)
    out = []
    comms = False
    for r, row in enumerate(rows):
        actions = []
        for raw, col in row:
            a = _parse_cell(raw, r + 1, col, source)
            if a is None:
                continue
            comms |= a.kind in COMMS
            actions.append(a)
        if not any(a.kind in COMPUTE or a.subs for a in actions):
            text = source.line(r + 1)
            span = _span(r + 1, 1, text) if text else None
            raise error(
                "E606",
                f"row {r + 1} (rank {r}) has no compute actions",
                span,
                source,
                ("every rank needs at least one stage; a blank line is a row (torch reads it as a rank)",),
            )
        out.append(actions)
    if comms:
        for r, row in enumerate(rows):
            for raw, col in row:
                if not raw.strip():
                    raise error(
                        "E606",
                        "an empty cell in a compute+communication CSV (torch's loader refuses it there)",
                        Span(r + 1, col, r + 1, col + max(len(raw), 1)),
                        source,
                        ("only the compute-only format may leave bubbles as empty cells",),
                    )
    return out


@dataclass(frozen=True)
class TorchCsv:
    """A parsed CSV and what pipec reads from it."""

    source: Source
    rows: tuple[tuple[Action, ...], ...]
    split: bool  # the file has I or W: our split backward
    comms: bool  # the file has sends or receives: the compute+communication format
    num_stages: int
    num_microbatches: int
    placement: tuple[int, ...]


def _opcode(kind: str) -> Opcode:
    """The instruction-table row of a torch action type."""
    return BY_NAME[OPCODE_OF[kind]]


def _message(op: Opcode, mb: int, stage: int) -> tuple[str, int, int]:
    """The message a transfer on `stage` names: (what travels, micro-batch, sending stage)."""
    return (op.message, mb, stage + op.key_stage)


def _compute(a: Action) -> Iterable[Action]:
    return a.subs if a.subs else (a,) if a.kind in COMPUTE else ()


def analyse(source: Source) -> TorchCsv:
    """Parse a CSV and infer its sizes and placement: stages 0 .. S-1 (E604 for a gap), each on the
    first rank that runs it; micro-batches up to the largest; split backward when it has I or W."""
    rows = parse_csv(source)
    computes = [c for row in rows for a in row for c in _compute(a)]
    split = any(c.kind in ("I", "W") for c in computes)  # an input gradient or a weight gradient
    comms = any(a.kind in COMMS for row in rows for a in row)
    S = max(c.stage for c in computes) + 1
    M = max(c.mb for c in computes) + 1
    owner: dict[int, int] = {}
    for r, row in enumerate(rows):
        for a in row:
            for c in _compute(a):
                owner.setdefault(c.stage, r)
    if len(owner) < S:
        absent = next(s for s, t in enumerate(sorted(owner)) if s != t)
        raise error(
            "E604",
            f"stage {absent} has no action on any rank, but stage {S - 1} does",
            None,
            source,
            ("torch infers the stages and their ranks from the CSV: stages are numbered 0 .. S-1 with no gaps",),
        )
    placement = tuple(owner[s] for s in range(S))
    return TorchCsv(source, tuple(tuple(r) for r in rows), split, comms, S, M, placement)


def read_csv(
    source: Source,
    params: Mapping[str, object] | Iterable[tuple[str, object]] = (),
    *,
    check: bool = True,
) -> Schedule:
    """The Schedule a torch CSV describes; spans point at its cells. `p` is its number of rows; `m` is by
    default its largest micro-batch + 1, and may be given (a cell beyond it is then E209). With `check`,
    every check of `check_schedule` runs, and a compute+communication file has its sends and receives
    checked too (see `check_comms`)."""
    from pipec.passes.checks import check_schedule

    doc = analyse(source)
    sched = _schedule(doc, list(params.items()) if isinstance(params, Mapping) else list(params))
    if check:
        _check_size(sched)
        check_schedule(sched)
        if doc.comms:
            check_comms(doc, sched)
    return sched


def _check_size(sched: Schedule) -> None:
    """When the sizes call for far more ops than the file holds (a stray `0F9999999`), say which op is
    missing without the checks' arrays over every (op, micro-batch, stage)."""
    K, S, M = len(sched.kinds), sched.num_stages, sched.num_microbatches
    if K * S * M <= max(8 * sched.num_ops, 1 << 22):
        return
    have = {(k, i, s) for r in sched.ranks for k, i, s in zip(r.kind.tolist(), r.mb.tolist(), r.stage.tolist())}
    k, i, s = next((k, i, s) for k in range(K) for s in range(S) for i in range(M) if (k, i, s) not in have)
    raise error(
        "E303",
        f"{sched.kinds[k]}({i}, stage {s}) is never emitted; stage {s} is placed on rank {sched.placement[s]}",
        None,
        sched.source,
        (f"{K * S * M - len(have) - 1} more op(s) missing",),
    )


def _schedule(doc: TorchCsv, params: Iterable[tuple[str, object]]) -> Schedule:
    R, S, M = len(doc.rows), doc.num_stages, doc.num_microbatches
    seen = set()
    for name, value in params:
        if name not in ("p", "m"):
            raise error("E607", f"a torch CSV has no parameter `{name}`", None, doc.source, _sizes_note(R, M))
        if name in seen:
            raise error("E607", f"parameter `{name}` given twice", None, doc.source)
        seen.add(name)
        try:
            n = value if isinstance(value, int) and not isinstance(value, bool) else int(str(value))
        except ValueError:
            n = None
        if name == "p" and n != R:
            raise error("E607", f"`p={value}` does not match the CSV, which has {R} rows (ranks)", None, doc.source)
        if name == "m":
            if n is None or not 1 <= n < MAX_INDEX:
                raise error("E607", f"`m={value}`: the number of micro-batches must be an int >= 1", None, doc.source)
            M = n  # the micro-batches the CSV is meant to have: a cell beyond them is E209
    kinds = OP_KINDS if doc.split else OP_KINDS[:2]
    wgrad = OP_KINDS.index(BY_NAME["WGRAD"].kind)
    spans: list[Span] = []
    ranks = []
    collectives: list[tuple[Collective, ...]] = []
    for row in doc.rows:
        ops: list[tuple[int, int, int, int, bool]] = []
        placed: list[Collective] = []  # UNSHARD, RESHARD, REDUCE_GRAD where the file puts them (docs/interop.md)
        for a in row:
            if a.kind in NO_MB:
                placed.append(Collective(OPCODE_OF[a.kind], a.stage, len(ops), a.span))
                continue
            if not a.subs and a.kind not in COMPUTE:
                continue
            full = []
            for j, c in enumerate(a.subs or (a,)):
                spans.append(c.span)
                sid = len(spans) - 1
                kind = OP_KINDS.index(_opcode(c.kind).kind)
                ops.append((kind, c.mb, c.stage, sid, bool(a.subs) and j == 0))
                if c.kind == "B" and doc.split:
                    full.append((wgrad, c.mb, c.stage, sid, False))
            ops += full  # a full backward in a split schedule: B, then its W (after the pair)
        cols = list(zip(*ops)) if ops else [(), (), (), (), ()]
        ranks.append(
            RankOps(
                kind=np.array(cols[0], dtype=np.int64),
                mb=np.array(cols[1], dtype=np.int64),
                stage=np.array(cols[2], dtype=np.int64),
                sid=np.array(cols[3], dtype=np.int64),
                paired=np.array(cols[4], dtype=bool),
            )
        )
        collectives.append(tuple(placed))
    return Schedule(
        name=PurePath(doc.source.path).stem,
        params=(("p", R), ("m", M)),
        num_stages=S,
        num_ranks=R,
        num_microbatches=M,
        kinds=kinds,
        placement=doc.placement,
        ranks=tuple(ranks),
        spans=tuple(spans),
        source=doc.source,
        collectives=tuple(collectives) if any(collectives) else (),
    )


def _sizes_note(R: int, M: int) -> tuple[str, ...]:
    return (f"a CSV takes `p`, which must be its rows ({R}), and `m` (by default {M}, its largest micro-batch + 1)",)


def check_comms(doc: TorchCsv, sched: Schedule) -> None:
    """A compute+communication file: every message is sent once after the compute that produces it and
    received once before the compute that needs it, on the right ranks (E608); both ends of each rank
    pair issue their messages in one order (E404); and the whole cannot deadlock even when every send
    blocks until its receive is posted (E609)."""
    from pipec.passes.dryrun import dry_run

    S, placement = doc.num_stages, doc.placement
    for r, row in enumerate(doc.rows):
        done: dict[tuple[str, int, int], tuple[Action, Opcode]] = {}  # message -> the compute and its send
        posted: set[tuple[str, int, int]] = set()
        sent: set[tuple[str, int, int]] = set()
        for a in row:
            for c in a.subs or (a,):
                if c.kind in COMMS:
                    _check_comm(doc, sched, r, c, done, posted, sent)
                elif c.kind in COMPUTE:
                    _check_input(doc, r, c, posted)
                    out = _opcode(c.kind).sends
                    if out is not None:
                        done[_message(BY_NAME[out], c.mb, c.stage)] = (c, BY_NAME[out])
        for key in sorted(done, key=lambda k: (-MESSAGES.index(k[0]), k[1], k[2])):  # gradients first, as ever
            msg, i, s = key
            cell, send = done[key]
            other = s + send.peer_stage
            if 0 <= other < S and placement[other] != r and key not in sent:
                raise error(
                    "E608",
                    f"`{cell}` on rank {r} has no `{s}{torch_name(send.name, doc.split)}{i}` after it: rank "
                    f"{placement[other]} never gets its {MESSAGE_NOUNS[MESSAGES.index(msg)]}",
                    cell.span,
                    doc.source,
                )
    prog, where = _program(doc, sched)
    _check_order(doc, where)
    run = dry_run(prog)
    if not run.completed:
        notes = []
        for w in run.waits:
            a = where[w.rank][w.index]
            notes.append(w.describe(f"`{a}` ({a.span.line}:{a.span.col})"))
        first = where[run.waits[0].rank][run.waits[0].index]
        raise error(
            "E609",
            "the CSV's sends and receives can deadlock when a send blocks until its receive is posted (as NCCL may)",
            first.span,
            doc.source,
            tuple(notes),
        )


def _check_comm(doc: TorchCsv, sched: Schedule, r: int, c: Action, done, posted, sent) -> None:
    S, M, placement = doc.num_stages, sched.num_microbatches, doc.placement
    op = _opcode(c.kind)
    send = op.side == "send"
    other = c.stage + op.peer_stage  # the peer stage
    bad = None
    if c.stage >= S or c.mb >= M:
        bad = f"stage {c.stage} or micro-batch {c.mb} is out of range (stages 0..{S - 1}, micro-batches 0..{M - 1})"
    elif placement[c.stage] != r:
        bad = f"stage {c.stage} is on rank {placement[c.stage]}, not rank {r}"
    elif not 0 <= other < S:
        bad = f"stage {c.stage} has no {'next' if other > c.stage else 'previous'} stage to exchange with"
    elif placement[other] == r:
        bad = f"stages {c.stage} and {other} are both on rank {r}: torch hands the tensor over locally"
    if bad:
        raise error("E608", f"`{c}` on rank {r}: {bad}", c.span, doc.source)
    key = _message(op, c.mb, c.stage)
    mine = sent if send else posted
    if key in mine:
        raise error("E608", f"`{c}` appears twice on rank {r}", c.span, doc.source)
    if send and key not in done:
        producer = next(o for o in BY_NAME.values() if o.sends == op.name)
        names = [k for k, o in OPCODE_OF.items() if o == producer.name]  # torch's I, or its full backward B
        what = f"`{c.stage}{names[0]}{c.mb}`" + "".join(f" (or `{c.stage}{k}{c.mb}`)" for k in names[1:])
        raise error("E608", f"`{c}` on rank {r} comes before {what}, which computes it", c.span, doc.source)
    mine.add(key)


def _check_input(doc: TorchCsv, r: int, c: Action, posted) -> None:
    S, placement = doc.num_stages, doc.placement
    needs = _opcode(c.kind).needs
    if needs is None:  # W: its input is on its own rank
        return
    msg, offset = needs
    other = c.stage + offset
    if not 0 <= other < S or placement[other] == r:
        return
    if (msg, c.mb, other) not in posted:
        recv = next(o for o in BY_NAME.values() if o.side == "recv" and (o.message, o.key_stage) == needs)
        raise error(
            "E608",
            f"`{c}` on rank {r} needs `{c.stage}{torch_name(recv.name, doc.split)}{c.mb}` before it",
            c.span,
            doc.source,
        )


def _program(doc: TorchCsv, sched: Schedule):
    """The file as a pipec Program, and per rank the action behind each instruction."""
    from pipec.ir.program import Instr, Program, RankProgram

    placement = doc.placement
    ranks, where = [], []
    for r, row in enumerate(doc.rows):
        instrs: list[Instr] = []
        acts: list[Action] = []
        for a in row:
            if a.kind in NO_MB:
                continue  # FSDP and gradient reduction: local, nothing to wait for
            if a.kind in COMMS:
                op = _opcode(a.kind)
                instrs.append(Instr(op.name, a.mb, a.stage, placement[a.stage + op.peer_stage]))
                acts.append(a)
                continue
            subs = a.subs or (a,)
            full = []
            for j, c in enumerate(subs):
                instrs.append(Instr(OPCODE_OF[c.kind], c.mb, c.stage, -1, bool(a.subs) and j == 0))
                acts.append(c)
                if c.kind == "B" and doc.split:
                    full.append(c)
            for c in full:
                instrs.append(Instr("WGRAD", c.mb, c.stage))
                acts.append(c)
        # Each stage's gradient reduction and optimizer step close its stream, as lowering writes them
        # (a Program has them once per stage); local, so they change no wait.
        for s in (s for s, q in enumerate(placement) if q == r):
            instrs += [Instr("REDUCE_GRAD", -1, s), Instr("STEP", -1, s)]
        ranks.append(RankProgram.from_instructions(instrs))
        where.append(acts)
    prog = Program(
        name=sched.name,
        params=sched.params,
        num_stages=doc.num_stages,
        num_ranks=len(doc.rows),
        num_microbatches=sched.num_microbatches,
        split_backward=doc.split,
        placement=doc.placement,
        ranks=tuple(ranks),
    )
    return prog, where


def _check_order(doc: TorchCsv, where: list[list[Action]]) -> None:
    """Both ends of every rank pair issue their messages to each other in one order (E404)."""
    seqs: dict[tuple[int, int], list[tuple[tuple[str, int, int], bool, Action]]] = {}
    for r, acts in enumerate(where):
        for a in acts:
            if a.kind not in COMMS:
                continue
            op = _opcode(a.kind)
            q = doc.placement[a.stage + op.peer_stage]
            seqs.setdefault((r, q), []).append((_message(op, a.mb, a.stage), op.side == "send", a))
    for (a, b), mine in seqs.items():
        if a > b:
            continue
        theirs = seqs.get((b, a), [])
        for k in range(max(len(mine), len(theirs))):
            x = mine[k] if k < len(mine) else None
            y = theirs[k] if k < len(theirs) else None
            if x and y and x[0] == y[0] and x[1] != y[1]:
                continue
            at = x or y
            assert at is not None
            notes = (
                f"rank {a}'s message {k} with rank {b} is " + (f"`{x[2]}` ({_pos(x[2])})" if x else "missing"),
                f"rank {b}'s message {k} with rank {a} is " + (f"`{y[2]}` ({_pos(y[2])})" if y else "missing"),
            )
            raise error(
                "E404",
                f"ranks {a} and {b} issue their messages to each other in different orders; NCCL would hang",
                at[2].span,
                doc.source,
                notes,
            )


def _pos(a: Action) -> str:
    return f"line {a.span.line}, column {a.span.col}"


def to_pipe(sched: Schedule, origin: str | None = None) -> str:
    """A `.pipe` file with this schedule's explicit per-rank orders; repeated patterns become loops.
    Evaluating it gives the same Schedule (orders, pairs, placement, kinds)."""
    R, M = sched.num_ranks, sched.num_microbatches
    head = []
    if origin is not None:
        head += [
            f"# Imported by `pipec import` from the torch.distributed.pipelining schedule CSV `{origin}`",
            f"# (torch {TORCH_VERSION} action format): row r of the CSV is rank r's order below.",
            "# torch's F is F; I (input gradient) is B and W is W (split backward); a full backward B is B,",
            "# or B then W in a split schedule; (F;B)OVERLAP_F_B is the overlapped pair `F & B`.",
        ]
    why = f"this schedule has fixed sizes: p = {R} ranks, m = {M} micro-batches"
    head += schedule_head(sched.name, R, M, why, sched.placement, sched.kinds)
    bodies = []
    for r in range(R):
        own = sched.stages_of(r)
        multi = len(own) != 1 or bool((sched.ranks[r].stage != own[0]).any())  # else `stage:` goes without saying
        bodies.append(rank_lines(schedule_steps(sched, r), multi))
    return "\n".join(head + rank_block(bodies) + ["}", ""])
