"""pipec: a compiler for pipeline-parallel training schedules. Imports no torch.

The Python API is five calls (docs/cli.md has the command line's):

>>> import pipec
>>> sched = pipec.load("1f1b", p=4, m=8)          # a checked Schedule
>>> prog = pipec.compile(sched)                    # every check, then one instruction stream per rank
>>> pipec.simulate("1f1b", p=4, m=8, cost="F=1,B=2").stats.makespan
33.0
>>> pipec.check("zb-h1", p=4, m=8).program.num_ranks   # all checks, the schedule's `expect`s too
4

`pipec.write_program(prog, path)` writes a Program file and `pipec.read_program(path)` reads one back
(validated); `write_trace` and `read_trace` do the same for a Timeline. User errors raise `PipecError`.
docs/api.md lists the whole public surface; old import paths still work for a release (pipec/moved.py).
The calls live in `pipec.api` and are imported on first use, so `import pipec` stays quick.
"""

from typing import TYPE_CHECKING

__version__ = "0.2.0"

__all__ = [
    "DataParallel",
    "Experts",
    "MemOp",
    "PipecError",
    "Program",
    "Schedule",
    "__version__",
    "check",
    "compile",
    "load",
    "read_program",
    "read_trace",
    "simulate",
    "write_program",
    "write_trace",
]

# Old import paths keep working for a release, warning with their new path (pipec/moved.py, CHANGELOG.md).
from pipec import moved as _moved  # noqa: E402

_moved.install()

if TYPE_CHECKING:
    from pipec.api import check, compile, load, read_program, read_trace, simulate, write_program, write_trace
    from pipec.errors import PipecError
    from pipec.ir.dataparallel import DataParallel
    from pipec.ir.experts import Experts
    from pipec.ir.program import Program
    from pipec.ir.schedule import MemOp, Schedule

_HOME = {
    "check": "pipec.api",
    "compile": "pipec.api",
    "load": "pipec.api",
    "read_program": "pipec.api",
    "read_trace": "pipec.api",
    "simulate": "pipec.api",
    "write_program": "pipec.api",
    "write_trace": "pipec.api",
    "DataParallel": "pipec.ir.dataparallel",
    "Experts": "pipec.ir.experts",
    "MemOp": "pipec.ir.schedule",
    "PipecError": "pipec.errors",
    "Program": "pipec.ir.program",
    "Schedule": "pipec.ir.schedule",
}


def __getattr__(name: str) -> object:
    """The API on first use (PEP 562): the parser and numpy load when a call needs them, not on import."""
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'pipec' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(__all__) | {k for k in globals() if k.startswith("__")})
