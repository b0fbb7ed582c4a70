"""The plan's files and printed text: the `.pipe` (or the library schedule's name and -D values), the
partition file (the one writer, `pipec.formats.partition_files.partition_doc`), the `pipec run` command,
Megatron-LM's and torchtitan's settings, the Pareto picture and the JSON document. Why a module of its own:
`pipec plan` prints and writes what this makes; nothing here prints."""

from __future__ import annotations

import math
import os
import shlex
from dataclasses import dataclass, field

from pipec.ir.units import fmt_bytes
from pipec.planner.report import (
    Why,
    comparison,
    explain,
    gain,
    megatron_settings,
    pareto,
    point_json,
    report_lines,
    torchtitan_settings,
)
from pipec.planner.search import Inputs, Plan, Point


@dataclass
class Outputs:
    """The plan with its inputs, and what is made from them (the why figures, once)."""

    plan: Plan
    inputs: Inputs
    model: str | None = None
    table_path: str | None = None
    whys: dict[str, Why] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, pt in comparison(self.plan):
            if pt is not None:
                self.whys[name] = explain(self.plan.problems[pt.candidate], pt.split)

    @property
    def pb(self):
        return self.plan.problems[self.plan.best.candidate]

    def named(self, pt: Point) -> bool:
        """True when a point's schedule is a library schedule as it stands (named with -D), False when it
        needs a written `.pipe` (memory ops chosen per stage)."""
        from pipec.planner.synthesized import SYNTH

        return pt.candidate.memop == "" and pt.candidate.schedule != SYNTH

    @property
    def library_named(self) -> bool:
        return self.named(self.plan.best)

    def limit_text(self) -> str:
        lim = [x for x in self.inputs.limit if not math.isnan(x)]
        if not lim:
            return "none"
        return fmt_bytes(lim[0]) if len(set(lim)) == 1 else ", ".join(fmt_bytes(x) for x in self.inputs.limit)

    def target(self, folder: str | None, pt: Point | None = None, prefix: str = "plan") -> list[str]:
        pt = pt or self.plan.best
        cand = pt.candidate
        if self.named(pt):
            out = [cand.schedule, "-D", f"p={self.inputs.p}", "-D", f"m={cand.m}"]
            return out + (["-D", f"v={cand.v}"] if cand.v else [])
        return [os.path.join(folder or ".", f"{prefix}.pipe")]

    def run_command(self, folder: str | None, pt: Point | None = None, prefix: str = "plan") -> str:
        name = "partition.json" if prefix == "plan" else f"{prefix}-partition.json"
        part = os.path.join(folder or ".", name)
        target = self.target(folder, pt, prefix)
        cmd = ["pipec", "run", *target, "--model", self.model or "MODEL.py", "--partition", part]
        return " ".join(shlex.quote(x) for x in cmd + ["--nproc", str(self.inputs.p), "--check"])

    def launch_order(self) -> str:
        """When the plan reorders the ranks: which of the given ranks each pipeline rank runs on (the
        launcher's rank order, e.g. the hosts' order for torchrun or Megatron-LM), else ""."""
        order = self.plan.best.candidate.ranks
        if not order:
            return ""
        given = ",".join(map(str, order))
        return (
            f"launch order: pipeline ranks 0-{len(order) - 1} on the ranks given (their index in --ranks) {given}: "
            "start the processes in that order (the launcher's rank order, for Megatron-LM and torchtitan too)"
        )

    def partition_doc(self, pt: Point | None = None) -> dict:
        from pipec.formats.partition_files import partition_doc

        best = pt or self.plan.best
        pb = self.plan.problems[best.candidate]
        names = pb.table.names
        stages = [list(names[a:b]) for a, b in zip(best.split.bounds, best.split.bounds[1:])]
        params = {"p": self.inputs.p, **best.candidate.params}
        return partition_doc(
            pb.table,
            best.candidate.schedule if self.named(best) else pb.sched.name,
            params,
            stages,
            placement=list(pb.sched.placement),
            ranks={"speed": pb.speed.tolist(), "memory_limit": _limits(pb.limit.tolist())},  # the pipeline's order
            predicted={
                "step": best.step,
                "memory": list(best.split.memory),
                "lower_bound": self.plan.lower_bound if best is self.plan.best else best.lower_bound,
                "optimal": best is self.plan.best and self.plan.lower_bound >= best.step,
                "layers_per_stage": [b - a for a, b in zip(best.split.bounds, best.split.bounds[1:])],
                "plan": best.candidate.label,
            },
        )

    def pipe_text(self, pt: Point | None = None) -> str:
        from pipec.formats.torch_csv_reader import to_pipe

        pt = pt or self.plan.best
        text = to_pipe(self.plan.problems[pt.candidate].sched)
        head = [
            f"# Written by `pipec plan`: {pt.candidate.label}, the memory ops chosen per stage.",
            f"# Simulated step {pt.step:.6g} s with the split of its partition file; run it with that file.",
        ]
        return "\n".join(head) + "\n" + text

    def write_point(self, folder: str, pt: Point, prefix: str) -> list[str]:
        """The point's `.pipe` (when it needs one) and partition file."""
        from pipec.files import write_text
        from pipec.formats.partition_files import write_json

        out = []
        if not self.named(pt):
            path = os.path.join(folder, f"{prefix}.pipe")
            write_text(path, self.pipe_text(pt))
            out.append(path)
        path = os.path.join(folder, "partition.json" if prefix == "plan" else f"{prefix}-partition.json")
        write_json(path, self.partition_doc(pt))
        out.append(path)
        return out

    def write(self, folder: str) -> list[str]:
        """Every file into `folder` (made if missing); returns their paths."""
        from pipec.files import write_text
        from pipec.formats.partition_files import write_json
        from pipec.planner.figure import write_pareto

        os.makedirs(folder, exist_ok=True)
        out = self.write_point(folder, self.plan.best, "plan")
        for prefix, pt in (("megatron", self.plan.megatron), ("library", self.plan.library)):
            if pt is not None:
                out += self.write_point(folder, pt, prefix)
        mflags, mcannot = megatron_settings(self.plan, self.pb, self.inputs.global_batch)
        path = os.path.join(folder, "megatron.txt")
        text = mflags + "\n" + "".join(f"# cannot express: {x}\n" for x in mcannot)
        write_text(path, text)
        out.append(path)
        ttext, tcsv, tcannot = torchtitan_settings(self.plan, self.pb, self.inputs.global_batch)
        path = os.path.join(folder, "torchtitan.toml")
        write_text(path, "".join(f"# cannot express: {x}\n" for x in tcannot) + ttext)
        out.append(path)
        if tcsv:
            path = os.path.join(folder, "plan.csv")
            write_text(path, tcsv)
            out.append(path)
        out += write_pareto(self.plan, folder)
        path = os.path.join(folder, "plan.json")
        write_json(path, self.to_json(out))
        out.append(path)
        return out

    def lines(self, written: list[str]) -> list[str]:
        folder = os.path.dirname(written[0]) if written else None
        lines = report_lines(self.plan, self.whys, self.limit_text())
        lines.append("")
        lines.append("run it: " + self.run_command(folder))
        if self.launch_order():
            lines.append("  " + self.launch_order())
        mflags, mcannot = megatron_settings(self.plan, self.pb, self.inputs.global_batch)
        lines.append("Megatron-LM: " + mflags)
        lines += [f"  Megatron-LM cannot express {x}" for x in mcannot]
        _, _, tcannot = torchtitan_settings(self.plan, self.pb, self.inputs.global_batch)
        lines.append("torchtitan: " + ("torchtitan.toml" if written else "with -o DIR, torchtitan.toml"))
        lines += [f"  torchtitan cannot express {x}" for x in tcannot]
        if written:
            lines.append("wrote " + ", ".join(written))
        return lines

    def to_json(self, written: list[str] = ()) -> dict:
        folder = os.path.dirname(written[0]) if written else None
        mflags, mcannot = megatron_settings(self.plan, self.pb, self.inputs.global_batch)
        ttext, _, tcannot = torchtitan_settings(self.plan, self.pb, self.inputs.global_batch)
        doc = {
            "p": self.inputs.p,
            "global_batch": self.inputs.global_batch,
            "memory_limit": _limits(self.inputs.limit),
            "speed": list(self.inputs.speed),
            "seconds": self.plan.seconds,
            "lower_bound": self.plan.lower_bound,
            "gap": self.plan.best.step / self.plan.lower_bound - 1 if self.plan.lower_bound > 0 else None,
        }
        for (name, pt), key in zip(comparison(self.plan), ("plan", "megatron", "library")):
            doc[key] = point_json(pt, gain(self.plan, pt) if key != "plan" else math.nan)
            w = self.whys.get(name)
            if doc[key] is not None and w is not None:
                doc[key]["why"] = {"bubble": w.bubble, "imbalance": w.imbalance, "recompute": w.recompute}
        doc["pareto"] = [point_json(p) for p in pareto(self.plan.points)]
        doc["candidates"] = len(self.plan.points)
        doc["not_tried"] = list(self.plan.skipped)
        doc["run"] = self.run_command(folder)
        doc["launch_order"] = self.launch_order() or None
        for key, pt in (("megatron", self.plan.megatron), ("library", self.plan.library)):
            if doc[key] is not None:
                doc[key]["run"] = self.run_command(folder, pt, key)
        doc["megatron_lm"] = {"flags": mflags, "cannot": mcannot}
        doc["torchtitan"] = {"toml": ttext, "cannot": tcannot}
        doc["files"] = list(written)
        return doc


def _limits(limit) -> list[float | None]:
    return [None if math.isnan(x) else x for x in limit]
