"""pipec's Python API: a schedule by name or path to a checked Schedule, a Program, a simulation.

The public facade: the five calls a user needs, re-exported at the top level (`pipec.load`,
`pipec.check`, `pipec.compile`, `pipec.simulate`, `pipec.read_program`). Each is one step of the one
pipeline, `pipec.driver`, which the CLI, the report and the tools call too, so the library and
`pipec ...` give the same answers. Every user error raises `pipec.errors.PipecError` with its
diagnostics, never anything else. Nothing here imports torch or matplotlib.

>>> import pipec
>>> pipec.check("1f1b", p=4, m=8).program.num_ranks
4
>>> round(pipec.simulate("1f1b", p=4, m=8).stats.bubble_rate, 4)
0.2727
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from pipec import driver
from pipec.errors import PipecError, brief, brief_path, error
from pipec.ir.dataparallel import DataParallel
from pipec.ir.experts import Experts
from pipec.ir.program import Program
from pipec.ir.schedule import Schedule

if TYPE_CHECKING:
    from pipec.driver import Simulation, Target
    from pipec.passes.compiler import CompiledSchedule
    from pipec.sim.timeline import Timeline

__all__ = ["check", "compile", "load", "read_program", "read_trace", "simulate", "write_program", "write_trace"]

# A cost model as `pipec simulate --cost` takes it: a cost file's path or overrides like "F=1,B=2",
# a cost document (a mapping, as in a cost file), or several of these, later ones winning.
CostSpec = str | Mapping[str, object] | Sequence[str | Mapping[str, object]] | None

# ---- the arguments, checked at the facade ----------------------------------------------------------------
# Each function below promises PipecError for a user's mistake: a value of the wrong kind or out of range is
# refused here (E840, naming the argument), before the driver would meet it as a bare TypeError, or take a
# NaN memory limit as "no limit".

_SCALARS = (str, int, float, bool)  # what a schedule parameter may be given as (the language checks its type)


def _shown(value: object) -> str:
    """A value as a refusal quotes it: a scalar by its text, a container by its type (never walked: it may
    nest thousands deep), an integer of thousands of digits by its size (str() refuses those)."""
    if isinstance(value, (str, bytes)):
        return brief(repr(value), 60)
    if isinstance(value, int) and abs(value).bit_length() > 1000:
        return f"an integer of {abs(value).bit_length():,} bits"
    if isinstance(value, (int, float, bool)) or value is None:
        return brief(value)
    return f"a {type(value).__name__}"


def _bad(argument: str, expected: str, value: object) -> PipecError:
    return error("E840", f"`{argument}` must be {expected}, got {_shown(value)}")


def _path(value: object, argument: str) -> None:
    if not isinstance(value, (str, os.PathLike)):
        raise _bad(argument, "a path (str or os.PathLike)", value)


def _target(value: object, argument: str = "target") -> None:
    if not isinstance(value, (str, os.PathLike, Schedule, Program)):
        raise _bad(argument, "a schedule's name or path, a Schedule or a Program", value)


def _params(params: object, kwargs: Mapping[str, object]) -> dict[str, object]:
    """`params` and the keyword parameters as one dict: names are strings, values str, int, float or bool."""
    if params is not None and not isinstance(params, Mapping):
        raise _bad("params", "a mapping of parameter names to values (a dict)", params)
    merged = {**(params or {}), **kwargs}
    for name, value in merged.items():
        if not isinstance(name, str):
            raise _bad("params", "a mapping with string keys", name)
        if not isinstance(value, _SCALARS) or (isinstance(value, int) and abs(value).bit_length() > 63):
            raise _bad(name, "an int (within 64 bits), float, bool or str", value)
    return merged


def _number(value: object, argument: str) -> None:
    """A memory amount: a number from 0 to 1e18, as a cost file's quantities (NaN and infinities fail both)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1e18:
        raise _bad(argument, "a finite number from 0 to 1e18", value)


def _memory(memory: object) -> dict[str, object] | None:
    """The memory overrides: the memory model's keys (`act`, `wact`, `ckpt`, `params`, `limit`,
    `host_limit`) as one finite number >= 0 each, and the measured byte keys (`saved_bytes`, ...) as one or one
    per stage. A NaN limit would read as none, a negative one refuse every schedule: both are refused."""
    from pipec.ir.schedule import MEMORY_RANK_KEYS, MEMORY_STAGE_KEYS
    from pipec.sim.memory import BYTE_KEYS

    if memory is None:
        return None
    if not isinstance(memory, Mapping):
        raise _bad("memory", "a mapping of memory keys to numbers (a dict)", memory)
    known = (*MEMORY_STAGE_KEYS, *MEMORY_RANK_KEYS, *BYTE_KEYS)
    for key, value in memory.items():
        if key not in known:
            raise error("E840", f"`memory` has an unknown key {_shown(key)} (it takes {', '.join(known)})")
        if key in BYTE_KEYS and isinstance(value, (list, tuple)):
            if not value:
                raise _bad(f"memory[{key!r}]", "a number or a non-empty list of them", value)
            for i, v in enumerate(value):
                _number(v, f"memory[{key!r}][{i}]")
        else:
            _number(value, f"memory[{key!r}]")
    return dict(memory)


def _cost(cost: object) -> None:
    """A cost spec as `simulate` takes it (CostSpec): a string, a mapping, or a list of those."""
    if cost is None:
        return
    single = isinstance(cost, (str, Mapping))
    if not single and not isinstance(cost, (list, tuple)):
        raise _bad("cost", "a cost file's path, overrides like 'F=1,B=2', a mapping, or a list of those", cost)
    for i, c in enumerate([cost] if single else cost):  # type: ignore[union-attr]
        name = "cost" if single else f"cost[{i}]"
        if not isinstance(c, (str, Mapping)):
            raise _bad(name, "a cost file's path, overrides like 'F=1,B=2' or a mapping", c)
        if isinstance(c, Mapping) and not all(isinstance(k, str) for k in c):
            raise _bad(name, "a mapping with string keys", next(k for k in c if not isinstance(k, str)))
        if isinstance(c, Mapping) and _deeper(c, 3):
            raise error("E840", f"`{name}` nests more than 3 deep: a cost document holds numbers, lists and tables")


def _deeper(value: object, limit: int) -> bool:
    """Whether lists and mappings nest more than `limit` deep in `value` (a walk with its own stack: a
    document nested thousands deep does not recurse)."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (list, tuple, Mapping)):
            if depth >= limit:
                return True
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, Mapping) else v))
    return False


def _options(data_parallel: object, experts: object, moe_layers: object, topology: object = None) -> None:
    """The parallelism arguments: their own classes (their ranges are theirs: E421, E425), MoE layer counts
    as integers, a topology as text."""
    from pipec.ir.experts import MAX_LAYERS

    if data_parallel is not None and not isinstance(data_parallel, DataParallel):
        raise _bad("data_parallel", "a pipec.DataParallel (e.g. DataParallel(2, 'fsdp'))", data_parallel)
    if experts is not None and not isinstance(experts, Experts):
        raise _bad("experts", "a pipec.Experts (e.g. Experts(2, 8))", experts)
    if moe_layers is not None:
        counts = [moe_layers] if isinstance(moe_layers, int) and not isinstance(moe_layers, bool) else moe_layers
        if not isinstance(counts, (list, tuple)) or not counts:
            raise _bad("moe_layers", "an int or a non-empty list of ints (one per stage)", moe_layers)
        for c in counts:
            if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= MAX_LAYERS:
                raise _bad("moe_layers", f"integers from 0 to {MAX_LAYERS:,}", c)
    if topology is not None and not isinstance(topology, str):
        raise _bad("topology", "a topology file's path or its text", topology)


def load(
    name_or_path: str | os.PathLike[str], params: Mapping[str, object] | None = None, **kwargs: object
) -> Schedule:
    """A library schedule by name, or a `.pipe` file (or torch CSV) by path, evaluated with these
    parameters and checked op by op (each op once, on its owner, in dependency order).

    >>> load("1f1b", p=4, m=8).num_ops
    64
    """
    _path(name_or_path, "name_or_path")
    return driver.load(name_or_path, _params(params, kwargs))


def read_program(path: str | os.PathLike[str]) -> Program:
    """A Program file, JSON or text (told apart by content), read and validated (E501 when it is
    malformed, E502 when it breaks a rule of docs/program.md; E000 when it cannot be read).

    >>> import os, tempfile
    >>> from pipec.formats.program_file import to_text
    >>> path = os.path.join(tempfile.mkdtemp(), "p.txt")
    >>> _ = open(path, "w").write(to_text(compile("gpipe", p=2, m=2)))
    >>> read_program(path) == compile("gpipe", p=2, m=2)
    True
    """
    from pipec.formats.program_file import read_program as _read

    _path(path, "path")
    return _read(os.fspath(path))


def check(
    target: Target,
    params: Mapping[str, object] | None = None,
    *,
    memory: Mapping[str, float] | None = None,
    data_parallel: DataParallel | None = None,
    experts: Experts | None = None,
    moe_layers: int | Sequence[int] | None = None,
    **kwargs: object,
) -> CompiledSchedule:
    """Every check `pipec check` runs, or raise PipecError: each op once, on its owner, in dependency
    order; memory within the limit (`memory` overrides `act`, `wact`, `params` and `limit`); no
    deadlock even when every send blocks until its receive is posted; the schedule's own `expect`
    lines. A Program (or Program file) is validated and dry-run. `data_parallel` (`pipec.DataParallel`)
    replicates each rank (ddp) or shards it (fsdp) and places the collectives (docs/program.md).
    `experts` (`pipec.Experts`, as `--ep` and `--experts`) shards the MoE layers over expert groups of
    replicas, with `moe_layers` per stage (one count for all, or one per stage, as `--moe-layers`): each
    FWD and BWD issues its all-to-alls, the same in the same order on every rank of a group (docs/moe.md).
    Returns the compiled schedule: `.schedule`, `.program` and `.memory` (the per-rank peaks).

    >>> c = check("zb-h1", p=4, m=8)
    >>> [round(r.peak, 2) for r in c.memory]
    [4.0, 3.5, 3.0, 2.5]
    """
    _target(target)
    given, memory = _params(params, kwargs), _memory(memory)
    _options(data_parallel, experts, moe_layers)
    c = driver.compile_target(target, given, memory, data_parallel, experts, _layers(moe_layers))
    driver.check_expectations(c.schedule, c.program)
    return c


def compile(  # noqa: A001 - pipec.compile is the name users look for
    target: Target,
    params: Mapping[str, object] | None = None,
    *,
    memory: Mapping[str, float] | None = None,
    data_parallel: DataParallel | None = None,
    experts: Experts | None = None,
    moe_layers: int | Sequence[int] | None = None,
    buffers: bool = False,
    recv_ahead: int | None = None,
    **kwargs: object,
) -> Program:
    """Check a schedule (as `pipec compile` does: all but its `expect` lines) and lower it to one
    instruction stream per rank (docs/program.md), with the collectives `data_parallel` calls for
    (`prog.dp`, `prog.dp_kind` record it) and the all-to-alls of `experts` over `moe_layers` (as for
    `check`; `prog.experts`, `prog.moe_layers`). `buffers=True`: the Program carries its proven buffer plan
    (`prog.buffers`, docs/memory.md "Buffer plan"; its file is version 3), planned for receives posted
    `recv_ahead` ahead of the Program's place (`pipec run --recv-ahead` on gloo; None: a Program file's own
    plan, else 0, where shared memory and NCCL post them). Write it with
    `pipec.formats.program_file.write_json` or `write_text`.

    >>> prog = compile("1f1b", p=2, m=2)
    >>> [str(i) for i in prog.ranks[1].instructions()][:3]
    ['RECV_ACT 0 1 0', 'RECV_ACT 1 1 0', 'FWD 0 1']
    >>> moe = compile("dualpipe-v", p=2, m=4, data_parallel=DataParallel(2), experts=Experts(2, 4), moe_layers=1)
    >>> moe.experts.per_rank, moe.moe_layers
    (2, (1, 1, 1, 1))
    """
    _target(target)
    if recv_ahead is not None:
        if isinstance(recv_ahead, bool) or not isinstance(recv_ahead, int) or recv_ahead < 0:
            raise ValueError(f"recv_ahead must be an integer >= 0, got {recv_ahead!r}")
        if not buffers:
            raise ValueError(f"recv_ahead={recv_ahead} is for the buffer plan: give buffers=True too")
    given, memory = _params(params, kwargs), _memory(memory)
    _options(data_parallel, experts, moe_layers)
    c = driver.compile_target(target, given, memory, data_parallel, experts, _layers(moe_layers))
    if not buffers:
        return c.program
    from pipec.passes.bufferplan import with_plan
    from pipec.sim.memory import memory_model

    return with_plan(c.program, memory_model(c.schedule, memory), recv_ahead)


def simulate(
    target: Target,
    params: Mapping[str, object] | None = None,
    *,
    cost: CostSpec = None,
    memory: Mapping[str, float] | None = None,
    topology: str | None = None,
    data_parallel: DataParallel | None = None,
    experts: Experts | None = None,
    moe_layers: int | Sequence[int] | None = None,
    overlap: bool = True,
    **kwargs: object,
) -> Simulation:
    """Check, lower and simulate under a cost model, as `pipec simulate` does: `cost` is what
    `--cost` takes (a cost file's path, overrides like "F=1,B=2,W=1", a cost document, or a list of
    these, later ones winning) on top of the schedule's own declarations; `topology` what
    `--topology` takes; `data_parallel`, `experts` and `moe_layers` as for `check` (the cost file's
    `moe_layers` when not given); `overlap=False` runs each `F & B` pair one op after the other, as
    `--no-overlap`. Returns the simulation: `.stats` (makespan, bubble, per rank), `.timeline`, `.costs`;
    `pipec.view.report.to_json(sim)` is `pipec simulate --json`'s record for it.

    >>> sim = simulate("1f1b", p=4, m=8, cost="F=1,B=2")
    >>> sim.stats.makespan, sim.stats.bubble_rate
    (33.0, 0.2727272727272727)
    >>> moe = dict(data_parallel=DataParallel(2), experts=Experts(2, 4), moe_layers=1, cost="a2a=0.2")
    >>> [round(simulate("dualpipe-v", p=4, m=8, overlap=o, **moe).stats.makespan, 2) for o in (True, False)]
    [36.03, 41.5]
    """
    _target(target)
    given, memory = _params(params, kwargs), _memory(memory)
    _options(data_parallel, experts, moe_layers, topology)
    _cost(cost)
    if not isinstance(overlap, bool):
        raise _bad("overlap", "True or False", overlap)
    obj, where = driver.target_of(target, given)
    docs = driver.cost_docs(cost)
    return driver.simulation(obj, docs, memory, topology, where, data_parallel, experts, _layers(moe_layers), overlap)


def _layers(moe_layers: int | Sequence[int] | None) -> Sequence[int] | None:
    """`moe_layers` as the driver takes it: one count for every stage is a list of one."""
    return [moe_layers] if isinstance(moe_layers, int) else moe_layers


def write_program(program: Program, path: str | os.PathLike[str], format: str | None = None) -> None:  # noqa: A002
    """Write a Program file, as `pipec compile -o` does: JSON when `format` is "json" (the default for a
    path ending in .json), else the text form (docs/program.md). All or nothing: `path` keeps what it held
    until the whole file is written. E903 when the file cannot be written; read it back with `read_program`.

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "gpipe.json")
    >>> write_program(compile("gpipe", p=2, m=2), path)
    >>> read_program(path) == compile("gpipe", p=2, m=2)
    True
    """
    from pipec.files import atomic_write
    from pipec.formats.program_file import write_json, write_text

    if not isinstance(program, Program):
        raise error("E903", f"write_program takes a Program (from pipec.compile), not {type(program).__name__}")
    fmt = format or ("json" if os.fspath(path).endswith(".json") else "text")
    if fmt not in ("json", "text"):
        raise error("E903", f"format must be 'json' or 'text', not {fmt!r}")
    try:
        with atomic_write(path) as f:
            (write_json if fmt == "json" else write_text)(program, f)
            if fmt == "json":
                f.write("\n")
    except OSError as e:
        raise error("E903", f"cannot write `{brief_path(path)}`: {e.strerror or e}") from None


def read_trace(path: str | os.PathLike[str]) -> Timeline:
    """A trace file (`pipec simulate --trace`, `pipec run --trace`) read back as the exact Timeline it
    holds, simulated or measured (E802 when it is not a pipec trace; docs/simulate.md)."""
    from pipec.formats.trace import read_trace as _read

    return _read(path)


def write_trace(timeline: Timeline, path: str | os.PathLike[str]) -> None:
    """A Timeline (`pipec.simulate(...).timeline`, or a measured one) as a Chrome/Perfetto trace that
    `read_trace` reads back bit for bit (docs/simulate.md, docs/view.md). E903 when the file cannot be
    written."""
    from pipec.formats.trace import write_trace as _write

    try:
        _write(timeline, path)
    except OSError as e:
        raise error("E903", f"cannot write `{brief_path(path)}`: {e.strerror or e}") from None
