"""What a schedule scores under the spec: fixed orders (the search's candidates) and the library's
schedules, checked and simulated through the driver (`Figures`). One module so the candidates, the
comparison table and the memory-limit tests (`below_1f1b`, `peak_of`) are measured the same way."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipec.errors import error
from pipec.synth.spec import MemOps, Spec, to_schedule


@dataclass(frozen=True)
class Figures:
    makespan: float
    cost: float
    bubble: float
    peak: tuple[float, ...]
    host_peak: tuple[float, ...] = ()  # per rank, the host pool's peak (memory ops)
    memops: int = 0  # how many memory ops the schedule places

    @property
    def key(self) -> tuple[float, float]:
        return (round(self.makespan, 9), round(self.cost, 9))

    @property
    def key3(self) -> tuple[float, int, float]:
        """The search's order under a memory limit: makespan, then memory ops, then cost."""
        return (round(self.makespan, 9), self.memops, round(self.cost, 9))


def evaluate_orders(spec: Spec, orders, name: str = "synth", memops: MemOps = ()):
    """Check, lower and simulate these orders (and memory ops) under the spec (pipec.driver.simulation): every
    check runs."""
    from pipec.driver import simulation
    from pipec.passes.checks import check_schedule
    from pipec.view.report import curves_of

    sched = to_schedule(spec, orders, name, memops)
    check_schedule(sched)
    sim = simulation(sched, spec.cost_docs)
    st = sim.stats
    peak = tuple(r.peak_memory or 0.0 for r in st.ranks)
    host = tuple(float(x) for x in curves_of(sim).host_peak)
    fig = Figures(st.makespan, st.cost, st.bubble_rate, peak, host, sum(len(x) for x in memops))
    return sim, fig


def _fits(spec: Spec, fig: Figures) -> bool:
    dev = spec.limit is None or all(p <= lim + 1e-9 for p, lim in zip(fig.peak, spec.limit))
    host = spec.host_limit is None or all(p <= lim + 1e-9 for p, lim in zip(fig.host_peak, spec.host_limit))
    return dev and host


def library_comparison(spec: Spec, names: Sequence[str] | None = None):
    """The library schedules simulated under the spec's costs and memory model (one stage per rank unless
    they declare chunks): (name, params, Figures or None, note)."""
    from pipec.driver import build, param_names, simulation
    from pipec.errors import PipecError
    from pipec.formats.graph_limits import refuse_graph
    from pipec.frontend import library

    if names is None:
        names = ["1f1b", "zb-h1", "zb-h2", "zb-v", "interleaved-1f1b"]
        if spec.topology is not None:
            names += ["crossdc-1f1b", "crossdc-zb"]
    names = list(names)
    mem = {k: float(v) for k, v in spec.memory.items() if k in ("act", "wact", "params")}
    rows = []
    for name in names:
        try:
            source = library.read(name)
            known = set(param_names(source))
            params = {k: v for k, v in (("p", spec.p), ("m", spec.m), ("v", 2)) if k in known}
            sched = build(source, params)
            refuse_graph(
                sched,
                "pipec synth",
                "it searches and compares chain schedules (stage s feeds s + 1), and a stage graph's step or "
                "peak is no figure for a chain",
                "compare with chain schedules, or simulate the graph schedule itself (`pipec simulate`)",
            )
            if spec.topology is not None:  # every schedule on the spec's network
                sched = replace(sched, topology=spec.topology)
            # memory per stage is per rank's share p / S of the model for every schedule
            share = {k: v * sched.num_ranks / sched.num_stages for k, v in mem.items()}
            sim = simulation(sched, spec.cost_docs, share or None)
        except PipecError as e:
            if e.code == "E217":  # a stage graph: refused, not a row of the comparison
                raise
            rows.append((name, "", None, e.diagnostics[0].message))
            continue
        st = sim.stats
        fig = Figures(st.makespan, st.cost, st.bubble_rate, tuple(r.peak_memory or 0.0 for r in st.ranks))
        ptext = " ".join(f"{k}={v}" for k, v in sched.params)
        rows.append((name, ptext, fig, ""))
    return rows


def below_1f1b(spec: Spec) -> bool:
    """Whether the limit is below 1F1B's peak on some rank, under the spec's memory model."""
    from pipec.errors import PipecError

    if spec.limit is None:
        return False
    try:
        rows = library_comparison(replace(spec, limit=None, host_limit=None), ["1f1b"])
    except PipecError:
        return True
    fig = rows[0][2]
    return fig is None or any(lim < p - 1e-9 for lim, p in zip(spec.limit, fig.peak))


def peak_of(spec: Spec, name: str) -> float:
    """The largest per-rank peak memory of a library schedule at the spec's sizes and memory model."""
    rows = library_comparison(replace(spec, limit=None), [name])
    _, _, fig, note = rows[0]
    if fig is None:
        raise error("E702", f"cannot take the memory limit of `{name}`: {note}")
    return max(fig.peak)
