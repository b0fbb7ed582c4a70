"""Checks of a Schedule, its Program or a bare Program by code independent of the compiler's
(`check_invariants`, `schedule_problem`, `program_problem`).

The rules are restated here on purpose, in plain Python over readable instructions, so that a bug in
the vectorised validator or the lowering shows up as a disagreement. Data parallelism too: each stage
reduces once after its last compute and before its STEP; a ddp Program has no UNSHARD/RESHARD; an fsdp
Program opens and closes each stage's windows in turn, computes only inside them, steps after the last
close, and its memory is the sharded parameters plus the open windows, walked instruction by
instruction (`_fsdp_peaks`)."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from pipec.errors import PipecError
from pipec.ir.dataparallel import DataParallel
from pipec.ir.program import (
    BWD,
    FWD,
    OPCODES,
    RECV_ACT,
    RECV_GRAD,
    REDUCE_GRAD,
    SEND_ACT,
    SEND_GRAD,
    STEP,
    WGRAD,
    Program,
)
from pipec.ir.schedule import Schedule
from pipec.passes.checks import check_schedule
from pipec.passes.compiler import CompiledSchedule, compile_schedule
from pipec.testing.listing import COMPUTE, Listing, Op3, _fmt_op, deps


class InvariantError(AssertionError):
    """pipec and an independent check disagree: a bug in pipec (or, for a bare Program, a bad Program)."""


@dataclass(frozen=True)
class Checked:
    """What `check_invariants` verified, with the numbers it measured."""

    ops: int
    instructions: int
    messages: int
    makespan: float
    critical_path: float
    expectations: int


def _fail(message: str) -> None:
    raise InvariantError(message)


def _keys(sched: Schedule) -> list[Op3]:
    return [(k, i, s) for k in sched.kinds for s in range(sched.num_stages) for i in range(sched.num_microbatches)]


def schedule_problem(sched: Schedule) -> str | None:
    """Why the schedule is invalid or deadlocks, by direct enumeration (None when it is fine)."""
    S, placement = sched.num_stages, sched.placement
    n = sched.slicing.slices if sched.slicing else 1  # token slices: the slice rules too (`deps`)
    where: dict[Op3, tuple[int, int]] = {}
    for r in range(sched.num_ranks):
        ops = sched.ops(r)
        paired = sched.ranks[r].paired.tolist()
        pos = 0
        for j, o in enumerate(ops):
            key = (o.kind, o.mb, o.stage)
            if not (0 <= o.stage < S and 0 <= o.mb < sched.num_microbatches):
                return f"{o} is out of range on rank {r}"
            if placement[o.stage] != r:
                return f"{o} is on rank {r}, but stage {o.stage} is placed on rank {placement[o.stage]}"
            if key in where:
                return f"{o} occurs twice"
            where[key] = (r, pos)
            if not (j < len(ops) - 1 and paired[j]):
                pos += 1
    missing = [k for k in _keys(sched) if k not in where]
    if missing:
        return f"{_fmt_op(missing[0])} never occurs"
    for key, (r, pos) in where.items():
        for d in deps(*key, S, sched.split_backward, n):
            dr, dpos = where[d]
            if dr == r and dpos >= pos:
                return f"{_fmt_op(key)} comes no later than {_fmt_op(d)}, which it needs, on rank {r}"
    problem = _memop_problem(sched)
    if problem:
        return problem
    # Deadlock: ranks run in order; an op (or overlapped pair) runs once everything it needs has run.
    done: set[Op3] = set()
    pc = [0] * sched.num_ranks
    orders = [[(o.kind, o.mb, o.stage) for o in sched.ops(r)] for r in range(sched.num_ranks)]
    pairs = [sched.ranks[r].paired.tolist() for r in range(sched.num_ranks)]
    progress = True
    while progress:
        progress = False
        for r, order in enumerate(orders):
            while pc[r] < len(order):
                j = pc[r]
                group = order[j : j + 2] if pairs[r][j] and j + 1 < len(order) else order[j : j + 1]
                if not all(d in done for op in group for d in deps(*op, S, sched.split_backward, n) if d not in group):
                    break
                done.update(group)
                pc[r] += len(group)
                progress = True
    stuck = [r for r in range(sched.num_ranks) if pc[r] < len(orders[r])]
    if stuck:
        return "deadlock: ranks " + ", ".join(f"{r} at {_fmt_op(orders[r][pc[r]])}" for r in stuck) + " wait forever"
    return None


def _memop_problem(sched: Schedule) -> str | None:
    """The memory ops' rules (MemOp's docstring), by direct enumeration: each at most once, on the rank
    that runs its F and B; RECOMPUTE and OFFLOAD after the F, RELOAD after its OFFLOAD, all before the B;
    OFFLOAD and RELOAD in pairs; a recomputed forward that is offloaded comes back before it is recomputed."""
    for r, mems in enumerate(sched.memops):
        ops = sched.ops(r)
        at = {(o.kind, o.mb, o.stage): j for j, o in enumerate(ops)}
        seen: dict[tuple[str, int, int], int] = {}
        for x in mems:
            name = f"{x.op}({x.mb}, stage {x.stage}) on rank {r}"
            if (x.op, x.mb, x.stage) in seen:
                return f"{name} occurs twice"
            seen[(x.op, x.mb, x.stage)] = x.before
            f, b = at.get(("F", x.mb, x.stage)), at.get(("B", x.mb, x.stage))
            if f is None or b is None:
                return f"{name}: its F and B are not on that rank"
            if not f < x.before <= b:
                return f"{name} is not between F({x.mb}) and B({x.mb}) of stage {x.stage}"
        for (op, i, st), before in seen.items():
            off, rel = seen.get(("OFFLOAD", i, st)), seen.get(("RELOAD", i, st))
            if (off is None) != (rel is None):
                return f"rank {r}: micro-batch {i} of stage {st} is offloaded or reloaded, not both"
            if op == "RELOAD" and before < off:
                return f"rank {r}: RELOAD({i}, stage {st}) comes before its OFFLOAD"
            if op == "RECOMPUTE" and rel is not None and before < rel:
                return f"rank {r}: RECOMPUTE({i}, stage {st}) comes before the RELOAD it recomputes from"
    return None


def _needs(op: int, i: int, s: int, S: int, placement: Sequence[int], r: int, slices: int = 1):
    """Local op keys a compute instruction needs, and the message (kind, mb, sending stage) it awaits. With
    token slices (`slices` n > 1, `i` a unit) also the slice rules, on the same stage: FWD i after FWD i - 1
    of its sequence, BWD i after BWD i + 1."""
    local, msg = [], None
    if op == FWD and s > 0:
        if placement[s - 1] == r:
            local.append((FWD, i, s - 1))
        else:
            msg = ("act", i, s - 1)
    elif op == BWD:
        local.append((FWD, i, s))
        if s < S - 1:
            if placement[s + 1] == r:
                local.append((BWD, i, s + 1))
            else:
                msg = ("grad", i, s + 1)
    elif op == WGRAD:
        local.append((BWD, i, s))
    if slices > 1 and op == FWD and i % slices > 0:
        local.append((FWD, i - 1, s))
    if slices > 1 and op == BWD and i % slices < slices - 1:
        local.append((BWD, i + 1, s))
    return local, msg


def program_problem(prog: Program, sched: Schedule | None = None) -> str | None:
    """What is wrong with a Program, by direct enumeration (None when nothing is)."""
    S, m, placement = prog.num_stages, prog.num_microbatches, prog.placement
    split = prog.split_backward
    n = prog.slicing.slices if prog.slicing else 1
    instrs = [rp.instructions() for rp in prog.ranks]
    kinds = (FWD, BWD, WGRAD) if split else (FWD, BWD)
    seen: dict[tuple[int, int, int], tuple[int, int]] = {}
    sends: dict[tuple, tuple[int, int, int]] = {}  # message -> (rank, index, peer)
    recvs: dict[tuple, tuple[int, int, int]] = {}
    for r, ins in enumerate(instrs):
        for j, x in enumerate(ins):
            code = OPCODES.index(x.op)
            if code in (FWD, BWD, WGRAD):
                key = (code, x.mb, x.stage)
                if code not in kinds or not (0 <= x.stage < S and 0 <= x.mb < m):
                    return f"rank {r}: `{x}` is not an op of this program"
                if placement[x.stage] != r:
                    return f"rank {r}: `{x}` computes a stage placed on rank {placement[x.stage]}"
                if key in seen:
                    return f"`{x}` computed twice"
                seen[key] = (r, j)
            elif code in (SEND_ACT, SEND_GRAD, RECV_ACT, RECV_GRAD):
                is_send = code in (SEND_ACT, SEND_GRAD)
                kind = "act" if code in (SEND_ACT, RECV_ACT) else "grad"
                sender = x.stage if is_send else (x.stage - 1 if kind == "act" else x.stage + 1)
                receiver = sender + 1 if kind == "act" else sender - 1
                if not (0 <= sender < S and 0 <= receiver < S and 0 <= x.mb < m):
                    return f"rank {r}: `{x}` names a stage out of range"
                me, other = (sender, receiver) if is_send else (receiver, sender)
                if placement[me] != r or placement[other] != x.peer or x.peer == r:
                    return f"rank {r}: `{x}` does not connect the owners of stages {sender} and {receiver}"
                table = sends if is_send else recvs
                msg = (kind, x.mb, sender)
                if msg in table:
                    return f"rank {r}: `{x}` {'sends' if is_send else 'receives'} a message a second time"
                table[msg] = (r, j, x.peer)
    missing = [(k, i, s) for k in kinds for s in range(S) for i in range(m) if (k, i, s) not in seen]
    if missing:
        k, i, s = missing[0]
        return f"{OPCODES[k]} {i} {s} is never computed"
    if sched is not None:
        for r in range(sched.num_ranks):
            want = [(("F", "B", "W").index(o.kind), o.mb, o.stage) for o in sched.ops(r)]
            got = [(OPCODES.index(x.op), x.mb, x.stage) for x in instrs[r] if OPCODES.index(x.op) <= WGRAD]
            if want != got:
                return f"rank {r}: the program computes in another order than the schedule"
    # Every remote input is sent after it is produced and received before it is consumed; every message
    # that is sent is needed and received, and the reverse.
    needed = set()
    for (code, i, s), (r, j) in seen.items():
        local, msg = _needs(code, i, s, S, placement, r, n)
        for d in local:
            if d not in seen or seen[d][1] >= j:
                return f"rank {r}: {OPCODES[code]} {i} {s} runs before {OPCODES[d[0]]} {d[1]} {d[2]}, which it needs"
        if msg is not None:
            needed.add(msg)
            if msg not in recvs or recvs[msg][0] != r or recvs[msg][1] > j:
                return f"rank {r}: {OPCODES[code]} {i} {s} has no receive of its input before it"
            if msg not in sends:
                return f"the {msg[0]} of micro-batch {i} from stage {msg[2]} is never sent"
            producer = (FWD if msg[0] == "act" else BWD, i, msg[2])
            pr, pj = seen[producer]
            if sends[msg][0] != pr or sends[msg][1] < pj:
                return f"rank {pr}: the {msg[0]} of micro-batch {i} from stage {msg[2]} is sent before it is computed"
    for table, what in ((sends, "sent"), (recvs, "received")):
        extra = [msg for msg in table if msg not in needed]
        if extra:
            kind, i, s = extra[0]
            return f"the {kind} of micro-batch {i} from stage {s} is {what} but no compute needs it"
    # Batches: a group is two adjacent compute instructions, or a send and a receive with one peer.
    last_compute: dict[int, int] = {}  # stage -> index of its last compute on its owner (one pass, not one per STEP)
    for (_, _, s), (_, jj) in seen.items():
        last_compute[s] = max(last_compute.get(s, -1), jj)
    for r, ins in enumerate(instrs):
        for j, x in enumerate(ins):
            if not x.group:
                continue
            if j + 1 >= len(ins):
                return f"rank {r}: `{x}` is bound to nothing"
            y = ins[j + 1]
            a, b = OPCODES.index(x.op), OPCODES.index(y.op)
            if a <= WGRAD and b <= WGRAD:
                if y.group:
                    return f"rank {r}: more than two compute instructions overlapped at `{x}`"
                continue
            comm = (SEND_ACT, SEND_GRAD, RECV_ACT, RECV_GRAD)
            if (
                a not in comm
                or b not in comm
                or x.peer != y.peer
                or ((a in (SEND_ACT, SEND_GRAD)) == (b in (SEND_ACT, SEND_GRAD)))
            ):
                return f"rank {r}: `{x}` and `{y}` are batched but are not a send and a receive with one peer"
            if y.group:
                return f"rank {r}: more than two transfers batched at `{x}`"
        # One reduction and one step per owned stage, after all of that stage's compute.
        owned = [s for s in range(S) if placement[s] == r]
        problem = _dp_problem(prog, r, ins, owned, last_compute)
        if problem:
            return problem
        for code in (REDUCE_GRAD, STEP):
            at = [j for j, x in enumerate(ins) if x.op == OPCODES[code]]
            stages = sorted(ins[j].stage for j in at)
            if stages != owned:
                return f"rank {r}: {OPCODES[code]} for stages {stages}, but the rank owns {owned}"
        for j, x in enumerate(ins):
            if x.op == "STEP":
                last = last_compute.get(x.stage, -1)
                if last > j:
                    return f"rank {r}: `STEP {x.stage}` comes before the last compute of stage {x.stage}"
    # Both ends of every channel issue its messages in one order.
    seqs: dict[tuple[int, int], list] = defaultdict(list)
    for r, ins in enumerate(instrs):
        for x in ins:
            if x.op in ("SEND_ACT", "SEND_GRAD", "RECV_ACT", "RECV_GRAD"):
                kind = "act" if x.op.endswith("ACT") else "grad"
                sender = x.stage if x.op.startswith("SEND") else (x.stage - 1 if kind == "act" else x.stage + 1)
                seqs[(r, x.peer)].append((kind, x.mb, sender))
    for (a, b), seq in seqs.items():
        if seq != seqs.get((b, a), []):
            return f"ranks {a} and {b} issue their messages to each other in different orders"
    return _rendezvous(prog, instrs)


def _dp_problem(prog: Program, r: int, ins, owned: list[int], last_compute: dict[int, int]) -> str | None:
    """The data-parallel rules for one rank, instruction by instruction."""
    if not (isinstance(prog.dp, int) and not isinstance(prog.dp, bool) and prog.dp >= 1):
        return f"data-parallel size {prog.dp!r} is not a positive integer"
    if prog.dp_kind not in ("ddp", "fsdp"):
        return f"data-parallel kind {prog.dp_kind!r} is neither ddp nor fsdp"
    reduce_at = {x.stage: j for j, x in enumerate(ins) if x.op == "REDUCE_GRAD"}
    step_at = {x.stage: j for j, x in enumerate(ins) if x.op == "STEP"}
    for s, j in reduce_at.items():
        if j < last_compute.get(s, -1):
            return f"rank {r}: `REDUCE_GRAD {s}` comes before the last compute of stage {s}"
        if s in step_at and j > step_at[s]:
            return f"rank {r}: `REDUCE_GRAD {s}` comes after `STEP {s}`"
    gathered: dict[int, bool] = {}
    windows: dict[int, int] = {}
    last_close: dict[int, int] = {}
    for j, x in enumerate(ins):
        if x.op in ("UNSHARD", "RESHARD"):
            if prog.dp_kind != "fsdp":
                return f"rank {r}: `{x}` in a {prog.dp_kind} program"
            opening = x.op == "UNSHARD"
            if gathered.get(x.stage, False) == opening:
                return f"rank {r}: `{x}` at #{j} " + ("re-gathers a gathered stage" if opening else "frees no window")
            gathered[x.stage] = opening
            if opening:
                windows[x.stage] = windows.get(x.stage, 0) + 1
            else:
                last_close[x.stage] = j
        elif x.op in COMPUTE and prog.dp_kind == "fsdp" and not gathered.get(x.stage, False):
            return f"rank {r}: `{x}` at #{j} computes on stage {x.stage} while it is not gathered"
    if prog.dp_kind == "fsdp":
        for s in owned:
            if windows.get(s, 0) == 0:
                return f"rank {r}: stage {s} has no UNSHARD .. RESHARD window"
            if gathered.get(s, False):
                return f"rank {r}: stage {s} is still gathered at the end"
            if s in step_at and step_at[s] < last_close[s]:
                return f"rank {r}: `STEP {s}` comes before the last `RESHARD {s}`"
    return None


def _walk_peak(instrs, model: dict[str, np.ndarray], split: bool, n: int = 1) -> float:
    """The largest device memory along one rank's (name, micro-batch, stage) stream, less what it holds
    throughout: each F keeps `act` (a recomputed one `ckpt`, the rest from its RECOMPUTE) until its B, a
    split B keeps `wact` until W, an OFFLOAD takes what the F kept off the device and its RELOAD brings it
    back; under fsdp over n replicas a stage's other (n - 1) / n of params from UNSHARD to RESHARD. With
    token slices or sequence lengths (`unit_share` in the model) a unit holds its share of what a whole
    sequence's F and B keep."""
    act, wact, ckpt, par = model["act"], model["wact"], model["ckpt"], model["params"]
    share = model.get("unit_share")
    instrs = list(instrs)
    recomputed = {(i, st) for name, i, st in instrs if name == "RECOMPUTE"}
    kept: dict[tuple[int, int], float] = {}
    live = peak = 0.0
    for name, i, st in instrs:
        w = float(share[i]) if share is not None and name in COMPUTE + ("RECOMPUTE",) else 1.0
        if name == "FWD":
            kept[(i, st)] = (ckpt[st] if (i, st) in recomputed else act[st]) * w
            live += kept[(i, st)]
        elif name == "RECOMPUTE":
            live += (act[st] - ckpt[st]) * w
        elif name == "OFFLOAD":
            live -= kept[(i, st)]
        elif name == "RELOAD":
            live += kept[(i, st)]
        elif name == "BWD":
            live += ((wact[st] if split else 0.0) - act[st]) * w
        elif name == "WGRAD":
            live -= wact[st] * w
        elif name == "UNSHARD":
            live += par[st] * (n - 1) / n
        elif name == "RESHARD":
            live -= par[st] * (n - 1) / n
        peak = max(peak, live)
    return peak


def _fsdp_peaks(prog: Program, sched: Schedule, model: dict[str, np.ndarray]) -> list[float]:
    """Per-rank peak memory of an fsdp Program: params / N of each owned stage throughout, plus the walk of
    its instructions (`_walk_peak`)."""
    par, n = model["params"], prog.dp
    return [
        float(sum(par[s] for s in sched.stages_of(r))) / n
        + _walk_peak(((x.op, x.mb, x.stage) for x in rp.instructions()), model, prog.split_backward, n)
        for r, rp in enumerate(prog.ranks)
    ]


def _fsdp_over(sched: Schedule, memory, dp: DataParallel) -> tuple[str | None, str | None]:
    """Whether the fsdp Program of a schedule pipec found over its limit is over it by `_fsdp_peaks`."""
    from pipec.passes.lower import lower
    from pipec.sim.memory import memory_model

    model = memory_model(sched, memory)
    peaks = _fsdp_peaks(lower(sched, dp), sched, model)
    over = [r for r, peak in enumerate(peaks) if not np.isnan(model["limit"][r]) and peak > model["limit"][r] + 1e-9]
    return ("E402", f"rank {over[0]} is over its memory limit") if over else (None, None)


def _rendezvous(prog: Program, instrs) -> str | None:
    """Run the Program with sends that block until matched (after the checks above): None if it finishes."""
    S, R, placement = prog.num_stages, prog.num_ranks, prog.placement
    comm = ("SEND_ACT", "SEND_GRAD", "RECV_ACT", "RECV_GRAD")
    kpos: list[dict[int, int]] = []  # per rank: instruction index -> position on its channel
    recv_k: dict[tuple, tuple[int, int]] = {}  # message -> (peer, position) on the receiving rank
    for r, ins in enumerate(instrs):
        count: Counter = Counter()
        pos = {}
        for j, x in enumerate(ins):
            if x.op in comm:
                pos[j] = count[x.peer]
                count[x.peer] += 1
                if x.op.startswith("RECV"):
                    kind = "act" if x.op.endswith("ACT") else "grad"
                    recv_k[(r, kind, x.mb, x.stage - 1 if kind == "act" else x.stage + 1)] = (x.peer, pos[j])
        kpos.append(pos)
    issued: Counter = Counter()  # (rank, peer) -> transfers the rank issued towards the peer

    def matched(a: int, b: int) -> int:
        return min(issued[(a, b)], issued[(b, a)])

    computed: set[tuple[int, int, int]] = set()
    pc, issued_upto = [0] * R, [0] * R
    progress = True
    while progress:
        progress = False
        for r, ins in enumerate(instrs):
            while pc[r] < len(ins):
                j = pc[r]
                end = j
                while ins[end].group and end + 1 < len(ins):
                    end += 1
                group = range(j, end + 1)
                if ins[j].op in comm:
                    for g in group:
                        if g >= issued_upto[r]:
                            issued[(r, ins[g].peer)] += 1
                            issued_upto[r] = g + 1
                    if any(ins[g].op.startswith("SEND") and matched(r, ins[g].peer) <= kpos[r][g] for g in group):
                        break
                elif ins[j].op in ("FWD", "BWD", "WGRAD"):
                    ready = True
                    for g in group:
                        x = ins[g]
                        local, msg = _needs(OPCODES.index(x.op), x.mb, x.stage, S, placement, r)
                        if any(d not in computed for d in local):
                            ready = False
                        if msg is not None:
                            peer, k = recv_k[(r, *msg)]
                            if matched(r, peer) <= k:
                                ready = False
                    if not ready:
                        break
                    computed.update((OPCODES.index(ins[g].op), ins[g].mb, ins[g].stage) for g in group)
                pc[r] = end + 1
                issued_upto[r] = max(issued_upto[r], pc[r])
                progress = True
    stuck = [r for r in range(R) if pc[r] < len(instrs[r])]
    if stuck:
        at = ", ".join(f"rank {r} at `{instrs[r][pc[r]]}`" for r in stuck)
        return f"the program deadlocks when sends block until received: {at}"
    return None


def _memory_peaks(sched: Schedule, model: dict[str, np.ndarray]) -> list[float]:
    """Per-rank peak memory of a schedule: its stages' params plus the walk of its ops with its memory ops
    just before the op they precede."""
    names = {"F": "FWD", "B": "BWD", "W": "WGRAD"}
    out = []
    for r in range(sched.num_ranks):
        mems = sched.memops[r] if r < len(sched.memops) else ()
        ops = sched.ops(r)
        stream = []
        for j in range(len(ops) + 1):
            stream += [(x.op, x.mb, x.stage) for x in mems if x.before == j]
            if j < len(ops):
                stream.append((names[ops[j].kind], ops[j].mb, ops[j].stage))
        base = float(sum(model["params"][s] for s in sched.stages_of(r)))
        out.append(base + _walk_peak(stream, model, sched.split_backward))
    return out


def _timeline_check(prog: Program, costs, tl) -> float:
    """Check a simulated timeline against the program and costs; return the critical path."""
    S, m, placement = prog.num_stages, prog.num_microbatches, prog.placement
    eps = 1e-9 * max(1.0, float(tl.end.max()) if len(tl.end) else 1.0)
    events = {}
    for r, o, i, s, a, b in zip(
        tl.rank.tolist(), tl.op.tolist(), tl.mb.tolist(), tl.stage.tolist(), tl.start.tolist(), tl.end.tolist()
    ):
        if (o, i, s) in events:
            _fail(f"the simulation runs {OPCODES[o]} {i} {s} twice")
        events[(o, i, s)] = (r, a, b)
    on_compute = (*COMPUTE, "RECOMPUTE")  # a RECOMPUTE runs on the compute resource too, at its F's cost
    want = {(OPCODES.index(x.op), x.mb, x.stage) for rp in prog.ranks for x in rp.instructions() if x.op in on_compute}
    if set(events) != want:
        _fail("the simulation does not run exactly the program's compute instructions")
    full_b = costs.B if prog.split_backward else costs.B + costs.W
    recompute = OPCODES.index("RECOMPUTE")
    dur = {FWD: costs.F, BWD: full_b, WGRAD: costs.W, recompute: costs.F}
    n = prog.slicing.slices if prog.slicing else 1
    kind_of = {FWD: 0, BWD: 1, WGRAD: 2, recompute: 0}

    def took(o: int, i: int, s: int) -> float:
        """An op's cost: its kind's on its stage, with token slices or lengths its unit's (the cost model's
        `kind_time`, the one rule of what a unit costs)."""
        if costs.unit_weight is None:
            return float(dur[o][s])
        return float(costs.kind_time(np.array([kind_of[o]]), np.array([s]), np.array([i]))[0])

    def wire(src_stage: int, a: int, b: int, kind: str, i: int = 0) -> float:
        if a == b:
            return 0.0
        size = (costs.act_bytes if kind == "act" else costs.grad_bytes)[src_stage]
        if costs.unit_share is not None:  # a unit's message carries its share of a sequence's bytes
            size = size * float(costs.unit_share[i])
        bw = costs.bandwidth[a, b]
        return float(costs.comm[src_stage] + costs.latency[a, b] + (size / bw if np.isfinite(bw) and size else 0.0))

    for (o, i, s), (r, a, b) in events.items():
        if abs((b - a) - took(o, i, s)) > eps:
            _fail(f"simulated {OPCODES[o]} {i} {s} takes {b - a:g}, its cost is {took(o, i, s):g}")
        local, msg = _needs(o, i, s, S, placement, r, n)
        if o == recompute:
            local, msg = [(FWD, i, s)], None
        elif o == BWD and (recompute, i, s) in events:
            local = [*local, (recompute, i, s)]
        for d in local:
            if a < events[d][2] - eps:
                _fail(f"simulated {OPCODES[o]} {i} {s} starts before {OPCODES[d[0]]} {d[1]} {d[2]} ends")
        if msg is not None:
            kind, _, src = msg
            d = (FWD if kind == "act" else BWD, i, src)
            dr, _, dend = events[d]
            if a < dend + wire(src, dr, r, kind, i) - eps:
                _fail(f"simulated {OPCODES[o]} {i} {s} starts before its input can arrive")
    for rp_index, rp in enumerate(prog.ranks):
        prev_end = 0.0
        for x in rp.instructions():
            if x.op in on_compute:
                _, a, b = events[(OPCODES.index(x.op), x.mb, x.stage)]
                if a < prev_end - eps:
                    _fail(f"rank {rp_index}: simulated `{x}` overlaps the compute before it")
                prev_end = b
    # Critical path: the longest chain of dependencies, with the least time each message can take.
    # With token slices a sequence's slices chain on each stage too: forwards first to last, backwards
    # last to first (`_needs`), so each sequence's forwards are timed before its backwards.
    finish: dict[tuple[int, int, int], float] = {}
    for seq in range(m // n):
        units = range(seq * n, seq * n + n)
        for i in units:
            for s in range(S):
                t = 0.0
                if s > 0:
                    t = finish[(FWD, i, s - 1)] + wire(s - 1, placement[s - 1], placement[s], "act", i)
                if i % n > 0:
                    t = max(t, finish[(FWD, i - 1, s)])
                finish[(FWD, i, s)] = t + took(FWD, i, s)
        for i in reversed(units):
            for s in reversed(range(S)):
                t = finish[(FWD, i, s)]
                if s < S - 1:
                    t = max(t, finish[(BWD, i, s + 1)] + wire(s + 1, placement[s + 1], placement[s], "grad", i))
                if i % n < n - 1:
                    t = max(t, finish[(BWD, i + 1, s)])
                finish[(BWD, i, s)] = t + took(BWD, i, s)
                if prog.split_backward:
                    finish[(WGRAD, i, s)] = finish[(BWD, i, s)] + took(WGRAD, i, s)
    critical = max(finish.values(), default=0.0)
    busy = np.bincount(tl.rank, weights=tl.end - tl.start, minlength=prog.num_ranks)
    if tl.makespan < critical - eps:
        _fail(f"simulated makespan {tl.makespan:g} is below the critical path {critical:g}")
    if len(busy) and tl.makespan < float(busy.max()) - eps:
        _fail(f"simulated makespan {tl.makespan:g} is below the busiest rank's compute time {busy.max():g}")
    return critical


def _schedule_of(prog: Program) -> Schedule:
    """A Schedule with the program's shape (no ops): enough for the default cost model."""
    return Schedule(
        name=prog.name,
        params=prog.params,
        num_stages=prog.num_stages,
        num_ranks=prog.num_ranks,
        num_microbatches=prog.num_microbatches,
        kinds=("F", "B", "W") if prog.split_backward else ("F", "B"),
        placement=prog.placement,
        ranks=(),
        slicing=prog.slicing,
    )


_PIPEC_CODES = (
    "E301",
    "E302",
    "E303",
    "E304",
    "E305",
    "E306",
    "E307",
    "E308",
    "E310",
    "E311",
    "E401",
    "E402",
    "E403",
    "E404",
)


def check_invariants(
    target: Schedule | CompiledSchedule | Program | Listing,
    memory: Mapping[str, float] | None = None,
    *,
    expectations: bool = True,
    data_parallel: DataParallel | None = None,
) -> Checked:
    """Check a schedule (or its compiled form, or a bare Program) by code independent of the compiler.

    For a schedule, pipec's own checks and lowering run first; their diagnostic is raised (PipecError)
    when the independent checks agree that the schedule is broken, and InvariantError when they
    disagree (pipec accepts a broken schedule or rejects a valid one). Then the Program, its strict
    rendezvous dry run, memory (`memory` overrides as in `pipec check --mem`), the simulated timeline
    under the schedule's costs, and (unless told not to) the schedule's `expect`s (E405). A schedule
    is compiled with `data_parallel` (default: none); an fsdp Program's memory is recomputed from its
    windows.
    """
    from pipec.driver import check_expectations  # the driver's: its simulations for `overlap_gain`
    from pipec.sim.costs import cost_model
    from pipec.sim.memory import memory_model
    from pipec.sim.simulate import simulate, stats

    if isinstance(target, Listing):
        target = target.build()
    if isinstance(target, Program):
        problem = program_problem(target)
        if problem:
            _fail(problem)
        sched = _schedule_of(target)
        costs = cost_model(sched)
        tl = simulate(target, costs)
        critical = _timeline_check(target, costs, tl)
        return Checked(0, target.num_instructions, len(tl.msg_send), tl.makespan, critical, 0)
    if isinstance(target, CompiledSchedule):
        sched, compiled = target.schedule, target
        problem = schedule_problem(sched)
        if problem:
            _fail(f"pipec compiled a schedule that is broken: {problem}")
    else:
        sched = target
        problem = schedule_problem(sched)
        over = []
        fsdp = data_parallel is not None and data_parallel.kind == "fsdp"
        if (problem is None or problem.startswith("deadlock")) and not fsdp:  # fsdp: after lowering, below
            model = memory_model(sched, memory)
            limit = model["limit"]
            peaks = _memory_peaks(sched, model)
            over = [r for r, peak in enumerate(peaks) if not np.isnan(limit[r]) and peak > limit[r] + 1e-9]
        # What pipec must say: E3xx for a broken schedule (checked first), then E402 (memory is checked
        # before deadlock), then E401.
        if problem is not None and not problem.startswith("deadlock"):
            expected, why = "E3", problem
        elif over:
            expected, why = "E402", f"rank {over[0]} is over its memory limit"
        elif problem is not None:
            expected, why = "E401", problem
        else:
            expected, why = None, None
        try:
            check_schedule(sched)
            dp_args = () if data_parallel is None else (data_parallel,)
            compiled = compile_schedule(sched, memory, *dp_args)
        except PipecError as e:
            if fsdp and e.code == "E402" and expected is None:
                expected, why = _fsdp_over(sched, memory, data_parallel)
            if e.code in _PIPEC_CODES and (expected is None or not e.code.startswith(expected)):
                said = e.diagnostics[0].message
                _fail(f"pipec reports {e.code} ({said}), but " + (why or "the schedule is valid and fits"))
            raise
        if expected is not None:
            _fail(f"pipec accepts a schedule it should reject ({expected}): {why}")
    prog = compiled.program
    problem = program_problem(prog, sched)
    if problem:
        _fail(f"the lowered program is wrong: {problem}")
    model = memory_model(sched, memory)
    peaks = _fsdp_peaks(prog, sched, model) if prog.dp_kind == "fsdp" else _memory_peaks(sched, model)
    for rep in compiled.memory:
        if abs(rep.peak - peaks[rep.rank]) > 1e-9 * max(1.0, abs(peaks[rep.rank])):
            _fail(f"rank {rep.rank}: pipec's peak memory {rep.peak:g}, recomputed {peaks[rep.rank]:g}")
        if rep.limit is not None and rep.peak > rep.limit + 1e-9:
            _fail(f"rank {rep.rank}: peak memory {rep.peak:g} above its limit {rep.limit:g}")
    costs = cost_model(sched)
    tl = simulate(prog, costs)
    critical = _timeline_check(prog, costs, tl)
    n_expect = check_expectations(sched, prog, stats(tl)) if expectations else 0
    return Checked(sched.num_ops, prog.num_instructions, len(tl.msg_send), tl.makespan, critical, n_expect)
