"""The joint search: every candidate of `pipec.planner.space` (schedule, m, v, memory ops) with its best
layer split, each evaluated by the one simulator and memory walk through `pipec.partition.Problem`, and a
lower bound on every plan so that the gap to the optimum is reported.

Phases, each bounded by the time limit:

1. screen: each (schedule, m, v) is built and compiled (`pipec.driver.build`, the compiler), its table
   scaled to m's micro-batch size, and the uniform and bottleneck splits simulated (and, when neither fits
   the limits, the split that a descent on the memory excess reaches). Where the limits bind (the
   unconstrained split does not fit), the memory-op variants (recomputation or offload on ranks 0..k-1)
   are screened too. A candidate whose memory rows (`Problem.memory_rows`, each additive over stages) have
   a minimum over all splits above the limit is proven not to fit (`fits_at_all`).
2. refine: from the fastest screened candidate on, `pipec.partition.search` (local search, fluid bound,
   branch and bound) within a share of the time left; a candidate whose lower bound is already at least the
   best step found is skipped: it cannot win.
3. the answer is compiled with its split's bytes as memory declarations and limits, so that the memory
   check (E402) proves it within the limits (`prove`), and simulated through `pipec.driver.simulation`.

Lower bound (`Plan.lower_bound`): the least, over the candidates that might fit, of each one's bound:
`pipec.partition`'s (fluid bound, branch and bound, work bound) where refined; else the work bound (some
rank computes at least its share of the whole work). Memory ops only add work and waits to a fixed order
(a RECOMPUTE is a forward more; a RELOAD a wait more), so a candidate's work bound holds for its variants.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from pipec.errors import PipecError, error
from pipec.formats.partition_files import LayerTable
from pipec.ir.units import fmt_bytes
from pipec.partition.local_search import _balanced, _neighbours
from pipec.partition.problem import Problem, Split
from pipec.partition.search import search
from pipec.planner.bounds import SEARCH_OPS, improve, layer_bound, path_bound, rows_of, universal_bound
from pipec.planner.space import (
    LIBRARY,
    MEMOPS,
    Candidate,
    has_memops,
    megatron_split,
    memop_ranks,
    rank_orders,
    scaled,
    with_memops,
)

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Inputs:
    """What the planner is given: the layer table (times for micro-batches of `table_mbs` samples), p ranks
    with their speeds and memory limits (bytes, NaN none), the global batch in samples, the cost documents
    of links (`--cost`), and which schedules, micro-batch counts and memory ops to try."""

    table: LayerTable
    p: int
    global_batch: int
    table_mbs: float
    speed: tuple[float, ...]
    limit: tuple[float, ...]
    microbatches: tuple[int, ...]
    cost_docs: tuple[Mapping, ...] = ()
    schedules: tuple[str, ...] = LIBRARY
    memops: tuple[str, ...] = MEMOPS
    synth: bool = True  # one synthesized schedule on the incumbent's stage costs (`pipec.planner.synthesized`)


@dataclass(frozen=True)
class Point:
    """A candidate's outcome: its best split found that fits (None: none found), a lower bound (seconds) on
    every split of it within the limits, whether that bound is its best's step (optimal), whether the
    partition search ran on it, and the least memory excess found (max over ranks of peak - limit, bytes;
    <= 0 fits) with that split's peaks."""

    candidate: Candidate
    split: Split | None
    lower_bound: float
    optimal: bool = False
    refined: bool = False
    excess: float = math.nan
    peaks: tuple[float, ...] = ()
    infeasible: bool = False  # proven: no split fits
    note: str = ""

    @property
    def step(self) -> float:
        return self.split.step if self.split is not None else math.inf

    @property
    def peak(self) -> float:
        return max(self.split.memory) if self.split is not None else max(self.peaks, default=math.nan)


@dataclass(frozen=True)
class Plan:
    """The search's outcome: the best point, every point, the baselines ((a) Megatron-LM's default, (b) the
    best library schedule with `pipec partition`'s split), the lower bound over every plan, and the
    problems (the schedule, Program and scaled table) of the points, by candidate."""

    best: Point
    points: tuple[Point, ...]
    megatron: Point | None
    library: Point | None
    lower_bound: float
    seconds: float
    skipped: tuple[str, ...] = ()
    problems: Mapping[Candidate, Problem] = field(default_factory=dict)


def _excess(pb: Problem, mem: np.ndarray) -> float:
    lim = pb.limit
    over = np.where(np.isnan(lim), -np.inf, mem - lim)
    return float(over.max()) if len(over) else -math.inf


def fits_at_all(pb: Problem) -> bool:
    """False when some memory row of some rank exceeds its limit under every split: the row's least value
    over all contiguous splits (a dynamic program over stage and boundary; each row is additive over the
    stages, `Problem.memory_rows`) is above it. True means only that no row proves otherwise."""
    L, S = pb.L, pb.S
    for r in range(pb.R):
        for wq, lim in pb.memory_rows(r):
            cost = np.full(L + 1, np.iinfo(np.int64).max // 4, dtype=np.int64)
            cost[0] = 0
            for s in range(S):
                w = wq[s]
                run = np.minimum.accumulate(cost - w)
                nxt = np.full(L + 1, np.iinfo(np.int64).max // 4, dtype=np.int64)
                nxt[1:] = w[1:] + run[:-1]
                cost = nxt
            if int(cost[L]) > lim:
                return False
    return True


def _memory_descent(pb: Problem, bounds: Sequence[int], deadline: float) -> tuple[int, ...]:
    """From `bounds`, steepest descent on the memory excess (max over ranks of peak - limit) over the
    one-boundary moves, until it fits or no move lowers it: a split that fits when the uniform and bottleneck
    splits do not (memory only: no simulation)."""
    cur = tuple(bounds)
    cur_ex = _excess(pb, pb.memory(cur))
    while cur_ex > 0 and time.perf_counter() < deadline:
        cands = _neighbours(cur)
        if not len(cands):
            break
        ex = [_excess(pb, pb.memory(tuple(int(x) for x in c))) for c in cands]
        j = int(np.argmin(ex))
        if ex[j] >= cur_ex:
            break
        cur, cur_ex = tuple(int(x) for x in cands[j]), ex[j]
    return cur


def _screen(
    pb: Problem, cand: Candidate, deadline: float, floor: float, extra: Sequence[tuple[int, ...]] = ()
) -> Point:
    """A candidate's first look (the module docstring, phase 1); `floor`, its `layer_bound`."""
    tried = [pb.evaluate(b) for b in dict.fromkeys([pb.uniform(), _balanced(pb), *extra])]
    fit = [x for x in tried if x.fits]
    if not fit:
        least = min(tried, key=lambda x: _excess(pb, np.asarray(x.memory)))
        down = _memory_descent(pb, least.bounds, deadline)
        if down != least.bounds:
            tried.append(pb.evaluate(down))
            fit = [x for x in tried if x.fits]
    least = min(tried, key=lambda x: _excess(pb, np.asarray(x.memory)))
    best = min(fit, key=lambda x: x.step) if fit else None
    if pb.graph.kind.size <= SEARCH_OPS or best is None:  # at scale the bound waits for the refinement
        rows = rows_of(pb, [x.bounds for x in tried])
        bound, infeasible = path_bound(pb, rows, best.step if best else None, 6, floor)
    else:
        bound, infeasible = floor, False
    return Point(
        cand,
        best,
        bound if best is None else min(bound, best.step),
        excess=_excess(pb, np.asarray(least.memory)),
        peaks=tuple(least.memory),
        infeasible=infeasible or (best is None and not fits_at_all(pb)),
    )


class _Builder:
    """Candidates built once: the schedule (evaluated, memory ops added), its Program, and the Problem with
    the table at the candidate's micro-batch size."""

    def __init__(self, inputs: Inputs) -> None:
        self.inputs = inputs
        self.problems: dict[Candidate, Problem] = {}
        self.base: dict[tuple[str, int, int], object] = {}

    def params(self, name: str) -> tuple[str, ...]:
        from pipec.driver import param_names, read_source

        return param_names(read_source(name))

    def schedule(self, cand: Candidate):
        from pipec.driver import build, read_source
        from pipec.partition.problem import refuse_graph_for_partition

        key = (cand.schedule, cand.m, cand.v)
        if key not in self.base:
            try:
                got = build(read_source(cand.schedule), {"p": self.inputs.p, **cand.params})
                refuse_graph_for_partition(got, tool="pipec plan")  # E217: said among the skipped
                # the layer table gives every time; a library schedule's own `cost` lines are in its units
                self.base[key] = replace(got, costs={})
            except PipecError as e:
                self.base[key] = e
        got = self.base[key]
        if isinstance(got, PipecError):
            raise got
        return with_memops(got, cand.memop, cand.memop_ranks) if cand.memop else got

    def problem(self, cand: Candidate) -> Problem:
        from pipec.passes.compiler import compile_schedule

        if cand not in self.problems:
            same = replace(cand, ranks=())  # the ranks' order changes their speeds, not the schedule
            if same in self.problems:
                sched, program = self.problems[same].sched, self.problems[same].program
            else:
                sched = self.schedule(cand)
                program = compile_schedule(sched).program
            inp = self.inputs
            table = scaled(inp.table, inp.global_batch / (cand.m * inp.table_mbs))
            order = list(cand.ranks or range(inp.p))  # pipeline rank k runs on the given rank order[k]
            speed, limit = np.asarray(inp.speed)[order], np.asarray(inp.limit, dtype=float)[order]
            self.problems[cand] = Problem(sched, program, table, speed, limit, inp.cost_docs)
        return self.problems[cand]


def _families(inputs: Inputs, builder: _Builder) -> tuple[list[Candidate], list[str]]:
    """The plain candidates (schedule, m, v), those the schedules' parameters allow, in screening order:
    every schedule at the largest m first, then the smaller m; each in every order of the ranks tried
    (`rank_orders`; as given only when the links name nodes, `ranks_per_node`, which an order would move)."""
    out, skipped = [], []
    orders = [()]
    if not any("ranks_per_node" in doc for doc in inputs.cost_docs):
        orders = rank_orders(inputs.speed, inputs.limit)
    order = sorted(inputs.microbatches, reverse=True)  # smaller micro-batches, smaller bubbles: likelier winners
    for m in order:
        for name in inputs.schedules:
            try:
                names = builder.params(name)
            except PipecError as e:
                skipped.append(f"{name}: {e.diagnostics[0].message}")
                continue
            vs = [2] if "v" in names else [0]
            if "v" in names and inputs.table.num_layers >= 4 * inputs.p:
                vs.append(4)
            out += [Candidate(name, m, v, ranks=o) for v in vs for o in orders]
    return out, skipped


def plan(inputs: Inputs, time_limit: float = 30.0, progress: Progress | None = None) -> Plan:
    """The best plan found within about `time_limit` seconds (the module docstring), with the baselines;
    E830 when no candidate fits the memory limits."""
    t0 = time.perf_counter()
    say = progress or (lambda _msg: None)
    builder = _Builder(inputs)
    fams, skipped = _families(inputs, builder)
    points: dict[Candidate, Point] = {}
    screen_end = t0 + 0.45 * time_limit

    def screen(cand: Candidate, extra=()) -> Point | None:
        try:
            pb = builder.problem(cand)
        except PipecError as e:
            if not cand.ranks:  # the same schedule on the ranks reordered fails alike: said once
                skipped.append(f"{cand.label}: {e.diagnostics[0].message}")
            return None
        pt = _screen(pb, cand, screen_end, layer_bound(inputs, cand.m, pb.sched.split_backward), extra)
        points[cand] = pt
        return pt

    plain: list[Point] = []
    pairs_left, unexpanded = False, []  # what the time limit left out: pairs, bases of memory-op variants
    for n, cand in enumerate(fams):
        if n and time.perf_counter() > screen_end:  # the first is screened whatever the limit
            skipped.append(f"{len(fams) - n} schedule and m pairs not screened: time limit")
            pairs_left = True
            break
        pt = screen(cand)
        if pt is not None:
            plain.append(pt)
            say(f"screened {n + 1}/{len(fams)}: {cand.label}: " + (f"{pt.step:.4g} s" if pt.split else "does not fit"))
    # memory ops where the limits bind (the bottleneck split does not fit), the closest to fitting first
    binding = [pt for pt in plain if _binds(builder.problems[pt.candidate], pt)]
    binding.sort(key=lambda pt: (pt.step, pt.excess))
    for i, pt in enumerate(binding):
        cand = pt.candidate
        for kind in inputs.memops:
            for k in memop_ranks(inputs.p):
                if time.perf_counter() > screen_end:
                    break
                var = Candidate(cand.schedule, cand.m, cand.v, kind, k, cand.ranks)
                vp = screen(var, [pt.split.bounds] if pt.split else [])
                if vp is not None:
                    say(f"screened {var.label}: " + (f"{vp.step:.4g} s" if vp.split else "does not fit"))
        if time.perf_counter() > screen_end:
            skipped.append("memory-op variants of some candidates not screened: time limit")
            unexpanded = [p.candidate for p in binding[i:]]
            break
    megatron = _megatron(inputs, builder, points, say)
    fitting = sorted((p for p in points.values() if p.split is not None), key=lambda p: p.step)
    if not fitting:
        raise _no_fit(inputs, list(points.values()))
    best_step = fitting[0].step
    _tighten(builder, points, best_step, t0 + 0.55 * time_limit, say)
    # phase 2: refine, fastest first
    fitting = sorted((p for p in points.values() if p.split is not None), key=lambda p: p.step)
    library_step = min((p.step for p in fitting if _is_library(p.candidate)), default=math.inf)
    for n, pt in enumerate(fitting):
        left = t0 + 0.85 * time_limit - time.perf_counter()
        if left <= 0.05:
            break
        # one that cannot beat the plan is still refined when it may be baseline (b): (b) is `pipec partition`'s
        # best split of the schedule, not the screen's (on reordered ranks the plan is often far below (b))
        if pt.lower_bound >= best_step and not (_is_library(pt.candidate) and pt.lower_bound < library_step):
            continue
        share = max(left / max(min(len(fitting) - n, 6), 1), min(0.5, left))
        pb = builder.problems[pt.candidate]
        end = time.perf_counter() + share
        res = None
        if sum(len(r) for r in pb.sched.ranks) <= SEARCH_OPS:
            res = search(pb, share, starts=[pt.split.bounds])  # it fits: the search never raises E806
        if res is not None:
            better, bound, optimal = (res.best if res.best.step < pt.step else pt.split), res.lower_bound, res.optimal
        else:
            better, seen = improve(pb, pt.split, end - 0.2 * share)
            rows = rows_of(pb, [better.bounds, *reversed(seen)], end)  # the best's paths first
            bound, _ = path_bound(pb, rows, better.step, floor=pt.lower_bound, deadline=end)
            bound = max(bound, pt.lower_bound)
            optimal = bound >= better.step
        refined = Point(
            pt.candidate,
            better,
            min(bound, better.step),
            optimal,
            True,
            _excess(pb, np.asarray(better.memory)),
            tuple(better.memory),
        )
        points[pt.candidate] = refined
        best_step = min(best_step, refined.step)
        library_step = min(library_step, refined.step) if _is_library(pt.candidate) else library_step
        say(
            f"refined {pt.candidate.label}: {refined.step:.4g} s (bound {refined.lower_bound:.4g} s"
            f"{', optimal' if refined.optimal else ''}), {time.perf_counter() - t0:.1f} s"
        )
    if inputs.synth:
        best_step = min(best_step, _synthesize(inputs, builder, points, t0 + time_limit, say))
    _tighten(builder, points, best_step, t0 + time_limit, say)
    allp = list(points.values())
    # ties: the plainer plan (no memory ops: what other systems express) first, then the smaller peak
    best = min(
        (p for p in allp if p.split is not None),
        key=lambda p: (p.step, has_memops(builder.problems[p.candidate].sched), p.peak),
    )
    library = min(
        (p for p in allp if p.split is not None and _is_library(p.candidate)),
        key=lambda p: p.step,
        default=None,
    )
    open_ = [p for p in allp if not p.infeasible]
    lower = min([p.lower_bound for p in open_] + [best.step])
    if pairs_left:  # those not looked at: the universal layer bound holds for them
        lower = min(lower, universal_bound(inputs))
    elif unexpanded:
        lower = min(lower, _variants_bound(inputs, builder, unexpanded, best.step, t0 + time_limit))
    return Plan(
        best,
        tuple(sorted(allp, key=lambda p: (p.step, p.peak))),
        megatron,
        library,
        lower,
        time.perf_counter() - t0,
        tuple(skipped),
        builder.problems,
    )


def _synthesize(inputs: Inputs, builder: _Builder, points: dict, deadline: float, say: Progress) -> float:
    """The synthesized candidate (`pipec.planner.synthesized`) on the incumbent's split, where p is small
    and time is left; returns the best step now."""
    from pipec.planner.synthesized import MAX_P, refine_synthesized, synthesized

    best = min((p for p in points.values() if p.split is not None), key=lambda p: p.step)
    left = deadline - time.perf_counter()
    if inputs.p > MAX_P or left < 1.0:
        return best.step
    base = builder.problems[best.candidate]
    got = synthesized(base, best.split.bounds, best.candidate.m, tuple(base.limit.tolist()), left / 3)
    if got is None:
        return best.step
    cand, pb = replace(got[0], ranks=best.candidate.ranks), got[1]
    split = refine_synthesized(pb, best.split.bounds, time.perf_counter() + (deadline - time.perf_counter()) / 2)
    if split is None:
        return best.step
    builder.problems[cand] = pb
    floor = layer_bound(inputs, cand.m, True)
    bound, _ = path_bound(pb, rows_of(pb, [split.bounds]), split.step, 12, floor)
    points[cand] = Point(
        cand,
        split,
        min(bound, split.step),
        bound >= split.step,
        True,
        _excess(pb, np.asarray(split.memory)),
        tuple(split.memory),
    )
    say(f"synthesized ({cand.label}) on the best split: {split.step:.4g} s")
    return min(best.step, split.step)


def _variants_bound(
    inputs: Inputs, builder: _Builder, bases: Sequence[Candidate], top: float, deadline: float
) -> float:
    """A bound on the memory-op variants of `bases` the time limit left unscreened: each base's `path_bound`
    on its paths alone, without its memory rows. A variant keeps every op and dependency of its base and adds
    work (a RECOMPUTE is a forward more, a RELOAD a wait more), so each of its base's paths is at most its step;
    its memory differs (the splits it lets fit are others), so the base's memory rows do not hold for it."""
    out = top
    for cand in bases:
        pb = builder.problems[cand]
        floor = layer_bound(inputs, cand.m, pb.sched.split_backward)
        rows = rows_of(pb, [pb.uniform(), _balanced(pb)], deadline, memory=False)
        bound, _ = path_bound(pb, rows, top, 12, floor, deadline)
        out = min(out, bound)
    return out


def _is_library(cand: Candidate) -> bool:
    """A candidate baseline (b) may be: a library schedule as it stands (no memory ops added) on the ranks as
    given (`pipec partition` neither adds memory ops nor reorders the ranks)."""
    return not cand.memop and not cand.ranks and cand.schedule in LIBRARY


def _binds(pb: Problem, pt: Point) -> bool:
    """The limits bind a candidate without memory ops: no split fits, or the bottleneck split does not."""
    return not has_memops(pb.sched) and (pt.split is None or not pb.evaluate(_balanced(pb)).fits)


def _tighten(builder: _Builder, points: dict, incumbent: float, deadline: float, say: Progress) -> None:
    """Each candidate's bound against the best step screened (`path_bound` with it as the top), the small
    problems first: a candidate whose bound reaches it cannot win and is not refined; one whose memory rows
    admit no split is proven not to fit."""
    todo = [p for p in points.values() if not p.infeasible and p.lower_bound < incumbent]
    todo.sort(key=lambda p: builder.problems[p.candidate].graph.kind.size)
    closed = 0
    for pt in todo:
        if time.perf_counter() > deadline:
            break
        pb = builder.problems[pt.candidate]
        splits = [pb.uniform(), _balanced(pb)] + ([pt.split.bounds] if pt.split else [])
        rows = rows_of(pb, splits, deadline)
        bound, infeasible = path_bound(pb, rows, incumbent, 12, pt.lower_bound, deadline)
        bound = max(bound, pt.lower_bound) if not infeasible else math.inf
        if pt.split is not None:
            bound = min(bound, pt.split.step)
        points[pt.candidate] = replace(pt, lower_bound=bound, infeasible=infeasible or pt.infeasible)
        closed += bound >= incumbent
    say(f"bounds: {closed} of {len(todo)} candidates cannot beat {incumbent:.4g} s")


def _megatron(inputs: Inputs, builder: _Builder, points: Mapping, say: Progress) -> Point | None:
    """Baseline (a), Megatron-LM's default: interleaved 1F1B with two chunks per rank where the layers
    allow (else 1F1B), its uniform split (`megatron_split`), and full recomputation on every rank when that
    split does not fit without it; the fastest m that fits."""
    L, p = inputs.table.num_layers, inputs.p
    name, v = ("interleaved-1f1b", 2) if L >= 2 * p + 2 else ("1f1b", 0)
    best = None
    for m in inputs.microbatches:
        if name == "interleaved-1f1b" and m % p:
            continue
        for memop in ("", "recompute"):
            cand = Candidate(name, m, v, memop, p if memop else 0)
            try:
                pb = builder.problem(cand)
            except PipecError:
                break
            split = pb.evaluate(megatron_split(L, pb.S))
            if not split.fits:
                continue  # without recomputation: with it next
            excess = _excess(pb, np.asarray(split.memory))
            if best is None or split.step < best.step:  # a fixed split: its bound is its step
                best = Point(cand, split, split.step, True, False, excess, tuple(split.memory), note="Megatron-LM")
            break
    if best is not None:
        say(f"baseline (a) Megatron-LM default: {best.candidate.label}: {best.step:.4g} s")
    return best


def _no_fit(inputs: Inputs, points: Sequence[Point]) -> PipecError:
    """E830: no candidate fits; names the one that came closest and by how much."""
    tried = [p for p in points if p.peaks]
    if not tried:
        return error("E830", "no candidate plan could be built for these inputs")
    close = min(tried, key=lambda p: p.excess)
    lim = np.asarray(inputs.limit, dtype=float)
    peaks = np.empty(inputs.p)
    peaks[list(close.candidate.ranks or range(inputs.p))] = close.peaks  # on the ranks as given
    r = int(np.nanargmax(np.where(np.isnan(lim), -np.inf, peaks - lim)))
    return error(
        "E830",
        f"no plan fits the memory limits: of {len(tried)} candidates the closest, {close.candidate.label}, needs "
        f"{fmt_bytes(peaks[r])} on rank {r}, {fmt_bytes(close.excess)} over its limit of {fmt_bytes(lim[r])}",
        notes=(
            "per rank: " + ", ".join(fmt_bytes(x) for x in peaks.tolist()),
            "raise --memory-limit (or the ranks' mem=) by at least that much, or allow more micro-batches "
            "(--microbatches: smaller ones keep fewer bytes each) or memory ops (--memops)",
        ),
    )


def prove(pb: Problem, split: Split):
    """The plan compiled with its split's bytes as the memory declarations and the limits, so the memory
    check (E402) proves it within them, and simulated (`pipec.driver.simulation` with the split's cost
    document): the Simulation."""
    from pipec.driver import simulation

    sched = pb.memory_schedule(split.bounds)
    return simulation(sched, [*pb.cost_docs, pb.cost_doc(split.bounds)])
