"""A rank block's `window` and `any` statements, recorded as its ops are emitted, to a RankFamily.

The generated code calls `_window(k, prefer, sid)`, `_any_open(sid)` and `_any_close()` (pipec.frontend.codegen);
`FamilyRecorder` notes where each `any` group begins and ends in the rank's ops and the window, and
`finish` turns that into the rank's segments (pipec.ir.family), with the language's errors: E218 for a
window that is not a whole number of ops between 1 and the rank's stream, or given twice; E219 for what a
family cannot reorder yet (an overlapped pair, a memory op or a collective on the rank).
"""

from __future__ import annotations

from pipec.frontend.shape import Fail
from pipec.ir.family import OrderFamily, RankFamily
from pipec.ir.schedule import RankOps


class FamilyRecorder:
    """What one rank block said about its order family, by op index."""

    def __init__(self, ops: list) -> None:
        self.ops = ops  # the rank's op list as it is emitted (the generated code's `_ops`)
        self.window: tuple[int, str, int] | None = None  # (k, prefer, sid)
        self.groups: list[tuple[int, int, int]] = []  # (first op, one past the last, sid)
        self.open: tuple[int, int] | None = None
        self.sid: int | None = None  # the statement the family's diagnostics point at

    def bind(self, ns: dict) -> None:
        ns["_window"] = self.set_window
        ns["_any_open"] = self.any_open
        ns["_any_close"] = self.any_close

    def set_window(self, k, prefer: str, sid: int) -> None:
        if self.window is not None:
            raise Fail("E218", "`window` given twice for this rank", sid)
        self.window = (k, prefer, sid)

    def any_open(self, sid: int) -> None:
        self.open = (len(self.ops), sid)

    def any_close(self) -> None:
        assert self.open is not None
        lo, sid = self.open
        self.open = None
        if len(self.ops) - lo > 1:
            self.groups.append((lo, len(self.ops), sid))

    def finish(self, rank: int, ops: RankOps, memops: bool, collectives: bool) -> RankFamily | None:
        """The rank's family (None when it said neither `window` nor `any`)."""
        if self.window is None and not self.groups:
            return None
        n = len(ops)
        k, prefer, sid = self.window if self.window is not None else (1, "order", self.groups[0][2])
        if self.window is not None:
            if not 1 <= k <= max(n, 1):
                what = "at least 1" if k < 1 else f"at most rank {rank}'s stream of {n} ops"
                raise Fail(
                    "E218",
                    f"`window {k}` on rank {rank}: a window counts ops and must be {what}",
                    sid,
                    ("`window 1` is the static order; `window n` lets a rank of n ops run them in any order",),
                )
        segments: list[tuple[int, int, int]] = []
        at = 0
        for lo, hi, _ in self.groups:
            if lo > at:
                segments.append((at, lo, k))
            segments.append((lo, hi, hi - lo))
            at = hi
        if at < n or not segments:
            segments.append((at, n, k))
        fam = RankFamily(tuple(segments), prefer, None)
        if fam.is_static:
            return None
        self.sid = sid
        why = _cannot_reorder(ops, memops, collectives)
        if why:
            where = sid if self.window is not None else self.groups[0][2]
            raise Fail("E219", f"rank {rank} {why}: its order cannot be chosen at run time yet", where)
        return fam


def _cannot_reorder(ops: RankOps, memops: bool, collectives: bool) -> str:
    if bool(ops.paired.any()):
        return "runs overlapped pairs (`a & b`)"
    if memops:
        return "places memory ops"
    if collectives:
        return "places its own collectives"
    return ""


def family_of(families: list[RankFamily | None], spans: dict[int, object]) -> OrderFamily | None:
    """The schedule's family from its ranks' (None when every rank is static); `spans[r]` is where rank r's
    family was said, for the proof's diagnostics."""
    if all(f is None for f in families):
        return None
    out = []
    for r, f in enumerate(families):
        out.append(None if f is None else RankFamily(f.segments, f.prefer, spans.get(r)))
    return OrderFamily(tuple(out))
