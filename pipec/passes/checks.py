"""Checks on an evaluated Schedule: ownership, exactly-once, same-rank dependency order.

Vectorised with numpy over all ops at once (schedules reach a million ops);
each failure becomes a diagnostic at the statement that emitted the op.
"""

from __future__ import annotations

import numpy as np

from pipec.errors import PipecError, error
from pipec.schedule import Op, Schedule


def _flat(sched: Schedule):
    ranks = sched.ranks
    kind = np.concatenate([r.kind for r in ranks]) if ranks else np.zeros(0, np.int64)
    mb = np.concatenate([r.mb for r in ranks])
    stage = np.concatenate([r.stage for r in ranks])
    sid = np.concatenate([r.sid for r in ranks])
    rank = np.concatenate([np.full(len(r), i, dtype=np.int64) for i, r in enumerate(ranks)])
    pos = np.concatenate([np.arange(len(r), dtype=np.int64) for r in ranks])
    # Ops of an overlapped pair share one position: neither may depend on the other.
    paired = np.concatenate([r.paired for r in ranks])
    second = np.zeros_like(paired)
    second[1:] = paired[:-1]
    return kind, mb, stage, sid, rank, pos - second.astype(np.int64)


def _at(sched: Schedule, code: str, message: str, sid: int, notes: tuple[str, ...] = ()) -> PipecError:
    return error(code, message, sched.spans[sid] if sched.spans else None, sched.source, notes)


def _op(sched: Schedule, k: int, i: int, s: int) -> Op:
    return Op(sched.kinds[k], int(i), int(s))


def check_schedule(sched: Schedule) -> None:
    """Raise the first error found; return None when every op occurs once, on its owner, in order."""
    S, m, K = sched.num_stages, sched.num_microbatches, len(sched.kinds)
    kind, mb, stage, sid, rank, gpos = _flat(sched)
    placement = np.asarray(sched.placement, dtype=np.int64)

    bad = np.flatnonzero(stage == -1)
    if len(bad):
        j = bad[0]
        r = int(rank[j])
        raise _at(
            sched,
            "E308",
            f"rank {r} owns stages {list(sched.stages_of(r))}: say which, e.g. `{sched.kinds[kind[j]]}(i, stage: s)`",
            sid[j],
        )
    bad = np.flatnonzero((stage < 0) | (stage >= S))
    if len(bad):
        j = bad[0]
        raise _at(sched, "E208", f"stage {stage[j]} is out of range 0..{S - 1}", sid[j])
    bad = np.flatnonzero((mb < 0) | (mb >= m))
    if len(bad):
        j = bad[0]
        raise _at(sched, "E209", f"micro-batch {mb[j]} is out of range 0..{m - 1}", sid[j])
    bad = np.flatnonzero(placement[stage] != rank)
    if len(bad):
        j = bad[0]
        op = _op(sched, kind[j], mb[j], stage[j])
        raise _at(
            sched,
            "E301",
            f"{op} emitted on rank {rank[j]}, but stage {stage[j]} is placed on rank {placement[stage[j]]}",
            sid[j],
        )

    key = (kind * S + stage) * m + mb
    counts = np.bincount(key, minlength=K * S * m)
    if (counts > 1).any():
        order = np.argsort(key, kind="stable")
        dup = np.flatnonzero(key[order][1:] == key[order][:-1])[0]
        first, j = order[dup], order[dup + 1]
        op = _op(sched, kind[j], mb[j], stage[j])
        line = sched.spans[sid[first]].line
        raise _at(sched, "E302", f"{op} emitted twice on rank {rank[j]} (first at line {line})", sid[j])
    if sched.split_backward and K == 3 and not (kind == 2).any():
        span_sid = None
        raise error(
            "E307",
            "the schedule declares split backward (`ops F, B, W`) but emits no W",
            sched.decl_spans.get("rank") if span_sid is None else None,
            sched.source,
            ("emit W(i) after B(i) for every micro-batch, or declare `ops F, B`",),
        )
    missing = np.flatnonzero(counts == 0)
    if len(missing):
        x = int(missing[0])
        k, rest = divmod(x, S * m)
        s, i = divmod(rest, m)
        op = _op(sched, k, i, s)
        owner = sched.placement[s]
        n = len(missing)
        more = (f"{n - 1} more op(s) missing",) if n > 1 else ()
        raise error(
            "E303",
            f"{op} is never emitted; stage {s} is placed on rank {owner}",
            sched.decl_spans.get("rank"),
            sched.source,
            more,
        )
    _check_order(sched, kind, mb, stage, sid, rank, gpos, key)


def dependencies(kind: np.ndarray, mb: np.ndarray, stage: np.ndarray, S: int, split: bool):
    """For each op, the keys (as (kind, mb, stage) arrays) of ops it needs, with a validity mask.

    F(i,s) needs F(i,s-1); B(i,s) needs F(i,s) and B(i,s+1); W(i,s) needs B(i,s).
    """
    deps = []
    is_f, is_b, is_w = kind == 0, kind == 1, kind == 2
    deps.append((np.zeros_like(kind), mb, stage - 1, is_f & (stage > 0)))
    deps.append((np.zeros_like(kind), mb, stage, is_b))
    deps.append((np.ones_like(kind), mb, stage + 1, is_b & (stage < S - 1)))
    if split:
        deps.append((np.ones_like(kind), mb, stage, is_w))
    return deps


def _check_order(sched: Schedule, kind, mb, stage, sid, rank, gpos, key) -> None:
    S, m = sched.num_stages, sched.num_microbatches
    where = np.empty(len(sched.kinds) * S * m, dtype=np.int64)
    where[key] = np.arange(len(key))
    for dk, dmb, dst, valid in dependencies(kind, mb, stage, S, sched.split_backward):
        idx = np.flatnonzero(valid)
        dep = where[(dk[idx] * S + dst[idx]) * m + dmb[idx]]
        bad = idx[(rank[dep] == rank[idx]) & (gpos[dep] >= gpos[idx])]
        if len(bad):
            j = int(bad[0])
            d = int(where[(dk[j] * S + dst[j]) * m + dmb[j]])
            op, needed = _op(sched, kind[j], mb[j], stage[j]), _op(sched, kind[d], mb[d], stage[d])
            together = gpos[d] == gpos[j]
            why = "is overlapped with it" if together else f"comes later (line {sched.spans[sid[d]].line})"
            raise _at(
                sched,
                "E304",
                f"{op} on rank {rank[j]} needs {needed}, which {why}",
                sid[j],
            )
