"""torchtitan's side of a pipec schedule: the compute-only CSV and the settings that make torchtitan run it
as pipec means it (`pipec export --to torchtitan`, docs/interop.md "torchtitan").

torchtitan (checked against 0.2.2, `torchtitan/distributed/pipeline_parallel.py`) loads a CSV through
torch's `_PipelineScheduleRuntime._load_csv(path)`, in the compute-only format, but it decides which
stages each rank builds from `pipeline_parallel_schedule`, not from the CSV: a single-stage class builds
stage r on rank r, any other class the looped placement `s -> s % p` (by default two stages per rank),
and ZBVZeroBubble or DualPipeV the V (rank r holds r and 2p-1-r). Nothing compares that with the CSV: a
wrong class crashes inside `step`. Its micro-batch count is `local_batch_size /
pipeline_parallel_microbatch_size`. So the settings are written from the schedule itself, and a schedule
torchtitan cannot place (E620), or the compute+comms format it cannot load (E621), is refused before
anything is written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pipec.errors import PipecError, error
from pipec.formats.torch_csv_writer import check_unsliced, export_csv, refuse_graph_for_torch
from pipec.ir.schedule import Schedule

TORCHTITAN_VERSION = "0.2.2"

# torchtitan's placement styles, each with the schedule class written for it (any class of the same style
# places the stages the same way; the CSV, not the class, orders the actions).
SINGLE, LOOP, V = "single", "loop", "v"
SCHEDULE_CLASS = {SINGLE: "1F1B", LOOP: "Interleaved1F1B", V: "ZBVZeroBubble"}


@dataclass(frozen=True)
class TorchtitanExport:
    """What `export_torchtitan` writes: the CSV text, the TOML fragment, and the placement it matched."""

    csv: str
    toml: str
    style: str
    schedule_class: str


def placement_style(sched: Schedule) -> str:
    """torchtitan's placement style that builds exactly this schedule's stage-to-rank map; E620 if none."""
    p, S = sched.num_ranks, sched.num_stages
    place = list(sched.placement)
    if p < 2:
        raise _refuse(
            sched,
            f"the schedule has {p} rank: torchtitan pipelines only with pipeline_parallel_degree >= 2",
            ("with pipeline_parallel_degree = 1 torchtitan builds no pipeline and never reads the CSV",),
        )
    if S == p and place == list(range(p)):
        return SINGLE
    if S % p == 0 and place == [s % p for s in range(S)]:
        return LOOP
    if S == 2 * p and place == [s if s < p else 2 * p - 1 - s for s in range(S)]:
        return V
    shown = ", ".join(f"{s}->{r}" for s, r in enumerate(place[:12])) + (", ..." if S > 12 else "")
    raise _refuse(
        sched,
        f"torchtitan cannot place these {S} stages on {p} ranks ({shown}): it builds only the looped "
        f"placement `s -> s % p` (stage s on rank s % {p}) or, for ZBVZeroBubble and DualPipeV, the V "
        f"(rank r holds stages r and {2 * p - 1} - r)",
    )


def _refuse(sched: Schedule, message: str, notes: tuple[str, ...] = ()) -> PipecError:
    notes = notes or ("torchtitan takes the placement from `pipeline_parallel_schedule`, not from the CSV",)
    return error("E620", message, sched.decl_spans.get("place"), sched.source, notes)


def schedule_class(sched: Schedule, style: str) -> str:
    """The class name for `pipeline_parallel_schedule`: DualPipeV for a V with overlapped pairs (what it
    is), else the style's class."""
    if style == V and any(bool(sched.ranks[r].paired.any()) for r in range(sched.num_ranks)):
        return "DualPipeV"
    return SCHEDULE_CLASS[style]


def settings(sched: Schedule, style: str, csv_path: str, microbatch_size: int = 1) -> str:
    """The TOML fragment for torchtitan's job config that runs `csv_path` as this schedule."""
    p, S, m = sched.num_ranks, sched.num_stages, sched.num_microbatches
    cls = schedule_class(sched, style)
    params = ", ".join(f"{k}={v}" for k, v in dict(sched.params).items())
    where = {
        SINGLE: "one stage per rank (stage r on rank r)",
        LOOP: f"the looped placement: rank r holds stages r, r + {p}, ... ({S // p} per rank)",
        V: f"a V: rank r holds stages r and {2 * p - 1} - r",
    }[style]
    lines = [
        f'# torchtitan settings for the pipec schedule "{sched.name}" ({params}), written by',
        f"# `pipec export --to torchtitan` (torchtitan {TORCHTITAN_VERSION}, torch 2.13): merge into the job's TOML.",
        "#",
        f"# Placement: {where}.",
        "# torchtitan builds each rank's stages from pipeline_parallel_schedule, not from the CSV:",
        f'# keep "{cls}" (or another class of the same placement style), or step() crashes.',
        "# Micro-batches: torchtitan runs local_batch_size / pipeline_parallel_microbatch_size of them,",
        f"# and the CSV has m = {m}: keep local_batch_size = {m} * pipeline_parallel_microbatch_size.",
    ]
    if style == LOOP and S != 2 * p:
        lines += [
            f"# {S // p} stages per rank: torchtitan builds 2 per rank unless told, so set",
            f"# module_fqns_per_model_part to the {S} stages' module names (or pipeline_parallel_layers_per_stage",
            f"# so that there are {S} stages).",
        ]
    lines += [
        "# torchtitan 0.3.0 cannot run pipeline parallelism with torch 2.13: use 0.2.2.",
        "",
        "[parallelism]",
        f"pipeline_parallel_degree = {p}",
        f'pipeline_parallel_schedule = "{cls}"',
        f"pipeline_parallel_schedule_csv = {_toml_string(csv_path)}",
        f"pipeline_parallel_microbatch_size = {microbatch_size}",
        "",
        "[training]",
        f"local_batch_size = {m * microbatch_size}",
        "",
    ]
    return "\n".join(lines)


def _toml_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def export_torchtitan(
    sched: Schedule, csv_path: str, *, comms: bool = False, microbatch_size: int = 1, drop_memops: bool = False
) -> TorchtitanExport:
    """The compute-only CSV and torchtitan's settings for a checked schedule. Raises E621 for the
    compute+comms format, E615 and E616 for token slices and variable lengths, E620 for a placement
    torchtitan cannot build, and the torch CSV writer's errors (E610 to E612, E614 for memory ops unless
    `drop_memops`) for what torch's runtime cannot run; E217 first for a stage graph (torchtitan builds and
    runs a chain of stages)."""
    refuse_graph_for_torch(sched, tool="the torchtitan export")
    if comms:
        raise error(
            "E621",
            "torchtitan loads only the compute-only CSV (it calls torch's `_load_csv` without "
            "format='compute_comms', and the compute-only reader refuses SEND and RECV actions)",
            None,
            sched.source,
            ("drop --comms: torch adds the sends and receives to a compute-only CSV itself",),
        )
    if microbatch_size < 1:
        raise ValueError(f"microbatch_size must be at least 1, not {microbatch_size}")
    check_unsliced(sched)  # E615, E616 before the placement: no torchtitan setting makes a slice
    style = placement_style(sched)
    csv = export_csv(sched, drop_memops=drop_memops)
    return TorchtitanExport(csv, settings(sched, style, csv_path, microbatch_size), style, schedule_class(sched, style))


def output_paths(output: str) -> tuple[str, str]:
    """`-o OUT` (or `OUT.csv`, or `OUT.toml`): the CSV at OUT.csv and the settings at OUT.toml."""
    stem, ext = os.path.splitext(output)
    if ext not in (".csv", ".toml"):
        stem = output
    return stem + ".csv", stem + ".toml"
