"""The planner's candidates: a library schedule (or a synthesized one) at a micro-batch count m and, where it
has one, a chunk count v, with the forwards of some stages recomputed or offloaded; and the layer table at
that m's micro-batch size. Why a module of its own: the search (`pipec.planner.search`) enumerates, builds
and scales these the one way, and the report names them the one way (`Candidate.label`).

Memory ops per stage: a candidate recomputes (or offloads) every forward of the stages on ranks 0 .. k-1,
the ranks that hold the most micro-batches in flight in 1F1B-like orders (the same family `pipec synth`'s
recomputation seeds use, `pipec.synth.recompute_memops`): a RECOMPUTE just before each B of those stages;
an OFFLOAD just after each F whose B is at least three ops later, and its RELOAD one op before that B.

Micro-batch size: the table's times and activation bytes are for micro-batches of `table_mbs` samples;
at m micro-batches of a global batch of G samples each op takes G / (m * table_mbs) times as long and
keeps as many bytes (linear in the samples: what fusing or a GPU's efficiency at small sizes changes is
not modelled; profile at the chosen m to check). Parameters, gradients and optimizer state do not scale.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from pipec.formats.partition_files import LayerTable
from pipec.ir.schedule import MemOp, Schedule

# The library schedules the planner tries by default: those that pipeline one model over p ranks with
# the ordinary F/B(/W) ops (cross-datacenter, token-sliced and ZeRO++ schedules need inputs a plan lacks).
LIBRARY = (  # in screening order: the likelier winners first, so a short time limit still sees them
    "1f1b",
    "zb-h1",
    "interleaved-1f1b",
    "zb-v",
    "zb-h2",
    "1f1b-recompute",
    "v-half",
    "v-min",
    "dualpipe-v",
    "gpipe",
    "looped-bfs",
    "1f1b-offload",
    "zb-v-recompute",
)
MEMOPS = ("recompute", "offload")


@dataclass(frozen=True)
class Candidate:
    """One point of the plan space (the module docstring): `memop` is "" (none added), "recompute" or
    "offload", on the stages of ranks 0 .. `memop_ranks` - 1. `v` is 0 for a schedule without a `v`.
    `ranks`: which of the given ranks (their index in `--ranks`) runs each pipeline rank, () as given
    (`rank_orders`)."""

    schedule: str
    m: int
    v: int = 0
    memop: str = ""
    memop_ranks: int = 0
    ranks: tuple[int, ...] = ()

    @property
    def params(self) -> dict[str, int]:
        return {"m": self.m, **({"v": self.v} if self.v else {})}

    @property
    def label(self) -> str:
        text = f"{self.schedule} m={self.m}" + (f" v={self.v}" if self.v else "")
        if self.memop:
            text += f" {self.memop} on rank{'s 0-' + str(self.memop_ranks - 1) if self.memop_ranks > 1 else ' 0'}"
        if self.ranks:
            text += " ranks " + ",".join(map(str, self.ranks))
        return text


def microbatch_counts(global_batch: int, p: int, given: Sequence[int] | None = None, most: int = 4) -> list[int]:
    """The m tried: `given`, or the divisors of the global batch from p up, the `most` smallest of them at
    p, 2p, 4p, ... where those divide it (every m >= p keeps every rank busy in the steady state)."""
    if given:
        return sorted(set(int(m) for m in given))
    divisors = [m for m in range(1, global_batch + 1) if global_batch % m == 0]
    out = [m for m in divisors if m >= p and m % p == 0]
    out = out or [m for m in divisors if m >= p] or [global_batch]
    chosen = [out[0]]
    for m in out[1:]:
        if m >= 2 * chosen[-1]:
            chosen.append(m)
    return chosen[:most]


def rank_orders(speed: Sequence[float], limit: Sequence[float]) -> list[tuple[int, ...]]:
    """The orders of the given ranks tried as the pipeline's ranks 0 .. p-1, () first (as given): where the
    ranks differ in speed or memory, also reversed and the fastest (then the largest memory) first and last.
    Why: a library schedule keeps its first stage on pipeline rank 0 and its last (a V: both) on rank p-1
    (rank 0), so which ranks those are decides where a heavy embedding or head can run fast; every order is
    a relabelling of the same machines (links as given are uniform over them, `--cost`)."""
    p = len(speed)
    lim = [math.inf if math.isnan(x) else float(x) for x in limit]
    if len(set(speed)) <= 1 and len(set(lim)) <= 1:
        return [()]
    fast = tuple(sorted(range(p), key=lambda r: (-speed[r], -lim[r], r)))
    out = [tuple(range(p)), tuple(range(p - 1, -1, -1)), fast, fast[::-1]]
    return [() if o == tuple(range(p)) else o for o in dict.fromkeys(out)]


def memop_ranks(p: int) -> list[int]:
    """The k tried for memory ops on ranks 0 .. k-1: 1, 2, 4, ... up to p, and p."""
    out, k = [], 1
    while k < p:
        out.append(k)
        k *= 2
    return [*out, p]


def scaled(table: LayerTable, factor: float) -> LayerTable:
    """The table at micro-batches `factor` times as large (the module docstring)."""
    if factor == 1.0:
        return table
    f = float(factor)
    return replace(
        table,
        F=table.F * f,
        B=table.B * f,
        W=table.W * f,
        full_backward=table.full_backward * f,
        act_bytes=table.act_bytes * f,
        wact_bytes=table.wact_bytes * f,
        out_bytes=table.out_bytes * f,
    )


def with_memops(sched: Schedule, kind: str, ranks: int) -> Schedule:
    """The schedule with every forward of the stages of ranks 0 .. ranks-1 recomputed or offloaded (the
    module docstring), as `Schedule.memops` (per rank, in issue order)."""
    out = []
    for r, ops in enumerate(sched.ranks):
        if r >= ranks:
            out.append(())
            continue
        kind_of = [sched.kinds[k] for k in ops.kind.tolist()]
        mb, st, paired = ops.mb.tolist(), ops.stage.tolist(), ops.paired.tolist()

        outside, after = _outside(paired), _after(paired)

        where_f = {(i, s): j for j, (k, i, s) in enumerate(zip(kind_of, mb, st)) if k == "F"}
        mem: list[MemOp] = []
        for j, (k, i, s) in enumerate(zip(kind_of, mb, st)):
            if k != "B":
                continue
            if kind == "recompute":
                mem.append(MemOp("RECOMPUTE", i, s, outside(j)))
                continue
            off, back = after(where_f[i, s]), outside(outside(j) - 1)
            if back > off:
                mem.append(MemOp("OFFLOAD", i, s, off))
                mem.append(MemOp("RELOAD", i, s, back))
        out.append(tuple(sorted(mem, key=lambda x: (x.before, x.op != "OFFLOAD"))))
    return replace(sched, memops=tuple(out), name=f"{sched.name}-{kind}-ranks{ranks}")


def has_memops(sched: Schedule) -> bool:
    return any(len(x) for x in sched.memops)


def megatron_split(L: int, S: int) -> tuple[int, ...]:
    """Megatron-LM's default: the first layer (the embedding) on the first stage, the last (the head and
    loss) on the last, and the layers between them as evenly as they go, the later stages taking one more
    when they do not divide (`pipeline_model_parallel_layout` left unset); falls back to every layer evenly
    when there are fewer than S layers between them."""
    n = L - 2
    if n < S:
        return tuple(int(L * s // S) for s in range(S + 1))
    bounds = [0] + [1 + int(n * s // S) for s in range(1, S)] + [L]
    return tuple(bounds)


def layer_kinds(names: Sequence[str]) -> list[str]:
    """Megatron's layout letters for the layers: `E` for an embedding first layer, `L` for a head or loss
    last layer (by name), `t` for the rest."""
    out = ["t"] * len(names)
    if names and any(w in names[0].lower() for w in ("emb", "wte", "tok")):
        out[0] = "E"
    if names and any(w in names[-1].lower() for w in ("head", "loss", "lm_", "output")):
        out[-1] = "L"
    return out


def stage_layers(bounds: Sequence[int]) -> np.ndarray:
    return np.diff(np.asarray(bounds, dtype=np.int64))


def _outside(paired: Sequence[bool]):
    """Where a memory op meant for just before op j goes: before j, or before j's overlapped pair when j is
    its second op (a memory op is never issued inside a pair)."""

    def at(j: int) -> int:
        while 0 < j < len(paired) and paired[j - 1]:
            j -= 1
        return j

    return at


def _after(paired: Sequence[bool]):
    """The index just after op j and the rest of its overlapped pair."""

    def at(j: int) -> int:
        while j < len(paired) and paired[j]:
            j += 1
        return j + 1

    return at
