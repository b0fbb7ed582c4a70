"""The partition problem: a schedule, its Program, the layer table and the ranks, and what one split
costs: its stages' quantized times and bytes, each rank's memory (and its integer rows), and its
simulated step (`Problem.evaluate`). Why a module of its own: every part of the search (bounds, local
search, branch and bound, the E806 diagnostic) reads a split through it.

A split gives stage s the layers [c_s, c_{s+1}) (0 = c_0 < c_1 < ... < c_S = L, every stage non-empty,
stages in pipeline order, so V and interleaved placements wrap the model across the ranks as their
placement says). Stage s's F, B and W are the sums of its layers' times divided by the speed of the rank
that owns it; its memory is the memory walk's (pipec.sim.memory.positions): parameters, gradients and
optimizer state held throughout, `act` bytes per micro-batch live from F to B (`ckpt`, act / 8 of the
memory model's default, until its RECOMPUTE where the schedule recomputes; on the host between an
OFFLOAD and its RELOAD) and, with split backward, `wact` from B to W, counted along the rank's own order
of ops and memory ops. The objective is `pipec.sim.simulate`'s makespan of the
schedule's Program under these per-stage costs (and the links of any cost documents given).

Times are quantized to a power-of-two unit u about 2^-24 of a rank's whole step, so that the solver's
integers and the simulator's floats are the same numbers exactly (sums of multiples of u below 2^53 are
exact); the quantized cost of stage s is Q_s[c_{s+1}] - Q_s[c_s], Q_s the rounded prefix sums of its
rank's layer times: a relative change of about 1e-7, far below any measurement's noise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from pipec.errors import brief, error
from pipec.formats.graph_limits import refuse_graph
from pipec.formats.partition_files import LayerTable
from pipec.ir.program import Program
from pipec.ir.schedule import Schedule
from pipec.partition.graph import KINDS, _Graph
from pipec.sim.memory import CKPT_OF_ACT, positions

# The memory rows' scale (`Problem.memory_rows`): 8 makes ckpt = act / 8 whole, so rows are exact without slices.
MEM_SCALE = 8
# The most a memory row may count: rows are int64 sums for CP-SAT (whose linear constraints must stay within
# int64 with their coefficients summed) and exact floats for the branch and bound, so MEM_SCALE times the most
# any rank could hold (every layer's parameters, and every micro-batch's activations) stays below 2^53.
MAX_ROW = 2**53


@dataclass(frozen=True)
class Split:
    """A split's boundaries (S + 1 of them) and what it costs: the simulated step (seconds), each rank's
    memory peak (bytes), whether every rank is within its limit, and the per-stage times it was simulated
    with."""

    bounds: tuple[int, ...]
    step: float
    memory: tuple[float, ...]
    fits: bool
    stage_times: Mapping[str, tuple[float, ...]]

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.bounds, self.bounds[1:]))


# Why a split of layers cannot take a stage graph (E217): said once, for `pipec partition` and `pipec plan`.
PARTITION_GRAPH_LIMIT = (
    "it splits the model's layers, in order, into consecutive stages (stage s takes the layers after stage "
    "s - 1's), and the stages of a stage graph are not a chain of layers"
)


def refuse_graph_for_partition(sched, program=None, tool: str = "the partition search") -> None:
    """E217 for a schedule or Program with a stage graph (before anything is profiled or searched)."""
    hint = "give each stage its layers in the model file and run the schedule with `pipec run`"
    refuse_graph(sched, tool, PARTITION_GRAPH_LIMIT, hint)
    if program is not None:
        refuse_graph(program, tool, PARTITION_GRAPH_LIMIT, hint, getattr(sched, "source", None))


class Problem:
    """The schedule, its Program, the layer table, the ranks' speeds and limits, and everything the search
    precomputes from them (quantized prefix tables, the dependency graph, each rank's memory positions)."""

    def __init__(
        self,
        sched: Schedule,
        program: Program,
        table: LayerTable,
        speed: np.ndarray,
        limit: np.ndarray,
        cost_docs: Sequence[Mapping] = (),
    ) -> None:
        from pipec.sim.costs import cost_model

        refuse_graph_for_partition(sched, program)
        S, R, L = sched.num_stages, sched.num_ranks, table.num_layers
        if S > L:
            raise error(
                "E805",
                f"`{brief(sched.name)}` has {S} stages, more than the model's {L} layers (every stage needs one)",
            )
        self.sched, self.program, self.table = sched, program, table
        self.S, self.R, self.L, self.m = S, R, L, sched.num_microbatches
        self.speed = np.asarray(speed, dtype=float)
        self.limit = np.asarray(limit, dtype=float)
        self.placement = np.asarray(sched.placement, dtype=np.int64)
        self.cost_docs = tuple(cost_docs)
        split = sched.split_backward
        times = {"F": table.F, "B": table.B if split else table.full_backward, "W": table.W if split else 0 * table.F}
        stage_speed = self.speed[self.placement]
        whole = max(float(sum(times[k].sum() for k in KINDS)) / float(self.speed.min()), 1e-30) * self.m
        self.unit = 2.0 ** (math.floor(math.log2(whole)) - 24)
        self.Q = {}  # kind -> (S, L + 1) int64: quantized prefix sums of stage s's rank's times
        for k in KINDS:
            pre = np.concatenate([[0.0], np.cumsum(times[k])])
            self.Q[k] = np.rint(pre[None, :] / stage_speed[:, None] / self.unit).astype(np.int64)
        _check_bytes(table, self.m, split)
        held = 2 * table.param_bytes + table.state_bytes  # weights, gradients, optimizer state
        self.P = {
            "act": _prefix(table.act_bytes),
            "wact": _prefix(table.wact_bytes if split else 0 * table.act_bytes),
            "params": _prefix(held),
        }
        self.positions = positions(sched)
        base = cost_model(sched, self.cost_docs)
        self.graph = _Graph(sched, base, self.unit)
        self.simulations = 0

    # ---- one split --------------------------------------------------------------

    def stage_units(self, bounds: Sequence[int]) -> dict[str, np.ndarray]:
        c = np.asarray(bounds)
        s = np.arange(self.S)
        return {k: self.Q[k][s, c[1:]] - self.Q[k][s, c[:-1]] for k in KINDS}

    def batch_units(self, bounds: np.ndarray) -> dict[str, np.ndarray]:
        """`stage_units` of many splits at once: bounds (n, S + 1), each kind's units (n, S)."""
        c = np.asarray(bounds, dtype=np.int64)
        s = np.arange(self.S)
        return {k: self.Q[k][s, c[:, 1:]] - self.Q[k][s, c[:, :-1]] for k in KINDS}

    def stage_bytes(self, bounds: Sequence[int]) -> dict[str, np.ndarray]:
        c = np.asarray(bounds)
        return {k: (v[c[1:]] - v[c[:-1]]).astype(float) for k, v in self.P.items()}

    def memory(self, bounds: Sequence[int]) -> np.ndarray:
        """Each rank's peak bytes: the memory walk's (`pipec.sim.memory.positions`) for the split's sizes, so
        equal to `pipec.sim.memory.rank_memory` of `memory_schedule`."""
        b = self.stage_bytes(bounds)
        ckpt = b["act"] * CKPT_OF_ACT
        return np.array([pos.peak(b["act"], b["wact"], ckpt, b["params"]) for pos in self.positions])

    def memory_rows(self, r: int) -> list[tuple[np.ndarray, int]]:
        """Rank r's memory at each of its positions as an integer row over the split: (wq, lim) with wq (S,
        L + 1) such that every split within r's limit has sum_s wq[s, c_{s+1}] - wq[s, c_s] <= lim (empty
        without a limit). Each row is MEM_SCALE times the position's bytes, rounded per stage and boundary
        (so non-decreasing in the boundary); where the scaled coefficients are not whole (token shares) the
        rounding may add up to one per stage, which the limit allows for: a row is then a relaxation, and
        the splits it lets through are checked by `memory` itself."""
        pos = self.positions[r]
        if math.isnan(self.limit[r]) or not len(pos.stages):
            return []
        k, P = MEM_SCALE, {key: v.astype(float) for key, v in self.P.items()}
        out = []
        for a, w, c in zip(pos.act, pos.wact, pos.ckpt):
            x = a + c * CKPT_OF_ACT  # the split's ckpt is its act / 8
            whole = np.allclose(k * x, np.rint(k * x), rtol=0, atol=1e-9) and np.allclose(k * w, np.rint(k * w))
            wq = np.zeros((self.S, self.L + 1), dtype=np.int64)
            for xs, ws, s in zip(x.tolist(), w.tolist(), pos.stages.tolist()):
                wq[s] = np.rint(k * (P["params"] + xs * P["act"] + ws * P["wact"])).astype(np.int64)
            slack = 0 if whole else len(pos.stages)
            # a limit above anything a row can count is no limit, and must not overflow the solver's int64
            out.append((wq, math.floor(min(k * self.limit[r], MAX_ROW)) + slack))
        return out

    def cost_doc(self, bounds: Sequence[int]) -> dict:
        """The per-stage cost document the simulator gets for this split."""
        u = self.stage_units(bounds)
        last = np.asarray(bounds[1:]) - 1
        return {
            "F": (u["F"] * self.unit).tolist(),
            "B": (u["B"] * self.unit).tolist(),
            "W": (u["W"] * self.unit).tolist(),
            "act_bytes": self.table.out_bytes[last].tolist(),
            "param_bytes": self._param_bytes(bounds),
            "_from": "pipec partition: the split's layer sums",
        }

    def _param_bytes(self, bounds: Sequence[int]) -> list[float]:
        pre = _prefix(self.table.param_bytes)
        c = np.asarray(bounds)
        return (pre[c[1:]] - pre[c[:-1]]).astype(float).tolist()

    def simulate(self, bounds: Sequence[int]):
        """The Timeline of the schedule's Program under this split's costs (`pipec.driver.timeline`)."""
        from pipec.driver import timeline

        self.simulations += 1
        return timeline(self.sched, self.program, [*self.cost_docs, self.cost_doc(bounds)])

    def evaluate(self, bounds: Sequence[int]) -> Split:
        from pipec.sim.simulate import stats

        tl = self.simulate(bounds)
        mem = self.memory(bounds)
        fits = bool(np.all(np.isnan(self.limit) | (mem <= self.limit + 1e-9)))
        u = self.stage_units(bounds)
        times = {k: tuple((u[k] * self.unit).tolist()) for k in KINDS}
        return Split(tuple(int(x) for x in bounds), float(stats(tl).makespan), tuple(mem.tolist()), fits, times)

    def uniform(self) -> tuple[int, ...]:
        """Layers as evenly as they go, the first stages taking one fewer when L is not a multiple of S."""
        return tuple(int(self.L * s // self.S) for s in range(self.S + 1))

    def memory_schedule(self, bounds: Sequence[int]) -> Schedule:
        """The schedule with this split's bytes as its memory declarations (for pipec.sim.memory)."""
        b = self.stage_bytes(bounds)
        mem = {k: tuple(v.tolist()) for k, v in b.items()}
        mem["ckpt"] = tuple((b["act"] * CKPT_OF_ACT).tolist())
        mem["limit"] = tuple(self.limit.tolist())
        return replace(self.sched, memory=mem)


def _check_bytes(table: LayerTable, m: int, split: bool) -> None:
    """E803 when the table's bytes are too large for the memory rows' integers (MAX_ROW): a layer table
    with an activation of 1e18 bytes once overflowed OR-Tools' int64 with a traceback. Bytes at most
    `bound` each always fit (L layers, each counted 2 + 1 times held and twice per micro-batch); the
    diagnostic names the largest value and that bound."""
    fields = ("param_bytes", "state_bytes", "act_bytes") + (("wact_bytes",) if split else ())
    cols = {f: np.asarray(getattr(table, f), dtype=float) for f in fields}
    held = float((2 * cols["param_bytes"] + cols["state_bytes"]).sum())
    per_mb = float(cols["act_bytes"].sum() + (cols["wact_bytes"].sum() if split else 0.0))
    m = max(m, 1)
    if MEM_SCALE * (held + m * per_mb) < MAX_ROW:
        return
    bound = MAX_ROW // (MEM_SCALE * table.num_layers * (3 + 2 * m))
    field = max(fields, key=lambda f: float(cols[f].max()))
    i = int(np.argmax(cols[field]))
    raise error(
        "E803",
        f"layer table: `{field}` of layer `{brief(table.names[i])}` is {float(cols[field][i]):.4g} bytes, too large"
        f" to partition: with {table.num_layers} layers and m={m}, each layer's bytes may be at most {bound:,}",
        notes=(
            f"the partition counts {MEM_SCALE} x the bytes a rank may hold (every layer's parameters, every"
            " micro-batch's activations) in integers below 2^53",
        ),
    )


def _prefix(x: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.rint(np.asarray(x, dtype=float)).astype(np.int64))])
