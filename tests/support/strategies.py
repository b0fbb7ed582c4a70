"""Random valid schedules for the project's own property tests: now `pipec.testing` (public, documented).

Kept so older tests import from here. `random_schedules` is `pipec.testing.schedules` without overlapped
pairs (tests written against it model each rank's order as a plain sequence); `RandomSchedule` is
`pipec.testing.Listing`.
"""

from __future__ import annotations

from hypothesis import assume
from hypothesis import strategies as st

from pipec.api import load
from pipec.errors import PipecError
from pipec.testing import Listing, deps, schedules

RandomSchedule = Listing


def random_schedules(max_ranks: int = 4, max_stages: int = 6, max_mb: int = 4):
    return schedules(max_ranks, max_stages, max_mb, pairs=False)


@st.composite
def library_schedules(draw, names: tuple[str, ...]):
    """A library schedule of `names` at p = 2..4 and m = p or 2p (one its `require`s reject is not drawn)."""
    name = draw(st.sampled_from(names))
    p = draw(st.integers(2, 4))
    m = draw(st.sampled_from([p, 2 * p]))
    try:
        return load(name, p=p, m=m)
    except PipecError:
        assume(False)


__all__ = ["RandomSchedule", "deps", "library_schedules", "random_schedules"]
