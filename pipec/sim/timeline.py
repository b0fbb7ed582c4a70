"""A Timeline: what ran where and when, simulated or measured (one type, so one renderer draws both).

Columnar (numpy) because a simulated million-op schedule has millions of
events. Times are seconds from the start of the step. Compute events use the
Program's opcodes (FWD, BWD, WGRAD); messages record when the send started
and when the data arrived.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pipec.program import OPCODES


@dataclass(frozen=True, eq=False)
class Timeline:
    num_ranks: int
    # Compute events, one row each.
    rank: np.ndarray  # int
    op: np.ndarray  # int, an index into pipec.program.OPCODES (FWD, BWD, WGRAD)
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
    origin: str = "simulated"  # or "measured"
    schedule: str = ""
    params: tuple[tuple[str, object], ...] = ()

    @property
    def makespan(self) -> float:
        return float(self.end.max() - min(self.start.min(), 0.0)) if len(self.end) else 0.0

    def rank_events(self, rank: int) -> list[tuple[str, int, int, float, float]]:
        """(opcode name, micro-batch, stage, start, end) of one rank, in start order."""
        sel = np.flatnonzero(self.rank == rank)
        sel = sel[np.argsort(self.start[sel], kind="stable")]
        return [
            (OPCODES[int(self.op[j])], int(self.mb[j]), int(self.stage[j]), float(self.start[j]), float(self.end[j]))
            for j in sel
        ]
