"""Data parallelism around the pipeline (PP x DP): the options, checked once.

A job of `ranks x size` processes runs on a DeviceMesh with dims ("pp", "dp"): each of the `size`
replicas of a pipeline rank runs the one Program of that rank on its own shard of the global batch, so
the lowering needs only these options to place the data-parallel collectives (docs/program.md, "Data
parallelism"): `REDUCE_GRAD s` as soon as stage s's last compute is done and, for `fsdp`, `UNSHARD s` /
`RESHARD s` windows around the computes of stage s, `prefetch` computes ahead, at most `max_gathered`
stages gathered at once.

The command-line flags are pipec.options's (`add_dp_arguments`, `dp_of`). Stdlib only: the runtime's
argument parser imports this without numpy or torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipec.errors import brief, error

if TYPE_CHECKING:
    from pipec.ir.program import Program

KINDS = ("ddp", "fsdp")
MAX_SIZE = 10_000_000  # replicas per rank, as a Program's other sizes are bounded (pipec/ir/program.py)


@dataclass(frozen=True)
class DataParallel:
    """How each pipeline rank is replicated.

    size: replicas per pipeline rank (the mesh's "dp" dim); 1 is no data parallelism.
    kind: "ddp" (parameters replicated; `REDUCE_GRAD` all-reduces) or "fsdp" (parameters sharded over
        the replicas, FSDP2's fully_shard per stage; `UNSHARD` all-gathers, `REDUCE_GRAD`
        reduce-scatters).
    prefetch: for fsdp, how many computes ahead of a stage's first use in a window its `UNSHARD` is
        issued (0: right before it), so the all-gather overlaps the computes before.
    max_gathered: for fsdp, at most this many of a rank's stages gathered at once (None: no bound,
        every stage gathered once per step, FSDP2's reshard_after_forward=False).
    """

    size: int = 1
    kind: str = "ddp"
    prefetch: int = 1
    max_gathered: int | None = None

    def __post_init__(self) -> None:
        def bad(what: str, value: object, want: str) -> None:
            shown = repr(value) if isinstance(value, str) else brief(value)
            raise error("E421", f"data parallelism: {what} must be {want}, got {shown}")

        if not _is_int(self.size) or not 1 <= self.size <= MAX_SIZE:
            bad("the size (--dp)", self.size, f"an integer from 1 to {MAX_SIZE:,}")
        if self.kind not in KINDS:
            bad("the kind (--dp-kind)", self.kind, "one of " + ", ".join(KINDS))
        if not _is_int(self.prefetch) or self.prefetch < 0:
            bad("prefetch (--prefetch)", self.prefetch, "an integer >= 0")
        if self.max_gathered is not None and (not _is_int(self.max_gathered) or self.max_gathered < 1):
            bad("max_gathered (--max-gathered)", self.max_gathered, "an integer >= 1 (or None: no bound)")

    @property
    def is_default(self) -> bool:
        """No data parallelism: the Program is the one pipec wrote before PP x DP, byte for byte."""
        return self.size == 1 and self.kind == "ddp"


def dp_mismatch(prog: Program, size: int, kind: str, asked: str | None = None) -> str | None:
    """Why a Program cannot run under `size` x `kind` data parallelism, or None when it can: a Program's
    collectives were placed by its lowering for one size and kind, so it runs under those alone (the API's
    E422, `pipec.driver.check_program`, and the runtime's refusal both read this). `asked` names the
    request as the caller's user gave it (`--dp 2 --dp-kind ddp`)."""
    if (prog.dp, prog.dp_kind) == (size, kind):
        return None
    return (
        f"the Program was compiled for data parallelism {prog.dp} x {prog.dp_kind}, "
        f"not the {asked or f'{size} x {kind}'} asked for"
    )


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
