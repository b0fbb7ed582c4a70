"""The order family's field of a version 3 Program file (`pipec.formats.program_file`; docs/program.md): the
family (`pipec.ir.family.OrderFamily`) as one JSON object, written in the JSON form's head and on the text
form's `family` line alike, so that torchrun's workers, which read the Program file, get the family with it
(no `family.json` beside it).

The object: `num_ranks` (the Program's), `ranks` (per rank that reorders, by its number as a string: its
`segments`, rows [lo, hi, k] covering its compute ops in order, and its `prefer`, one of
`pipec.ir.family.PREFER`) and `nccl` (why NCCL cannot run it, or null). `from_doc` reads it back with every
value's type and range checked (ValueError, which the Program readers turn into E501 at the field). `prove`
then re-proves it on the Program (E502): each family covers exactly its rank's compute ops, and a family
that reorders a channel is not marked runnable on NCCL (`nccl` null), since NCCL matches a channel by
issue order and a run would hang (`pipec.passes.family.nccl_reason`, the compiler's channel proof). Its
deadlock freedom for an executor that runs only ready ops is the static order's (pipec.passes.family's
module docstring), which every reader of a Program proves (the dry run). Its worst-case memory is the
compiler's (E430): a Program holds no limits to check it against.
"""

from __future__ import annotations

from dataclasses import replace

from pipec.errors import Source, Span, error
from pipec.ir.family import PREFER, OrderFamily, RankFamily
from pipec.ir.opcodes import IS_COMPUTE
from pipec.ir.program import Program, schedule_of

PLAN_VERSION = 3  # program_file.PLAN_VERSION: the version that may carry a family
_MAX = 10_000_000  # program_file.MAX_SIZE


def written(prog: Program) -> bool:
    """Whether the Program's file carries a family: one that reorders some rank (a static one is none)."""
    return prog.family is not None and not prog.family.is_static


def to_doc(family: OrderFamily, num_ranks: int) -> dict:
    """The family as the file's `family` object (what `OrderFamily.describe()` gives, with the rank count
    and the NCCL reason)."""
    return {"num_ranks": num_ranks, "ranks": family.describe(), "nccl": family.nccl}


def _int(x: object, what: str, lo: int, hi: int = _MAX) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi:
        raise ValueError(f"order family: {what} must be an integer from {lo} to {hi:,}, got {str(x)[:40]}")
    return x


def _rank(r: int, entry: object) -> RankFamily:
    if not isinstance(entry, dict) or set(entry) != {"segments", "prefer"}:
        raise ValueError(f"order family, rank {r}: expected segments and prefer")
    if entry["prefer"] not in PREFER:
        raise ValueError(
            f"order family, rank {r}: prefer must be one of {', '.join(PREFER)}, got {str(entry['prefer'])[:40]!r}"
        )
    rows = entry["segments"]
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"order family, rank {r}: segments must be a non-empty list of [lo, hi, k] rows")
    segments, at = [], 0
    for row in rows:
        if not isinstance(row, list) or len(row) != 3:
            raise ValueError(f"order family, rank {r}: a segment must be a row [lo, hi, k]")
        lo, hi = _int(row[0], "a segment's lo", 0), _int(row[1], "a segment's hi", 1)
        k = _int(row[2], "a segment's window k", 1)
        if lo != at or hi <= lo:
            raise ValueError(
                f"order family, rank {r}: segments must cover its ops in order, each from where the last ended; "
                f"[{lo}, {hi}] after {at}"
            )
        segments.append((lo, hi, k))
        at = hi
    return RankFamily(tuple(segments), entry["prefer"])


def from_doc(version: int, doc: object, num_ranks: int) -> OrderFamily | None:
    """The file's `family` object back as an OrderFamily (None when the file has none); ValueError when
    malformed, or when a version other than 3 carries one."""
    if doc is None:
        return None
    if version != PLAN_VERSION:
        raise ValueError(f"`family` (an order family) needs format version {PLAN_VERSION}, not {version}")
    if not isinstance(doc, dict) or set(doc) != {"num_ranks", "ranks", "nccl"}:
        raise ValueError("`family` must hold num_ranks, ranks and nccl")
    if doc["num_ranks"] != num_ranks:
        raise ValueError(f"`family` is for {str(doc['num_ranks'])[:20]} ranks; the Program has {num_ranks}")
    nccl, ranks = doc["nccl"], doc["ranks"]
    if nccl is not None and (not isinstance(nccl, str) or len(nccl) > 2000):
        raise ValueError("`family`'s nccl must be null or a reason (a string)")
    if not isinstance(ranks, dict) or not all(isinstance(k, str) and k.isdigit() and int(k) < num_ranks for k in ranks):
        raise ValueError(f"`family`'s ranks must be an object keyed by rank numbers 0 to {num_ranks - 1}")
    return OrderFamily(tuple(_rank(r, ranks[str(r)]) if str(r) in ranks else None for r in range(num_ranks)), nccl)


def _span(source: Source) -> Span | None:
    """The text form's `family` line (the JSON form is one document: no line to point at)."""
    for n, line in enumerate(source.text.split("\n"), 1):
        if line.strip().startswith("family "):
            return Span(n, 1, n, len(line.rstrip("\r")) + 1)
    return None


def prove(prog: Program, source: Source) -> None:
    """The family read from a file holds for its Program, or E502 at its field (the module docstring)."""
    if prog.family is None:
        return
    for r, rp in enumerate(prog.ranks):
        fam = prog.family.of(r)
        n = int(IS_COMPUTE[rp.op].sum())
        if fam is not None and fam.num_ops != n:
            raise error(
                "E502",
                f"rank {r}'s order family covers {fam.num_ops} ops, but the rank has {n} computes: the family is "
                "not this Program's",
                _span(source),
                source,
            )
    why = None
    if prog.family.nccl is None:
        from pipec.passes.family import nccl_reason

        why = nccl_reason(replace(schedule_of(prog, source), family=prog.family))
    if why is not None:
        raise error(
            "E502",
            f"the order family says NCCL can run it (`nccl` null), but {why}",
            _span(source),
            source,
            ("a run on NCCL would hang; the compiler records this reason (pipec compile the schedule again)",),
        )
