"""Property testing for pipeline schedules: hypothesis strategies, independent checks, and `pipec test`.

Five tools, for anyone who writes a schedule (see docs/testing.md):

- `params(schedule)`: parameter assignments that satisfy the schedule's
  top-level `require`s, within bounds; they shrink toward small p and m.
- `schedules()`: random valid schedules from scratch, as `Listing`s (explicit
  per-rank op lists that print as .pipe text): random stage counts and
  placements (contiguous, looped, V-shaped, scattered), split or full
  backward, optional overlapped pairs, orders from random list scheduling.
- `mutations(schedule)`: invalid variants of a valid schedule, each tagged
  with the diagnostic pipec must report (E301, E302, E303, E304, E401, E402).
- `check_invariants(x)`: checks of a Schedule, its compiled form or a bare
  Program by code independent of the compiler's: every op exactly once on its
  owner; dependency order; a deadlock-free execution exists exactly when pipec
  says so; every message sent once, received once, by the right peer, in the
  same order on both ends of every channel, batched only as send+receive
  pairs; a strict rendezvous dry run completes; memory peaks agree and stay
  within the limit; the simulated timeline respects every dependency and its
  makespan is at least the critical path; the schedule's own `expect`s hold.
- `runtime_check(x)`: train a tiny model on the runtime's `--local` mode and
  compare the loss and gradients with a single-process reference (torch).

`check_file` runs the whole property over one schedule file (what `pipec
test` and the pytest plugin do), for a time budget: `sample_space` is p up to
32, m up to max(12, 4p), v up to 4; `Sampler` orders it cheapest first with
weight on boundaries (m < p, m = p, m = 2p - 1, p = 1, the edges of the
`require`s) and a ladder up to p = 32. The first failure is shrunk to the
smallest failing parameter set (each parameter down, then a scan of every
smaller set), reported as a `pipec check` command that reproduces it, with
the values each parameter took (`Coverage`).

hypothesis is a test extra (`pip install pipec[test]`): this module imports
it only inside the strategies, so `import pipec.testing`, `check_invariants`
and `check_file` work without it.

Modules: `listing` (explicit schedules and the `schedules` strategy), `mutations`, `space` (parameter
sets), `invariants` (the independent checks), `files` (`check_file`, `runtime_check`).
"""

from pipec.testing.files import (
    Coverage,
    Failure,
    FileResult,
    check_file,
    default_budget,
    find_schedule_files,
    runtime_check,
)
from pipec.testing.invariants import Checked, InvariantError, check_invariants, program_problem, schedule_problem
from pipec.testing.listing import Listing, deps, schedules
from pipec.testing.mutations import Mutation, mutations
from pipec.testing.space import DEFAULT_BOUNDS, Sampler, Space, parameter_space, params, sample_space

__all__ = [
    "DEFAULT_BOUNDS",
    "Checked",
    "Coverage",
    "FileResult",
    "Failure",
    "InvariantError",
    "Listing",
    "Mutation",
    "Sampler",
    "Space",
    "check_file",
    "check_invariants",
    "default_budget",
    "deps",
    "find_schedule_files",
    "mutations",
    "parameter_space",
    "params",
    "program_problem",
    "runtime_check",
    "sample_space",
    "schedule_problem",
    "schedules",
]
