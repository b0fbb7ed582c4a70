"""TeraPipe's slicing: choose the token slice lengths of a sliced schedule by TeraPipe's dynamic program, and
write the schedule with them (docs/terapipe.md, "Choosing the slices"); `pipec slice` (pipec.cli.slice) is
its command line.

    pipec slice terapipe -D p=4 -D m=1 -D L=2048 --cost gpt.toml -o sliced.pipe
    pipec simulate sliced.pipe --cost gpt.toml

TeraPipe (Li et al., ICML 2021, section 3.3) cuts a sequence of L tokens into slices l_1 .. l_n; slice j
starts after c_j = l_1 + ... + l_{j-1} tokens of context, and takes t(l_j, c_j) on a stage. With K
pipeline stages and m sequences per step, the step is estimated as

    T = m * sum_j t(l_j, c_j) + (K - 1) * max_j t(l_j, c_j)

(every slice passes through the stage that runs it, plus the pipeline's fill and drain, which the longest
slice sets). Minimising it: for each candidate bound t_max (a value t(l, c) takes on the grid of
`granularity` tokens), f(i) = the least sum of slice times covering the first i tokens with slices of
time <= t_max, a shortest path over the grid; the answer is the least m f(L) + (K - 1) t_max over the
bounds. Bounds are tried in increasing order, and stop once (K - 1) t_max + m t(L, 0) cannot beat the
best (the sum of slice times is at least the unsliced sequence's: Slicing.weight sums to 1 over any cut).
The search is exact on the grid: `tests/unit/tools/test_slicing.py` checks it against every slicing of small L.

A slice's time is the cost model's (`pipec.sim.costs.CostModel.kind_time` of the unit, with the stage's `attn`
and `op_fixed` through `Slicing.weight`): its F and backward (B and W when split) summed, plus the `overhead`
of the messages it sends and receives (each costs the rank its time whatever the slice's length), the slowest
stage's. So the program and the simulator agree on what a slice costs; what the estimate leaves out (the
messages' latency, the order of F and B, stages of different speeds) the simulated step printed beside it has.
The written file is the schedule's own text with its slice-count parameter's default and the `tokens j -> ...`
declaration replaced (the language has no list literal: a balanced `if j < k then ...` over the runs of equal
lengths), and the `-D` values as defaults, so it simulates alone.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from pipec.errors import PipecError, Source, error
from pipec.formats.graph_limits import refuse_graph
from pipec.ir.schedule import Schedule, Slicing

# The grid's default: at most this many positions along the sequence (granularity = the smallest divisor of
# L that keeps the grid within it). 128 positions take about a second.
DEFAULT_POSITIONS = 128
# The most positions a search takes (its work grows as about positions^3.5: 512 take minutes).
MAX_POSITIONS = 512
_CLI = Source("<command line>", "")
# The most slice prices a search tabulates (stages x the grid's slices, positions (positions + 1) / 2): each
# takes about PRICE_BYTES through the cost model's arrays, so 2^24 of them hold about 1 GiB and take a minute;
# `pipec slice terapipe -D p=100000` (826 million) once ended in numpy's MemoryError after allocating 6 GiB.
MAX_PRICES = 2**24
PRICE_BYTES = 64


# ---- what a slice costs ------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class SliceCosts:
    """A sliced schedule's slice times under a cost model: what the dynamic program minimises.

    `grid[k, i]` is the time of the slice of tokens [k g, i g) (`granularity` g; inf unless k < i), the
    slowest stage's F plus backward; `sequences` (m) and `depth` (K stages) weigh the sum and the maximum."""

    schedule: Schedule
    docs: tuple[Mapping, ...]
    seqlen: int
    granularity: int
    sequences: int
    depth: int
    grid: np.ndarray

    @property
    def positions(self) -> int:
        return self.seqlen // self.granularity

    def stage_times(self, tokens: Sequence[int]) -> np.ndarray:
        """Per (stage, slice), the slice's time when the sequence is cut into `tokens` (any lengths)."""
        return _stage_times(self.schedule, self.docs, _cut(self.seqlen, tokens))

    def estimate(self, tokens: Sequence[int]) -> float:
        """TeraPipe's estimate of the step for this cut: m * sum + (K - 1) * max of the slice times."""
        t = self.stage_times(tokens).max(axis=0)
        return float(self.sequences * t.sum() + (self.depth - 1) * t.max())


def _cut(seqlen: int, tokens: Sequence[int]) -> Slicing:
    """One sequence of `seqlen` tokens cut into `tokens`, as a Slicing (its units: the slices)."""
    return Slicing(1, len(tokens), seqlen, tuple(int(t) for t in tokens), (seqlen,))


def _kinds(sched: Schedule) -> np.ndarray:
    """The op kinds one slice runs on a stage (0 F, 1 B, 2 W): F and B, the full backward unless split."""
    return np.array([0, 1, 2] if sched.split_backward else [0, 1])


def _unit_times(costs, sched: Schedule, units: int) -> np.ndarray:
    """Per (stage, unit) of `costs` (a CostModel whose `unit_weight` holds the units), F plus backward, plus
    the rank's own time for the slice's messages (`overhead` per send and per receive: F receives from the
    stage before and sends to the next when they are on other ranks, the backward the other way). Why:
    every slice pays them whatever its length, as it pays `op_fixed`, so they decide how short a slice pays."""
    from pipec.sim.costs import CostModel

    assert isinstance(costs, CostModel)
    S = sched.num_stages
    stage = np.repeat(np.arange(S), units)
    unit = np.tile(np.arange(units), S)
    out = np.zeros(S * units)
    for kind in _kinds(sched):
        out += costs.kind_time(np.full(S * units, kind), stage, unit)
    place = np.asarray(sched.placement)
    crossing = np.zeros(S)  # neighbouring stages on another rank: one message each way per slice
    crossing[1:] += place[1:] != place[:-1]
    crossing[:-1] += place[1:] != place[:-1]
    return out.reshape(S, units) + (2 * costs.overhead * crossing)[:, None]


def _stage_times(sched: Schedule, docs: Sequence[Mapping], cut: Slicing) -> np.ndarray:
    from pipec.sim.costs import cost_model

    costs = cost_model(dataclasses.replace(sched, slicing=cut), docs)
    return _unit_times(costs, sched, cut.slices)


def slice_costs(sched: Schedule, docs: Sequence[Mapping] = (), granularity: int | None = None) -> SliceCosts:
    """The slice times of `sched` (evaluated, with `slices`) under these cost documents on a grid of
    `granularity` tokens (default: `default_granularity`). E807 without slices, E808 when no `attn` is
    given, E809 for a granularity that does not divide the sequence."""
    _refuse_graph(sched)
    sl = sched.slicing
    if sl is None or "slices" not in sched.decl_spans:
        raise _no_slices(sched)
    L = sl.seqlen
    g = default_granularity(L) if granularity is None else granularity
    if g < 1 or L % g:
        raise error(
            "E809",
            f"granularity {g} does not divide the sequence of {L:,} tokens: slices are whole steps of it",
            source=_CLI,
            notes=(f"take a divisor of {L}, e.g. {default_granularity(L)}",),
        )
    if L // g > MAX_POSITIONS:
        coarse = next(d for d in range(g, L + 1) if L % d == 0 and L // d <= MAX_POSITIONS)
        raise error(
            "E809",
            f"granularity {g} cuts the sequence of {L:,} tokens into {L // g:,} positions: the search takes "
            f"at most {MAX_POSITIONS}",
            source=_CLI,
            notes=(f"take a coarser granularity, e.g. {coarse} ({L // coarse} positions)",),
        )
    if not _gives_attn(sched, docs):
        raise error(
            "E808",
            "the costs give no `attn`: without attention's share of a stage's time every cut of a sequence "
            "costs the same, and there is nothing to choose",
            source=_CLI,
            notes=(
                "measure it: pipec profile SCHEDULE --model MODEL --slices 4 -o costs.toml",
                "or state it: --cost attn=0.3 (0 when the model has no attention)",
            ),
        )
    G = L // g
    _check_prices(sched.num_stages, L, g)
    grid_cut = _cut(L, (g,) * G)
    from pipec.sim.costs import cost_model

    costs = cost_model(dataclasses.replace(sched, slicing=grid_cut), docs)
    # Slicing.weight is additive along the sequence (a slice weighs what the grid cells it covers weigh),
    # so every slice [k g, i g) is priced by prefix sums of the cells' weights, then by kind_time.
    prefix = np.concatenate([np.zeros((sched.num_stages, 1)), np.cumsum(costs.unit_weight, axis=1)], axis=1)
    k, i = np.triu_indices(G + 1, 1)
    pairs = prefix[:, i] - prefix[:, k]
    times = _unit_times(dataclasses.replace(costs, unit_weight=pairs), sched, len(k)).max(axis=0)
    grid = np.full((G + 1, G + 1), np.inf)
    grid[k, i] = times
    return SliceCosts(sched, tuple(docs), L, g, sl.sequences, sched.num_stages, grid)


def _prices(stages: int, positions: int) -> int:
    return stages * (positions * (positions + 1) // 2)


def _check_prices(stages: int, seqlen: int, granularity: int) -> None:
    """E809 before anything is allocated when the table of slice prices (every slice on every stage) is
    above MAX_PRICES, naming the counts and a coarser granularity that fits where one does; E902 when this
    machine cannot hold the table even so."""
    from pipec.files import require_memory

    positions = seqlen // granularity
    slices = positions * (positions + 1) // 2
    prices = stages * slices
    if prices > MAX_PRICES:
        fit = next(
            (
                d
                for d in range(granularity, seqlen + 1)
                if seqlen % d == 0 and _prices(stages, seqlen // d) <= MAX_PRICES
            ),
            None,
        )
        hint = (
            f"fewer stages (-D p), or a coarser granularity, e.g. --granularity {fit} ({seqlen // fit} positions)"
            if fit
            else f"fewer stages (-D p): even one position is {stages:,} prices"
        )
        raise error(
            "E809",
            f"pricing every slice on every stage takes {stages:,} stages x {slices:,} slices of {positions}"
            f" positions = {prices:,} prices (about {prices * PRICE_BYTES / 2**30:,.1f} GiB): the search takes"
            f" at most {MAX_PRICES:,}",
            source=_CLI,
            notes=(f"take {hint}",),
        )
    require_memory(float(prices * PRICE_BYTES), f"pricing {prices:,} slices")


def _gives_attn(sched: Schedule, docs: Sequence[Mapping]) -> bool:
    """Whether the schedule's `cost attn = ...` or a cost document sets `attn` (0 included)."""
    return "attn" in sched.costs or any("attn" in d for d in docs)


def default_granularity(seqlen: int) -> int:
    """The smallest divisor of `seqlen` that keeps the grid within DEFAULT_POSITIONS positions."""
    return next(g for g in range(1, seqlen + 1) if seqlen % g == 0 and seqlen // g <= DEFAULT_POSITIONS)


# ---- the dynamic program -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    """The slicing chosen: its lengths, TeraPipe's estimate of the step, the bound t_max it met, and how
    many bounds were tried of how many there are."""

    tokens: tuple[int, ...]
    estimate: float
    t_max: float
    tried: int
    bounds: int
    seconds: float


def choose(costs: SliceCosts, max_slices: int | None = None, progress: Callable[[str], None] | None = None) -> Choice:
    """The slicing of least estimate (m * sum + (K - 1) * max of slice times) among those of whole grid
    steps with at most `max_slices` slices (None: any number); among equal estimates, the fewest slices."""
    t0 = time.perf_counter()
    G, grid = costs.positions, costs.grid
    kmax = G if max_slices is None else min(max_slices, G)
    if kmax < 1:
        raise error("E809", f"--max-slices {max_slices}: a sequence needs at least one slice", source=_CLI)
    finite = grid[np.isfinite(grid)]
    floor = grid[G - 1, G]  # the last cell, after the most context: every cut has a slice at least this slow
    bounds = np.unique(finite[finite >= floor])
    if costs.depth == 1:  # no pipeline to fill: the sum alone, any bound
        bounds = bounds[-1:]
    m, K1 = costs.sequences, costs.depth - 1
    least_sum = grid[0, G]  # the unsliced sequence: no cut sums to less (module docstring)
    best, best_bound, tried = np.inf, np.inf, 0
    chunk, last_say = max(1, min(64, 2_000_000 // (G + 1) ** 2)), t0  # bounds a round: about 16 MB of arrays
    at = 0
    while at < len(bounds):
        if K1 and best < np.inf:  # bounds this large cannot beat the best found
            stop = np.searchsorted(bounds, (best - m * least_sum) / K1, side="right")
            if at >= stop:
                break
        part = bounds[at : at + chunk]
        sums = _least_sums(grid, part, kmax)[0]
        total = m * sums + K1 * part
        j = int(np.argmin(total))
        if total[j] < best * (1 - 1e-12):
            best, best_bound = float(total[j]), float(part[j])
        tried += len(part)
        at += chunk
        now = time.perf_counter()
        if progress and now - last_say > 2.0:
            progress(f"tried {tried:,} of {len(bounds):,} bounds on the slice time, best estimate {best:.6g}")
            last_say = now
    if not np.isfinite(best):
        raise error(
            "E809",
            f"no cut of {costs.seqlen:,} tokens into at most {kmax} slices of {costs.granularity} tokens' steps",
            source=_CLI,
        )
    tokens = _cut_at(grid, best_bound, kmax) * costs.granularity
    return Choice(tuple(int(t) for t in tokens), best, best_bound, tried, len(bounds), time.perf_counter() - t0)


def _least_sums(grid: np.ndarray, bounds: np.ndarray, kmax: int) -> tuple[np.ndarray, int]:
    """Per bound, the least sum of slice times covering the whole grid with at most `kmax` slices each of
    time <= the bound (inf when none), by rounds of relaxation (round k: at most k slices) until nothing
    improves; and the rounds that took."""
    G = grid.shape[0] - 1
    allowed = np.where(grid[None, :, :] <= bounds[:, None, None], grid[None, :, :], np.inf)  # (bound, from, to)
    f = np.full((len(bounds), G + 1), np.inf)
    f[:, 0] = 0.0
    for k in range(1, kmax + 1):
        new = np.minimum(f, (f[:, :, None] + allowed).min(axis=1))
        if np.array_equal(new, f):
            return f[:, G], k - 1
        f = new
    return f[:, G], kmax


def _cut_at(grid: np.ndarray, bound: float, kmax: int) -> np.ndarray:
    """The grid cut of least sum under `bound` with the fewest slices among the least: exactly-k-slice
    rounds with the argmins kept, then back from the end. Among cuts of equal sum (with identical stages and
    free messages the sum depends on the count alone: Slicing.weight sums to 1), the one of least sum of
    squared slice times: the slices' times as even as the grid allows, TeraPipe's shape."""
    G = grid.shape[0] - 1
    allowed = np.where(grid <= bound, grid, np.inf)
    squared = allowed**2
    h, h2 = np.full(G + 1, np.inf), np.full(G + 1, np.inf)
    h[0] = h2[0] = 0.0
    parents, ends = [], []
    for _ in range(kmax):
        cand = h[:, None] + allowed
        least = cand.min(axis=0)
        tie = cand <= least + 1e-12 * np.maximum(1.0, np.abs(least))  # equal sums, to rounding
        second = np.where(tie, h2[:, None] + squared, np.inf)
        parent = np.argmin(second, axis=0)
        parents.append(parent)
        h, h2 = least, second[parent, np.arange(G + 1)]
        ends.append(h[G])
    ends_a = np.asarray(ends)
    least = ends_a.min()
    k = int(np.flatnonzero(ends_a <= least + 1e-12 * max(1.0, abs(least)))[0])  # fewest slices reaching it
    cuts, i = [G], G
    for r in range(k, -1, -1):
        i = int(parents[r][i])
        cuts.append(i)
    edges = np.asarray(cuts[::-1])
    return np.diff(edges)


def uniform(seqlen: int, n: int) -> tuple[int, ...]:
    """`seqlen` cut into n slices as evenly as it goes, as the language's default (the first r one longer)."""
    q, r = divmod(seqlen, n)
    return tuple(q + (j < r) for j in range(n))


def best_uniform(costs: SliceCosts, max_slices: int | None = None) -> tuple[int, ...]:
    """The uniform cut of least estimate over the slice counts 1 .. max_slices (default: the grid's)."""
    top = min(max_slices or costs.positions, costs.seqlen)
    return min((uniform(costs.seqlen, n) for n in range(1, top + 1)), key=costs.estimate)


# ---- the schedule file ---------------------------------------------------------------------------------------


def tokens_expr(tokens: Sequence[int], var: str = "j", indent: str = "") -> str:
    """A `tokens` expression giving slice `var` its length: a balanced `if var < k then ... else ...` over
    the runs of equal lengths (depth log2 of the runs, so any count parses)."""
    runs: list[tuple[int, int]] = []  # (first slice, length)
    for j, t in enumerate(tokens):
        if not runs or runs[-1][1] != t:
            runs.append((j, int(t)))

    def tree(lo: int, hi: int) -> str:
        if hi - lo == 1:
            return str(runs[lo][1])
        mid = (lo + hi) // 2
        return f"(if {var} < {runs[mid][0]} then {tree(lo, mid)} else {tree(mid, hi)})"

    text = tree(0, len(runs))
    return text[1:-1] if text.startswith("(") else text


def _literal(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    return repr(v) if isinstance(v, float) else str(v)


def _offset(text: str, line: int, col: int) -> int:
    lines = text.split("\n")
    return sum(len(x) + 1 for x in lines[: line - 1]) + col - 1


def write_schedule(
    source: Source,
    params: Mapping[str, object],
    tokens: Sequence[int],
    note: str = "",
) -> str:
    """The schedule's text with its slice-count parameter's default set to len(tokens), these `params` as
    defaults, and `tokens j -> ...` giving these lengths (replacing the schedule's own, or after its
    `slices` declaration). E807 when the schedule has no `slices` naming one of its parameters."""
    from pipec.frontend import ast

    tree, decl = _slice_parameter(source)
    values = {**params, decl.value.name: len(tokens)}
    toks = next((s for s in tree.body if isinstance(s, ast.Place) and s.kind == "tokens"), None)
    edits: list[tuple[int, int, str]] = []  # (start, end, new text) on the source
    text = source.text
    for p in tree.params:
        if p.name in values:
            kind = f": {p.type}" if p.type else ""
            a, b = _offset(text, p.span.line, p.span.col), _offset(text, p.span.end_line, p.span.end_col)
            edits.append((a, b, f"{p.name}{kind} = {_literal(values[p.name])}"))
    at = decl if toks is None else toks
    indent = " " * (at.span.col - 1)
    var = "j" if toks is None else toks.var
    comment = f"# {note}\n{indent}" if note else ""
    line = f"{comment}tokens {var} -> {tokens_expr(tokens, var)}"
    if toks is None:
        end = _offset(text, decl.span.end_line, decl.span.end_col)
        edits.append((end, end, f"\n{indent}{line}"))
    else:
        a, b = _offset(text, toks.span.line, toks.span.col), _offset(text, toks.span.end_line, toks.span.end_col)
        edits.append((a, b, line))
    for a, b, new in sorted(edits, reverse=True):
        text = text[:a] + new + text[b:]
    return text


def _slice_parameter(source: Source):
    """The schedule's syntax tree and its `slices` declaration, which names the parameter the written file
    sets; E807 when it has no `slices` or its `slices` is not a parameter."""
    from pipec.frontend import ast
    from pipec.frontend.parse import parse

    tree = parse(source)
    decl = next((s for s in tree.body if isinstance(s, ast.Decl) and s.kind == "slices"), None)
    if decl is None:
        raise error("E807", f"`{tree.name}` declares no `slices`: there are no slice lengths to choose", None, source)
    if not isinstance(decl.value, ast.Var) or decl.value.name not in {p.name for p in tree.params}:
        raise error(
            "E807",
            "`pipec slice` sets the number of slices through a parameter: write `slices n` with `n` a parameter",
            decl.span,
            source,
            notes=("the rank blocks' loops over the slices then follow it",),
        )
    return tree, decl


def _refuse_graph(sched: Schedule) -> None:
    """E217: TeraPipe's dynamic program prices slices through a chain of stages."""
    refuse_graph(
        sched,
        "pipec slice",
        "TeraPipe's dynamic program prices each slice through a chain of stages (a pipeline of depth S, stage s "
        "feeding s + 1), and a stage graph's paths differ in depth",
        "choose the slices by hand (`tokens j -> ...`) and compare them with `pipec simulate`",
    )


def _no_slices(sched: Schedule) -> PipecError:
    span = sched.decl_spans.get("slices")
    return error(
        "E807",
        f"`{sched.name}` has no token slices: `pipec slice` chooses the lengths of a schedule's `slices`",
        span,
        sched.source,
        notes=("declare `slices n` and `seqlen L` (docs/terapipe.md), or start from the library's `terapipe`",),
    )


# ---- the command ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    """What `pipec slice` found: the choice, and each slicing's simulated step (DP, uniform at the same
    count, the best uniform count, unsliced), with the text of the written schedule."""

    choice: Choice
    granularity: int
    rows: tuple[dict, ...]
    text: str
    # the written schedule's own `expect` lines it does not meet (E405, as `pipec check` reports them): an
    # expectation written for equal slices, say; the file is written all the same
    unmet: tuple[PipecError, ...] = ()

    def to_json(self) -> dict:
        c = self.choice
        return {
            "tokens": list(c.tokens),
            "slices": len(c.tokens),
            "granularity": self.granularity,
            "estimate": c.estimate,
            "t_max": c.t_max,
            "bounds_tried": c.tried,
            "bounds": c.bounds,
            "seconds": round(c.seconds, 3),
            "compare": list(self.rows),
            "unmet_expectations": [e.diagnostics[0].message for e in self.unmet],
        }


def slice_schedule(
    source: Source,
    params: Sequence[tuple[str, object]] | Mapping[str, object],
    docs: Sequence[Mapping] = (),
    granularity: int | None = None,
    max_slices: int | None = None,
    progress: Callable[[str], None] | None = None,
    out_path: str | None = None,
) -> Result:
    """Evaluate the schedule with these parameters, choose its slices (`choose`), write it with them and
    simulate it, beside the uniform cut of as many slices, the best uniform count and the unsliced run.
    `out_path` names the written schedule in diagnostics of it."""
    from pipec.driver import build

    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    sched = build(source, items)
    _refuse_graph(sched)
    if sched.slicing is None or "slices" not in sched.decl_spans:
        raise _no_slices(sched)
    _slice_parameter(source)  # before the search: the file could not be written
    costs = slice_costs(sched, docs, granularity)
    if progress:
        progress(
            f"pricing slices of {costs.granularity} tokens' steps over {costs.positions} positions of "
            f"{costs.seqlen:,} tokens ({costs.depth} stages, {costs.sequences} sequence(s))"
        )
    choice = choose(costs, max_slices, progress)
    values = dict(sched.params)
    note = (
        f"slice lengths chosen by `pipec slice` (TeraPipe's dynamic program, granularity {costs.granularity}): "
        f"estimate {choice.estimate:.6g} s"
    )
    text = write_schedule(source, values, choice.tokens, note)
    out_source = Source(out_path or f"{source.path} (sliced)", text)
    even = uniform(costs.seqlen, len(choice.tokens))
    best_even = best_uniform(costs, max_slices)
    rows = []
    for label, toks, src in (
        ("TeraPipe DP", choice.tokens, out_source),
        ("uniform, same count", even, None),
        (f"uniform, best count ({len(best_even)})", best_even, None),
        ("unsliced", (costs.seqlen,), None),
    ):
        src = src or Source(source.path, write_schedule(source, values, toks))
        rows.append(
            {
                "slicing": label,
                "slices": len(toks),
                "tokens": list(toks),
                "estimate": costs.estimate(toks),
                "step": _simulated(src, docs),
            }
        )
    return Result(choice, costs.granularity, tuple(rows), text, _unmet(out_source))


def _unmet(source: Source) -> tuple[PipecError, ...]:
    """The E405 diagnostics of the written schedule's `expect` lines that do not hold (`pipec check`'s)."""
    from pipec.driver import build, metrics
    from pipec.passes.expect import failed

    sched = build(source, ())
    return tuple(err for _, err in failed(sched, metrics(sched)))


def _simulated(source: Source, docs: Sequence[Mapping]) -> float:
    """The simulated step (makespan) of a written schedule, built from its text alone."""
    from pipec.driver import build, simulation

    return float(simulation(build(source, ()), docs).stats.makespan)


def report_lines(res: Result) -> list[str]:
    """The result as `pipec slice` prints it: the slices, then each slicing's step beside the DP's."""
    c = res.choice
    lines = [
        f"slices ({len(c.tokens)}, granularity {res.granularity}): {', '.join(map(str, c.tokens))}",
        f"TeraPipe's estimate {c.estimate:.6g} s at slice time <= {c.t_max:.6g} s "
        f"({c.tried:,} of {c.bounds:,} bounds tried, {c.seconds:.2f} s)",
    ]
    head = ("slicing", "slices", "estimate s", "step s (simulated)", "vs DP")
    dp = res.rows[0]["step"]
    rows = [
        (r["slicing"], str(r["slices"]), f"{r['estimate']:.6g}", f"{r['step']:.6g}", f"{r['step'] / dp:.3f}x")
        for r in res.rows
    ]
    widths = [max(len(x[i]) for x in (head, *rows)) for i in range(len(head))]
    fmt = lambda r: "  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(r, widths)))  # noqa: E731
    return [*lines, fmt(head), *map(fmt, rows)]
