"""Expert parallelism (mixture of experts) on the pipeline: the options, and the one rule that orders an
overlapped pair's all-to-alls.

Where the experts live. Expert parallelism is folded into the "dp" mesh dim, as torchtitan does (its
`dp_shard_in_ep`): the `size` ranks of an expert group are consecutive replicas of one pipeline rank in the
"dp" dim, so they run the same Program on different shards of the batch. Non-expert parameters stay
data-parallel over the whole "dp" dim; each MoE layer's `num` experts are sharded over the expert group
(`num / size` per rank), and its tokens travel to their experts and back by two all-to-alls (dispatch and
combine) over that group. Folding costs no processes: ranks that see different tokens (which is what
makes expert parallelism pay) are data-parallel for everything else anyway.

Where the all-to-alls are. An MoE layer's forward issues two all-to-alls (dispatch, combine) and its
backward their two gradients, in reverse order; a weight-gradient op (W) issues none. So an op of a stage
with `L` MoE layers is `all_to_alls(kind, L) + 1` compute segments with an all-to-all after every one but
the last. The executor, the simulator and the checks all read the segment counts from here. A forward's
dispatch is one all-to-all of two messages in a row, the token counts and then the rows (`a2a_latencies`).

How a pair overlaps (`F & B`, DualPipe's overlapped forward-backward). The two ops take turns on the
compute resource, passing a baton at their all-to-alls: the pair's first op runs its first segment, issues
its first all-to-all asynchronously and hands over; the second op runs a segment while that all-to-all
travels, issues its own and hands back; and so on. An op with no all-to-all left runs its remaining
segment when its turn comes and is done; the other then runs alone. `pair_order` is that rule, and it fixes
the order in which a rank issues its all-to-alls, which every rank of an expert group must share (a
collective issued in different orders on one group deadlocks, the bug of an odd MoE layer count in
Megatron-LM's overlapped 1F1B).

Stdlib only, like pipec.ir.dataparallel: the runtime's argument parser imports it without numpy or torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipec.errors import brief, error

if TYPE_CHECKING:
    from pipec.ir.program import Program

MAX_SIZE = 1_000_000  # ranks per expert group; the dp size bounds it anyway (pipec.ir.dataparallel)
MAX_LAYERS = 100_000  # MoE layers of one stage (a Program's other sizes are bounded alike)
A2A_PER_LAYER = 2  # an MoE layer's forward: dispatch, combine; its backward: their gradients
DISPATCH_LATENCIES = 2  # a forward's dispatch: its counts, then its rows (`a2a_latencies`)


@dataclass(frozen=True)
class Experts:
    """How a Program's MoE layers are spread.

    size: ranks of an expert group (`--ep`), consecutive replicas in the "dp" dim; 1 is no expert
        parallelism (every rank holds every expert and no all-to-all is issued).
    num: experts per MoE layer (`--experts`), a multiple of `size`; 0 when the model has no MoE layer.
    """

    size: int = 1
    num: int = 0

    def __post_init__(self) -> None:
        def bad(message: str) -> None:
            raise error("E425", f"expert parallelism: {message}")

        if not _is_int(self.size) or not 1 <= self.size <= MAX_SIZE:
            bad(f"the expert group size (--ep) must be an integer from 1 to {MAX_SIZE:,}, got {brief(self.size)}")
        if not _is_int(self.num) or self.num < 0:
            bad(f"the expert count (--experts) must be an integer >= 0, got {brief(self.num)}")
        if self.size > 1 and self.num % self.size:
            bad(
                f"{self.num} experts cannot be sharded evenly over an expert group of {self.size} ranks "
                f"(--experts must be a multiple of --ep)"
            )

    @property
    def per_rank(self) -> int:
        """Experts of each MoE layer that one rank of the group holds."""
        return self.num // self.size

    def fits(self, dp_size: int) -> str | None:
        """Why this expert group cannot fold into `dp_size` data-parallel replicas, or None when it can."""
        if dp_size % self.size:
            return (
                f"an expert group of {self.size} ranks (--ep) must divide the data-parallel replicas (--dp "
                f"{dp_size}): expert parallelism is folded into the dp dim"
            )
        return None


def layers_problem(layers: Sequence[object], num_stages: int) -> str | None:
    """Why per-stage MoE layer counts (a Program's `moe_layers`) do not fit `num_stages` stages, or None:
    one integer from 0 to MAX_LAYERS per stage, or none at all (no MoE layer anywhere)."""
    if not len(layers):
        return None
    if len(layers) != num_stages:
        return f"the MoE layers name {len(layers)} stages, the program has {num_stages}"
    bad = next((x for x in layers if not _is_int(x) or not 0 <= x <= MAX_LAYERS), None)
    if bad is not None:
        return f"a stage's MoE layer count must be an integer from 0 to {MAX_LAYERS:,}, not {brief(bad)}"
    return None


def experts_mismatch(
    prog: Program, experts: Experts, layers: Sequence[int] = (), asked: str | None = None
) -> str | None:
    """Why a Program cannot run with these experts and per-stage MoE layers, or None when it can: its
    all-to-alls (how many each op issues, in which order) were fixed when it was compiled, as its
    collectives were for its data parallelism (`pipec.ir.dataparallel.dp_mismatch`). `layers` empty: the
    Program's own (not asked about)."""
    same = prog.experts == experts and (not len(layers) or tuple(layers) == tuple(prog.moe_layers))
    if same:
        return None
    have = f"--ep {prog.experts.size} --experts {prog.experts.num} --moe-layers {layers_text(prog.moe_layers)}"
    want = f"--ep {experts.size} --experts {experts.num}" + (
        f" --moe-layers {layers_text(layers)}" if len(layers) else ""
    )
    return f"the Program was compiled for experts {have}, not the {asked or want} asked for"


def layers_text(layers: Sequence[int]) -> str:
    """Per-stage MoE layers as `--moe-layers` takes them: one number when all stages agree, else a list."""
    if not len(layers):
        return "0"
    return str(layers[0]) if len(set(layers)) == 1 else ",".join(map(str, layers))


def a2a_sequence(ops: Iterable[tuple[str, int, int, bool]], layers: Sequence[int]) -> list[tuple[str, int, int, int]]:
    """The all-to-alls a rank issues, in issue order, as (kind, micro-batch, stage, index within its op):
    its ops (kind, micro-batch, stage, bound to the next op) in stream order on stages with these MoE
    layers, an overlapped pair's in `pair_order`. Two ranks of one expert group must issue equal sequences
    (each all-to-all is a collective over the group)."""
    out: list[tuple[str, int, int, int]] = []
    pending: tuple[str, int, int] | None = None
    for kind, mb, stage, bound in ops:
        if bound and pending is None:
            pending = (kind, mb, stage)
            continue
        pair = [pending, (kind, mb, stage)] if pending else [(kind, mb, stage)]
        pending = None
        counts = [all_to_alls(k, layers[s] if s < len(layers) else 0) for k, _, s in pair]  # type: ignore[misc]
        order = pair_order(*counts) if len(pair) == 2 else tuple((0, k) for k in range(counts[0] + 1))
        for who, k in order:
            if k < counts[who]:
                out.append((*pair[who], k))  # type: ignore[arg-type]
    return out


def all_to_alls(kind: str, moe_layers: int) -> int:
    """All-to-alls an op of `kind` ("F", "B", "W") issues on a stage with `moe_layers` MoE layers: a
    forward and a backward (input gradient or full) two per layer, a weight gradient none."""
    return 0 if kind == "W" else A2A_PER_LAYER * moe_layers


def a2a_latencies(kind: str, index: int) -> int:
    """One-way link latencies the `index`-th all-to-all of an op of `kind` takes, one after the other. A
    forward's dispatch (even index) takes two: the receivers size their buffers from the token counts per
    expert, so the counts travel first and the rows when they have arrived (pipec.runtime.exec.alltoall,
    as torchtitan's and Megatron-LM's token dispatchers do). Every other all-to-all takes one: a combine
    sends back what its dispatch brought, and a backward's sizes are its forward's."""
    return DISPATCH_LATENCIES if kind == "F" and index % A2A_PER_LAYER == 0 else 1


def pair_order(first: int, second: int) -> tuple[tuple[int, int], ...]:
    """The compute segments of an overlapped pair in the order they run, as (op, segment): op 0 is the
    pair's first op (with `first` all-to-alls, so `first + 1` segments), op 1 its second. After segment k
    of an op with more than k all-to-alls, that op issues its k-th all-to-all and the other op's next
    segment runs while it travels; so the all-to-alls are issued in this order too."""
    if first < 0 or second < 0:
        raise ValueError(f"all-to-all counts must be >= 0, got {first} and {second}")
    order: list[tuple[int, int]] = []
    left = [first + 1, second + 1]
    nxt = [0, 0]
    op = 0
    while left[0] or left[1]:
        if not left[op]:
            op = 1 - op
        order.append((op, nxt[op]))
        nxt[op] += 1
        left[op] -= 1
        op = 1 - op
    return tuple(order)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
