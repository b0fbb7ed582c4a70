"""The one pipeline: a target to a checked Schedule or Program, then to its simulated numbers.

Every caller that turns a schedule into numbers comes through here: the public API (`pipec.api`), the
report (`pipec.view.report`), `expect` (its metrics, `metrics`), synth, slicing and partition. So the
steps happen once, in one order:

1. build: a library name, `.pipe` file or torch CSV evaluated with its parameters (`build`); an
   `order` block resolved into per-rank orders (`pipec.passes.policy.resolve`); checked op by op;
2. compile: memory and deadlock checks, then the lowering (`pipec.passes.compiler`); a Program file
   is validated, dry-run and its memory checked instead (`check_program`);
3. the memory overrides: a cost document's measured bytes under the caller's overrides
   (`memory_overrides`, the one merge of profiled bytes into the memory model);
4. cost, memory model, simulate, memory curves, peaks (`measure`).

A topology given apart from the schedule (`--topology`) replaces the schedule's own before it is compiled
(a Program's: on the Schedule it executes).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from pipec.errors import Source, brief, error
from pipec.formats.program_file import is_program_text, parse_program
from pipec.formats.torch_csv_reader import is_torch_csv, read_csv
from pipec.frontend.library import read
from pipec.frontend.load import compile_source, evaluate_source
from pipec.ir.dataparallel import DataParallel, dp_mismatch
from pipec.ir.experts import Experts
from pipec.ir.program import Program, schedule_of  # schedule_of lives below the formats now; importable here as before
from pipec.ir.schedule import Schedule
from pipec.passes.checks import check_schedule

if TYPE_CHECKING:  # the lowering's and the simulator's modules load when a call needs them (start-up time)
    from pipec.passes.compiler import CompiledSchedule
    from pipec.sim.costs import CostModel
    from pipec.sim.memtime import MemoryCurves
    from pipec.sim.simulate import Stats
    from pipec.sim.timeline import Timeline

# What check, compile and simulate accept: a Schedule or Program already in hand, or a library name or
# the path of a .pipe file, a torch CSV or a Program file (JSON or text, told apart by content).
Target = Schedule | Program | str | os.PathLike
Params = Mapping[str, object] | Iterable[tuple[str, object]]


@dataclass(frozen=True)
class Simulation:
    """A compiled schedule and what simulating it gave: its cost and memory models, the timeline, the stats
    (peaks from the memory curves) and the curves (None: computed on demand by `pipec.view.report.curves_of`)."""

    compiled: CompiledSchedule
    costs: CostModel
    memory: dict[str, np.ndarray]
    timeline: Timeline
    stats: Stats
    curves: MemoryCurves | None = None
    overlap: bool = True  # whether overlapped pairs ran their segments in turns (False: one op after the other)

    @property
    def schedule(self) -> Schedule:
        return self.compiled.schedule


# ---- 1. build -----------------------------------------------------------------------------------------


def build(source: Source, params: Params = (), *, check: bool = True, ranks: Iterable[int] | None = None) -> Schedule:
    """Parse, evaluate with these parameters, resolve an `order` block and (unless told not to) check a
    schedule. `ranks`: evaluate only these ranks' ops (a rank of a run; unchecked).

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
        sched = evaluate_source(source, items, ranks)
        if sched.order is not None:  # an `order` block: its per-rank orders, derived under its own costs
            from pipec.passes.policy import resolve

            sched = resolve(sched)
    return checked(sched) if check and ranks is None else sched


def checked(sched: Schedule) -> Schedule:
    """`build`'s last step, for a caller that built unchecked to look at the schedule first (the
    playground's op bound): its memory estimate (E902), then every check op by op."""
    from pipec.files import require_ops_fit

    require_ops_fit(sched.num_ops, f"`{sched.name}`")  # before the checks' arrays
    check_schedule(sched)
    return sched


# A torch CSV's `p` or `m` given as text (`-D p=4`): ASCII digits with an optional sign, as the language's
# own integers (pipec.frontend.evaluate); Python's int() would also take `1_0` as 10 and `٤` as 4.
_INT = re.compile(r"[-+]?[0-9]+")


def read_source(target: str | os.PathLike[str]) -> Source:
    """The schedule, CSV or Program file a target names (`pipec.frontend.library.read`, which refuses
    with E901 a path that is not a regular file or is above 64 MiB)."""
    return read(os.fspath(target))


def load(
    name_or_path: str | os.PathLike[str], params: Mapping[str, object] | None = None, **kwargs: object
) -> Schedule:
    """A library schedule by name, or a `.pipe` file (or torch CSV) by path, evaluated and checked."""
    return build(read_source(name_or_path), dict(params or {}, **kwargs))


def param_names(source: Source) -> tuple[str, ...]:
    """The parameters a schedule declares (a torch CSV: `p` and `m`; a Program file: none)."""
    if is_torch_csv(source):
        return ("p", "m")
    if is_program_text(source.text, source.path):
        return ()
    return tuple(p.name for p in compile_source(source).params)


def target_of(target: Target, params: Params | None = None) -> tuple[Schedule | Program, str | None]:
    """What a target names, and the Program file it was read from (None otherwise): a Schedule
    (evaluated with the parameters and checked op by op) or a validated Program, which takes no
    parameters (they were fixed when it was compiled)."""
    items = list(params.items()) if isinstance(params, Mapping) else list(params or ())
    if isinstance(target, (Schedule, Program)):
        obj, where = target, None
    else:
        source = read_source(target)
        if not is_program_text(source.text, source.path):  # a damaged Program is E501, not schedule syntax
            return build(source, items), None
        obj, where = parse_program(source.text, source.path), source.path  # the file is read already
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


# ---- 2. compile ---------------------------------------------------------------------------------------


def check_program(
    prog: Program,
    memory: Mapping[str, object] | None = None,
    path: str | None = None,
    data_parallel: DataParallel | None = None,
    experts: Experts | None = None,
    moe_layers: Sequence[int] = (),
) -> CompiledSchedule:
    """A Program's checks, the ones a compiled schedule passes: validated, no deadlock when sends block
    until the receive is posted, and memory within the limit (under `memory`, as a Program holds no
    memory declarations; fsdp Programs count their own windows). `path` names the file in diagnostics.
    `data_parallel`, when given, must agree with the Program's own `dp` and `dp_kind` (E422): a Program
    was lowered for its data parallelism and is run as it stands; so were its all-to-alls for its `experts`
    and `moe_layers`, which must agree with these when given (E426)."""
    from pipec.passes.compiler import CompiledSchedule, program_deadlock_error
    from pipec.passes.dryrun import dry_run
    from pipec.passes.experts import check_program_experts
    from pipec.passes.memcheck import check_memory
    from pipec.sim.memory import program_memory

    run = dry_run(prog)  # validates first
    if experts is not None or len(moe_layers):
        check_program_experts(prog, experts or prog.experts, moe_layers, path)
    if data_parallel is not None:
        problem = dp_mismatch(prog, data_parallel.size, data_parallel.kind)
        if problem is not None:
            raise error(
                "E422",
                problem,
                source=Source(path, "") if path else None,
                notes=("compile the schedule again with these options, or leave them out to run the Program as it is",),
            )
    sched = schedule_of(prog, Source(path or "<program>", ""))
    if not run.completed:
        raise program_deadlock_error(sched, run)
    reports = program_memory(prog, sched, memory)
    check_memory(sched, reports)
    return CompiledSchedule(sched, prog, tuple(reports))


def compiled(
    obj: Schedule | Program,
    memory: Mapping[str, object] | None = None,
    where: str | None = None,
    data_parallel: DataParallel | None = None,
    topology: str | None = None,
    experts: Experts | None = None,
    moe_layers: Sequence[int] = (),
) -> CompiledSchedule:
    """A Schedule checked and lowered (with `data_parallel`'s collectives and `experts` over its stages'
    `moe_layers`, see `moe_layers_of`), or a Program checked as it stands; on the network `topology`
    names (`--topology`), if given, in place of the schedule's own."""
    from pipec.frontend.topology import read_topology, with_topology
    from pipec.passes.compiler import compile_schedule

    if isinstance(obj, Schedule):
        if topology:
            obj = with_topology(obj, read_topology(topology, obj))
        return compile_schedule(obj, memory, data_parallel, experts, moe_layers)
    c = check_program(obj, memory, where, data_parallel, experts, moe_layers)
    if topology:
        c = replace(c, schedule=with_topology(c.schedule, read_topology(topology, c.schedule)))
    return c


def compile_target(
    target: Target,
    params: Params | None = None,
    memory: Mapping[str, object] | None = None,
    data_parallel: DataParallel | None = None,
    experts: Experts | None = None,
    moe_layers: Sequence[int] | None = None,
    docs: Sequence[Mapping] = (),
) -> CompiledSchedule:
    """`pipec.compile`'s and `pipec.check`'s pipeline: the target read and built, then compiled."""
    obj, where = target_of(target, params)
    return compiled(obj, memory, where, data_parallel, None, experts, moe_layers_of(obj, docs, moe_layers))


def moe_layers_of(obj: Schedule | Program, docs: Sequence[Mapping] = (), given: Sequence[int] | None = None):
    """The MoE layers of each stage, in one place: `given` (`--moe-layers`: one count for every stage, or
    one per stage), else the last cost document's `moe_layers` (what `pipec profile` writes for a model
    with MoE layers), else the schedule's own `cost moe_layers` declaration; empty when none says (a
    Program: its own). E425 for a `given` list of the wrong length; E801 for a cost file's or the schedule's
    (or a count that is not an integer)."""
    from pipec.passes.experts import layers_for

    S = obj.num_stages
    if given is not None:
        return layers_for(S, given)
    doc = next((d for d in reversed(docs) if "moe_layers" in d), None)
    found, where = (doc["moe_layers"], str(doc.get("_from", "the cost file"))) if doc else (None, "")
    if found is None and isinstance(obj, Schedule) and "moe_layers" in obj.costs:
        found, where = list(np.asarray(obj.costs["moe_layers"], dtype=float).ravel()), "the schedule"
    if found is None:
        return ()
    values = found if isinstance(found, list | tuple) else [found]
    if any(float(v) != int(v) for v in values):
        raise error("E801", f"{where}: `moe_layers` must be a whole number of layers per stage, got {brief(values)}")
    if len(values) not in (1, S):
        raise error("E801", f"{where}: `moe_layers` lists {len(values)} values but the schedule has {S} stages")
    return layers_for(S, [int(v) for v in values])


# ---- 3. the memory overrides --------------------------------------------------------------------------


def memory_overrides(docs: Sequence[Mapping] = (), memory: Mapping[str, object] | None = None) -> dict[str, object]:
    """The memory model's overrides: the cost documents' measured bytes (`saved_bytes`, ..., which make the
    model count bytes; `pipec.sim.memory.memory_bytes`), under the caller's own (`--mem`, `memory=`)."""
    from pipec.sim.memory import memory_bytes

    return {**memory_bytes(docs), **(memory or {})}


def cost_docs(cost: str | Mapping[str, object] | Sequence[str | Mapping[str, object]] | None) -> list[dict]:
    """Cost documents, checked and converted, from what `pipec.simulate(cost=...)` takes: a cost file's path
    or overrides like "F=1,B=2", a cost document (a mapping), or several of these, later ones winning."""
    from pipec.sim.cost_files import cost_spec, normalize

    specs = [] if cost is None else [cost] if isinstance(cost, (str, Mapping)) else list(cost)
    return [cost_spec(c) if isinstance(c, str) else dict(c) if "_from" in c else normalize(c, "cost=") for c in specs]


# ---- 4. cost, memory, simulate, peaks -----------------------------------------------------------------


def measure(
    c: CompiledSchedule,
    docs: Sequence[Mapping] = (),
    memory: Mapping[str, object] | None = None,
    overlap: bool = True,
) -> Simulation:
    """A compiled schedule simulated under these cost documents, with its memory curves and peaks (the two
    pools, memory ops included; `pipec.sim.memtime`). `memory`: the overrides as `memory_overrides` made them.
    `overlap` False runs each overlapped pair one op after the other (`pipec simulate --no-overlap`)."""
    from pipec.sim.costs import cost_model
    from pipec.sim.memory import memory_model
    from pipec.sim.memtime import memory_curves
    from pipec.sim.simulate import simulate, stats

    sched, prog = c.schedule, c.program
    costs = cost_model(sched, docs)
    mem = memory_model(sched, memory)
    tl = simulate(prog, costs, overlap=overlap)
    curves = memory_curves(tl, prog, mem)
    return Simulation(c, costs, mem, tl, with_peaks(stats(tl), curves), curves, overlap)


def with_peaks(st: Stats, curves: MemoryCurves) -> Stats:
    """The Stats with each rank's peak memory the device curve's (`pipec.sim.memtime`)."""
    ranks = tuple(replace(r, peak_memory=float(curves.device_peak[r.rank])) for r in st.ranks)
    return replace(st, ranks=ranks)


def simulation(
    obj: Schedule | Program,
    docs: Sequence[Mapping] = (),
    memory: Mapping[str, object] | None = None,
    topology: str | None = None,
    where: str | None = None,
    data_parallel: DataParallel | None = None,
    experts: Experts | None = None,
    moe_layers: Sequence[int] | None = None,
    overlap: bool = True,
) -> Simulation:
    """Simulate a Schedule (checked and lowered first, with `data_parallel`'s collectives and `experts`'
    all-to-alls over `moe_layers_of` its stages) or a Program (checked, then run as it stands) under these
    cost documents (see `cost_docs`) and memory overrides (over the documents' measured bytes), on
    `topology` if given; `overlap` False runs each overlapped pair one op after the other."""
    memory = memory_overrides(docs, memory)
    layers = moe_layers_of(obj, docs, moe_layers)
    c = compiled(obj, memory, where, data_parallel, topology, experts, layers)
    return measure(c, docs, memory, overlap)


def timeline(sched: Schedule, prog: Program, docs: Sequence[Mapping] = ()) -> Timeline:
    """A lowered schedule's timeline under these cost documents, without the memory curves: what a search
    that simulates many variants of one Program (partition's splits) asks for each."""
    from pipec.sim.costs import cost_model
    from pipec.sim.simulate import simulate

    return simulate(prog, cost_model(sched, docs))


# ---- the schedule's own promises ----------------------------------------------------------------------


def metrics(sched: Schedule, program: Program | None = None, stats: Stats | None = None):
    """What a schedule's `expect` lines read (`pipec.passes.expect.Metrics`), its times measured here under
    the schedule's own costs and memory (`measure`), only when an expectation names one."""
    from pipec.passes.expect import Metrics

    return Metrics(sched, program, stats, _own_stats, _own_overlap_gain)


def check_expectations(sched: Schedule, program: Program | None = None, stats: Stats | None = None) -> int:
    """Raise E405 for the first `expect` that does not hold; return how many were checked
    (`pipec.passes.expect.check_expectations`, its times from `measure`)."""
    from pipec.passes.expect import check_expectations as check

    return check(sched, program, stats, _own_stats, _own_overlap_gain)


def _own_stats(sched: Schedule, prog: Program | None) -> Stats:
    """A schedule's Stats under its own costs and memory (what `expect` lines read): lowered if need be."""
    from pipec.passes.compiler import CompiledSchedule

    if prog is None:
        from pipec.passes.lower import lower

        prog = lower(sched)
    return measure(CompiledSchedule(sched, prog, ())).stats


def _own_overlap_gain(sched: Schedule) -> float:
    """`overlap_gain` (pipec.passes.expect): 1 - makespan / makespan with each pair run one op after the other,
    with the schedule's MoE layers (else 1 per stage) over an expert group of 2, each all-to-all its `a2a`
    (else one forward segment of its stage)."""
    from pipec.ir.experts import all_to_alls
    from pipec.passes.compiler import CompiledSchedule
    from pipec.passes.lower import lower
    from pipec.sim.costs import cost_model

    if not any(r.paired.any() for r in sched.ranks):
        return 0.0
    layers = moe_layers_of(sched) or (1,) * sched.num_stages
    prog = replace(lower(sched), experts=Experts(2, 2), moe_layers=tuple(layers))
    doc: dict[str, object] = {"_from": "overlap_gain"}
    if "a2a" not in sched.costs:
        F = cost_model(sched).F
        doc["a2a"] = [float(f) / (all_to_alls("F", L) + 1) for f, L in zip(F.tolist(), layers)]
    c = CompiledSchedule(sched, prog, ())
    with_overlap = measure(c, [doc]).stats.makespan
    without = measure(c, [doc], overlap=False).stats.makespan
    return 1.0 - with_overlap / without if without > 0 else 0.0
