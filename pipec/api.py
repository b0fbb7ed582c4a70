"""pipec's Python API: a schedule by name or path to a checked Schedule, a Program, a simulation.

The five calls a user needs are re-exported at the top level (`pipec.load`, `pipec.check`,
`pipec.compile`, `pipec.simulate`, `pipec.read_program`); the CLI is built on the same calls, so
the library and `pipec ...` give the same answers. Every user error raises `pipec.errors.PipecError`
with its diagnostics, never anything else. Nothing here imports torch or matplotlib.

>>> import pipec
>>> pipec.check("1f1b", p=4, m=8).program.num_ranks
4
>>> round(pipec.simulate("1f1b", p=4, m=8).stats.bubble_rate, 4)
0.2727
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from pipec import cachedir
from pipec.errors import Source, brief, error
from pipec.formats.torch_csv_reader import is_torch_csv, read_csv
from pipec.frontend.codegen import GeneratedCode, compile_ast
from pipec.frontend.evaluate import evaluate
from pipec.frontend.library import package_files, read
from pipec.ir.dataparallel import DataParallel
from pipec.ir.program import Program, is_program_text
from pipec.ir.schedule import RankOps, Schedule
from pipec.passes.checks import check_schedule

if TYPE_CHECKING:
    from pipec.passes.compiler import CompiledSchedule
    from pipec.view.report import Simulation

__all__ = [
    "build",
    "check",
    "check_program",
    "compile",
    "cost_docs",
    "load",
    "param_names",
    "read_program",
    "schedule_of",
    "simulate",
    "simulation",
    "target_of",
]

# What check, compile and simulate accept: a Schedule or Program already in hand, or a library name or
# the path of a .pipe file, a torch CSV or a Program file (JSON or text, told apart by content).
Target = Schedule | Program | str | os.PathLike
# A cost model as `pipec simulate --cost` takes it: a cost file's path or overrides like "F=1,B=2",
# a cost document (a mapping, as in a cost file), or several of these, later ones winning.
CostSpec = str | Mapping[str, object] | Sequence[str | Mapping[str, object]] | None


@functools.lru_cache(maxsize=128)
def compile_source(source: Source) -> GeneratedCode:
    """Parse and generate code once per distinct text: in this process (lru_cache), and across processes
    through the per-user cache (`pipec.cachedir`), since every rank of a job, and every fresh `pipec`
    command, compiles the same few schedule texts again. The entry's name digests the text and the
    front end's own files, so an edit to either is never served stale."""
    import hashlib
    import pickle

    name = "code-" + hashlib.sha256((_front_end_digest() + "\0" + source.text).encode()).hexdigest()[:32] + ".pickle"
    data = cachedir.load(name)
    if data is not None:
        try:
            code = pickle.loads(data)
            if isinstance(code, GeneratedCode):
                return code
        except Exception:  # a damaged entry: compute it again
            pass
    from pipec.frontend.parse import parse  # lark loads only when a text is parsed

    code = compile_ast(parse(source), source)
    cachedir.store(name, pickle.dumps(code))
    return code


@functools.cache
def _front_end_digest() -> str:
    """What the generated code depends on besides the text: the grammar, the front end's modules, the
    versions of pipec and Python."""
    import hashlib
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    h = hashlib.sha256(f"{sys.version}\0{_version()}".encode())
    for path in sorted((here / "frontend").glob("*.py")):
        with contextlib.suppress(OSError):
            h.update(path.read_bytes())
    h.update(package_files("pipec.grammar").joinpath("pipe.lark").read_bytes())
    return h.hexdigest()


def _version() -> str:
    from pipec import __version__

    return __version__


def param_names(source: Source) -> tuple[str, ...]:
    """The parameters a schedule declares (a torch CSV: `p` and `m`; a Program file: none)."""
    if is_torch_csv(source):
        return ("p", "m")
    if is_program_text(source.text):
        return ()
    return tuple(p.name for p in compile_source(source).params)


def build(
    source: Source,
    params: Mapping[str, object] | Iterable[tuple[str, object]] = (),
    *,
    check: bool = True,
    ranks: Iterable[int] | None = None,
) -> Schedule:
    """Parse, evaluate with these parameters and (unless told not to) check a schedule.

    A source read from a `.csv` file is a torch.distributed.pipelining schedule CSV (docs/interop.md):
    it is read as it stands, and takes only `p` and `m`, equal to the sizes it fixes.
    """
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    if is_torch_csv(source):  # torch.distributed.pipelining's schedule CSV: its own front end
        for name, value in items:
            if name in ("p", "m") and isinstance(value, str) and not _INT.fullmatch(value.strip()):
                raise error("E607", f"`{name}={brief(value)}`: expected an int (ASCII digits)", None, source)
        sched = read_csv(source, items, check=check and ranks is None)
    else:
        sched = evaluate(compile_source(source), source, items, ranks)
    if check and ranks is None:
        from pipec.files import require_ops_fit

        require_ops_fit(sched.num_ops, f"`{sched.name}`")  # before the checks' arrays
        check_schedule(sched)
    return sched


# A torch CSV's `p` or `m` given as text (`-D p=4`): ASCII digits with an optional sign, as the language's
# own integers (pipec.frontend.evaluate); Python's int() would also take `1_0` as 10 and `٤` as 4.
_INT = re.compile(r"[-+]?[0-9]+")


def load(
    name_or_path: str | os.PathLike[str], params: Mapping[str, object] | None = None, **kwargs: object
) -> Schedule:
    """A library schedule by name, or a `.pipe` file (or torch CSV) by path, evaluated with these
    parameters and checked op by op (each op once, on its owner, in dependency order).

    >>> load("1f1b", p=4, m=8).num_ops
    64
    """
    merged = dict(params or {}, **kwargs)
    return build(_read(name_or_path), merged)


def _read(target: str | os.PathLike[str]) -> Source:
    """The schedule, CSV or Program file a target names (`pipec.frontend.library.read`, which refuses
    with E901 a path that is not a regular file or is above 64 MiB)."""
    return read(os.fspath(target))


def read_program(path: str | os.PathLike[str]) -> Program:
    """A Program file, JSON or text (told apart by content), read and validated (E501 when it is
    malformed, E502 when it breaks a rule of docs/program.md; E000 when it cannot be read).

    >>> import os, tempfile
    >>> from pipec.ir.program import to_text
    >>> path = os.path.join(tempfile.mkdtemp(), "p.txt")
    >>> _ = open(path, "w").write(to_text(compile("gpipe", p=2, m=2)))
    >>> read_program(path) == compile("gpipe", p=2, m=2)
    True
    """
    from pipec.ir.program import read_program as _read

    return _read(os.fspath(path))


def schedule_of(prog: Program, source: Source | None = None) -> Schedule:
    """The Schedule a Program executes: each rank's computes in their order (an overlapped pair stays a
    pair), with the Program's sizes, parameters and placement. A Program holds no cost, memory,
    topology or `expect` declarations, so the defaults apply to it (give costs with `cost=`)."""
    from pipec.ir.opcodes import IS_COMPUTE, KIND_OF

    ranks = []
    for rp in prog.ranks:
        idx = np.flatnonzero(IS_COMPUTE[rp.op])
        ranks.append(
            RankOps(
                kind=KIND_OF[rp.op[idx]],
                mb=rp.mb[idx],
                stage=rp.stage[idx],
                sid=np.zeros(len(idx), dtype=np.int64),
                paired=rp.group[idx],
            )
        )
    return Schedule(
        name=prog.name,
        params=tuple(prog.params),
        num_stages=prog.num_stages,
        num_ranks=prog.num_ranks,
        num_microbatches=prog.num_microbatches,
        kinds=("F", "B", "W") if prog.split_backward else ("F", "B"),
        placement=tuple(prog.placement),
        ranks=tuple(ranks),
        source=source,
        slicing=prog.slicing,
    )


def target_of(
    target: Target, params: Mapping[str, object] | Iterable[tuple[str, object]] | None = None
) -> tuple[Schedule | Program, str | None]:
    """What a target names, and the Program file it was read from (None otherwise): a Schedule
    (evaluated with the parameters and checked op by op) or a validated Program, which takes no
    parameters (they were fixed when it was compiled)."""
    items = list(params.items()) if isinstance(params, Mapping) else list(params or ())
    if isinstance(target, (Schedule, Program)):
        obj, where = target, None
    else:
        source = _read(target)
        if not is_program_text(source.text):
            return build(source, items), None
        from pipec.ir.program import parse_program  # the file is read already: parse its text

        obj, where = parse_program(source.text, source.path), source.path
    if items:
        name = items[0][0]
        if isinstance(obj, Program):
            given = " ".join(f"{k}={v}" for k, v in obj.params) or "no parameters"
            raise error(
                "E205",
                f"unknown parameter `{name}`: a compiled Program takes no parameters",
                source=Source(where, "") if where else None,
                notes=(f"it was compiled with {given}",),
            )
        raise error("E205", f"unknown parameter `{name}`: this Schedule is evaluated already")
    return obj, where


def check_program(
    prog: Program,
    memory: Mapping[str, float] | None = None,
    path: str | None = None,
    data_parallel: DataParallel | None = None,
) -> CompiledSchedule:
    """A Program's checks, the ones a compiled schedule passes: validated, no deadlock when sends block
    until the receive is posted, and memory within the limit (under `memory`, as a Program holds no
    memory declarations; fsdp Programs count their own windows). `path` names the file in diagnostics.
    `data_parallel`, when given, must agree with the Program's own `dp` and `dp_kind` (E422): a Program
    was lowered for its data parallelism and is run as it stands."""
    from pipec.passes.compiler import CompiledSchedule, program_deadlock_error
    from pipec.passes.dryrun import dry_run
    from pipec.passes.memcheck import check_memory
    from pipec.sim.memory import program_memory

    run = dry_run(prog)  # validates first
    if data_parallel is not None:
        require_same_dp(prog, data_parallel, path)
    sched = schedule_of(prog, Source(path or "<program>", ""))
    if not run.completed:
        raise program_deadlock_error(sched, run)
    reports = program_memory(prog, sched, memory)
    check_memory(sched, reports)
    return CompiledSchedule(sched, prog, tuple(reports))


def require_same_dp(prog: Program, dp: DataParallel, path: str | None = None) -> None:
    """E422 unless a Program's data parallelism is `dp`'s (size and kind; a Program's windows are fixed)."""
    if (prog.dp, prog.dp_kind) != (dp.size, dp.kind):
        raise error(
            "E422",
            f"the Program was compiled for data parallelism {prog.dp} x {prog.dp_kind}, "
            f"not the {dp.size} x {dp.kind} asked for",
            source=Source(path, "") if path else None,
            notes=("compile the schedule again with these options, or leave them out to run the Program as it is",),
        )


def _compiled(target: Target, params, memory, kwargs, data_parallel: DataParallel | None) -> CompiledSchedule:
    from pipec.passes.compiler import compile_schedule

    obj, where = target_of(target, dict(params or {}, **kwargs))
    if isinstance(obj, Program):
        return check_program(obj, memory, where, data_parallel)
    return compile_schedule(obj, memory, data_parallel)


def check(
    target: Target,
    params: Mapping[str, object] | None = None,
    *,
    memory: Mapping[str, float] | None = None,
    data_parallel: DataParallel | None = None,
    **kwargs: object,
) -> CompiledSchedule:
    """Every check `pipec check` runs, or raise PipecError: each op once, on its owner, in dependency
    order; memory within the limit (`memory` overrides `act`, `wact`, `params` and `limit`); no
    deadlock even when every send blocks until its receive is posted; the schedule's own `expect`
    lines. A Program (or Program file) is validated and dry-run. `data_parallel` (`pipec.DataParallel`)
    replicates each rank (ddp) or shards it (fsdp) and places the collectives (docs/program.md).
    Returns the compiled schedule: `.schedule`, `.program` and `.memory` (the per-rank peaks).

    >>> c = check("zb-h1", p=4, m=8)
    >>> [round(r.peak, 2) for r in c.memory]
    [4.0, 3.5, 3.0, 2.5]
    """
    from pipec.passes.expect import check_expectations

    c = _compiled(target, params, memory, kwargs, data_parallel)
    check_expectations(c.schedule, c.program)
    return c


def compile(  # noqa: A001 - pipec.compile is the name users look for
    target: Target,
    params: Mapping[str, object] | None = None,
    *,
    memory: Mapping[str, float] | None = None,
    data_parallel: DataParallel | None = None,
    **kwargs: object,
) -> Program:
    """Check a schedule (as `pipec compile` does: all but its `expect` lines) and lower it to one
    instruction stream per rank (docs/program.md), with the collectives `data_parallel` calls for
    (`prog.dp`, `prog.dp_kind` record it). Write it with `pipec.ir.program.write_json` or `write_text`.

    >>> prog = compile("1f1b", p=2, m=2)
    >>> [str(i) for i in prog.ranks[1].instructions()][:3]
    ['RECV_ACT 0 1 0', 'RECV_ACT 1 1 0', 'FWD 0 1']
    """
    return _compiled(target, params, memory, kwargs, data_parallel).program


def simulate(
    target: Target,
    params: Mapping[str, object] | None = None,
    *,
    cost: CostSpec = None,
    memory: Mapping[str, float] | None = None,
    topology: str | None = None,
    data_parallel: DataParallel | None = None,
    **kwargs: object,
) -> Simulation:
    """Check, lower and simulate under a cost model, as `pipec simulate` does: `cost` is what
    `--cost` takes (a cost file's path, overrides like "F=1,B=2,W=1", a cost document, or a list of
    these, later ones winning) on top of the schedule's own declarations; `topology` what
    `--topology` takes; `data_parallel` as for `compile`. Returns the simulation: `.stats` (makespan,
    bubble, per rank), `.timeline`, `.costs`; `pipec.view.report.to_json(sim)` is `pipec simulate --json`'s
    record for it.

    >>> sim = simulate("1f1b", p=4, m=8, cost="F=1,B=2")
    >>> sim.stats.makespan, sim.stats.bubble_rate
    (33.0, 0.2727272727272727)
    """
    obj, where = target_of(target, dict(params or {}, **kwargs))
    return simulation(obj, cost_docs(cost), memory, topology, where, data_parallel)


def cost_docs(cost: CostSpec) -> list[dict]:
    """Cost documents, checked and converted, from what `simulate(cost=...)` takes."""
    from pipec.sim.costs import cost_spec, normalize

    specs = [] if cost is None else [cost] if isinstance(cost, (str, Mapping)) else list(cost)
    return [cost_spec(c) if isinstance(c, str) else dict(c) if "_from" in c else normalize(c, "cost=") for c in specs]


def simulation(
    obj: Schedule | Program,
    docs: Sequence[Mapping] = (),
    memory: Mapping[str, float] | None = None,
    topology: str | None = None,
    where: str | None = None,
    data_parallel: DataParallel | None = None,
) -> Simulation:
    """Simulate a Schedule (checked and lowered first, with `data_parallel`'s collectives) or a Program
    (checked, then run as it stands) under these cost documents (see `cost_docs`) and memory overrides,
    on `topology` if given."""
    from pipec.frontend.topology import read_topology, with_topology
    from pipec.sim.costs import cost_model
    from pipec.sim.memory import memory_bytes, memory_model
    from pipec.sim.memtime import memory_curves
    from pipec.sim.simulate import simulate as run
    from pipec.sim.simulate import stats
    from pipec.view import report

    if isinstance(obj, Schedule) and (data_parallel is None or data_parallel.is_default):
        return report.run(with_topology(obj, read_topology(topology, obj)) if topology else obj, docs, memory)
    memory = {**memory_bytes(docs), **(memory or {})}  # the cost documents' measured bytes, as report.run
    if isinstance(obj, Schedule):
        from pipec.passes.compiler import compile_schedule

        compiled = compile_schedule(obj, memory, data_parallel)
        obj = compiled.program
    else:
        compiled = check_program(obj, memory, where, data_parallel)
    sched = compiled.schedule
    if topology:
        sched = with_topology(sched, read_topology(topology, sched))
    costs = cost_model(sched, docs)
    mem = memory_model(sched, memory)
    tl = run(obj, costs)
    curves = memory_curves(tl, obj, mem)
    st = report.with_peaks(stats(tl), curves)
    return report.Simulation(replace(compiled, schedule=sched), costs, mem, tl, st, curves)
