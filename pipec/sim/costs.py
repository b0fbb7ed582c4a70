"""The cost model: how long each op runs and how long each message travels (its files and overrides are
read and written by `pipec.sim.cost_files`; the links a topology declares are `pipec.sim.topology_links`).

Sources, later ones winning key by key: built-in defaults, the schedule's
`cost` and `topology` declarations, then cost files and `--cost` overrides in
the order given. Defaults: `T_F = T_B = T_W = 1` for each rank's share of the
model, that is `p / S` per stage (1 when each rank holds one stage, 1/v with
v chunks per rank, so every schedule computes the same model and schedules
compare fairly); a full backward (schedules without `W`) takes `T_B + T_W`,
except that when a source gives `B` and none gives `W`, that `B` is the full
backward; communication is free. The closed forms of GPipe, 1F1B, interleaved 1F1B
and Zero Bubble then hold exactly.

Times are seconds (any unit works if every number uses it: the unit costs of
the defaults read as 1 s). Per-stage keys take one number for every stage or
a list with one per stage:

- `F`, `B`, `W`: compute times of the stage's forward, backward (input
  gradient when split) and weight-gradient passes; `T_F`, `T_B`, `T_W` (one
  number) instead give the time of a rank's share of the model, `p / S` of it
  per stage, so one value compares schedules with any number of chunks;
- `comm`: a fixed time per message the stage sends (Zero Bubble's `T_comm`);
- `overhead` (one number): the time a rank's own thread spends on each send and each receive it
  issues, the `o` of the LogP model: the call that hands the message to the backend (on gloo the send
  writes the data to the socket itself), so the rank computes nothing meanwhile (`pipec profile`
  measures it; default 0);
- `act_bytes`: bytes of the activation stage s sends to s + 1 (on a stage graph,
  on each of its out-edges); `grad_bytes`: bytes of the gradient stage s sends to
  s - 1 (on a graph, on each of its in-edges; default: the activation size across
  the same edge, `act_bytes` of the stage at its other end: `act_bytes[s - 1]` on
  the chain);
- data parallelism (a Program with `dp` = N > 1 replicas of each rank): `param_bytes`, the bytes of
  stage s's parameters (its gradients are as large); `reduce_grad` and `unshard`, the seconds of stage
  s's gradient reduction and parameter all-gather when no bytes are known (they win over the ring
  formulas below); `dp_latency` (seconds per ring hop) and `dp_bandwidth` (bit/s), both one number: the
  link between the replicas of a rank inside one datacenter;
- `step`: the seconds of stage s's optimizer step, charged to its rank's compute at its `STEP s` after
  the stage's REDUCE_GRAD is done (with FSDP2 it includes the final post-backward callback and the
  reshard; `pipec profile --in-situ` measures it from the schedule's own STEPs; default 0);
- `step_overhead` (one number): the seconds of every step outside the Program's instructions, on every
  rank alike (zeroing gradients, splitting the batch, with replicas the loss all-reduce at the end):
  it adds to the makespan (`pipec profile --in-situ` measures it; default 0);
- `pair_handoff` (one number): the seconds an overlapped pair's op waits, when its turn comes, before it
  runs (the other op's thread hands over at an all-to-all and this one wakes up): added to every segment
  that takes the turn from the pair's other op, unshared by ranks sharing cores (`pipec profile
  --in-situ` measures it on a Program with overlapped pairs and all-to-alls; default 0);
- `dp_blocking` (0 or 1, or a boolean): whether a collective blocks the rank that issues it, so that
  REDUCE_GRAD and UNSHARD run on the rank's own timeline, its next instruction waiting for them, rather
  than on a stream of their own (gloo through FSDP2 on CPU blocks; `pipec profile` writes 1 when it
  times its collectives on gloo; default 0, overlapping).

Collectives (`REDUCE_GRAD`, `UNSHARD`) are rings over the N replicas (`collective_time`): with a link of
latency a and bandwidth b (bytes/s) and B bytes, an all-reduce (ddp's REDUCE_GRAD) takes 2(N-1) a +
2(N-1)/N B / b, an all-gather (fsdp's UNSHARD) or a reduce-scatter (fsdp's REDUCE_GRAD) (N-1) a +
(N-1)/N B / b, and nothing with N = 1. Every step of a ring moves a chunk of B / N over each hop at
once, so a step takes its slowest hop's time: the hop between replicas in one datacenter takes
`dp_latency`/`dp_bandwidth`, or when those are not given the link of two ranks inside that datacenter
(free with no topology); the hop between replicas in two datacenters (the topology's `replica_dcs`)
takes the link between those datacenters by the rules of rank links below. Collectives are free when
nothing is given, as messages are.

A message from stage s, rank a to rank b arrives `comm[s] + latency(a, b) +
bytes / bandwidth(a, b)` after it is sent, when nothing else is on its link:
messages between two datacenters share one link per direction (`link_group`),
whose bandwidth concurrent messages divide equally. Links come by the rank pair's
class: `node` (same node: `ranks_per_node` set and `a // n == b // n`), `dc`
(same datacenter; ranks outside every declared datacenter form one) and
`cross` (different datacenters). With no topology declared every link is
free; with one, undeclared links take the built-in defaults of their class
(`LINK_DEFAULTS`), `default link` covers every pair its datacenters' links do
not, and `link "A" <-> "B"` the pairs between A and B. Cost files and
overrides can set a class (`links.cross`) or every link (`latency`,
`bandwidth`). Bandwidths are bits per second (as in the language); strings
with units are accepted everywhere: `"40ms"`, `"10Gbps"`, `"16MiB"`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from pipec.errors import error
from pipec.ir.opcodes import ACT_MSG, COST_KIND
from pipec.ir.schedule import STAGE_COST_KEYS, Schedule
from pipec.ir.units import MAX_QUANTITY
from pipec.sim.pairs import PairTable
from pipec.sim.topology_links import (
    FREE,
    LINK_CLASSES,
    datacenter_of,
    dp_links,
    ep_link,
    group_links,
    link_classes,
    link_groups,
    ring_links,
    topology_links,
)
from pipec.sim.topology_links import LINK_DEFAULTS as LINK_DEFAULTS  # kept here, where it was

# Per-stage keys whose absence means "compute it" (NaN in the model), not zero: the collectives' direct times.
_DIRECT = ("reduce_grad", "unshard", "offload", "a2a")

# An OFFLOAD or RELOAD with neither its time (`offload`) nor its bytes and the host link's bandwidth: this
# fraction of the stage's F. Half a forward hides behind the next forward, as PipeOffload measures offload
# to hide in most configurations, but not behind a bubble: a slow-enough default to show where it cannot.
HOST_DEFAULT_F = 0.5
# The ring collectives: how many ring steps each takes per replica beyond the first (an all-reduce is a
# reduce-scatter then an all-gather).
RING_STEPS = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}


@dataclass(frozen=True, eq=False)
class CostModel:
    """Per-stage compute times and message sizes, per-rank-pair links; built by `cost_model`."""

    F: np.ndarray
    B: np.ndarray
    W: np.ndarray
    comm: np.ndarray
    act_bytes: np.ndarray
    grad_bytes: np.ndarray
    # Per rank pair, indexed [src, dst] (pipec.sim.pairs: held per pair of datacenters and node sharing).
    latency: PairTable  # seconds
    bandwidth: PairTable  # bytes per second; inf: no size term
    link_class: PairTable  # index into LINK_CLASSES (-1 on the diagonal)
    split_backward: bool
    origin: tuple[str, ...] = field(default=())  # what contributed, for the report
    # (ranks, ranks): the shared link a message between the pair crosses, -1 for none. Every pair from
    # datacenter A to datacenter B crosses one link (one per direction: links are full duplex), and
    # concurrent messages on it share its bandwidth; links inside a datacenter are not shared.
    link_group: PairTable | None = None
    overhead: float = 0.0  # seconds of the rank's time per send or receive instruction (LogP's o)
    # Data parallelism (the module docstring): per stage, its parameters' bytes and the direct times of its
    # reduction and all-gather (NaN where not given: the ring formula's); per rank, (latency s, bandwidth
    # bytes/s) of a ring hop between two of its replicas inside one datacenter; per replica index, the
    # datacenter the topology's `replica_dcs` puts it in (empty: the rank's own), and the hop link between
    # two such datacenters by name. None: nothing given (a model built before collectives, all free).
    param_bytes: np.ndarray | None = None
    reduce_grad: np.ndarray | None = None
    unshard: np.ndarray | None = None
    dp_link: np.ndarray | None = None
    replica_names: tuple[str | None, ...] = ()
    replica_links: Mapping[tuple[str, str], tuple[float, float]] = field(default_factory=dict)
    # Per stage, its optimizer step's seconds at STEP (None: nothing given, free); the fixed seconds of a
    # step outside its instructions; whether collectives block the issuing rank (the module docstring).
    step: np.ndarray | None = None
    step_overhead: float = 0.0
    dp_blocking: bool = False
    pair_handoff: float = 0.0  # seconds per turn an overlapped pair's op takes from the other (the docstring)
    grad_given: bool = True  # False: `grad_bytes` is the default (a graph's gradient: its edge's activation)
    # Memory (docs/simulate.md, "Memory ops"): per stage, the bytes its F keeps for its B (`saved_bytes`),
    # its B for its W (`wsaved_bytes`), a recomputed F for its RECOMPUTE (`input_bytes`: its input) and its
    # parameters with gradients and optimizer state (`state_bytes`), 0 where not given; the seconds of one
    # OFFLOAD or RELOAD of the stage (`offload`, NaN where not given); the host link, one per rank
    # (`host_latency` s, `host_bandwidth` bytes/s; inf: not given).
    saved_bytes: np.ndarray | None = None
    wsaved_bytes: np.ndarray | None = None
    input_bytes: np.ndarray | None = None
    state_bytes: np.ndarray | None = None
    offload: np.ndarray | None = None
    host_latency: float = 0.0
    host_bandwidth: float = math.inf
    # Token slices and sequence lengths (pipec.ir.schedule.Slicing; None: every micro-batch weighs the same):
    # per (stage, unit), what the unit's F, B and W cost relative to a whole sequence (`Slicing.weight`
    # with the stage's `attn`), beyond `op_fixed` seconds per op that every op pays; per unit, its share of
    # a sequence's tokens, which scales its messages' bytes and its activations.
    unit_weight: np.ndarray | None = None
    unit_share: np.ndarray | None = None
    op_fixed: np.ndarray | None = None
    # Experts (docs/moe.md): per stage, its MoE layers as the documents give them (the Program's own win:
    # `pipec.driver.moe_layers_of`), the seconds of one of its all-to-alls (NaN where not given) and the
    # bytes one rank sends in one; per rank, (latency s, bandwidth bytes/s) of its expert link, the link
    # between the replicas of an expert group (`ep_latency`/`ep_bandwidth`, else the data-parallel hop).
    moe_layers: np.ndarray | None = None
    a2a: np.ndarray | None = None
    a2a_bytes: np.ndarray | None = None
    ep_link: np.ndarray | None = None
    # Cores (docs/simulate.md, "Ranks that share cores"): the ranks of a node (`ranks_per_node`, 0: each rank
    # a node of its own) compute on its `cores_per_node` cores (0: as many as it has ranks); more of them
    # computing at once than it has cores share them, each at cores / computing of its speed.
    ranks_per_node: int = 0
    cores_per_node: int = 0

    @property
    def shares_cores(self) -> bool:
        """Whether some node has more ranks than cores, so that ranks computing at once slow each other."""
        return 0 < self.cores_per_node < self.ranks_per_node

    @property
    def num_stages(self) -> int:
        return len(self.F)

    @property
    def free_collectives(self) -> bool:
        """Whether every collective takes no time at any number of replicas (nothing sized or timed)."""
        direct = [a for a in (self.reduce_grad, self.unshard) if a is not None]
        if any((np.nan_to_num(a, nan=0.0) > 0).any() for a in direct):
            return False
        sized = self.param_bytes is not None and (self.param_bytes > 0).any()
        links = [] if self.dp_link is None else [tuple(x) for x in self.dp_link.tolist()]
        links += list(self.replica_links.values())
        return not any(lat > 0 or (sized and math.isfinite(bw)) for lat, bw in links)

    def ring_hops(self, rank: int, n: int) -> list[tuple[float, float]]:
        """The links (latency s, bandwidth bytes/s) of the ring over rank's n replicas, replica i to i + 1:
        inside the rank's datacenter, or between the datacenters `replica_dcs` puts them in."""
        own = FREE if self.dp_link is None else (float(self.dp_link[rank, 0]), float(self.dp_link[rank, 1]))
        return ring_links(own, self.replica_names, self.replica_links, n)

    def collective_time(self, op: np.ndarray, stage: np.ndarray, rank: np.ndarray, n: int, dp_kind: str) -> np.ndarray:
        """Durations of collective instructions (opcodes of `pipec.ir.opcodes`) on these stages and ranks, over
        n replicas sharing parameters as `dp_kind` says: REDUCE_GRAD an all-reduce (ddp) or reduce-scatter
        (fsdp) of the stage's gradients, UNSHARD an all-gather of its parameters, RESHARD nothing. A given
        `reduce_grad`/`unshard` time wins over the formula; with one replica everything is free. The
        simulator charges every collective with this (`ring_time` for the formula)."""
        from pipec.ir.opcodes import REDUCE_GRAD, UNSHARD

        out = np.zeros(len(op))
        if n <= 1 or not len(op):
            return out
        size = np.zeros(len(op)) if self.param_bytes is None else self.param_bytes[stage]
        reduce = "all_reduce" if dp_kind == "ddp" else "reduce_scatter"
        for r in np.unique(rank).tolist():
            hops = self.ring_hops(r, n)
            for code, algo, direct in ((REDUCE_GRAD, reduce, self.reduce_grad), (UNSHARD, "all_gather", self.unshard)):
                sel = (rank == r) & (op == code)
                if not sel.any():
                    continue
                t = ring_time(algo, n, size[sel], hops)
                if direct is not None:
                    given = direct[stage[sel]]
                    t = np.where(np.isnan(given), t, given)
                out[sel] = t
        return out

    def a2a_links(self, rank: int, ep: int, dp: int) -> list[tuple[float, float]]:
        """The links (latency s, bandwidth bytes/s) an all-to-all of rank's expert groups crosses: between
        two replicas of a group (`ep` consecutive replicas of the `dp`) in one datacenter the rank's expert
        link (`ep_latency`/`ep_bandwidth`, else the data-parallel hop), between two datacenters of the
        topology's `replica_dcs` the link between them (as the rings of `ring_hops`)."""
        own = FREE if self.ep_link is None else (float(self.ep_link[rank, 0]), float(self.ep_link[rank, 1]))
        return group_links(own, self.replica_names, self.replica_links, ep, dp)

    def a2a_time(self, stage: np.ndarray, rank: np.ndarray, ep: int, dp: int | None = None) -> np.ndarray:
        """Seconds of one all-to-all of these stages' ops on these ranks over an expert group of `ep` ranks
        (of `dp` replicas, default ep): the stage's given `a2a`, else the slowest of its links
        (`a2a_links`): latency plus the `a2a_bytes` one rank sends over the bandwidth; nothing with ep = 1
        (no token leaves its rank). `a2a_parts` splits it into its wire time and its latency."""
        wire, lat = self.a2a_parts(stage, rank, ep, dp)
        return wire + lat

    def a2a_parts(
        self, stage: np.ndarray, rank: np.ndarray, ep: int, dp: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """`a2a_time` as (wire, latency): the bytes over the bandwidth of the slowest link, which hold the
        rank's expert link, and the latency after them, which does not (two all-to-alls in flight overlap
        their latencies, as two messages on one channel do: pipec.sim.machine). A given `a2a` is all wire."""
        wire, lat = np.zeros(len(stage)), np.zeros(len(stage))
        if ep <= 1 or not len(stage):
            return wire, lat
        size = np.zeros(len(stage)) if self.a2a_bytes is None else self.a2a_bytes[stage].astype(float)
        for r in np.unique(rank).tolist():
            sel = rank == r
            for link_lat, bw in self.a2a_links(r, ep, dp or ep):
                w = size[sel] / bw if math.isfinite(bw) else np.zeros(int(sel.sum()))
                slower = link_lat + w > wire[sel] + lat[sel]
                wire[sel] = np.where(slower, w, wire[sel])
                lat[sel] = np.where(slower, link_lat, lat[sel])
        if self.a2a is not None:
            given = self.a2a[stage]
            wire = np.where(np.isnan(given), wire, given)
            lat = np.where(np.isnan(given), lat, 0.0)
        return wire, lat

    def collective_wire(self, op: np.ndarray, stage: np.ndarray, rank: np.ndarray, n: int, dp_kind: str) -> np.ndarray:
        """The part of each collective's `collective_time` that is bytes on a link between two replica
        datacenters (`replica_dcs`): the chunks its ring steps send over that link, when a hop across it is
        the ring's slowest; 0 for rings inside one datacenter and for given times. The simulator shares
        such a link among the rings on it at one time, as it shares a cross link among messages."""
        from pipec.ir.opcodes import REDUCE_GRAD, UNSHARD

        out = np.zeros(len(op))
        names = self.replica_names[:n]
        if n <= 1 or not len(op) or self.param_bytes is None or len({x for x in names if x is not None}) < 2:
            return out
        size = self.param_bytes[stage]
        reduce = "all_reduce" if dp_kind == "ddp" else "reduce_scatter"
        for r in np.unique(rank).tolist():
            hops = self.ring_hops(r, n)
            cross = [names[i] != names[(i + 1) % n] for i in range(n)]
            for code, algo, direct in ((REDUCE_GRAD, reduce, self.reduce_grad), (UNSHARD, "all_gather", self.unshard)):
                sel = (rank == r) & (op == code)
                if not sel.any():
                    continue
                chunk = size[sel] / n
                step = np.stack([lat + (chunk / bw if math.isfinite(bw) else 0.0 * chunk) for lat, bw in hops])
                worst = np.argmax(step, axis=0)
                bw = np.array([b for _, b in hops])[worst]
                wire = np.where(np.array(cross)[worst] & np.isfinite(bw), chunk / bw, 0.0)
                wire = RING_STEPS[algo] * (n - 1) * wire
                if direct is not None:
                    wire = np.where(np.isnan(direct[stage[sel]]), wire, 0.0)
                out[sel] = wire
        return out

    @property
    def free_comm(self) -> bool:
        return not (self.comm.any() or self.latency.any() or self._size_term() or self.overhead)

    def _size_term(self) -> bool:
        sized = (self.act_bytes > 0).any() or (self.grad_bytes > 0).any()
        return bool(sized and np.isfinite(self.bandwidth.values()).any())

    def compute_time(self, op: np.ndarray, stage: np.ndarray, mb: np.ndarray | None = None) -> np.ndarray:
        """Durations of compute instructions on these stages (of these micro-batches, or units): the cost of
        the op kind each executes or costs as (`pipec.ir.opcodes.COST_KIND`: a RECOMPUTE costs its stage's F)."""
        return self.kind_time(COST_KIND[op], stage, mb)

    def host_time(self, stage: np.ndarray, recomputed: np.ndarray) -> np.ndarray:
        """Durations of OFFLOADs and RELOADs of these stages on the rank's host link, each moving what its
        F keeps (`input_bytes` when the F is recomputed, else `saved_bytes`): the stage's `offload` where
        given; else, with those bytes and `host_bandwidth` known, bytes / host_bandwidth + host_latency;
        else `HOST_DEFAULT_F` of the stage's F."""
        n = len(stage)
        zeros = np.zeros(self.num_stages)
        saved = (self.saved_bytes if self.saved_bytes is not None else zeros)[stage]
        kept = (self.input_bytes if self.input_bytes is not None else zeros)[stage]
        held = np.where(recomputed, kept, saved) if n else np.zeros(0)
        if math.isfinite(self.host_bandwidth):
            t = np.where(held > 0, held / self.host_bandwidth + self.host_latency, HOST_DEFAULT_F * self.F[stage])
        else:
            t = HOST_DEFAULT_F * self.F[stage]
        if self.offload is not None:
            given = self.offload[stage]
            t = np.where(np.isnan(given), t, given)
        return np.asarray(t, dtype=float)

    def kind_time(self, kind: np.ndarray, stage: np.ndarray, mb: np.ndarray | None = None) -> np.ndarray:
        """Durations of ops of these kinds (0 F, 1 B, 2 W) on these stages; B is the full backward when the
        schedule does not split it. With token slices or sequence lengths and the ops' units given, each
        costs `op_fixed` plus the rest of its kind's time scaled by the unit's weight."""
        full_b = self.B if self.split_backward else self.B + self.W
        t = np.where(kind == 0, self.F[stage], np.where(kind == 1, full_b[stage], self.W[stage]))
        if self.unit_weight is None or mb is None:
            return t
        fixed = np.minimum(self.op_fixed[stage], t)
        return fixed + (t - fixed) * self.unit_weight[stage, mb]

    def wire(
        self,
        msg: np.ndarray,
        stage: np.ndarray,
        src: np.ndarray,
        dst: np.ndarray,
        mb: np.ndarray | None = None,
        other: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per message (what travels, sending stage, from rank, to rank, and of which unit; on a stage graph
        the stage at the other end of its edge): its bytes, its time on the wire when alone there (`bytes /
        bandwidth`, 0 on a free link) and the delay after it left the wire (`latency + comm`). The simulator
        and the list scheduler time every message with these; a unit's message carries its share of a
        sequence's bytes (`unit_share`)."""
        grad = self.grad_bytes[stage]
        if other is not None and not self.grad_given:  # the gradient of the activation its edge carried
            grad = self.act_bytes[np.clip(other, 0, len(self.act_bytes) - 1)]
        size = np.where(msg == ACT_MSG, self.act_bytes[stage], grad)
        if self.unit_share is not None and mb is not None:
            size = size * self.unit_share[mb]
        bw = self.bandwidth[src, dst]
        finite = np.isfinite(bw)
        txd = np.where(finite & (size > 0), size / np.where(finite, bw, 1.0), 0.0)
        return size, txd, self.latency[src, dst] + self.comm[stage]

    def _describe_collectives(self, col) -> dict:
        """The data-parallel part of `describe`: sizes, direct times (None: the ring's), the ring hops."""

        def direct(a: np.ndarray | None):
            if a is None or np.isnan(a).all():
                return None
            return col(np.where(np.isnan(a), -1.0, a))  # -1: the formula's on that stage

        hop = None
        if self.dp_link is not None and len(self.dp_link):
            lat = sorted(set(self.dp_link[:, 0].tolist()))
            bw = sorted(set((self.dp_link[:, 1] * 8).tolist()))
            hop = {
                "latency_s": lat[0] if len(lat) == 1 else lat,
                "bandwidth_bps": _json_num(bw[0]) if len(bw) == 1 else [_json_num(b) for b in bw],
            }
        between = {
            f"{a} <-> {b}": {"latency_s": lat, "bandwidth_bps": _json_num(bw * 8)}
            for (a, b), (lat, bw) in sorted(self.replica_links.items())
            if a < b
        }
        return {
            "param_bytes": None if self.param_bytes is None else col(self.param_bytes),
            "reduce_grad": direct(self.reduce_grad),
            "unshard": direct(self.unshard),
            "dp_link": hop,
            "replica_dcs": sorted({n for n in self.replica_names if n is not None}),
            "between_replica_dcs": between,
            "free": self.free_collectives,
        }

    def _describe_host(self, col) -> dict:
        """The memory-op part of `describe`: the per-stage bytes given (None: not given), the stages'
        `offload` times (-1: from the bytes or the default on that stage) and the host link."""
        sizes = ("saved_bytes", "wsaved_bytes", "input_bytes", "state_bytes")
        given = {k: getattr(self, k) for k in sizes}
        off = self.offload
        return {
            **{k: col(v) if v is not None and (v > 0).any() else None for k, v in given.items()},
            "offload": None if off is None or np.isnan(off).all() else col(np.where(np.isnan(off), -1.0, off)),
            "host_latency_s": self.host_latency,
            "host_bandwidth_bps": _json_num(self.host_bandwidth * 8),
            "default_offload_of_F": HOST_DEFAULT_F,
        }

    def per_microbatch(self) -> float:
        """Compute time of one micro-batch through the whole model (every stage's F + B + W)."""
        return float(self.F.sum() + self.B.sum() + self.W.sum())

    def describe(self) -> dict:
        """A JSON-ready summary: per-stage values collapsed to one number where they are all equal."""

        def col(a: np.ndarray):
            vals = a.tolist()
            return vals[0] if vals and all(v == vals[0] for v in vals) else vals

        links = {}
        pairs = self.link_class.pairs()
        for c, name in enumerate(LINK_CLASSES):
            sel = (self.link_class.table == c) & (pairs > 0)
            if sel.any():
                lat = sorted(set(self.latency.table[sel].tolist()))
                bw = sorted(set((self.bandwidth.table[sel] * 8).tolist()))
                links[name] = {
                    "pairs": int(pairs[sel].sum()) // 2,
                    "latency_s": lat[0] if len(lat) == 1 else lat,
                    "bandwidth_bps": _json_num(bw[0]) if len(bw) == 1 else [_json_num(b) for b in bw],
                }
                if name == "cross" and self.link_group is not None:
                    links[name]["shared"] = True  # one link per pair of datacenters and direction
        return {
            "F": col(self.F),
            "B": col(self.B),
            "W": col(self.W),
            "full_backward": "B + W" if not self.split_backward else None,
            "comm": col(self.comm),
            "act_bytes": col(self.act_bytes),
            "grad_bytes": col(self.grad_bytes),
            "overhead": self.overhead,
            "links": links,
            "collectives": self._describe_collectives(col),
            "host": self._describe_host(col),
            "free_comm": self.free_comm,
            "from": list(self.origin),
        }


def ring_time(algo: str, n: int, nbytes: np.ndarray | float, hops: Sequence[tuple[float, float]]) -> np.ndarray:
    """Time of a ring collective (`RING_STEPS`: "all_reduce", "all_gather", "reduce_scatter") of `nbytes`
    over n replicas whose ring hops have these links (latency s, bandwidth bytes/s; inf: no size term).

    Each of its steps (2(n-1) for an all-reduce, n-1 for the others) sends a chunk of nbytes / n over every
    hop at once and takes the slowest hop's time; over one link (a, b) that is Patarasuk and Yuan's
    2(n-1) a + 2(n-1)/n B/b for an all-reduce and (n-1) a + (n-1)/n B/b for the others. Zero for n = 1.
    """
    size = np.asarray(nbytes, dtype=float)
    if n <= 1:
        return np.zeros(size.shape)
    step = np.zeros(size.shape)
    for lat, bw in set(hops):
        chunk = np.where(size > 0, size / n / bw, 0.0) if math.isfinite(bw) else np.zeros(size.shape)
        step = np.maximum(step, lat + chunk)
    return RING_STEPS[algo] * (n - 1) * step


def _json_num(x: float):
    return x if math.isfinite(x) else None


# ---- building the model -------------------------------------------------------


def cost_model(sched: Schedule, overrides: Sequence[Mapping] = ()) -> CostModel:
    """The cost model of a schedule: defaults, its declarations, then each override document in order."""
    S, R = sched.num_stages, sched.num_ranks
    vals = {k: np.full(S, R / S) for k in ("F", "B", "W")}
    vals.update({k: np.zeros(S) for k in ("comm", "act_bytes", "param_bytes", "step")})
    vals.update({k: np.zeros(S) for k in ("saved_bytes", "wsaved_bytes", "input_bytes", "state_bytes")})
    vals.update({k: np.full(S, np.nan) for k in _DIRECT})
    vals.update({k: np.zeros(S) for k in ("attn", "op_fixed", "moe_layers", "a2a_bytes")})
    grad: np.ndarray | None = None  # default: the activation size across the same boundary
    origin = ["defaults"]
    if sched.costs:
        origin.append("schedule: " + ", ".join(f"cost {k}" for k in sched.costs))
    for k, per in sched.costs.items():
        if k == "grad_bytes":
            grad = np.asarray(per, dtype=float)
        else:
            vals[k] = np.asarray(per, dtype=float)
    given = set(sched.costs)
    ranks_per_node = cores_per_node = None
    overhead = step_overhead = host_latency = pair_handoff = 0.0
    host_bandwidth = math.inf  # bit/s, as cost documents give it
    dp_blocking = False
    dp_given: dict[str, float] = {}
    ep_given: dict[str, float] = {}
    for ov in overrides:
        ranks_per_node = ov.get("ranks_per_node", ranks_per_node)
        cores_per_node = ov.get("cores_per_node", cores_per_node)
        overhead = ov.get("overhead", overhead)
        step_overhead = ov.get("step_overhead", step_overhead)
        pair_handoff = ov.get("pair_handoff", pair_handoff)
        host_latency = ov.get("host_latency", host_latency)
        host_bandwidth = ov.get("host_bandwidth", host_bandwidth)
        dp_blocking = ov.get("dp_blocking", dp_blocking)
        dp_given.update({k[3:]: ov[k] for k in ("dp_latency", "dp_bandwidth") if k in ov})
        ep_given.update({k[3:]: ov[k] for k in ("ep_latency", "ep_bandwidth") if k in ov})
    dc = datacenter_of(sched, R)
    cls = link_classes(dc, ranks_per_node)
    latency, bandwidth = topology_links(sched, dc, cls)
    lat_t, bw_t, cls_t = latency.table, bandwidth.table, cls.table
    if sched.topology is not None:
        origin.append("schedule: topology")
    for ov in overrides:
        origin.append(str(ov.get("_from", "overrides")))
        for k in ("F", "B", "W"):
            if f"T_{k}" in ov:
                vals[k] = np.full(S, ov[f"T_{k}"] * R / S)
                given.add(k)
        for k in STAGE_COST_KEYS:
            if k not in ov:
                continue
            given.add(k)
            v = ov[k]
            if isinstance(v, list):
                if len(v) != S:
                    raise error("E801", f"`{k}` lists {len(v)} values but the schedule has {S} stages")
                arr = np.asarray(v, dtype=float)
            else:
                arr = np.full(S, float(v))
            if k == "grad_bytes":
                grad = arr
            else:
                vals[k] = arr
        for c, spec in ov.get("links", {}).items():
            sel = cls_t == LINK_CLASSES.index(c)
            if "latency" in spec:
                lat_t[sel] = spec["latency"]
            if "bandwidth" in spec:
                bw_t[sel] = spec["bandwidth"] / 8.0
    grad_given = grad is not None
    if grad is None:
        grad = np.concatenate([[0.0], vals["act_bytes"][:-1]])
    if not sched.split_backward and "B" in given and "W" not in given:
        vals["W"] = np.zeros(S)  # B was given for a schedule without W: it is the full backward
    vals["grad_bytes"] = grad
    for k in (*STAGE_COST_KEYS, *_DIRECT):
        v = vals[k][~np.isnan(vals[k])] if k in _DIRECT else vals[k]  # a direct time not given is NaN
        if not (np.isfinite(v).all() and (v >= 0).all()):
            raise error("E801", f"cost `{k}` must be a finite number >= 0 for every stage")
        if (v > MAX_QUANTITY).any():  # a schedule's own declaration, or T_F scaled by p / S
            raise error("E801", f"cost `{k}` is out of range (at most {MAX_QUANTITY:g}) on some stage")
    class_specs = [(c, spec) for ov in overrides for c, spec in ov.get("links", {}).items()]
    dp_link, replica_names, replica_links = dp_links(sched.topology, dc, class_specs, dp_given)
    return CostModel(
        F=vals["F"],
        B=vals["B"],
        W=vals["W"],
        comm=vals["comm"],
        act_bytes=vals["act_bytes"],
        grad_bytes=grad,
        latency=latency,
        bandwidth=bandwidth,
        link_class=cls,
        split_backward=sched.split_backward,
        origin=tuple(origin),
        link_group=link_groups(dc, cls),
        overhead=float(overhead),
        param_bytes=vals["param_bytes"],
        reduce_grad=vals["reduce_grad"],
        unshard=vals["unshard"],
        dp_link=dp_link,
        replica_names=replica_names,
        replica_links=replica_links,
        step=vals["step"],
        step_overhead=float(step_overhead),
        pair_handoff=float(pair_handoff),
        dp_blocking=bool(dp_blocking),
        grad_given=grad_given,
        saved_bytes=vals["saved_bytes"],
        wsaved_bytes=vals["wsaved_bytes"],
        input_bytes=vals["input_bytes"],
        state_bytes=vals["state_bytes"],
        offload=vals["offload"],
        host_latency=float(host_latency),
        host_bandwidth=float(host_bandwidth) / 8.0,
        ranks_per_node=int(ranks_per_node or 0),
        cores_per_node=int(cores_per_node or 0),
        **_unit_costs(sched, vals),
        moe_layers=vals["moe_layers"],
        a2a=vals["a2a"],
        a2a_bytes=vals["a2a_bytes"],
        ep_link=ep_link(dp_link, ep_given),
    )


def _unit_costs(sched: Schedule, vals: Mapping[str, np.ndarray]) -> dict:
    """CostModel's per-unit fields for a schedule with token slices or sequence lengths (`Slicing.weight`
    of each stage's `attn`, its `op_fixed`, `Slicing.share`); none without. E801 for an `attn` above 1."""
    sl = sched.slicing
    if sl is None:
        return {}
    attn = vals["attn"]
    if (attn > 1).any():
        raise error("E801", "cost `attn` is a share of a stage's time: at most 1")
    weight = np.stack([sl.weight(a) for a in attn.tolist()])
    return {"unit_weight": weight, "unit_share": sl.share(), "op_fixed": vals["op_fixed"]}
