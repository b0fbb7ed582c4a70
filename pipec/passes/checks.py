"""Checks on an evaluated Schedule: ownership, exactly-once, same-rank dependency order, and the memory ops.

The dependency rule (and the slice rules) is `pipec.ir.rules`'s; E304 holds it on each rank's order.

Vectorised with numpy over all ops at once (schedules reach a million ops);
each failure becomes a diagnostic at the statement that emitted the op.

The memory ops (`Schedule.memops`: RECOMPUTE, OFFLOAD, RELOAD) are checked here too, after the ops, not in
the front end as the collectives' stages are: whether a memory op is in order depends on where its F and B
are in the rank's whole order, which is only defined once every op is known to occur exactly once on its
owner, and a Schedule from `pipec import` or `pipec synth` must pass the same rules as one from the
language. So all of a memory op's rules (its stage and micro-batch, its order, its pairing) live in one
place, `_check_memops`.
"""

from __future__ import annotations

import numpy as np

from pipec.errors import PipecError, Span, error
from pipec.ir.rules import dependencies
from pipec.ir.schedule import MemOp, Schedule


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


def _op(sched: Schedule, k: int, i: int, s: int) -> str:
    """The op as a diagnostic names it: `F(3, stage 1)`, or `F(1, slice 0, stage 1)` when sliced."""
    return sched.op_text(sched.kinds[k], int(i), int(s))


def check_schedule(sched: Schedule) -> None:
    """Raise the first error found; return None when every op occurs once, on its owner, in order."""
    S, m, K = sched.num_stages, sched.num_microbatches, len(sched.kinds)
    kind, mb, stage, sid, rank, gpos = _flat(sched)
    placement = sched.placement_array

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
    _check_pairs(sched, kind, mb, stage, sid, rank)
    if sched.memops:
        _check_memops(sched, sid, key)


def _check_order(sched: Schedule, kind, mb, stage, sid, rank, gpos, key) -> None:
    S, m = sched.num_stages, sched.num_microbatches
    where = np.empty(len(sched.kinds) * S * m, dtype=np.int64)
    where[key] = np.arange(len(key))
    n = sched.slicing.slices if sched.slicing else 1
    for rule, dk, dmb, dst, valid in dependencies(kind, mb, stage, S, sched.split_backward, n, sched.graph):
        idx = np.flatnonzero(valid)
        dep = where[(dk[idx] * S + dst[idx]) * m + dmb[idx]]
        bad = idx[(rank[dep] == rank[idx]) & (gpos[dep] >= gpos[idx])]
        if len(bad):
            j = int(bad[0])
            d = int(where[(dk[j] * S + dst[j]) * m + dmb[j]])
            op, needed = _op(sched, kind[j], mb[j], stage[j]), _op(sched, kind[d], mb[d], stage[d])
            together = gpos[d] == gpos[j]
            why = "is overlapped with it" if together else f"comes later (line {sched.spans[sid[d]].line})"
            notes = (rule.why.format(j=int(mb[j] % n), p=int(mb[d] % n)),) if rule.why else ()
            if together:  # at the pair's `&`
                pair = sorted((int(d), j))
                span = _amp(sched, int(sid[pair[0]]), int(sid[pair[1]]))
                raise error("E304", f"{op} on rank {rank[j]} needs {needed}, which {why}", span, sched.source, notes)
            raise _at(
                sched,
                "E304",
                f"{op} on rank {rank[j]} needs {needed}, which {why}",
                sid[j],
                notes,
            )


def _check_pairs(sched: Schedule, kind, mb, stage, sid, rank) -> None:
    """E304 at the `&` of an overlapped pair whose second op needs the first (or the first the second) through
    other stages: both run at once (the executor interleaves their compute segments, pipec.ir.experts), so
    neither may wait for the other's output however far it travels. Along one micro-batch the ops form a
    chain, F(0) .. F(S-1), B(S-1) .. B(0), each W after its B: an op needs every op before it in that chain
    but a W (nothing needs a W). The same-rank direct case is `_check_order`'s; this finds the rest (a V
    placement's F(i, stage r) & B(i, stage 2p-1-r): the backward needs the forward through the other ranks)."""
    paired = np.concatenate([r.paired for r in sched.ranks]) if sched.ranks else np.zeros(0, bool)
    a = np.flatnonzero(paired[:-1] & (rank[:-1] == rank[1:]))
    if not len(a):
        return
    b = a + 1
    S = sched.num_stages
    name = np.array([{"F": 0, "B": 1, "W": 2}[k] for k in sched.kinds])
    pos = np.where(name[kind] == 0, 2 * stage, 2 * (2 * S - 1 - stage) + (name[kind] == 2))
    w = name[kind] == 2
    same = mb[a] == mb[b]
    if sched.graph is None:
        b_needs_a = same & ~w[a] & (pos[a] < pos[b])
        a_needs_b = same & ~w[b] & (pos[b] < pos[a])
    else:  # a graph: not every op before another in the chain's order is needed by it (parallel branches)
        g = sched.graph

        def needs(x: int, y: int) -> bool:  # op x needs op y through other stages (same micro-batch)
            kx, ky, sx, sy = int(name[kind[x]]), int(name[kind[y]]), int(stage[x]), int(stage[y])
            if ky == 2 or (kx == 0 and ky != 0):
                return False  # nothing needs a W; a forward needs no backward
            if kx == 0:
                return g.reaches(sy, sx)
            return ky == 0 or (sx == sy and kx == 2) or g.reaches(sx, sy)

        b_needs_a = same & np.array([needs(int(y), int(x)) for x, y in zip(a, b)], dtype=bool)
        a_needs_b = same & np.array([needs(int(x), int(y)) for x, y in zip(a, b)], dtype=bool)
    bad = np.flatnonzero(b_needs_a | a_needs_b)
    if not len(bad):
        return
    x, y = int(a[bad[0]]), int(b[bad[0]])
    if a_needs_b[bad[0]]:
        x, y = y, x
    op, needed = _op(sched, kind[y], mb[y], stage[y]), _op(sched, kind[x], mb[x], stage[x])
    raise error(
        "E304",
        f"{op} on rank {rank[y]} needs {needed}, which is overlapped with it (`&`), through the stages between",
        _amp(sched, int(sid[a[bad[0]]]), int(sid[b[bad[0]]])),
        sched.source,
        ("the two ops of an overlapped pair run at once: neither may need the other's output",),
    )


def _amp(sched: Schedule, first: int, second: int):
    """The span of the `&` between a pair's two ops when both sit on one line, else the second op's."""
    if not sched.spans:
        return None
    sa, sb = sched.spans[first], sched.spans[second]
    if sched.source is not None and sa.end_line == sb.line:
        text = sched.source.line(sb.line)
        c = text.find("&", sa.end_col - 1, sb.col - 1)
        if c >= 0:
            return Span(sb.line, c + 1, sb.line, c + 2)
    return sb


def _mem_at(sched: Schedule, code: str, message: str, x: MemOp, notes: tuple[str, ...] = ()) -> PipecError:
    return error(code, message, x.span, sched.source, notes)


def _check_memops(sched: Schedule, sid, key) -> None:
    """The rules of pipec.ir.schedule.MemOp, per rank in its order: each memory op on a stage of its rank
    (E308 when the stage goes without saying on a rank of several, E208, E301) and a micro-batch that
    exists (E209), at most once per (op, mb, stage) (E311); then an OFFLOAD with its RELOAD and vice versa
    (E311), a RECOMPUTE or OFFLOAD after its F and at or before its B (`before` in F's index + 1 .. B's
    index), a RELOAD after its OFFLOAD and before its B, and where the forward is both recomputed and
    offloaded, the RELOAD before the RECOMPUTE, which runs from the input the offload moved (E310).

    Vectorised per rank (a schedule recomputing every forward has half as many memory ops as ops); the
    first memory op of the rank, in its order, that breaks the first group's rules is reported, else the
    first that breaks the second's."""
    S, m = sched.num_stages, sched.num_microbatches
    where = np.empty(len(sched.kinds) * S * m, dtype=np.int64)
    where[key] = np.arange(len(key))  # every op once (checked above): its index into the flat arrays
    offset = np.cumsum([0] + [len(r) for r in sched.ranks])
    for r, row in enumerate(sched.memops):
        if row:
            _check_rank_memops(sched, r, row, where, int(offset[r]), sid)


_MEMOP_CODE = {"RECOMPUTE": 0, "OFFLOAD": 1, "RELOAD": 2}


def _check_rank_memops(sched: Schedule, r: int, row: tuple[MemOp, ...], where, base: int, sid) -> None:
    """`_check_memops` for rank r: `where[(kind * S + stage) * m + mb] - base` is the index of F (kind 0) or
    B (kind 1) in the rank's order, `sid[base + j]` the statement id of the rank's op j."""
    S, m = sched.num_stages, sched.num_microbatches
    own = sched.stages_of(r)
    RC, OFF, REL = 0, 1, 2

    def fail(code: str, message: str, j: int, notes: tuple[str, ...] = ()) -> PipecError:
        return _mem_at(sched, code, message, row[j], notes)

    def at_line(op: str, index: int) -> tuple[str, ...]:
        return (f"{op} is emitted at line {sched.spans[sid[base + index]].line}",) if sched.spans else ()

    n = len(row)
    op = np.fromiter((_MEMOP_CODE[x.op] for x in row), np.int64, n)
    # Clipped as Python ints first: a stage or micro-batch beyond int64 is out of range, not an overflow.
    stage = np.fromiter((x.stage if -1 <= x.stage < S else S for x in row), np.int64, n)
    mb = np.fromiter((x.mb if 0 <= x.mb < m else m for x in row), np.int64, n)
    before = np.fromiter((x.before for x in row), np.int64, n)
    valid = (stage >= 0) & (stage < S) & (mb < m)
    st, i = np.clip(stage, 0, S - 1), np.clip(mb, 0, m - 1)
    owner = sched.placement_array[st]
    k = (op * S + st) * m + i
    order = np.argsort(k, kind="stable")
    ks = k[order]
    dup = np.zeros(n, dtype=bool)
    dup[order[1:][ks[1:] == ks[:-1]]] = True
    bad = ~valid | (owner != r) | dup
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        x = row[j]
        if x.stage == -1:
            raise fail("E308", f"rank {r} owns stages {list(own)}: say which, e.g. `{x.op}(i, stage: s)`", j)
        if not 0 <= x.stage < S:
            raise fail("E208", f"stage {x.stage} is out of range 0..{S - 1}", j)
        if not 0 <= x.mb < m:
            raise fail("E209", f"micro-batch {x.mb} is out of range 0..{m - 1}", j)
        if owner[j] != r:
            raise fail(
                "E301",
                f"{x.op}({x.mb}, stage {x.stage}) placed on rank {r}, but stage {x.stage} is placed on rank {owner[j]}",
                j,
                (f"rank {r} owns stage{'s' if len(own) != 1 else ''} {', '.join(map(str, own)) or 'none'}",),
            )
        first = row[int(order[np.searchsorted(ks, k[j])])]
        line = f" (first at line {first.span.line})" if first.span is not None else ""
        raise fail("E311", f"{x.op}({x.mb}, stage {x.stage}) placed twice on rank {r}{line}", j)

    def position(kind: int) -> np.ndarray:
        """Per memory op, where (in the rank's memory ops) the `kind` one of its (mb, stage) is; -1: none."""
        want = (kind * S + st) * m + i
        at = np.minimum(np.searchsorted(ks, want), n - 1)
        return np.where(ks[at] == want, order[at], -1)

    f, b = where[st * m + i] - base, where[(S + st) * m + i] - base
    off, rel, rc = position(OFF), position(REL), position(RC)
    nth = np.arange(n)
    unpaired = ((op == OFF) & (rel < 0)) | ((op == REL) & (off < 0))
    early = ((op == RC) | (op == OFF)) & (before <= f)
    reload_early = (op == REL) & (off > nth)
    late = before > b
    after_rc = (op == REL) & (rc >= 0) & (rc < nth)
    bad = unpaired | early | reload_early | late | after_rc
    if not bad.any():
        return
    j = int(np.flatnonzero(bad)[0])
    x = row[j]
    fwd, bwd = f"F({x.mb}, stage {x.stage})", f"B({x.mb}, stage {x.stage})"
    what = f"{x.op}({x.mb}, stage {x.stage}) on rank {r}"
    if unpaired[j] and x.op == "OFFLOAD":
        raise fail("E311", f"{what} has no RELOAD: {bwd} would find its activations on the host", j)
    if unpaired[j]:
        raise fail("E311", f"{what} has no OFFLOAD before it: there is nothing to bring back", j)
    if early[j]:
        raise fail("E310", f"{what} comes before {fwd}: it acts on what the forward keeps", j, at_line(fwd, f[j]))
    if reload_early[j]:
        span = row[int(off[j])].span
        raise fail("E310", f"{what} comes before its OFFLOAD" + (f" (line {span.line})" if span else ""), j)
    if late[j]:
        raise fail("E310", f"{what} comes after {bwd}, which needs it done", j, at_line(bwd, b[j]))
    raise fail(
        "E310",
        f"{what} comes after RECOMPUTE({x.mb}, stage {x.stage}), which runs from the input the OFFLOAD "
        "moved to the host",
        j,
        ("reload it before the recompute",),
    )
