"""The memory model of DESIGN.md, per rank: two pools, the device and the host.

Device pool, per stage: `act` is held from F until B frees it; with split
backward, B holds `wact` until W frees it; `params` (weights, gradients,
optimizer state) is held throughout. Memory ops (`Schedule.memops`, lowered to
RECOMPUTE/OFFLOAD/RELOAD instructions): a forward whose (micro-batch, stage)
has a RECOMPUTE keeps only `ckpt` (its input); the RECOMPUTE runs the forward
again and replaces that `ckpt` with the full `act` (the saved activations
include the stage's input), which B then frees. An OFFLOAD moves what the
forward kept (`act`, or `ckpt` when recomputed) from the device pool to the
host pool; its RELOAD moves it back. The host pool holds nothing else. One
function says what each instruction does to both pools (`deltas`), and one
table when in an instruction's run it does it (`DEVICE_AT_START`,
`HOST_AT_START`). Every consumer reads them:

- the schedule-level walk (`walk`, `rank_memory`: the ops with their memops
  merged at their `before` indices) and the Program-level walk
  (`program_memory`: `instruction_deltas` of the lowered stream); their
  diagnostics (E402, E406) and table are `pipec.passes.memcheck`'s;
- the curves over time (`pipec.sim.memtime`);
- the partition search (`positions`: each rank's live amounts as linear
  functions of the per-stage sizes, so a split's peak is the walk's);
- the list scheduler of `order` blocks (`compute_deltas`);
- synth's exact solver (`unit_holds`: each (micro-batch, stage)'s amounts as
  intervals between its instructions' starts and ends);
- `expect in_flight(r)` (the walk of both pools under `counting_model`).

Units. Without measured bytes the model is in abstract units of one
micro-batch's activations for a rank's share of the model: act = p / S per
stage (1 with one stage per rank, 1/v with v chunks, so schedules compare at
equal model size), wact = half of that (W keeps roughly the layer inputs and
output gradients, about half of what B needed), ckpt = act / 8, params = 0, no
limits. ckpt = act / 8: a transformer layer saves about 34 s b h bytes of
activations for its backward against 2 s b h of input (Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models", 2022: 1/17),
and a stage of k blocks of examples/mlp.py (a Linear and its GELU, each saving
its input) 2k times its input, 1/8 at k = 4; a measured `input_bytes` replaces
it. The schedule's `memory` declarations override the
defaults, and command-line overrides (`--mem`, `--memory-limit`,
`--host-memory-limit`) override both.

Bytes. When the costs give measured bytes (the per-stage cost keys
`saved_bytes`, `wsaved_bytes`, `input_bytes`, `state_bytes`, from the
schedule's `cost` declarations or from cost documents as `memory_bytes`
extracts them into the overrides), the model is in bytes: act <- saved_bytes,
wact <- wsaved_bytes, ckpt <- input_bytes, params <- state_bytes, for the keys
given. `saved_bytes` must be among them (the other defaults scale from it): a
key not given takes its default relative to the measured act (wact = act / 2,
ckpt = act / 8, params = 0). The schedule's own `memory` declarations are in
abstract units unless the schedule itself declares byte costs, so under
measured bytes from a cost file they are not used (`limit` included: give
`--memory-limit 80GiB`); limits are then bytes.

Data parallelism. Under ddp every replica holds its stages' `params` whole.
Under fsdp with N replicas a stage's parameters, gradients and optimizer state
are sharded: the rank holds params / N throughout, and params * (N - 1) / N
more while the stage is gathered, between an `UNSHARD` and its `RESHARD`. The
windows are the Program's, so the fsdp model walks the lowered instruction
stream; a peak is named by the compute at or before it (the first compute
when the peak comes before any).

Stage graphs (pipec.ir.graph: skip connections, fan-in, fan-out). The walk is
per stage and per instruction, so a graph changes none of its rules: a stage's
`act` is what its F keeps for its B, whatever it reads and whoever reads it.
What that means on a graph. Fan-in: the inputs a stage receives on its several
in-edges are part of its own saved activations (a measured `saved_bytes` is
what its F saved, the inputs it keeps included), held from its F until its B
like the rest; they are not counted again as buffers. Fan-out: the output a
stage sends on several out-edges is one tensor, kept (as part of the sender's
`act`) until the sender's own B; since B(i, u) needs B(i, v) for every edge
(u, v) (`pipec.ir.rules`), that B comes after every consumer's B, so an
activation sent on a fan-out lives until its last consumer's B (and the
sender's B that follows), counted once however many edges carry it. Neither on
the chain nor on a graph does the walk hold send or receive buffers of their
own: a message is the sender's output or the receiver's input, both counted in
a stage's `act`. The bytes on the wire per edge are the cost model's
(`pipec.sim.costs`: `act_bytes` per sending stage on each of its out-edges).

Token slices and sequence lengths (pipec.ir.schedule.Slicing). `act` and `wact`
are a whole sequence's; a unit (a slice, or a micro-batch of its own length)
holds its share of the tokens (`Slicing.share`). A slice's keys and values,
which the later slices of its sequence read, are part of what its F keeps and
live exactly as long: its B, after every later slice's B, frees them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pipec.errors import error
from pipec.ir.opcodes import (
    BWD,
    CODE,
    COMPUTE_OF_KIND,
    FWD,
    IS_COMPUTE,
    IS_MEMOP,
    OFFLOAD,
    OPCODES,
    RECOMPUTE,
    RELOAD,
    RESHARD,
    UNSHARD,
    WGRAD,
)
from pipec.ir.schedule import MEMORY_RANK_KEYS, MEMORY_STAGE_KEYS, Op, Schedule, Slicing

if TYPE_CHECKING:
    from pipec.ir.program import Program

DEFAULTS = {"act": 1.0, "wact": 0.5, "params": 0.0}  # per rank share; scaled by p / S per stage
CKPT_OF_ACT = 1.0 / 8  # ckpt's default, a fraction of act (the module docstring says why)
STAGE_KEYS = MEMORY_STAGE_KEYS  # per stage
RANK_KEYS = MEMORY_RANK_KEYS  # per rank
# The measured byte cost keys (pipec.ir.schedule.STAGE_COST_KEYS) and the pool each sets.
BYTE_KEYS = {"saved_bytes": "act", "wsaved_bytes": "wact", "input_bytes": "ckpt", "state_bytes": "params"}


@dataclass(frozen=True)
class RankMemory:
    rank: int
    peak: float  # device pool
    peak_index: int  # index into the rank's ops; -1 when the rank has no ops
    peak_op: Op | None
    live_act: tuple[tuple[int, int], ...]  # (micro-batch, stage) holding activations on the device at the peak
    live_wact: tuple[tuple[int, int], ...]  # (micro-batch, stage) holding W inputs at the peak
    params: float  # the rank's parameters held throughout (fsdp: its shards)
    limit: float | None
    gathered: tuple[int, ...] = ()  # fsdp: the stages gathered (UNSHARD .. RESHARD) at the peak
    host_peak: float = 0.0  # host pool
    host_limit: float | None = None
    unit: str = "units"  # or "bytes"
    peak_memop: int = -1  # the peak is at this memop (index into Schedule.memops[rank]); -1: at a compute
    # The OFFLOAD at the host peak, or where the host pool first passes its limit: its text, its index into
    # Schedule.memops[rank] (-1 unknown) and the (micro-batch, stage) on the host there.
    host_op: str | None = None
    host_memop: int = -1
    live_host: tuple[tuple[int, int], ...] = ()
    # The schedule's token slices (None: none): then every micro-batch above is a unit, which the texts
    # below name as people read it (`F(1, slice 2, stage 0)`, `1s2`).
    slicing: Slicing | None = None

    @property
    def at_text(self) -> str | None:
        """The op at the peak as reports name it: `F(3, stage 1)`, `F(1, slice 2, stage 1)` with slices."""
        if self.peak_op is None:
            return None
        o = self.peak_op
        return self.slicing.op_text(o.kind, o.mb, o.stage) if self.slicing else str(o)

    def unit_text(self, mb: int) -> str:
        """A micro-batch of the live lists: `3`, or `1s2` (slice 2 of micro-batch 1; pipec.ir.schedule)."""
        from pipec.ir.schedule import unit_label

        return unit_label(self.slicing, mb)


# ---- the model -----------------------------------------------------------------


def memory_bytes(cost_docs: Iterable[Mapping]) -> dict[str, object]:
    """The measured byte keys of cost documents (`pipec.sim.cost_files.normalize`'d; later wins), as memory
    overrides: pass them to `memory_model` (or `compile_schedule`) with the others."""
    out: dict[str, object] = {}
    for doc in cost_docs:
        out.update({k: doc[k] for k in BYTE_KEYS if k in doc})
    return out


def _per(value, n: int, what: str) -> np.ndarray:
    arr = np.asarray(value, dtype=float)
    if arr.ndim == 0:
        return np.full(n, float(arr))
    if len(arr) != n:
        raise error("E801", f"`{what}` lists {len(arr)} values but the schedule has {n} stages")
    return arr.copy()


def memory_model(sched: Schedule, overrides: Mapping[str, object] | None = None) -> dict[str, np.ndarray]:
    """Per-stage act/wact/ckpt/params and per-rank limit/host_limit (NaN for none), after defaults,
    declarations, measured bytes and overrides (the module docstring); `in_bytes` (a 0-d bool array)
    says whether the model is in bytes. `overrides` takes the keys above (one number each) and the byte
    cost keys (`memory_bytes`; a number or one per stage)."""
    overrides = dict(overrides or {})
    S, R = sched.num_stages, sched.num_ranks
    own = {k: sched.costs[k] for k in BYTE_KEYS if k in sched.costs}
    measured = {**own, **{k: overrides[k] for k in BYTE_KEYS if k in overrides}}
    in_bytes = bool(measured)
    if in_bytes and "saved_bytes" not in measured:
        raise error(
            "E801",
            f"memory in bytes needs `saved_bytes` (what a stage's F keeps for its B); got {', '.join(measured)}",
        )
    decl = sched.memory if (own or not in_bytes) else {}
    out: dict[str, np.ndarray] = {}
    share = R / S
    for key in STAGE_KEYS:
        src = next((k for k, pool in BYTE_KEYS.items() if pool == key and k in measured), None)
        if key in overrides:
            out[key] = np.full(S, float(overrides[key]))
        elif src is not None:
            out[key] = _per(measured[src], S, src)
        elif key in decl:
            out[key] = np.asarray(decl[key], dtype=float)
        elif key == "ckpt":
            out[key] = out["act"] * CKPT_OF_ACT
        elif in_bytes:
            out[key] = out["act"] * (DEFAULTS[key] / DEFAULTS["act"])
        else:
            out[key] = np.full(S, DEFAULTS[key] * share)
    for key in RANK_KEYS:
        if key in overrides:
            out[key] = np.full(R, float(overrides[key]))
        elif key in decl:
            out[key] = np.asarray(decl[key], dtype=float)
        else:
            out[key] = np.full(R, np.nan)
    out["in_bytes"] = np.array(in_bytes)
    if sched.slicing is not None:  # act and wact are per whole sequence: a unit holds its tokens' share
        out["unit_share"] = sched.slicing.share()
    return out


def unit_of(model: Mapping[str, np.ndarray]) -> str:
    """ "bytes" when the model is in measured bytes, else "units"."""
    return "bytes" if bool(model.get("in_bytes", False)) else "units"


def fmt_memory(x: float, unit: str = "units") -> str:
    """One amount of memory for people: GiB/MiB/KiB/B in bytes, the number itself in abstract units."""
    if unit != "bytes":
        return f"{x:g}"
    from pipec.ir.units import fmt_bytes

    return fmt_bytes(x)


# ---- the rule: what each instruction does to the two pools ---------------------


def deltas(
    op: np.ndarray, mb: np.ndarray, st: np.ndarray, model: Mapping[str, np.ndarray], split: bool, dp: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Per instruction of one rank's stream (opcodes of pipec.ir.opcodes), its change to the device pool and
    to the host pool: the module docstring's rule, the one place it is written. `dp` > 1: fsdp's gathered
    windows (UNSHARD adds, RESHARD frees params * (dp - 1) / dp)."""
    act, wact, ckpt, params = (np.asarray(model[k], dtype=float) for k in STAGE_KEYS)
    S = len(act)
    s = np.clip(st, 0, S - 1)
    key = np.where(mb >= 0, mb, 0) * S + s
    recomputed = np.isin(key, key[op == RECOMPUTE]) if (op == RECOMPUTE).any() else np.zeros(len(op), bool)
    kept = np.where(recomputed, ckpt[s], act[s])  # what the forward keeps, and what OFFLOAD/RELOAD move
    after_b = wact[s] if split else 0.0
    dev = np.select(
        [op == FWD, op == RECOMPUTE, op == BWD, op == WGRAD, op == OFFLOAD, op == RELOAD],
        [kept, act[s] - ckpt[s], after_b - act[s], -wact[s], -kept, kept],
        0.0,
    )
    host = np.where(op == OFFLOAD, kept, np.where(op == RELOAD, -kept, 0.0))
    if "unit_share" in model:  # token slices or sequence lengths: a unit holds its share of a sequence's
        share = np.asarray(model["unit_share"])[np.where(mb >= 0, mb, 0)]  # (its keys and values too)
        dev, host = dev * share, host * share
    if dp > 1:
        extra = params[s] * (dp - 1) / dp
        dev = dev + np.where(op == UNSHARD, extra, np.where(op == RESHARD, -extra, 0.0))
    return dev, host


def _when(names: tuple[str, ...]) -> np.ndarray:
    out = np.zeros(len(OPCODES), dtype=bool)
    out[[CODE[n] for n in names]] = True
    return out


# When, in a compute or host-link instruction's run, its change to each pool happens: at its start (True) or at
# its end. Memory is allocated as a forward (or recomputation) runs and freed when a backward piece is done; both
# pools hold a micro-batch during a transfer (an OFFLOAD frees the device copy at its end, a RELOAD allocates it
# at its start; the host copy the other way round). `pipec.sim.memtime` times its curves by it, synth's solver
# places its intervals by it (`unit_holds`).
DEVICE_AT_START = _when(("FWD", "RECOMPUTE", "RELOAD"))
HOST_AT_START = _when(("OFFLOAD",))


def resident(
    placement: tuple[int, ...] | np.ndarray, model: Mapping[str, np.ndarray], num_ranks: int, dp: int = 1
) -> np.ndarray:
    """Per rank, what its device pool holds throughout: its stages' params (fsdp over dp replicas: a shard).
    All ranks at once: one rank at a time read the whole placement each, quadratic in p."""
    place = np.asarray(placement, dtype=np.int64)
    params = np.asarray(model["params"], float)
    return np.bincount(place, weights=params, minlength=num_ranks)[:num_ranks] / dp


def _fsdp(prog: Program) -> int:
    return prog.dp if prog.dp_kind == "fsdp" else 1


def instruction_deltas(prog: Program, model: Mapping[str, np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per rank of a Program, each instruction's change to the device pool and to the host pool (the
    pools start at `resident` and 0). `program_memory`'s peaks and `pipec.sim.memtime`'s curves are
    their running sums, in instruction order and in time order."""
    cols = [np.concatenate([getattr(rp, k) for rp in prog.ranks]) for k in ("op", "mb", "stage")]
    return _per_rank(deltas(*cols, model, prog.split_backward, _fsdp(prog)), [len(rp.op) for rp in prog.ranks])


def _per_rank(both: tuple[np.ndarray, np.ndarray], sizes: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """`deltas` of every rank's stream at once, cut back into ranks: the rule is per instruction (a
    RECOMPUTE's (micro-batch, stage) is on one rank), and one call instead of one per rank keeps a check
    of many short ranks linear with a small constant."""
    cut = np.cumsum(sizes)[:-1]
    return list(zip(np.split(both[0], cut), np.split(both[1], cut)))


def schedule_stream(sched: Schedule, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One rank's ops with its memops merged at their `before` indices, as instruction columns (opcode,
    micro-batch, stage) and, per entry, its index in the rank's ops (>= 0) or -1 - its memop index."""
    ops = sched.ranks[rank]
    mem = sched.memops[rank] if rank < len(sched.memops) else ()
    n = len(ops)
    op = np.concatenate([COMPUTE_OF_KIND[ops.kind], np.array([CODE[m.op] for m in mem], dtype=np.int64)])
    mb = np.concatenate([ops.mb, np.array([m.mb for m in mem], dtype=np.int64)])
    st = np.concatenate([ops.stage, np.array([m.stage for m in mem], dtype=np.int64)])
    src = np.concatenate([np.arange(n), -1 - np.arange(len(mem))])
    if not mem:
        return op, mb, st, src
    pos = np.concatenate([2 * np.arange(n) + 1, 2 * np.array([m.before for m in mem], dtype=np.int64)])
    o = np.argsort(pos, kind="stable")  # memops just before their op, in their own order
    return op[o], mb[o], st[o], src[o]


# ---- the walks -------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Walk:
    """One rank's stream (a Schedule's ops with its memops merged, `schedule_stream`) and what each entry
    does to the two pools (`deltas`): the running totals are the walk, its largest values the peaks."""

    op: np.ndarray
    mb: np.ndarray
    stage: np.ndarray
    src: np.ndarray  # per entry, its index in the rank's ops (>= 0) or -1 - its memop index
    device: np.ndarray  # per entry, its change to the device pool
    host: np.ndarray  # per entry, its change to the host pool
    resident: float  # what the device pool holds throughout (`resident`)

    @property
    def device_level(self) -> np.ndarray:
        """The device pool after each entry, the resident parameters included."""
        return self.resident + np.cumsum(self.device)

    @property
    def host_level(self) -> np.ndarray:
        return np.cumsum(self.host)

    @property
    def peak(self) -> float:
        """The device pool's largest value (the resident parameters before any entry)."""
        return self.resident + max(float(np.cumsum(self.device).max(initial=0.0)), 0.0)

    @property
    def host_peak(self) -> float:
        return max(float(self.host_level.max(initial=0.0)), 0.0)


def walk(sched: Schedule, model: Mapping[str, np.ndarray], ranks: Sequence[int] | None = None) -> list[Walk]:
    """Per rank (of `ranks`, default all), the walk of a Schedule under a `memory_model` (ddp, or no data
    parallelism: every replica holds its params whole); `rank_memory` reports it."""
    rs = list(range(sched.num_ranks) if ranks is None else ranks)
    streams = [schedule_stream(sched, r) for r in rs]
    if not streams:
        return []
    cols = [np.concatenate([x[k] for x in streams]) for k in range(3)]
    both = _per_rank(deltas(*cols, model, sched.split_backward), [len(x[0]) for x in streams])
    base = resident(sched.placement_array, model, sched.num_ranks)
    return [
        Walk(op, mb, st, src, dev, host, float(base[r])) for r, (op, mb, st, src), (dev, host) in zip(rs, streams, both)
    ]


def counting_model(num_stages: int) -> dict[str, np.ndarray]:
    """A memory model in which every (micro-batch, stage) weighs one on the device or on the host, from its F
    until its last backward piece (act = wact = ckpt = 1, no params): the walk of both pools under it counts
    the pairs a rank holds (`expect in_flight(r)`), wherever memory ops move them."""
    one = np.ones(num_stages)
    return {"act": one, "wact": one, "ckpt": one, "params": 0 * one}


@dataclass(frozen=True, eq=False)
class Positions:
    """A rank's device pool along its walk as linear functions of the per-stage sizes: at position j it
    holds params + act[stages] @ self.act[j] + wact[stages] @ self.wact[j] + ckpt[stages] @ self.ckpt[j]
    (each row: how many micro-batches' worth of each of its stages' `act`, `wact`, `ckpt` are live; units
    weigh their token share). Positions dominated by another (no larger in any column) are left out: for
    sizes >= 0 they are never the peak. The partition search's memory rows are these."""

    stages: np.ndarray  # the rank's stages (the columns)
    act: np.ndarray  # (positions, stages)
    wact: np.ndarray
    ckpt: np.ndarray

    def peak(self, act: np.ndarray, wact: np.ndarray, ckpt: np.ndarray, params: np.ndarray) -> float:
        """The rank's device peak (`Walk.peak`) for these per-stage sizes (each indexed by stage, >= 0)."""
        st = self.stages
        if not len(st):
            return 0.0
        live = self.act @ np.asarray(act, float)[st] + self.wact @ np.asarray(wact, float)[st]
        live = live + self.ckpt @ np.asarray(ckpt, float)[st]
        return float(np.asarray(params, float)[st].sum()) + max(float(live.max(initial=0.0)), 0.0)


def positions(sched: Schedule) -> list[Positions]:
    """Per rank, `Positions`: the walk (`schedule_stream`, `deltas`) run once per pool kind with that kind's
    size 1 and the others 0 (the rule is linear in the sizes), summed per stage along the order, its
    dominated positions left out by `_undominated` (n log n in the rank's entries, not quadratic: at
    p = 64 a schedule's thousands of positions per rank made the pairwise filter the build's cost)."""
    S = sched.num_stages
    out = []
    for r in range(sched.num_ranks):
        op, mb, st, _ = schedule_stream(sched, r)
        stages = np.asarray(sched.stages_of(r), dtype=np.int64)
        n = len(stages)
        col = np.searchsorted(stages, np.clip(st, 0, S - 1))
        cols = []
        for key in ("act", "wact", "ckpt"):
            basis: dict[str, np.ndarray] = {k: np.full(S, float(k == key)) for k in STAGE_KEYS}
            if sched.slicing is not None:
                basis["unit_share"] = sched.slicing.share()
            dev, _ = deltas(op, mb, st, basis, sched.split_backward)
            per = np.zeros((len(op), n))
            per[np.arange(len(op)), col] = dev
            cols.append(np.cumsum(per, axis=0))
        start = np.zeros((1, 3 * n))  # before any entry: nothing live
        rows = _undominated(np.round(np.concatenate([start, np.hstack(cols)]), 12))
        out.append(Positions(stages, rows[:, :n], rows[:, n : 2 * n], rows[:, 2 * n :]))
    return out


def _undominated(walk_rows: np.ndarray, block: int = 256) -> np.ndarray:
    """The distinct rows of a walk (in `np.unique`'s order) that no other row dominates (another row at
    least as large in every column and larger in one). Three steps, none pairwise over all rows:
    a row dominated by its neighbour along the walk goes first (linear: a rising or falling run keeps only
    its ends); the rest are sorted and made unique; then, in descending lexicographic order (every dominating
    row comes before the rows it dominates), each block of rows is checked against the front kept so far and
    against the block's earlier rows, so the work is rows x (front + block), the front being the few
    positions that can be a peak."""
    x = walk_rows
    if len(x) > 1:
        up = np.all(x[1:] >= x[:-1], axis=1) & np.any(x[1:] > x[:-1], axis=1)  # row j+1 dominates row j
        down = np.all(x[1:] <= x[:-1], axis=1) & np.any(x[1:] < x[:-1], axis=1)  # row j dominates row j+1
        x = x[~(np.append(up, False) | np.insert(down, 0, False))]
    x = x[np.lexsort(x.T[::-1])]  # ascending lexicographic order, the first column first (`np.unique`'s)
    rows = x[np.append(True, np.any(x[1:] != x[:-1], axis=1))] if len(x) > 1 else x
    live = np.flatnonzero(np.any(rows != rows[0], axis=0))  # columns constant over the rows decide nothing
    y = rows[:, live]
    order = np.arange(len(rows))[::-1]
    keep = np.zeros(len(rows), dtype=bool)
    front = np.zeros((0, len(live)))
    for a in range(0, len(order), block):
        idx = order[a : a + block]
        b = y[idx]
        beaten = np.all(front[None, :, :] >= b[:, None, :], axis=2).any(axis=1)
        inner = np.all(b[None, :, :] >= b[:, None, :], axis=2) & np.tri(len(b), k=-1, dtype=bool)
        ok = ~(beaten | inner.any(axis=1))
        keep[idx[ok]] = True
        front = np.concatenate([front, b[ok]])
    return rows[keep]


def compute_deltas(model: Mapping[str, np.ndarray], num_microbatches: int, split: bool) -> np.ndarray:
    """(3, micro-batches, stages): the device change of F, B and W of each (micro-batch, stage) that no
    memory op touches (`deltas`), for a list scheduler that plays the ops one at a time."""
    S = len(np.asarray(model["act"]))
    k, i, s = (x.ravel() for x in np.meshgrid(np.arange(3), np.arange(num_microbatches), np.arange(S), indexing="ij"))
    dev, _ = deltas(COMPUTE_OF_KIND[k], i, s, model, split)
    return dev.reshape(3, num_microbatches, S)


@dataclass(frozen=True)
class Hold:
    """An amount one (micro-batch, stage) holds in a pool between two moments of its own instructions'
    runs (opcode name, "start" or "end")."""

    pool: str  # "device" or "host"
    amount: float
    since: tuple[str, str]
    until: tuple[str, str]


def unit_holds(
    model: Mapping[str, np.ndarray], stage: int, mb: int, split: bool, memop: str | None
) -> tuple[Hold, ...]:
    """What (micro-batch `mb`, stage `stage`) holds in each pool, as intervals between its instructions'
    starts and ends: its instructions in order (F, then RECOMPUTE, or OFFLOAD and RELOAD, when `memop` names
    it, then B and, split, W), each's change from `deltas` at its moment from `DEVICE_AT_START` /
    `HOST_AT_START`, the level after one held until the next change. A solver that places these intervals
    at its variables' times has the curves `pipec.sim.memtime` draws."""
    names = ["FWD", *({"RECOMPUTE": ["RECOMPUTE"], "OFFLOAD": ["OFFLOAD", "RELOAD"]}[memop] if memop else [])]
    names += ["BWD", *(["WGRAD"] if split else [])]
    op = np.array([CODE[n] for n in names], dtype=np.int64)
    dev, host = deltas(op, np.full(len(op), mb), np.full(len(op), stage), model, split)
    out = []
    for pool, change, at_start in (("device", dev, DEVICE_AT_START), ("host", host, HOST_AT_START)):
        moments = [(n, "start" if at_start[o] else "end") for n, o in zip(names, op.tolist())]
        js = [j for j in range(len(op)) if change[j] != 0]
        level = 0.0
        for a, b in zip(js, [*js[1:], None]):
            level += float(change[a])
            if b is not None and abs(level) > 1e-12:
                out.append(Hold(pool, level, moments[a], moments[b]))
    return tuple(out)


def _walk(
    sched: Schedule,
    r: int,
    op: np.ndarray,
    mb: np.ndarray,
    st: np.ndarray,
    memop_of: np.ndarray,
    dev: np.ndarray,
    host: np.ndarray,
    base: float,
    model: Mapping[str, np.ndarray],
    dp: int = 1,
) -> RankMemory:
    """A rank's report from its stream and deltas; `memop_of[j]`: the memop index of entry j, or -1."""
    limit = None if np.isnan(model["limit"][r]) else float(model["limit"][r])
    hlimit = None if np.isnan(model["host_limit"][r]) else float(model["host_limit"][r])
    unit = unit_of(model)
    comp = IS_COMPUTE[op]
    if len(op) == 0 or not comp.any():
        return RankMemory(r, base, -1, None, (), (), base, limit, host_limit=hlimit, unit=unit, slicing=sched.slicing)
    live = np.cumsum(dev)
    j = int(np.argmax(live))
    peak = base + max(float(live[j]), 0.0)
    idx = max(int(np.cumsum(comp)[j]) - 1, 0)  # the op at the peak: the compute at or before it
    ops = sched.ranks[r]
    at = Op(sched.kinds[int(ops.kind[idx])], int(ops.mb[idx]), int(ops.stage[idx]))
    live_a, live_w, _ = _live_at(op[: j + 1], mb[: j + 1], st[: j + 1], sched.split_backward)
    gathered = _gathered_at(op[: j + 1], st[: j + 1]) if dp > 1 else ()
    host_peak, host_op, host_memop, live_h = 0.0, None, -1, ()
    if (op == OFFLOAD).any():
        hl = np.cumsum(host)
        over = np.flatnonzero(hl > hlimit + 1e-9) if hlimit is not None else np.zeros(0, np.int64)
        h = int(over[0]) if len(over) else int(np.argmax(hl))
        host_peak = max(float(hl.max()), 0.0)
        host_op = f"{OPCODES[int(op[h])]} {int(mb[h])} {int(st[h])}"
        host_memop = int(memop_of[h])
        live_h = _live_at(op[: h + 1], mb[: h + 1], st[: h + 1], sched.split_backward)[2]
    return RankMemory(
        r,
        peak,
        idx,
        at,
        live_a,
        live_w,
        base,
        limit,
        gathered,
        host_peak=host_peak,
        host_limit=hlimit,
        unit=unit,
        peak_memop=int(memop_of[j]),
        host_op=host_op,
        host_memop=host_memop,
        live_host=live_h,
        slicing=sched.slicing,
    )


def rank_memory(sched: Schedule, overrides: Mapping[str, object] | None = None) -> list[RankMemory]:
    """Per-rank device and host peaks of a Schedule: its ops in order with its memops merged at their
    `before` indices (ddp, or no data parallelism: every replica holds its params whole)."""
    model = memory_model(sched, overrides)
    reports = []
    for r, w in enumerate(walk(sched, model)):
        memop_of = np.where(w.src < 0, -1 - w.src, -1)
        reports.append(_walk(sched, r, w.op, w.mb, w.stage, memop_of, w.device, w.host, w.resident, model))
    return reports


def program_memory(prog: Program, sched: Schedule, overrides: Mapping[str, object] | None = None) -> list[RankMemory]:
    """Per-rank device and host peaks of a Program: its instruction stream (RECOMPUTE/OFFLOAD/RELOAD, and
    under fsdp sharded parameters plus its gathered windows), by `instruction_deltas`. `sched` is the
    Schedule it executes (its memory declarations, spans and memops, which name the memops of the
    stream when they are the same, in order)."""
    model = memory_model(sched, overrides)
    n = _fsdp(prog)
    base = resident(prog.placement_array, model, prog.num_ranks, n)
    reports = []
    for r, ((dev, host), rp) in enumerate(zip(instruction_deltas(prog, model), prog.ranks)):
        memop_of = _memop_index(rp, sched.memops[r] if r < len(sched.memops) else ())
        reports.append(_walk(sched, r, rp.op, rp.mb, rp.stage, memop_of, dev, host, float(base[r]), model, n))
    return reports


def _memop_index(rp, memops) -> np.ndarray:
    """Per instruction, the index of the Schedule memop it lowers (the k-th memop instruction is memop k
    when they agree op for op), else -1."""
    out = np.full(len(rp.op), -1, dtype=np.int64)
    js = np.flatnonzero(IS_MEMOP[rp.op])
    same = len(js) == len(memops) and all(
        (CODE[m.op], m.mb, m.stage) == (int(rp.op[j]), int(rp.mb[j]), int(rp.stage[j])) for m, j in zip(memops, js)
    )
    if same:
        out[js] = np.arange(len(js))
    return out


def _gathered_at(op: np.ndarray, st: np.ndarray) -> tuple[int, ...]:
    """The stages whose last window instruction in this prefix is an UNSHARD."""
    state: dict[int, bool] = {}
    window = (op == UNSHARD) | (op == RESHARD)
    for o, s in zip(op[window].tolist(), st[window].tolist()):
        state[s] = o == UNSHARD
    return tuple(sorted(s for s, on in state.items() if on))


def _live_at(op: np.ndarray, mb: np.ndarray, st: np.ndarray, split: bool):
    """After this prefix of a stream: the (micro-batch, stage) whose activations are on the device, those
    awaiting W, and those on the host."""
    dev: dict[tuple[int, int], None] = {}
    wact: dict[tuple[int, int], None] = {}
    host: dict[tuple[int, int], None] = {}
    for o, i, s in zip(op.tolist(), mb.tolist(), st.tolist()):
        key = (i, s)
        if o == FWD:
            dev[key] = None
        elif o == BWD:
            dev.pop(key, None)
            if split:
                wact[key] = None
        elif o == WGRAD:
            wact.pop(key, None)
        elif o == OFFLOAD:
            dev.pop(key, None)
            host[key] = None
        elif o == RELOAD:
            host.pop(key, None)
            dev[key] = None
    return tuple(dev), tuple(wact), tuple(host)
