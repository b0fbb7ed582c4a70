"""A Timeline: what ran where and when, simulated or measured (one type, so one renderer draws both).

Columnar (numpy) because a simulated million-op schedule has millions of
events. Times are seconds from the start of the step. Compute events use the
Program's opcodes (FWD, BWD, WGRAD, and RECOMPUTE, the forward run again);
messages record when the send started and when the data arrived; host-link
events (OFFLOAD, RELOAD) when the link moved a micro-batch's activations.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from pipec.ir.program import OPCODES
from pipec.ir.schedule import Slicing


@dataclass(frozen=True, eq=False)
class Timeline:
    num_ranks: int
    # Compute events, one row each.
    rank: np.ndarray  # int
    op: np.ndarray  # int, an index into pipec.ir.program.OPCODES (FWD, BWD, WGRAD, RECOMPUTE)
    mb: np.ndarray  # int
    stage: np.ndarray  # int
    start: np.ndarray  # float seconds
    end: np.ndarray  # float seconds
    # Messages, one row each: kind 0 activation, 1 gradient; `stage` is the sending stage.
    msg_kind: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    msg_mb: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    msg_stage: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    msg_src: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    msg_dst: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    msg_send: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=float))
    msg_arrival: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=float))
    msg_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=float))
    # When the receiver posted its receive (empty when unknown; may precede the send).
    msg_post: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=float))
    # Data-parallel collectives, one row each (pipec.ir.opcodes: REDUCE_GRAD, UNSHARD, RESHARD): their rank and
    # stage, when the rank's stream issued them, when its collective stream ran them (RESHARD is instant at
    # its issue) and the bytes each replica holds of the stage's parameters.
    coll_rank: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    coll_op: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    coll_stage: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    coll_issue: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=float))
    coll_start: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=float))
    coll_end: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=float))
    coll_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=float))
    coll_after: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # its rank's computes before it
    # Exposed collective time: intervals in which a rank's stream waited for a collective (at a STEP for its
    # REDUCE_GRAD, before a compute for its UNSHARD) beyond the message that compute waited for anyway.
    wait_rank: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    wait_start: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=float))
    wait_end: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=float))
    # Optimizer steps with a cost (the cost model's `step`; empty when free): the rank, stage and interval
    # of each STEP on its rank's compute stream. A step is over when they are.
    step_rank: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    step_stage: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    step_start: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=float))
    step_end: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=float))
    # The host link (pipec.ir.opcodes: OFFLOAD, RELOAD of a micro-batch's saved activations), one row each: its
    # rank, opcode, micro-batch and stage, and when the rank's host-link stream ran it (from its issue, or
    # the end of the one before it on the link, to its end). A RECOMPUTE is a compute event above.
    host_rank: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    host_op: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    host_mb: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    host_stage: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    host_start: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=float))
    host_end: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=float))
    # Expert parallelism (docs/moe.md; empty without all-to-alls): each all-to-all, one row each (its rank,
    # the opcode that issued it, FWD or BWD, its micro-batch and stage, its index within that op, and when
    # the rank's expert link ran it); and the compute segments of ops cut at their all-to-alls (an op's row
    # above spans from its first segment's start to its last's end, the other op of an overlapped pair and
    # its own all-to-alls running in between), which are what the rank computed.
    a2a_rank: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    a2a_op: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    a2a_mb: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    a2a_stage: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    a2a_index: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    a2a_start: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=float))
    a2a_end: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=float))
    seg_rank: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    seg_op: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    seg_mb: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    seg_stage: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    seg_start: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=float))
    seg_end: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=float))
    # The replicas per rank and how they share parameters (the Program's dp, dp_kind): fsdp's memory is
    # sharded, with the gathered windows on top.
    dp: int = 1
    dp_kind: str = "ddp"
    # Token slices (pipec.ir.schedule.Slicing; None: none): then every `mb` above is a unit (micro-batch * slices
    # + slice), which the pictures name `1s2` (pipec.view.grid.unit_label) and the trace's args split.
    slicing: Slicing | None = None
    origin: str = "simulated"  # or "measured"
    schedule: str = ""
    params: tuple[tuple[str, object], ...] = ()

    @property
    def makespan(self) -> float:
        """From the step's start (0, or an earlier event) to the end of its last compute or collective: a
        step is over when every rank has computed and every gradient is reduced."""
        if not len(self.end):
            return 0.0
        last = float(self.end.max())
        first = min(float(self.start.min()), 0.0)
        if len(self.coll_end):
            last = max(last, float(self.coll_end.max()))
            first = min(first, float(self.coll_start.min()))
        if len(self.step_end):
            last = max(last, float(self.step_end.max()))
        return last - first

    def computed(self) -> Timeline:
        """This Timeline with each op cut at its all-to-alls drawn as its segments: one compute row per
        interval the rank computed (itself when nothing is cut). What the pictures draw and `busy` sums."""
        if not len(self.seg_rank):
            return self
        S1, M1, K = int(self.stage.max()) + 1, int(self.mb.max()) + 1, len(OPCODES)

        def key(r, st, m, op):
            return ((r * S1 + st) * M1 + m) * K + op

        keep = ~np.isin(
            key(self.rank, self.stage, self.mb, self.op), key(self.seg_rank, self.seg_stage, self.seg_mb, self.seg_op)
        )
        cols = {
            c: np.concatenate([getattr(self, c)[keep], getattr(self, f"seg_{c}")])
            for c in ("rank", "op", "mb", "stage", "start", "end")
        }
        order = np.lexsort((cols["start"], cols["rank"]))
        return replace(self, **{c: v[order] for c, v in cols.items()})

    def busy(self) -> np.ndarray:
        """Per rank, the time it computed: its ops' rows, where an op was cut at its all-to-alls its
        segments instead (the row of a cut op also spans its waits and the other op of its pair)."""
        tl = self.computed()
        return np.bincount(tl.rank, weights=tl.end - tl.start, minlength=self.num_ranks)

    def rank_events(self, rank: int) -> list[tuple[str, int, int, float, float]]:
        """(opcode name, micro-batch, stage, start, end) of one rank, in start order."""
        sel = np.flatnonzero(self.rank == rank)
        sel = sel[np.argsort(self.start[sel], kind="stable")]
        return [
            (OPCODES[int(self.op[j])], int(self.mb[j]), int(self.stage[j]), float(self.start[j]), float(self.end[j]))
            for j in sel
        ]
