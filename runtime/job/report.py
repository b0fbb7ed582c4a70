"""What `pipec run` reports: one record per step (`StepRecord`), and every other line it shows, each
written once by `Report`: as text on standard output, and, when the run was given a records file (`pipec
run --json` names one), as one JSON object a line there. The text and `--json` are both made from these
records (`read_records`), never by reading the text back.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass


def show(text: str) -> None:
    """Print a line of the run's output. When the reader has gone (`pipec run ... | head`), the rest of the
    output goes to /dev/null and training carries on, rather than a rank failing over a closed pipe."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def header(program, how: str, model_path: str) -> str:
    params = " ".join(f"{k}={v}" for k, v in program.params)
    return (
        f"{program.name} ({params}): {program.num_stages} stages on {program.num_ranks} ranks, "
        f"{program.num_sequences} micro-batches{_slices(program)}, {how}, model {model_path}"
    )


def _slices(program) -> str:
    """`, 4 token slices each` for a sliced Program (its micro-batches are then its sequences)."""
    sl = getattr(program, "slicing", None)
    return f" of {sl.slices} token slices each" if sl is not None and sl.slices > 1 else ""


@dataclass(frozen=True)
class StepRecord:
    """One training step as the run reports it: `step` counts from 1 of `steps`; `loss` is None where no
    rank computed one; `rel_err` (with --check) the largest relative errors of the loss, the gradients and
    the parameters against the single-process reference."""

    step: int
    steps: int
    loss: float | None
    seconds: float
    rel_err: tuple[float, float, float] | None = None

    @staticmethod
    def of(step: int, steps: int, loss: float | None, seconds: float, errors=None) -> StepRecord:
        """The record of step index `step` (from 0); a loss of -inf (no rank had one) is None."""
        if loss is not None and math.isinf(loss):
            loss = None
        errs = None if errors is None else tuple(float(e) for e in errors)
        return StepRecord(step + 1, steps, None if loss is None else float(loss), float(seconds), errs)

    def line(self) -> str:
        """The step's line of text."""
        width = len(str(self.steps))
        loss = "-" if self.loss is None else f"{self.loss:.6f}"
        text = f"step {self.step:>{width}}/{self.steps}: loss {loss}, {self.seconds:.3f} s"
        if self.rel_err is not None:
            loss_err, grad_err, param_err = self.rel_err
            text += f"  | rel err vs reference: loss {loss_err:.1e}, grads {grad_err:.1e}, params {param_err:.1e}"
        return text

    def to_json(self) -> dict:
        """The step as `pipec run --json` gives it (docs/cli.md)."""
        errs = None if self.rel_err is None else dict(zip(("loss", "grads", "params"), self.rel_err))
        return {"step": self.step, "loss": self.loss, "seconds": self.seconds, "rel_err": errs}


class Report:
    """The run's output: each line shown once (`show`), and with a records file each also kept there as
    a JSON line, `{"step": {...}}` for a step and `{"line": TEXT}` for any other line. Rank 0 reports for
    the job; the launcher appends its own lines (`pipec run --memory`) after the workers'."""

    def __init__(self, records: str | None = None) -> None:
        self.records = records

    def line(self, text: str) -> None:
        """Show a line of text (several, joined by newlines, are one record each)."""
        show(text)
        self._keep([{"line": t} for t in text.split("\n")])

    def step(self, record: StepRecord) -> None:
        """Show a step's line, and keep its record."""
        show(record.line())
        self._keep([{"step": record.to_json()}])

    def _keep(self, docs: list[dict]) -> None:
        if self.records is None:
            return
        with open(self.records, "a") as f:
            f.write("".join(json.dumps(d) + "\n" for d in docs))


def read_records(path: str) -> dict:
    """A records file as `pipec run --json` reports it: `steps` (each step's record) and `log` (the run's
    other lines, in order)."""
    steps, log = [], []
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:  # the run ended before it reported anything
        lines = []
    for text in lines:
        doc = json.loads(text)
        if "step" in doc:
            steps.append(doc["step"])
        else:
            log.append(doc["line"])
    return {"steps": steps, "log": log}


class CheckStats:
    """Largest relative errors over the steps: of the loss, and per (stage, tensor name) of the gradients
    and of the parameters after the optimizer step."""

    def __init__(self) -> None:
        self.loss = 0.0
        self.grads: dict[str, float] = {}
        self.params: dict[str, float] = {}
        self.stage_of: dict[str, int] = {}

    def add(self, loss_err: float, grads: dict[tuple[int, str], float], params: dict[tuple[int, str], float]) -> None:
        self.loss = max(self.loss, loss_err)
        for table, errs in ((self.grads, grads), (self.params, params)):
            for (s, name), e in errs.items():
                key = f"stage {s} `{name}`"
                self.stage_of[key] = s
                table[key] = max(table.get(key, 0.0), e)

    def to_json(self) -> str:
        return json.dumps({"loss": self.loss, "grads": self.grads, "params": self.params, "stage_of": self.stage_of})

    def merge_json(self, text: str) -> None:
        doc = json.loads(text)
        self.loss = max(self.loss, doc["loss"])
        for table, other in ((self.grads, doc["grads"]), (self.params, doc["params"])):
            for k, e in other.items():
                table[k] = max(table.get(k, 0.0), e)
        self.stage_of.update(doc["stage_of"])

    def worst(self) -> float:
        return max([self.loss, *self.grads.values(), *self.params.values()])

    def lines(self, tol: float, steps: int) -> list[str]:
        out = [f"check against a single-process reference (same weights, same data), {steps} step(s):"]
        out.append(f"  loss                 max rel err {self.loss:.2e}")
        for what, table in (("gradient", self.grads), ("parameter", self.params)):
            for s in sorted(set(self.stage_of.values())):
                mine = {k: e for k, e in table.items() if self.stage_of[k] == s}
                if mine:
                    k = max(mine, key=mine.get)
                    worst = f" (largest: `{k.split('`')[1]}`)" if mine[k] > 0 else ""
                    out.append(
                        f"  stage {s:<3} {what + 's':<10} max rel err {mine[k]:.2e} over {len(mine)} tensors{worst}"
                    )
        w = self.worst()
        verdict = "OK" if w <= tol else "FAILED"
        out.append(f"{verdict}: largest relative error {w:.2e} (tolerance {tol:g})")
        return out


def buffer_lines(docs: list[dict]) -> list[str]:
    """The run's receive-buffer lines from each rank's {"made": per step, "how": Slots.describe(), "replays": ...}
    (pipec.runtime.exec.buffers): the buffers created per step over all ranks, then each rank's pools."""
    steps = max((len(d["made"]) for d in docs), default=0)
    per = [sum(d["made"][k] for d in docs if k < len(d["made"])) for k in range(steps)]
    if not per:
        return []
    text = f"receive buffers created: step 1: {per[0]}"
    if steps > 1:
        later = per[1:]
        span = "step 2" if steps == 2 else f"steps 2-{steps}"
        text += f", {span}: {sum(later)}" + ("" if not any(later) else f" ({later})")
    lines = [text + " (all ranks)"]
    lines += [f"  rank {r}: {d['how']}" for r, d in enumerate(docs)]
    graphs = [d["replays"] for d in docs if d.get("replays") is not None]
    if graphs:
        lines.append(
            f"CUDA graphs: {sum(g[0] for g in graphs)} replays, {sum(g[1] for g in graphs)} graphs run without "
            "capture (inductor's skips), all ranks"
        )
    return lines
