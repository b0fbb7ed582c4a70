"""The buffer plan (issue 43, part 1): every tensor a rank holds for a micro-batch gets a slot, slots reused by
lifetime, and a proof that no two tensors live at once share one (docs/memory.md, "Buffer plan").

The tensors and their lifetimes, per rank, along its instruction stream (positions are instruction indices; an
instruction bound to the next by `group` shares its position range, so the two halves of an overlapped pair
or a batched exchange count as one moment):

- `input` of stage s along in-edge e = (u, s), micro-batch i: born when its receive is posted (`RECV_ACT i s`,
  or, with receives posted `ahead`, at the receive that many before it in the rank's stream: where gloo's
  runtime posts it, the step's start for the first ones), or at `FWD i u` when u is on the same rank
  (handed over locally); it lives until what F(i, s) saved is
  released: its last backward piece (`WGRAD i s` with split backward, else `BWD i s`; `FWD i s` in a
  forward-only Program), because the stage's autograd keeps its input (pipec.sim.memory counts it in `act`).
- `grad` of stage s along out-edge e = (s, v): born when its receive is posted (`RECV_GRAD i s`, moved back
  as an input's with `ahead`), or at `BWD i v` when v is on the same rank; it dies at `BWD i s`, which
  consumes it, or with split backward at `WGRAD i s`: the runtime's B keeps it for W (the gradients W starts
  from can be that very tensor, and the first stage defers its whole backward to W).
- `saved` of stage s: what F(i, s) keeps beyond its inputs that B frees (the model's `act` less the
  stage's input messages; with split backward less `wact` too); `wsaved`: with split backward, what the
  same F keeps for W beyond its inputs (`wact` less the inputs). Both are made at `FWD i s` (at
  `RECOMPUTE i s` when recomputed: until then only `ckpt`, what a recomputed F keeps beyond its inputs,
  lives); `saved` is freed at `BWD i s`, `wsaved` at `WGRAD i s`. From F to B they hold the walk's `act`
  with the inputs, from B to W its `wact`: autograd's saved tensors are not copied when B frees some.
- An `OFFLOAD i s` ends the device copy of what (i, s) holds (its inputs and its `saved` or `ckpt`) and
  begins a host copy of each (the `host` pools, same classes); `RELOAD i s` ends the host copy and begins
  a new device copy in the same pool (one shape: it may land in another slot).

Each class (kind, stage, edge, tokens, pool) is one pool of interchangeable slots. Classes of one size, one
family (messages, or saved tensors: pipec.ir.buffers.FAMILY), one token count and one side share a bank
(`banks`), and each bank is coloured greedily by birth (optimal for intervals: a bank's slots are the most
of its tensors live at once). Why banks of equal size and not one arena per rank packed by offsets: the
runtime allocates the receive slots itself, from the shapes of the handshake, in its own bytes; an arena's
offsets are in the memory model's unit and would have to be packed again there, while a slot of one shape
is reused as it is (the runtime shares a bank only where its classes' shapes agree, `banks` over the
handshake's specs). Saved tensors are autograd's: their banks are what an allocator of them would need, and
they never share with messages, so the plan's message bytes are the runtime's. Sizes are the
memory model's (`pipec.sim.memory.memory_model`): messages take the cost model's `act_bytes` / `grad_bytes`
per edge where given, else the receiver's `ckpt` (its input) shared over its in-edges.

The rule of what lives when is written once, `lifetimes` (the runtime's receive slots read it too:
pipec.runtime.exec.buffers); `plan_buffers` colours it, `prove` checks a plan (made here or read from a file)
against it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from pipec.errors import Source, error
from pipec.ir.buffers import FAMILY, BufferPlan, Pool, RankPlan
from pipec.ir.graph import graph_of
from pipec.ir.opcodes import BWD, FWD, OFFLOAD, OPCODES, RECOMPUTE, RECV_ACT, RECV_GRAD, RELOAD, WGRAD
from pipec.ir.program import Program

# A pool key: (kind, stage, edge, tokens, host).
Key = tuple[str, int, int, int, bool]


@dataclass(frozen=True, eq=False)
class Lifetimes:
    """A rank's tensors in the plan's order (by birth, then pool key, then micro-batch): each one's class,
    micro-batch (unit), and first and last position (instruction indices, both inclusive)."""

    keys: tuple[Key, ...]  # the classes, in order of first appearance
    pool: np.ndarray  # per tensor, an index into keys
    mb: np.ndarray
    birth: np.ndarray
    death: np.ndarray


def _positions(group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per instruction, the first and last index of its group (an instruction alone: its own)."""
    n = len(group)
    j = np.arange(n)
    g = np.asarray(group, bool)
    lo = np.where(np.concatenate([[False], g[:-1]]) if n else g, j - 1, j)
    hi = np.where(g, np.minimum(j + 1, n - 1), j)
    return lo, hi


def _tokens(prog: Program) -> np.ndarray | None:
    """Per unit, the class's token count with token slices (slices of one length share a shape), else None."""
    sl = prog.slicing
    return sl.unit_tokens() if sl is not None and sl.slices > 1 else None


def lifetimes(prog: Program, rank: int, ahead: int = 0) -> Lifetimes:
    """The rule (the module docstring): rank `rank`'s tensors and when each lives, its receives posted `ahead`
    receives early. A class the memory model sizes 0 (a stage whose F keeps no more than its input) still has
    its tensors and slots, at no cost, so the proof needs no sizes."""
    if ahead < 0:
        raise ValueError(f"receives posted ahead must be at least 0, got {ahead}")
    rp = prog.ranks[rank]
    g = graph_of(prog)
    place = prog.placement
    op, mb, st = rp.op.tolist(), rp.mb.tolist(), rp.stage.tolist()
    other = rp.other.tolist() if rp.other is not None else None
    lo, hi = (x.tolist() for x in _positions(rp.group))
    at: dict[tuple[int, int, int], int] = {}  # (opcode, mb, stage) -> index (computes, memory ops)
    recv: dict[tuple[int, int, int, int], int] = {}  # (opcode, mb, stage, other stage) -> where it is posted
    order: list[int] = []  # the receives in stream order
    for j, (o, i, s) in enumerate(zip(op, mb, st)):
        if o in (RECV_ACT, RECV_GRAD):
            t = other[j] if other is not None and other[j] >= 0 else s + (-1 if o == RECV_ACT else 1)
            k = len(order)
            order.append(j)
            recv[(o, i, s, t)] = order[k - ahead] if k >= ahead else 0
        else:
            at.setdefault((o, i, s), j)
    tok = _tokens(prog)
    out: list[tuple[int, Key, int, int, int]] = []  # (birth, key, mb, birth, death)

    def add(kind: str, s: int, e: int, i: int, a: int, b: int, host: bool = False) -> None:
        key = (kind, s, e, int(tok[i]) if tok is not None else -1, host)
        out.append((lo[a], key, i, lo[a], hi[b]))

    def moved(kind: str, s: int, e: int, i: int, a: int, b: int, off: int | None, rel: int | None) -> None:
        """A tensor from position a to b, its device copy cut by an OFFLOAD .. RELOAD inside it."""
        if off is not None and rel is not None and a <= off < rel <= b:
            add(kind, s, e, i, a, off)
            add(kind, s, e, i, off, rel, True)
            add(kind, s, e, i, rel, b)
        else:
            add(kind, s, e, i, a, b)

    for (o, i, s), f in at.items():
        if o != FWD or place[s] != rank:
            continue
        b, w = at.get((BWD, i, s)), at.get((WGRAD, i, s))
        release = w if w is not None else b if b is not None else f
        rc, off, rel = at.get((RECOMPUTE, i, s)), at.get((OFFLOAD, i, s)), at.get((RELOAD, i, s))
        for e in g.in_edges(s).tolist():
            u = int(g.src[e])
            born = at.get((FWD, i, u)) if place[u] == rank else recv.get((RECV_ACT, i, s, u))
            if born is not None:
                moved("input", s, e, i, born, release, off, rel)
        if b is None:  # forward only: F keeps nothing
            continue
        made = f  # where the saved activations are made: F, or the RECOMPUTE that runs it again
        if rc is not None:
            moved("ckpt", s, -1, i, f, rc, off, rel)
            made = rc
        moved("saved", s, -1, i, made, b, off, rel)
        if w is not None:  # what W needs was saved by the same forward, and outlives B
            moved("wsaved", s, -1, i, made, w, off, rel)
        for e in g.out_edges(s).tolist():
            v = int(g.dst[e])
            born = at.get((BWD, i, v)) if place[v] == rank else recv.get((RECV_GRAD, i, s, v))
            if born is not None:
                add("grad", s, e, i, born, w if w is not None else b)  # split backward: B keeps it for W
    out.sort(key=lambda x: (x[0], x[1], x[2]))
    keys: dict[Key, int] = {}
    pool = [keys.setdefault(k, len(keys)) for _, k, _, _, _ in out]
    col = lambda n: np.array([x[n] for x in out], dtype=np.int64)  # noqa: E731
    return Lifetimes(tuple(keys), np.array(pool, dtype=np.int64), col(2), col(3), col(4))


def colour(life: Lifetimes, bank: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per tensor its slot, and per bank its slot count: greedy by birth, the lowest free slot first (a slot
    is free once its tensor's last position is before the new one's first). `bank`: per class its bank (the
    classes sharing slots, `banks`); None: each class its own."""
    group = np.arange(len(life.keys)) if bank is None else np.asarray(bank, dtype=np.int64)
    n = int(group.max()) + 1 if len(group) else 0
    slot = np.zeros(len(life.pool), dtype=np.int64)
    busy: list[list[tuple[int, int]]] = [[] for _ in range(n)]  # per bank: (death, slot) heaps
    free: list[list[int]] = [[] for _ in range(n)]
    count = [0] * n
    for t, (k, a, b) in enumerate(zip(group[life.pool].tolist(), life.birth.tolist(), life.death.tolist())):
        while busy[k] and busy[k][0][0] < a:
            heapq.heappush(free[k], heapq.heappop(busy[k])[1])
        if free[k]:
            s = heapq.heappop(free[k])
        else:
            s, count[k] = count[k], count[k] + 1
        slot[t] = s
        heapq.heappush(busy[k], (b, s))
    return slot, np.array(count, dtype=np.int64)


def banks(keys: tuple[Key, ...], shape: Callable[[Key], Hashable]) -> np.ndarray:
    """Per class its bank: classes of one family (pipec.ir.buffers.FAMILY), one `shape` (the memory model's
    size for the plan; the handshake's specs for the runtime), one token count and one side share slots.
    Banks are numbered by first appearance."""
    ids: dict[tuple, int] = {}
    return np.array([ids.setdefault((FAMILY[k[0]], shape(k), k[3], k[4]), len(ids)) for k in keys], dtype=np.int64)


# ---- sizes ----------------------------------------------------------------------------------------------


def class_sizes(
    prog: Program,
    model: Mapping[str, np.ndarray],
    act_bytes: np.ndarray | None = None,
    grad_bytes: np.ndarray | None = None,
) -> tuple[dict[Key, float], dict[Key, str]]:
    """Every class's amount in the memory model's unit, and the classes whose amount is an upper bound (with
    why). `act_bytes` / `grad_bytes` (per sending stage, the cost model's) size the messages where > 0;
    else an edge into v carries v's `ckpt` (its input) over its in-edges."""
    g = graph_of(prog)
    S = prog.num_stages
    act, wact, ckpt = (np.asarray(model[k], dtype=float) for k in ("act", "wact", "ckpt"))
    n_in = np.bincount(g.dst, minlength=S) if g.num_edges else np.zeros(S, np.int64)
    msg_act, msg_grad = np.zeros(max(g.num_edges, 1)), np.zeros(max(g.num_edges, 1))
    for e, (u, v) in enumerate(g.edges):
        fallback = ckpt[v] / max(int(n_in[v]), 1)
        a = float(act_bytes[u]) if act_bytes is not None and act_bytes[u] > 0 else fallback
        gb = float(grad_bytes[v]) if grad_bytes is not None and grad_bytes[v] > 0 else a
        msg_act[e], msg_grad[e] = a, gb
    inputs = np.zeros(S)
    for e, (_, v) in enumerate(g.edges):
        inputs[v] += msg_act[e]
    sl = prog.slicing
    shares: dict[int, float] = {-1: 1.0}
    bound: dict[Key, str] = {}
    if sl is not None and sl.slices > 1:
        shares = {int(t): float(t) / sl.seqlen for t in sl.unit_tokens().tolist()}
    elif sl is not None:
        shares = {-1: float(sl.share().max())}
    varlen = sl is not None and sl.slices == 1 and len(set(sl.lengths)) > 1
    moe = prog.a2a_layers
    out: dict[Key, float] = {}
    for t, share in shares.items():
        for host in (False, True):
            for s in range(S):
                kept = max(wact[s], inputs[s]) if prog.split_backward else inputs[s]  # what outlives B
                for kind, amount in (
                    ("saved", act[s] - kept),
                    ("wsaved", wact[s] - inputs[s]),
                    ("ckpt", ckpt[s] - inputs[s]),
                ):
                    key = (kind, s, -1, t, host)
                    out[key] = max(float(amount), 0.0) * share
                    if moe[s]:
                        bound[key] = "MoE token counts (the model's amount; a larger count falls back)"
            for e, (u, v) in enumerate(g.edges):
                out[("input", v, e, t, host)] = msg_act[e] * share
                out[("grad", u, e, t, host)] = msg_grad[e] * share
    if varlen:
        for key in out:
            bound.setdefault(key, "the longest micro-batch")
    return out, bound


# ---- the pass and its proof -----------------------------------------------------------------------------


def plan_buffers(
    prog: Program,
    model: Mapping[str, np.ndarray],
    act_bytes: np.ndarray | None = None,
    grad_bytes: np.ndarray | None = None,
    ahead: int = 0,
) -> BufferPlan:
    """The plan of a Program under a memory model (`pipec.sim.memory.memory_model`), its receives posted
    `ahead` (gloo's runtime: pipec.ir.buffers.GLOO_RECV_AHEAD), proven (`prove`)."""
    from pipec.sim.memory import unit_of

    sizes, bound = class_sizes(prog, model, act_bytes, grad_bytes)
    ranks = []
    for r in range(prog.num_ranks):
        life = lifetimes(prog, r, ahead)
        bank = banks(life.keys, sizes.__getitem__)
        slot, count = colour(life, bank)
        pools = tuple(
            Pool(*k, int(count[b]), sizes[k], bound.get(k, ""), int(b)) for k, b in zip(life.keys, bank.tolist())
        )
        ranks.append(RankPlan(pools, life.pool, life.mb, slot))
    plan = BufferPlan(unit_of(model), tuple(ranks), ahead)
    prove(prog, plan)
    return plan


def plan_for(prog: Program, model: Mapping[str, np.ndarray], ahead: int | None = None) -> BufferPlan:
    """The plan a caller asks for with `ahead` receives posted ahead: the Program's own where it carries one
    made for that many (or `ahead` is None: whatever it was made for), else one made here (for 0 when None).
    `pipec compile --buffers`, `pipec check --memory` and `pipec.compile(buffers=True)` all ask here."""
    own = prog.buffers
    if own is not None and (ahead is None or own.ahead == ahead):
        return own
    return plan_buffers(prog, model, ahead=ahead or 0)


def with_plan(prog: Program, model: Mapping[str, np.ndarray], ahead: int | None = None) -> Program:
    """The Program carrying `plan_for`'s plan (written as format version 3): itself when that is its own."""
    plan = plan_for(prog, model, ahead)
    return prog if plan is prog.buffers else replace(prog, buffers=plan)


def prove(prog: Program, plan: BufferPlan, source: Source | None = None) -> None:
    """E502 unless, on every rank, every tensor of the rule (`lifetimes`, with the plan's `ahead`) has a slot of
    its class's pool, in the plan's order, the pools of a bank agree (one size, family, token count, side and
    slot count), and no two tensors live at once share a slot (a bank's slot k is one slot for all its pools)."""

    def fail(r: int, text: str):
        return error("E502", f"the buffer plan does not hold on rank {r}: {text}", source=source)

    if len(plan.ranks) != prog.num_ranks:
        raise error(
            "E502", f"the buffer plan has {len(plan.ranks)} ranks; the Program has {prog.num_ranks}", None, source
        )
    for r, rp in enumerate(plan.ranks):
        index = {p.key: k for k, p in enumerate(rp.pools)}
        life = lifetimes(prog, r, plan.ahead)
        if len(index) != len(rp.pools):
            raise fail(r, "two pools of one class")
        lead: dict[int, Pool] = {}
        for p in rp.pools:
            q = lead.setdefault(p.bank, p) if p.bank >= 0 else p
            same = (q.size, FAMILY[q.kind], q.tokens, q.host, q.slots) == (
                p.size,
                FAMILY[p.kind],
                p.tokens,
                p.host,
                p.slots,
            )
            if not same:
                raise fail(
                    r, f"bank {p.bank} joins the {q.describe()} and the {p.describe()}, which cannot share slots"
                )
        want = np.array([index.get(k, -1) for k in life.keys], dtype=np.int64)[life.pool]
        if (want < 0).any():
            j = int(np.flatnonzero(want < 0)[0])
            raise fail(r, f"micro-batch {int(life.mb[j])}'s {Pool(*life.keys[life.pool[j]]).describe()} has no pool")
        if len(want) != len(rp) or not (np.array_equal(want, rp.pool) and np.array_equal(life.mb, rp.mb)):
            j = _first_difference(want, life.mb, rp.pool, rp.mb)
            shown = _tensor(prog, r, rp.pools, want, life, j) if j < len(want) else "none"
            raise fail(r, f"its tensors do not match the Program's: tensor #{j} should be {shown}")
        slots = np.array([p.slots for p in rp.pools], dtype=np.int64)
        out = (rp.slot < 0) | (rp.slot >= slots[rp.pool]) if len(rp) else np.zeros(0, bool)
        if out.any():
            j = int(np.flatnonzero(out)[0])
            tensor = _tensor(prog, r, rp.pools, rp.pool, life, j)
            raise fail(r, f"{tensor} has slot {int(rp.slot[j])}, outside its pool's {int(slots[rp.pool[j]])}")
        bank = np.array([p.bank for p in rp.pools], dtype=np.int64)
        space = np.where(bank >= 0, bank, len(rp.pools) + np.arange(len(rp.pools)))[rp.pool]  # whose slots
        order = np.lexsort((life.birth, rp.slot, space))
        same = (space[order][1:] == space[order][:-1]) & (rp.slot[order][1:] == rp.slot[order][:-1])
        clash = same & (life.death[order][:-1] >= life.birth[order][1:])
        if clash.any():
            k = int(np.flatnonzero(clash)[0])
            a, b = int(order[k]), int(order[k + 1])
            raise fail(
                r,
                f"{_tensor(prog, r, rp.pools, rp.pool, life, a)} and {_tensor(prog, r, rp.pools, rp.pool, life, b)}"
                f" share slot {int(rp.slot[a])} while both live",
            )


def _first_difference(a_pool, a_mb, b_pool, b_mb) -> int:
    n = min(len(a_pool), len(b_pool))
    diff = np.flatnonzero((a_pool[:n] != b_pool[:n]) | (a_mb[:n] != b_mb[:n]))
    return int(diff[0]) if len(diff) else n


def _tensor(prog: Program, r: int, pools, pool: np.ndarray, life: Lifetimes, j: int) -> str:
    """`micro-batch 3's saved activations of stage 1 (FWD 3 1 .. BWD 3 1)`: a tensor and its lifetime."""
    rp = prog.ranks[r]

    def instr(k: int) -> str:
        return f"{OPCODES[int(rp.op[k])]} {int(rp.mb[k])} {int(rp.stage[k])}" if 0 <= k < len(rp) else f"#{k}"

    what = pools[int(pool[j])].describe() if 0 <= int(pool[j]) < len(pools) else f"pool {int(pool[j])}"
    return f"micro-batch {int(life.mb[j])}'s {what} (`{instr(int(life.birth[j]))}` .. `{instr(int(life.death[j]))}`)"


# ---- figures --------------------------------------------------------------------------------------------


def over_peak(plan: BufferPlan, peaks, resident) -> list[float]:
    """Per rank, the plan's device amount plus its resident parameters less the walk's peak (what packing
    by bank costs beyond the walk; negative: below it)."""
    return [float(a + p - q) for a, p, q in zip(plan.device(), resident, peaks)]


def live_peak(prog: Program, plan: BufferPlan) -> list[float]:
    """Per rank, the most the plan's device tensors hold at once (each at its class's size): what one arena
    packed by lifetime would need, against the plan's banks, each sized for its own busiest moment."""
    out = []
    for r, rp in enumerate(plan.ranks):
        life = lifetimes(prog, r, plan.ahead)
        size = np.array([0.0 if p.host else p.size for p in rp.pools])[rp.pool] if len(rp) else np.zeros(0)
        n = len(prog.ranks[r]) + 2
        level = np.zeros(n)
        np.add.at(level, life.birth, size)
        np.add.at(level, life.death + 1, -size)
        out.append(max(float(np.cumsum(level).max(initial=0.0)), 0.0))
    return out
