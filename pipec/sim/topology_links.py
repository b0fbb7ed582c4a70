"""The links between ranks, and between replica datacenters, that a schedule's topology declares.

Why a module of its own: which link joins two ranks (its class, `node`, `dc` or `cross`; its latency and
bandwidth by the class defaults, `default link` and `link "A" <-> "B"`; the shared link between two
datacenters) and which joins two replicas of a rank (a ring hop inside a datacenter or between the
topology's `replica_dcs`, and the expert link) are read from the topology alone, once per cost model, by
rules the cost model's docstring states (`pipec.sim.costs`). `pipec.sim.costs.cost_model` builds its
per-pair tables with these, then lays the cost documents' class settings over them; `CostModel.ring_hops`
and `CostModel.a2a_links` pick a collective's links with `ring_links` and `group_links`; the runtime's
links (`pipec.runtime.exec.links`) read `FREE` from here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from pipec.errors import error
from pipec.ir.schedule import Schedule, Topology
from pipec.sim.pairs import PairTable

LINK_CLASSES = ("node", "dc", "cross")
# Built-in links when a topology is declared but a class is not: NVLink-like inside a node,
# InfiniBand-like inside a datacenter, a long-haul link between datacenters. (latency s, bandwidth bit/s)
LINK_DEFAULTS = {"node": (2e-6, 1.6e12), "dc": (10e-6, 100e9), "cross": (10e-3, 10e9)}
FREE = (0.0, math.inf)


def ep_link(dp_link: np.ndarray, given: Mapping[str, float]) -> np.ndarray:
    """Per rank, its expert link (latency s, bandwidth bytes/s): `ep_latency`/`ep_bandwidth` (bit/s) where
    given, else the hop between two of its data-parallel replicas in one datacenter (an expert group is
    consecutive replicas, pipec.ir.experts)."""
    out = dp_link.copy()
    if "latency" in given:
        out[:, 0] = given["latency"]
    if "bandwidth" in given:
        out[:, 1] = given["bandwidth"] / 8.0
    return out


def dc_link(topo: Topology | None, a: str | None, b: str | None, class_specs) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) between datacenters named a and b (None: the implicit one of ranks
    outside every declared datacenter), by the rules of rank links: free without a topology, else the
    class default (`dc` for one datacenter, `cross` for two), `default link`, then `link "A" <-> "B"`, then
    the cost documents' class settings in order."""
    cls = "dc" if a == b else "cross"
    lat, bps = FREE if topo is None else LINK_DEFAULTS[cls]
    if topo is not None:
        for link in sorted(topo.links, key=lambda lk: lk.a is not None):
            if link.a is None or {link.a, link.b} == {a, b}:
                lat = lat if link.latency_s is None else link.latency_s
                bps = bps if link.bandwidth_bps is None else link.bandwidth_bps
    for c, spec in class_specs:
        if c == cls:
            lat, bps = spec.get("latency", lat), spec.get("bandwidth", bps)
    return float(lat), float(bps) / 8.0


def dp_links(topo: Topology | None, dc: np.ndarray, class_specs, given: Mapping[str, float]):
    """The ring hops of data parallelism (see `CostModel`): per rank the hop inside its datacenter
    (`dp_latency`/`dp_bandwidth` where given, else the link of two ranks there), the datacenter of each
    replica index, and the hop between two replica datacenters by name (inside one: the given values)."""
    names = [d.name for d in topo.datacenters] if topo is not None else []

    def inside(name: str | None) -> tuple[float, float]:
        lat, bw = dc_link(topo, name, name, class_specs)
        return given.get("latency", lat), given["bandwidth"] / 8.0 if "bandwidth" in given else bw

    own = {i: inside(names[i] if i >= 0 else None) for i in set(dc.tolist())}
    dp_link = np.array([own[i] for i in dc.tolist()], dtype=float).reshape(len(dc), 2)
    replicas = topo.replica_dcs if topo is not None else ()
    by_index: list[str | None] = [None] * max((d.hi for d in replicas), default=0)
    for d in replicas:
        by_index[d.lo : d.hi] = [d.name] * (d.hi - d.lo)
    replica_names = tuple(by_index)
    links = {}
    for a in {d.name for d in replicas}:
        for b in {d.name for d in replicas}:
            links[a, b] = inside(a) if a == b else dc_link(topo, a, b, class_specs)
    return dp_link, replica_names, links


def datacenter_of(sched: Schedule, R: int) -> np.ndarray:
    dc = np.full(R, -1, dtype=np.int64)  # -1: the implicit datacenter of undeclared ranks
    if sched.topology is not None:
        for i, d in enumerate(sched.topology.datacenters):
            dc[d.lo : d.hi] = i
    return dc


def link_groups(dc: np.ndarray, cls: PairTable) -> PairTable | None:
    """Per rank pair, the shared cross-datacenter link it uses (one per ordered pair of datacenters), or -1."""
    cross = cls.table == LINK_CLASSES.index("cross")
    if not (cross & (cls.pairs() > 0)).any():
        return None
    D = cls.table.shape[0]
    ids = np.arange(D)[:, None] * D + np.arange(D)[None, :]
    return cls.with_table(np.where(cross, ids[:, :, None], -1))


def link_classes(dc: np.ndarray, ranks_per_node: int | None) -> PairTable:
    """Each rank pair's LINK_CLASSES index: "node" for two ranks of one node (with a node size), "dc" for
    two of one datacenter, "cross" between datacenters."""
    dense = np.unique(dc, return_inverse=True)[1].astype(np.int64)
    D = int(dense.max()) + 1 if len(dense) else 0
    node = np.arange(len(dc)) // ranks_per_node if ranks_per_node else np.arange(len(dc))
    table = np.full((D, D, 2), 2, dtype=np.int64)
    idx = np.arange(D)
    table[idx, idx, :] = 1
    if ranks_per_node:
        table[idx, idx, 1] = 0
    return PairTable(dense, node.astype(np.int64), table, -1)


def topology_links(sched: Schedule, dc: np.ndarray, cls: PairTable) -> tuple[PairTable, PairTable]:
    """Latency and bandwidth per rank pair from the schedule's topology: free without one, else each
    class's default, `default link` over every pair, then `link "A" <-> "B"` in declaration order."""
    latency = PairTable(cls.dc, cls.node, np.zeros(cls.table.shape), 0.0)
    bandwidth = PairTable(cls.dc, cls.node, np.full(cls.table.shape, np.inf), np.inf)
    topo = sched.topology
    if topo is None:
        return latency, bandwidth
    lat_t, bw_t = latency.table, bandwidth.table
    for c, name in enumerate(LINK_CLASSES):
        lat, bps = LINK_DEFAULTS[name]
        lat_t[cls.table == c] = lat
        bw_t[cls.table == c] = bps / 8.0
    names = {d.name: i for i, d in enumerate(topo.datacenters)}
    declared = np.unique(dc)  # the topology's datacenter index of each dense index (-1: undeclared ranks)
    dense = {int(x): i for i, x in enumerate(declared.tolist())}
    for link in sorted(topo.links, key=lambda lk: lk.a is not None):
        sel = np.zeros(cls.table.shape, dtype=bool)
        if link.a is None:
            sel[:] = True
        elif link.a in names and link.b in names:
            a, b = dense.get(names[link.a]), dense.get(names[link.b])
            if a is None or b is None:
                continue  # a datacenter without ranks: no rank pair crosses this link
            sel[a, b, :] = sel[b, a, :] = True
        else:
            continue  # a link between datacenters of replicas only (`replica_dcs`): no rank pair crosses it
        if link.latency_s is not None:
            lat_t[sel] = link.latency_s
        if link.bandwidth_bps is not None:
            bw_t[sel] = link.bandwidth_bps / 8.0
    return latency, bandwidth


def replica_datacenters(replica_names: tuple[str | None, ...], n: int) -> tuple[str | None, ...]:
    """The datacenters the topology's `replica_dcs` put replicas 0 to n - 1 in; E801 when they leave one out."""
    names = replica_names[:n]
    if len(names) < n or None in names:
        lost = next(i for i in range(n) if i >= len(names) or names[i] is None)
        raise error(
            "E801",
            f"the program runs {n} data-parallel replicas of each rank, but the topology's replica "
            f"datacenters leave replica {lost} out",
        )
    return names


def ring_links(own: tuple[float, float], replica_names, replica_links, n: int) -> list[tuple[float, float]]:
    """The hops of a ring over n replicas, replica i to i + 1 (`CostModel.ring_hops`): `own` (the rank's
    hop inside its datacenter) without replica datacenters, else the link between the two replicas'."""
    if not replica_names:
        return [own] * n
    names = replica_datacenters(replica_names, n)
    return [replica_links.get((names[i], names[(i + 1) % n]), own) for i in range(n)]


def group_links(own: tuple[float, float], replica_names, replica_links, ep: int, dp: int) -> list[tuple[float, float]]:
    """The links an all-to-all of expert groups of `ep` consecutive replicas (of `dp`) crosses
    (`CostModel.a2a_links`): `own` (the rank's expert link) inside one datacenter, the link between two
    replica datacenters otherwise."""
    if not replica_names:
        return [own]
    names = replica_datacenters(replica_names, dp)
    pairs = {
        (names[i], names[j])
        for g in range(0, dp - dp % ep, ep)
        for i in range(g, g + ep)
        for j in range(g, g + ep)
        if i != j
    }
    return [own if a == b else replica_links.get((a, b), own) for a, b in sorted(pairs)] or [own]
