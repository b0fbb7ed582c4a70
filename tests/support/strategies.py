"""Random valid schedules for the project's own property tests: now `pipec.testing` (public, documented).

Kept so older tests import from here. `random_schedules` is `pipec.testing.schedules` without overlapped
pairs (tests written against it model each rank's order as a plain sequence); `RandomSchedule` is
`pipec.testing.Listing`.
"""

from __future__ import annotations

from pipec.testing import Listing, deps, schedules

RandomSchedule = Listing


def random_schedules(max_ranks: int = 4, max_stages: int = 6, max_mb: int = 4):
    return schedules(max_ranks, max_stages, max_mb, pairs=False)


__all__ = ["RandomSchedule", "deps", "random_schedules"]
