"""`validate(program)`: the structural rules every consumer of a Program relies on, checked once.

A Program may come from the lowering, from a file someone edited, or from an
importer. Readers, the dry run and the executor all call this before they
trust it, so each can assume what it says: every instruction is a known
opcode with the operands the instruction table gives it, on a stage its rank
owns, naming the peer that owns the other end; groups are the ones the table
allows (at most `GROUP_MAX` long); every compute op happens exactly once; every
message the placement needs is sent once and received once; and each stage
reduces its gradients once and then steps its optimizer once, after its last
compute. Data parallelism: `dp` is a positive integer and `dp_kind` "ddp" or
"fsdp"; ddp has no UNSHARD/RESHARD; a forward-only Program (an evaluation pass) has FWDs and activation
messages only, and no REDUCE_GRAD or STEP; under fsdp each stage's UNSHARDs and
RESHARDs alternate, starting with UNSHARD and ending with RESHARD (at least one
window per owned stage), every compute of the stage (RECOMPUTE too) lies inside
one of its windows, and its STEP comes after its last RESHARD. Memory ops
(RECOMPUTE, OFFLOAD, RELOAD; `_memops`): at most one of each per micro-batch
and stage, a RECOMPUTE and an OFFLOAD after the FWD of their micro-batch and
stage, a RELOAD after its OFFLOAD, both before the BWD, every OFFLOAD reloaded.
What it leaves to the dry
run is order: whether the ranks can run these instructions without a deadlock.

That every replica of a data-parallel group issues the same collectives in the
same order needs no rule here: the replicas of a pipeline rank all run that
rank's one Program (docs/program.md, "Data parallelism"); nor that the ranks of an
expert group issue their all-to-alls in one order, for the same reason (they are
replicas of one pipeline rank); experts: `moe_layers` is empty or one count per
stage, and the expert group divides `dp` (pipec.ir.experts).

Vectorised per rank (a Program reaches millions of instructions). A failure
is one E502 diagnostic naming the first problems by rank and instruction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from pipec.errors import PipecError, Source, Span, brief, error
from pipec.ir.dataparallel import KINDS as DP_KINDS
from pipec.ir.dataparallel import MAX_SIZE as DP_MAX
from pipec.ir.experts import layers_problem
from pipec.ir.graph import message_edge
from pipec.ir.opcodes import (
    BWD,
    FWD,
    HAS_MB,
    HAS_PEER,
    IS_COMPUTE,
    IS_MEMOP,
    IS_P2P,
    IS_SEND,
    KIND_OF,
    MESSAGE_NOUNS,
    OFFLOAD,
    ON_COMPUTE,
    OP_KINDS,
    OPCODES,
    PEER_STAGE,
    RECOMPUTE,
    REDUCE_GRAD,
    RELOAD,
    RESHARD,
    STEP,
    TABLE,
    UNSHARD,
    may_group,
    message_key,
)
from pipec.ir.rules import dependencies

if TYPE_CHECKING:
    from pipec.ir.program import Program

# Where a problem is: (rank, instruction index or -1 for the rank or the header) -> a span in the source.
Locate = Callable[[int, int], Span | None]

_SHOWN = 8  # problems listed in one diagnostic
_IS_WINDOW = np.isin(np.arange(len(TABLE)), [UNSHARD, RESHARD])  # the fsdp window instructions, by opcode


def validate(prog: Program, source: Source | None = None, locate: Locate | None = None) -> None:
    """Raise E502 unless `prog` is well formed (see the module docstring); return None when it is."""
    problems = _header(prog)
    if not problems and not _plainly_sound(prog):  # the exact walk, rank by rank, says what is wrong
        problems = _rank_problems(prog)
    if not problems:
        problems = _exactly_once(prog) + _messages(prog)
    if problems:
        raise _diagnostic(prog, problems, source, locate)


def _describe(prog: Program, r: int, j: int) -> str:
    rp = prog.ranks[r]
    o = int(rp.op[j])
    if not 0 <= o < len(TABLE):
        return f"opcode {o}"
    vals = {"mb": int(rp.mb[j]), "stage": int(rp.stage[j]), "peer": int(rp.peer[j])}
    return " ".join([OPCODES[o], *(str(vals[x]) for x in TABLE[o].operands)]) + (" &" if bool(rp.group[j]) else "")


def _diagnostic(
    prog: Program, problems: list[tuple[int, int, str]], source: Source | None, locate: Locate | None
) -> PipecError:
    def where(r: int, j: int) -> str:
        if r < 0:
            return ""
        if j < 0:
            return f"rank {r}: "
        return f"rank {r}, instruction #{j} `{_describe(prog, r, j)}`: "

    (r0, j0, first), rest = problems[0], problems[1 : _SHOWN + 1]
    notes = [where(r, j) + msg for r, j, msg in rest]
    if len(problems) > _SHOWN + 1:
        notes.append("... and more")
    span = locate(r0, j0) if locate is not None and r0 >= 0 else None
    return error("E502", "invalid program: " + where(r0, j0) + first, span, source, tuple(notes))


def _header(prog: Program) -> list[tuple[int, int, str]]:
    S, R, m = prog.num_stages, prog.num_ranks, prog.num_microbatches
    out = []
    for name, v in (("stages", S), ("ranks", R), ("micro-batches", m)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            out.append((-1, -1, f"the number of {name} must be a positive integer, not {v!r}"))
    if out:
        return out
    if len(prog.placement) != S:
        out.append((-1, -1, f"the placement names {len(prog.placement)} stages, the program has {S}"))
    bad = [s for s, r in enumerate(prog.placement) if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < R]
    if bad:
        out.append((-1, -1, f"stage {bad[0]} is placed on {prog.placement[bad[0]]!r}, not one of the {R} ranks"))
    if len(prog.ranks) != R:
        out.append((-1, -1, f"the program declares {R} ranks and holds {len(prog.ranks)} instruction streams"))
    dp = getattr(prog, "dp", 1)
    if isinstance(dp, bool) or not isinstance(dp, int) or not 1 <= dp <= DP_MAX:
        out.append((-1, -1, f"the data-parallel size must be a positive integer up to {DP_MAX:,}, not {brief(dp)}"))
    if getattr(prog, "dp_kind", "ddp") not in DP_KINDS:
        out.append((-1, -1, f"the data-parallel kind must be one of {', '.join(DP_KINDS)}, not {brief(prog.dp_kind)}"))
    layers = getattr(prog, "moe_layers", ())
    problem = layers_problem(layers, S) if isinstance(layers, tuple) else "the MoE layers must be a list"
    if problem is None and isinstance(dp, int) and not isinstance(dp, bool):
        problem = prog.experts.fits(dp)
    if problem is not None:
        out.append((-1, -1, problem))
    sl = getattr(prog, "slicing", None)
    if sl is not None:
        if sl.sequences * sl.slices != m or len(sl.lengths) != sl.sequences or len(sl.tokens) != sl.slices:
            out.append((-1, -1, f"the slicing holds {sl.sequences} x {sl.slices} units, the program {m}"))
        elif sl.slices > 1 and (sum(sl.tokens) != sl.seqlen or min(sl.tokens) < 1):
            out.append(
                (-1, -1, f"the slices hold {sum(sl.tokens)} tokens; they must cover the {sl.seqlen} of a sequence")
            )
    return out


def _rank_problems(prog: Program) -> list[tuple[int, int, str]]:
    """The first problems of the ranks, walked in rank order (`_rank`), up to what one diagnostic shows."""
    problems: list[tuple[int, int, str]] = []
    pl = prog.placement_array
    by_rank = np.argsort(pl, kind="stable")  # each rank's stages, found once (not one pass over S per rank)
    cut = np.searchsorted(pl[by_rank], np.arange(prog.num_ranks + 1))
    for r, rp in enumerate(prog.ranks):
        problems += _rank(prog, r, rp, by_rank[cut[r] : cut[r + 1]])
        if len(problems) > _SHOWN:
            break
    return problems


def _plainly_sound(prog: Program) -> bool:
    """Whether every rank passes `_rank`, decided in one pass over all ranks' instructions at once, for a
    Program without memory ops, fsdp windows or token slices (the common and the largest ones); False
    sends `validate` to the walk over ranks, which finds the same problems and says them. `_rank` costs a
    few dozen numpy calls per rank, which at p=10,000 were a third of a check; here they are a few dozen
    in all. It must never say True where `_rank` finds a problem (tests/unit/ir: every corruption of the
    validator's tests is found by both)."""
    lengths = [len(rp.op) for rp in prog.ranks]
    cols = ("op", "mb", "stage", "peer", "group")
    if any(len(getattr(rp, c)) != n for rp, n in zip(prog.ranks, lengths, strict=True) for c in cols[1:]):
        return False
    if not sum(lengths):
        return not len(prog.placement)
    op, mb, st, peer = (np.concatenate([getattr(rp, c) for rp in prog.ranks]) for c in cols[:4])
    group = np.concatenate([rp.group for rp in prog.ranks]).astype(bool)
    if ((op < 0) | (op >= len(TABLE))).any() or IS_MEMOP[op].any() or _IS_WINDOW[op].any():
        return False
    if prog.dp_kind == "fsdp" or (prog.slicing is not None and prog.slicing.slices > 1) or prog.graph is not None:
        return False
    S, m = prog.num_stages, prog.num_microbatches
    rank = np.repeat(np.arange(len(lengths)), lengths)
    placement = prog.placement_array
    if (np.where(HAS_MB[op], (mb < 0) | (mb >= m), mb != -1)).any() or ((st < 0) | (st >= S)).any():
        return False
    if (placement[st] != rank).any() or (~HAS_PEER[op] & (peer != -1)).any():
        return False
    other = st + PEER_STAGE[op]
    p2p = IS_P2P[op]
    inside = (other >= 0) & (other < S)
    if (p2p & ~inside).any() or (p2p & ((placement[np.clip(other, 0, S - 1)] != peer) | (peer == rank))).any():
        return False
    ends = np.cumsum(lengths) - 1  # each rank's last instruction (empty ranks repeat the one before)
    if group[ends[np.asarray(lengths) > 0]].any():
        return False
    g = np.flatnonzero(group[:-1])  # never a rank's last: the next one is on the same rank
    if len(g) and (~may_group(op[g], op[g + 1], peer[g], peer[g + 1]) | group[g + 1]).any():
        return False
    # each stage (all its instructions on its owner, checked above): one REDUCE_GRAD then one STEP (none
    # forward only), both after its last compute; global positions order a rank's stream
    once = 0 if prog.forward_only else 1
    at = np.arange(len(op))
    for code in (STEP, REDUCE_GRAD):
        if (np.bincount(st[op == code], minlength=S) != once).any():
            return False
    if once:
        last = np.full(S, -1, dtype=np.int64)
        comp = IS_COMPUTE[op]
        np.maximum.at(last, st[comp], at[comp])
        steps, reduces = np.full(S, -1, dtype=np.int64), np.full(S, -1, dtype=np.int64)
        steps[st[op == STEP]] = at[op == STEP]
        reduces[st[op == REDUCE_GRAD]] = at[op == REDUCE_GRAD]
        if (steps < last).any() or (reduces < last).any() or (reduces > steps).any():
            return False
    return True


def _rank(prog: Program, r: int, rp, own: np.ndarray) -> list[tuple[int, int, str]]:
    """One rank's problems; `own` its stages. Per-stage tables cover only the stages the rank names or
    owns (`u`), so a rank costs its own length, not the number of stages."""
    S, m = prog.num_stages, prog.num_microbatches
    placement = prog.placement_array
    n = len(rp.op)
    if any(len(c) != n for c in (rp.mb, rp.stage, rp.peer, rp.group)):
        return [(r, -1, "its instruction columns have different lengths")]
    out: list[tuple[int, int, str]] = []

    def flag(mask: np.ndarray, say: Callable[[int], str]) -> None:
        if mask.any():  # the common case, a valid rank, costs one pass per rule
            for j in np.flatnonzero(mask)[: _SHOWN + 1].tolist():
                out.append((r, j, say(j)))

    op = rp.op
    unknown = (op < 0) | (op >= len(TABLE))
    flag(unknown, lambda j: f"no such opcode (the table has {len(TABLE)})")
    if out:
        return out
    mb, st, peer, group = rp.mb, rp.stage, rp.peer, rp.group.astype(bool)
    flag(np.where(HAS_MB[op], (mb < 0) | (mb >= m), mb != -1), lambda j: f"micro-batch outside 0 .. {m - 1}")
    bad_stage = (st < 0) | (st >= S)
    flag(bad_stage, lambda j: f"stage outside 0 .. {S - 1}")
    st_c = np.clip(st, 0, S - 1)
    owner = placement[st_c]
    flag(~bad_stage & (owner != r), lambda j: f"stage {int(st[j])} is placed on rank {int(owner[j])}")
    p2p = IS_P2P[op]
    other, inside = _other_end(prog, rp, op, st, p2p)
    other_owner = placement[np.clip(other, 0, S - 1)]
    if prog.graph is None:
        flag(p2p & ~bad_stage & ~inside, lambda j: f"stage {int(st[j])} has no neighbour that way")
    else:
        flag(
            p2p & ~bad_stage & ~inside,
            lambda j: (
                f"names stage {int(other[j])} at the other end, but the stage graph has no such edge of stage "
                f"{int(st[j])} ({prog.graph.describe()})"
            ),
        )
    flag(
        p2p & inside & ((other_owner != peer) | (peer == r)),
        lambda j: (
            f"the peer must be rank {int(other_owner[j])} (the owner of stage {int(other[j])})"
            if int(other_owner[j]) != r
            else f"stage {int(other[j])} is on this rank too: it is handed over locally, not sent"
        ),
    )
    flag(~HAS_PEER[op] & (peer != -1), lambda j: "takes no peer")
    if n and group[-1]:
        out.append((r, n - 1, "the last instruction cannot bind a next one"))
    grouped = np.flatnonzero(group[:-1])
    if len(grouped):
        allowed = may_group(op[grouped], op[grouped + 1], peer[grouped], peer[grouped + 1])
        bad = np.zeros(n, dtype=bool)
        bad[grouped[~allowed]] = True
        flag(bad, lambda j: "cannot be grouped with the next instruction")
        flag(group[:-1] & group[1:], lambda j: "a group holds at most 2 instructions")
    # Each stage reduces its gradients once and steps once, in that order, after its last compute.
    u = np.union1d(st_c, own)  # the stages this rank names or owns; `loc` indexes them
    loc, own_l = np.searchsorted(u, st_c), np.searchsorted(u, own)
    comps = np.flatnonzero(IS_COMPUTE[op])
    last = np.full(len(u), -1, dtype=np.int64)
    if len(comps):  # the last compute of each stage: the final index of each stage's run, stably sorted
        by = comps[np.argsort(loc[comps], kind="stable")]
        ends = np.append(loc[by][1:] != loc[by][:-1], True)
        last[loc[by][ends]] = by[ends]
    once = 0 if prog.forward_only else 1  # a forward-only program reduces and steps nothing
    for code, name in ((STEP, "STEP"), (REDUCE_GRAD, "REDUCE_GRAD")):
        at = np.flatnonzero(op == code)
        count = np.bincount(loc[at], minlength=len(u))[own_l]
        for s, c in zip(own[count != once].tolist(), count[count != once].tolist()):
            need = "none (the program is forward only)" if prog.forward_only else "exactly one"
            out.append((r, -1, f"stage {s} has {c} {name} instructions; it needs {need}"))
    steps, reduces = np.full(len(u), -1, dtype=np.int64), np.full(len(u), -1, dtype=np.int64)
    at = np.flatnonzero(op == STEP)
    steps[loc[at]] = at
    at = np.flatnonzero(op == REDUCE_GRAD)
    reduces[loc[at]] = at
    for s, x in zip(own.tolist(), own_l.tolist()):
        if steps[x] >= 0 and steps[x] < last[x]:
            out.append((r, int(steps[x]), f"steps stage {s} before its last compute (#{int(last[x])})"))
        if reduces[x] >= 0 and (reduces[x] < last[x] or (steps[x] >= 0 and reduces[x] > steps[x])):
            out.append((r, int(reduces[x]), f"must come after stage {s}'s last compute and before its STEP"))
    windows = _IS_WINDOW[op]
    if prog.dp_kind != "fsdp":
        flag(windows, lambda j: "UNSHARD and RESHARD belong to fsdp programs; this one is ddp (replicated)")
    else:  # a RECOMPUTE computes on the stage's parameters too
        by_stage = np.full(S, -1, dtype=np.int64)  # fsdp's window rules read the STEPs by stage
        by_stage[u] = steps
        out += _windows(r, op, st_c, np.flatnonzero(ON_COMPUTE[op]), windows, own, by_stage, S)
    sliced = prog.slicing is not None and prog.slicing.slices > 1
    if sliced:
        flag(IS_MEMOP[op], lambda j: "memory ops of token slices are not supported (docs/terapipe.md)")
    if not out and IS_MEMOP[op].any():
        out += _memops(r, op, mb, st_c, own, m)
    if not out and sliced:
        out += _slice_order(r, op, mb, st_c, S, m, prog.slicing.slices)
    return out


def _other_end(prog: Program, rp, op: np.ndarray, st: np.ndarray, p2p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each transfer's stage at the other end of its message and whether that is an edge of the Program's
    stage graph in the direction the opcode goes (pipec.ir.graph: SEND_ACT s -> t and RECV_GRAD s <- t name
    edge (s, t); RECV_ACT and SEND_GRAD edge (t, s)). On the chain the other end is the table's neighbour."""
    S = prog.num_stages
    if prog.graph is None:
        other = st + PEER_STAGE[op]
        return other, (other >= 0) & (other < S)
    n = len(op)
    other = rp.other if rp.other is not None and len(rp.other) == n else np.full(n, -1, dtype=np.int64)
    lo, hi = np.where(PEER_STAGE[op] > 0, st, other), np.where(PEER_STAGE[op] > 0, other, st)
    inside = p2p & (other >= 0) & (other < S) & (lo < hi)
    inside &= message_edge(prog.graph, np.clip(lo, 0, S - 1), np.clip(hi, 0, S - 1)) >= 0
    return other, inside


def _slice_order(r: int, op: np.ndarray, mb: np.ndarray, st: np.ndarray, S: int, m: int, n: int):
    """Token slices (pipec.ir.schedule.Slicing): the slice rules of `pipec.ir.rules`, the one place they are
    written, on one rank's FWDs and BWDs (a stage's slices all live on its owner): on each
    stage, the FWD of slice j after the FWD of slice j - 1 of its sequence, the BWD of slice j after the BWD
    of slice j + 1. A missing one is the exactly-once rule's."""
    out: list[tuple[int, int, str]] = []
    at = np.flatnonzero((op == FWD) | (op == BWD))
    kind, u, s = KIND_OF[op[at]], np.clip(mb[at], 0, m - 1), st[at]
    missing = np.iinfo(np.int64).max
    pos = np.full(2 * S * m, missing, dtype=np.int64)
    pos[(kind * S + s) * m + u] = at
    say = {-1: "comes before FWD {u} {s}, the slice before it: ", +1: "comes before BWD {u} {s}, the slice after it: "}
    for rule, dk, du, ds, valid in dependencies(kind, u, s, S, False, n):
        if not rule.is_slice:
            continue
        x = np.flatnonzero(valid)
        need = pos[(dk[x] * S + ds[x]) * m + np.clip(du[x], 0, m - 1)]
        for y in x[(need != missing) & (need > at[x])][: _SHOWN + 1].tolist():
            j, other = int(u[y] % n), int(du[y])
            text = say[rule.unit] + rule.why
            out.append((r, int(at[y]), text.format(u=other, s=int(s[y]), j=j, p=other % n)))
    return out


def _memops(
    r: int, op: np.ndarray, mb: np.ndarray, st: np.ndarray, own: np.ndarray, m: int
) -> list[tuple[int, int, str]]:
    """The memory ops of one rank (docs/program.md, "Memory ops"), each at most once per (micro-batch,
    stage): a RECOMPUTE after the FWD of its micro-batch and stage and before its BWD; an OFFLOAD after that
    FWD, reloaded by a RELOAD after it and before the BWD; with both, the RECOMPUTE after the RELOAD (it
    recomputes from what comes back). Operand ranges and the stage's owner are the rules above. One
    position per (opcode, key) in numpy, then masks over the memory ops only."""
    out: list[tuple[int, int, str]] = []
    S = len(own)  # every stage in the stream is the rank's own by now: keys over those only
    key = np.searchsorted(own, st) * m + np.clip(mb, 0, m - 1)
    n = len(op)
    pos: dict[int, np.ndarray] = {}
    for code in (FWD, BWD, RECOMPUTE, OFFLOAD, RELOAD):
        at = np.flatnonzero(op == code)
        p = np.full(S * m, -1, dtype=np.int64)
        p[key[at][::-1]] = at[::-1]  # the first of each key
        pos[code] = p
        if code in (RECOMPUTE, OFFLOAD, RELOAD):
            seen = np.bincount(key[at], minlength=S * m)
            twice = at[(seen[key[at]] > 1) & (p[key[at]] != at)]
            for j in twice[: _SHOWN + 1].tolist():
                say = f"a second {OPCODES[code]} of micro-batch {int(mb[j])} on stage {int(st[j])} (at most one)"
                out.append((r, j, say))
    if out:
        return out
    fwd, bwd = pos[FWD], np.where(pos[BWD] >= 0, pos[BWD], n)  # a missing BWD is the exactly-once rule's
    before_fwd = lambda a, k: (fwd[k] < 0) | (a < fwd[k])  # noqa: E731
    rules = (
        (RECOMPUTE, before_fwd, "comes before the FWD it recomputes (FWD {i} {s})"),
        (RECOMPUTE, lambda a, k: a > bwd[k], "comes after BWD {i} {s}: it rebuilds what that BWD needs"),
        (OFFLOAD, before_fwd, "comes before FWD {i} {s}, whose saved activations it moves"),
        (OFFLOAD, lambda a, k: pos[RELOAD][k] < 0, "is never reloaded: no RELOAD {i} {s} on this rank"),
        (RELOAD, lambda a, k: (pos[OFFLOAD][k] < 0) | (a < pos[OFFLOAD][k]), "has no OFFLOAD {i} {s} before it"),
        (RELOAD, lambda a, k: a > bwd[k], "comes after BWD {i} {s}, which waits for it"),
        (
            RECOMPUTE,
            lambda a, k: (pos[RELOAD][k] >= 0) & (a < pos[RELOAD][k]),
            "comes before RELOAD {i} {s}: it recomputes from the input that RELOAD brings back",
        ),
    )
    for code, broken, say in rules:
        at = np.flatnonzero(op == code)
        bad = at[np.asarray(broken(at, key[at]), dtype=bool)] if len(at) else at
        for j in bad[: _SHOWN + 1].tolist():
            out.append((r, j, say.format(i=int(mb[j]), s=int(st[j]))))
    return out


def _windows(
    r: int,
    op: np.ndarray,
    st: np.ndarray,
    comps: np.ndarray,
    windows: np.ndarray,
    own: np.ndarray,
    steps: np.ndarray,
    S: int,
) -> list[tuple[int, int, str]]:
    """fsdp: per stage, UNSHARD and RESHARD alternate from an UNSHARD to a RESHARD; every compute lies in a
    window of its stage; STEP after the last RESHARD; each owned stage has a window. One stable sort of
    the window instructions by stage, then masks."""
    out: list[tuple[int, int, str]] = []
    at = np.flatnonzero(windows)
    by = at[np.argsort(st[at], kind="stable")]  # by stage, in stream order within a stage
    bst, opens = st[by], op[by] == UNSHARD
    start = np.concatenate(([True], bst[1:] != bst[:-1])) if len(by) else np.zeros(0, dtype=bool)
    end = np.append(start[1:], True) if len(by) else np.zeros(0, dtype=bool)
    run_start = np.maximum.accumulate(np.where(start, np.arange(len(by)), 0)) if len(by) else by
    even = (np.arange(len(by)) - run_start) % 2 == 0  # an UNSHARD must come at even places in its stage's run
    for x in np.flatnonzero(opens != even)[: _SHOWN + 1].tolist():
        s = int(bst[x])
        what = f"stage {s} is gathered already" if opens[x] else f"stage {s} is not gathered (no UNSHARD {s} open)"
        out.append((r, int(by[x]), what))
    for x in np.flatnonzero(end & opens)[: _SHOWN + 1].tolist():
        out.append((r, int(by[x]), f"stage {int(bst[x])} is never resharded after this UNSHARD"))
    count = np.bincount(bst[opens], minlength=S)
    for s in own[count[own] == 0].tolist():
        out.append((r, -1, f"stage {s} has no UNSHARD .. RESHARD window (fsdp gathers a stage to compute on it)"))
    # Each compute: the last window instruction of its stage before it must be an UNSHARD.
    n = len(op)
    keys = bst * (n + 1) + by
    ck = st[comps] * (n + 1) + comps
    prev = np.searchsorted(keys, ck) - 1
    ok = (prev >= 0) & (bst[np.maximum(prev, 0)] == st[comps]) & opens[np.maximum(prev, 0)] if len(by) else None
    outside = comps if ok is None else comps[~ok]
    for j in outside[: _SHOWN + 1].tolist():
        out.append((r, j, f"computes on stage {int(st[j])} outside its UNSHARD .. RESHARD windows"))
    last_reshard = np.full(S, -1, dtype=np.int64)
    closing = end & ~opens
    last_reshard[bst[closing]] = by[closing]
    for s in own.tolist():
        if steps[s] >= 0 and steps[s] < last_reshard[s]:
            out.append((r, int(steps[s]), f"steps stage {s} before its last RESHARD (#{int(last_reshard[s])})"))
    return out


def _all_ranks(prog: Program, which: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's instructions that `which` (a column by opcode) selects, in rank order then stream
    order, as (rank, index in its stream): the checks over the whole Program take one pass over these,
    where a loop over ranks that updated a table of every op was quadratic in p."""
    sel = [np.flatnonzero(which[rp.op]) for rp in prog.ranks]
    rank = np.repeat(np.arange(len(sel)), [len(x) for x in sel])
    return rank, np.concatenate(sel) if sel else np.zeros(0, dtype=np.int64)


def _column(prog: Program, name: str, rank: np.ndarray, index: np.ndarray) -> np.ndarray:
    """One column (op, mb, stage, ...) of the instructions `_all_ranks` chose."""
    whole = np.concatenate([getattr(rp, name) for rp in prog.ranks])
    starts = np.concatenate(([0], np.cumsum([len(rp.op) for rp in prog.ranks])[:-1]))
    return whole[starts[rank] + index]


def _repeats(key: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Per instruction (in rank order, then stream order), whether a walk over the ranks has seen its key
    twice once it has taken in the instruction's whole rank: every occurrence of a key but its first, and
    the first too when the second is on the same rank."""
    out = np.zeros(len(key), dtype=bool)
    if not len(key):
        return out
    o = np.argsort(key, kind="stable")
    k = o[1:][key[o][1:] == key[o][:-1]]  # each occurrence but a key's first
    out[k] = True
    prev = o[:-1][key[o][1:] == key[o][:-1]]  # the occurrence before each of those
    out[prev[rank[prev] == rank[k]]] = True
    return out


def _first_per_rank(mask: np.ndarray, rank: np.ndarray) -> list[tuple[int, int]]:
    """(rank, position) of the first selected instruction of each rank that has one, in rank order."""
    at = np.flatnonzero(mask)
    ranks, first = np.unique(rank[at], return_index=True)
    return list(zip(ranks.tolist(), at[first].tolist()))


def _exactly_once(prog: Program) -> list[tuple[int, int, str]]:
    """Every (kind, micro-batch, stage) of the Program's kinds exactly once: W only when backward is split,
    F alone when the program is forward only."""
    S, m = prog.num_stages, prog.num_microbatches
    kinds = 1 if prog.forward_only else 3 if prog.split_backward else 2
    rank, index = _all_ranks(prog, IS_COMPUTE)
    op, st, mb = (_column(prog, k, rank, index) for k in ("op", "stage", "mb"))
    kind = KIND_OF[op]
    out: list[tuple[int, int, str]] = []
    bad = np.zeros(len(kind), dtype=bool)
    for wrong, what in (
        (kind == 2 if not prog.split_backward else None, "a WGRAD in a program whose backward is not split"),
        (kind > 0 if prog.forward_only else None, "a backward in a forward-only program"),
    ):
        if wrong is not None:
            out += [(r, int(index[j]), what) for r, j in _first_per_rank(wrong, rank)]
            bad |= wrong
    key = (kind * S + st) * m + mb
    twice = np.flatnonzero(_repeats(key, rank))
    if len(twice) and not (bad & (rank <= rank[twice[0]])).any():  # the walk stopped at the first report
        j = twice[0]
        out.append((int(rank[j]), int(index[j]), "this op was already executed (each op happens exactly once)"))
        out.sort(key=lambda x: x[0])  # in rank order, as the walk over ranks reported them
    count = np.bincount(key, minlength=len(OP_KINDS) * S * m)
    if out:
        return out
    missing = np.flatnonzero(count[: kinds * S * m] == 0)
    for key in missing[:_SHOWN].tolist():
        rest, mb = divmod(key, m)
        kind, s = divmod(rest, S)
        name = OPCODES[int(np.flatnonzero(KIND_OF == kind)[0])]
        out.append((prog.placement[s], -1, f"`{name} {mb} {s}` never happens (each op happens exactly once)"))
    return out


def _messages(prog: Program) -> list[tuple[int, int, str]]:
    """Each message the placement needs (a stage boundary between two ranks) is sent once and received once."""
    S, m = prog.num_stages, prog.num_microbatches
    placement = prog.placement_array
    g = prog.graph
    rank, index = _all_ranks(prog, IS_P2P)
    op, st, mb = (_column(prog, k, rank, index) for k in ("op", "stage", "mb"))
    if g is None:
        # needed[(msg * S + sending stage) * m + mb]: act leaves s towards s + 1, grad leaves s towards s - 1.
        cross_up = np.append(placement[:-1] != placement[1:], False)
        cross_down = np.concatenate(([False], placement[1:] != placement[:-1]))
        keys = message_key(op, mb, st, S, m)
    else:  # needed[(msg * E + edge) * m + mb]: both messages of each edge between two ranks
        cross_up = cross_down = placement[g.src] != placement[g.dst]
        other = np.concatenate([rp.other if rp.other is not None else np.full(len(rp.op), -1) for rp in prog.ranks])
        starts = np.concatenate(([0], np.cumsum([len(rp.op) for rp in prog.ranks])[:-1]))
        keys = message_key(op, mb, st, S, m, other[starts[rank] + index], g)
        if (keys < 0).any():  # the other end is not an edge: validate's rank walk names it
            return [
                (int(rank[j]), int(index[j]), "names no edge of the stage graph") for j in np.flatnonzero(keys < 0)[:1]
            ]
    needed = np.concatenate([np.repeat(cross_up, m), np.repeat(cross_down & (not prog.forward_only), m)])
    total = len(needed)
    is_send = IS_SEND[op]
    sends = np.bincount(keys[is_send], minlength=total)
    recvs = np.bincount(keys[~is_send], minlength=total)
    flagged = ~needed[keys]
    for side in (is_send, ~is_send):  # a message its side already had, up to the end of this rank
        at = np.flatnonzero(side)
        flagged[at] |= _repeats(keys[at], rank[at])
    what = "sends or receives a message that is sent once and only between ranks"
    out = [(r, int(index[x]), what) for r, x in _first_per_rank(flagged, rank)]
    if out:
        return out
    for count, side in ((sends, "sent"), (recvs, "received")):
        for key in np.flatnonzero(needed & (count == 0))[:_SHOWN].tolist():
            rest, mb = divmod(key, m)
            msg, s = divmod(rest, S if g is None else g.num_edges)
            what = MESSAGE_NOUNS[msg]
            if g is None:
                out.append((-1, -1, f"the {what} of micro-batch {mb} from stage {s} is never {side}"))
            else:
                u, v = g.edges[s]
                out.append((-1, -1, f"the {what} of micro-batch {mb} on edge {u} -> {v} is never {side}"))
    return out
