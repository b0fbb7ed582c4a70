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
function says what each instruction does to both pools (`_deltas`); the
schedule-level walk (`rank_memory`: the ops with their memops merged at their
`before` indices), the Program-level walk (`program_memory`:
`instruction_deltas` of the lowered stream) and the curves over time
(`pipec.sim.memtime`) all use it.

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

Token slices and sequence lengths (pipec.ir.schedule.Slicing). `act` and `wact`
are a whole sequence's; a unit (a slice, or a micro-batch of its own length)
holds its share of the tokens (`Slicing.share`). A slice's keys and values,
which the later slices of its sequence read, are part of what its F keeps and
live exactly as long: its B, after every later slice's B, frees them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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


def _deltas(
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
    if "unit_share" in model:  # token slices or sequence lengths: a unit holds its share of a sequence's
        dev = dev * np.asarray(model["unit_share"])[np.where(mb >= 0, mb, 0)]  # (its keys and values too)
    if dp > 1:
        extra = params[s] * (dp - 1) / dp
        dev = dev + np.where(op == UNSHARD, extra, np.where(op == RESHARD, -extra, 0.0))
    host = np.where(op == OFFLOAD, kept, np.where(op == RELOAD, -kept, 0.0))
    return dev, host


def resident(placement: tuple[int, ...], model: Mapping[str, np.ndarray], rank: int, dp: int = 1) -> float:
    """What the rank's device pool holds throughout: its stages' params (fsdp over dp replicas: a shard)."""
    own = [s for s, r in enumerate(placement) if r == rank]
    return float(np.asarray(model["params"], float)[own].sum() / dp) if own else 0.0


def _fsdp(prog: Program) -> int:
    return prog.dp if prog.dp_kind == "fsdp" else 1


def instruction_deltas(prog: Program, model: Mapping[str, np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per rank of a Program, each instruction's change to the device pool and to the host pool (the
    pools start at `resident` and 0). `program_memory`'s peaks and `pipec.sim.memtime`'s curves are
    their running sums, in instruction order and in time order."""
    n = _fsdp(prog)
    return [_deltas(rp.op, rp.mb, rp.stage, model, prog.split_backward, n) for rp in prog.ranks]


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
    for r in range(sched.num_ranks):
        op, mb, st, src = schedule_stream(sched, r)
        dev, host = _deltas(op, mb, st, model, sched.split_backward)
        memop_of = np.where(src < 0, -1 - src, -1)
        reports.append(_walk(sched, r, op, mb, st, memop_of, dev, host, resident(sched.placement, model, r), model))
    return reports


def program_memory(prog: Program, sched: Schedule, overrides: Mapping[str, object] | None = None) -> list[RankMemory]:
    """Per-rank device and host peaks of a Program: its instruction stream (RECOMPUTE/OFFLOAD/RELOAD, and
    under fsdp sharded parameters plus its gathered windows), by `instruction_deltas`. `sched` is the
    Schedule it executes (its memory declarations, spans and memops, which name the memops of the
    stream when they are the same, in order)."""
    model = memory_model(sched, overrides)
    n = _fsdp(prog)
    reports = []
    for r, ((dev, host), rp) in enumerate(zip(instruction_deltas(prog, model), prog.ranks)):
        memop_of = _memop_index(rp, sched.memops[r] if r < len(sched.memops) else ())
        base = resident(prog.placement, model, r, n)
        reports.append(_walk(sched, r, rp.op, rp.mb, rp.stage, memop_of, dev, host, base, model, n))
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


# ---- diagnostics and the table ---------------------------------------------------


def _span(sched: Schedule, rank: int, memop: int, index: int):
    if memop >= 0 and rank < len(sched.memops) and sched.memops[rank][memop].span is not None:
        return sched.memops[rank][memop].span
    return sched.span_of(rank, index) if sched.spans and index >= 0 else None


def _pairs(keys: tuple[tuple[int, int], ...], rep: RankMemory) -> str:
    more = "" if len(keys) <= 16 else f" and {len(keys) - 16} more"
    return ", ".join(f"{rep.unit_text(i)}@{s}" for i, s in keys[:16]) + more


def check_memory(sched: Schedule, reports: list[RankMemory]) -> None:
    """Raise E402 for the first rank whose device peak exceeds its limit, else E406 for the first whose
    host pool does (located at the OFFLOAD that passes the host limit)."""
    for rep in reports:
        if rep.limit is not None and rep.peak > rep.limit + 1e-9:
            span = _span(sched, rep.rank, rep.peak_memop, rep.peak_index)
            notes = [f"live activations (micro-batch@stage): {_pairs(rep.live_act, rep)}"]
            if rep.live_wact:
                notes.append("waiting for W: " + ", ".join(f"{rep.unit_text(i)}@{s}" for i, s in rep.live_wact[:16]))
            if rep.gathered:
                stages = ", ".join(map(str, rep.gathered))
                shards = fmt_memory(rep.params, rep.unit)
                notes.append(f"fsdp: parameter shards {shards}, and stages {stages} gathered at the peak")
            where = rep.at_text if rep.peak_memop < 0 or rep.peak_op is None else _memop_text(sched, rep)
            raise error(
                "E402",
                f"rank {rep.rank} needs {fmt_memory(rep.peak, rep.unit)} memory at `{where}`, above its limit "
                f"{fmt_memory(rep.limit, rep.unit)}",
                span,
                sched.source,
                tuple(notes),
            )
    for rep in reports:
        if rep.host_limit is not None and rep.host_peak > rep.host_limit + 1e-9:
            raise error(
                "E406",
                f"rank {rep.rank} needs {fmt_memory(rep.host_peak, rep.unit)} of host memory at `{rep.host_op}`, "
                f"above its host limit {fmt_memory(rep.host_limit, rep.unit)}",
                _span(sched, rep.rank, rep.host_memop, -1),
                sched.source,
                (f"offloaded there (micro-batch@stage): {_pairs(rep.live_host, rep)}",),
            )


def _memop_text(sched: Schedule, rep: RankMemory) -> str:
    m = sched.memops[rep.rank][rep.peak_memop]
    return f"{m.op} {m.mb} {m.stage}"


def format_table(reports: list[RankMemory]) -> str:
    """The per-rank table `pipec check --memory` prints, amounts by `fmt_memory` (GiB/MiB in bytes); a
    `gathered` column (fsdp) when any rank has one, host columns when any rank offloads."""
    fsdp = any(rep.gathered for rep in reports)
    host = any(rep.host_op is not None for rep in reports)
    rows = [("rank", "peak", "params", "limit", "at op", "live micro-batches (@stage)")]
    for rep in reports:
        u = rep.unit
        several = len({st for _, st in rep.live_act}) > 1  # name the stage too when the rank holds several
        shown = [f"{rep.unit_text(i)}@{st}" if several else rep.unit_text(i) for i, st in rep.live_act[:12]]
        live = ",".join(shown) + ("..." if len(rep.live_act) > 12 else "")
        if rep.live_wact:
            live += f" (+{len(rep.live_wact)} awaiting W)"
        rows.append(
            (
                str(rep.rank),
                fmt_memory(rep.peak, u),
                fmt_memory(rep.params, u),
                "-" if rep.limit is None else fmt_memory(rep.limit, u),
                rep.at_text or "-",
                live or "-",
            )
        )
    if fsdp:  # after params: the stages gathered at the peak
        cells = ["gathered"] + [",".join(map(str, rep.gathered)) or "-" for rep in reports]
        rows = [(*row[:3], cell, *row[3:]) for row, cell in zip(rows, cells)]
    if host:  # after the device limit: the host pool's peak and limit
        at = rows[0].index("limit") + 1
        cells = [("host peak", "host limit")] + [
            (
                fmt_memory(rep.host_peak, rep.unit),
                "-" if rep.host_limit is None else fmt_memory(rep.host_limit, rep.unit),
            )
            for rep in reports
        ]
        rows = [(*row[:at], *cell, *row[at:]) for row, cell in zip(rows, cells)]
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
