"""The library's schedules as the library and interop tests compare them: parameters, orders, the torch
schedules that are their oracle, a thinned grid of micro-batch counts."""

from __future__ import annotations

import functools

from torch.distributed.pipelining import schedules as ts

from pipec.api import load
from pipec.errors import PipecError
from pipec.frontend import library
from pipec.frontend.load import compile_source
from pipec.ir.schedule import Schedule

# An op as compared here: (kind, micro-batch, stage, overlapped with the next op).
Op = tuple[str, int, int, bool]


@functools.cache
def param_names(name: str) -> tuple[str, ...]:
    return tuple(p.name for p in compile_source(library.read(name)).params)


def try_load(name: str, **params: int) -> Schedule | None:
    """The checked schedule, or None when one of its `require`s rejects these parameters."""
    try:
        return load(name, **params)
    except PipecError as e:
        if e.code == "E202":
            return None
        raise


def orders(s: Schedule) -> list[list[Op]]:
    return [
        [(o.kind, o.mb, o.stage, bool(pr)) for o, pr in zip(s.ops(r), s.ranks[r].paired.tolist())]
        for r in range(s.num_ranks)
    ]


def grid_ms(p: int) -> list[int]:
    """A thinned grid of micro-batch counts for the slower comparisons: all of 1..4p for p <= 2, then the
    edges around p, 2p and 4p, where the schedules change shape."""
    if p <= 2:
        return list(range(1, 4 * p + 1))
    edges = {1, 2, p - 1, p, p + 1, 2 * p - 2, 2 * p - 1, 2 * p, 2 * p + 1, 3 * p, 4 * p - 1, 4 * p}
    return sorted(m for m in edges if 1 <= m <= 4 * p)


TORCH = [
    # pipec name, torch class, stages per rank ("v": the schedule's parameter v), split backward
    ("gpipe", ts.ScheduleGPipe, 1, False),
    ("interleaved-1f1b", ts.ScheduleInterleaved1F1B, "v", False),
    ("looped-bfs", ts.ScheduleLoopedBFS, "v", False),
    ("zb-v", ts.ScheduleZBVZeroBubble, 2, True),
    ("dualpipe-v", ts.ScheduleDualPipeV, 2, True),
    # torch's ZB1P with one stage per rank is ZB-H1.
    ("zb-h1", ts.ScheduleInterleavedZeroBubble, 1, True),
]


def schedule_params(name: str, p: int) -> dict[str, int]:
    """p ranks, m = 2p micro-batches (meets every library schedule's requirements), v = 2 where declared;
    a sliced schedule's sequences of L = 8 tokens in 2 slices (the small GPT's context: `sliced_gpt`)."""
    params = {"p": p, "m": 2 * p}
    declared = dict(load(name).params)
    if "v" in declared:
        params["v"] = 2
    if "L" in declared and "n" in declared:
        params.update(n=2, L=8)
    return params
