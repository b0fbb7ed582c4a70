"""What `pipec run` prints: a line per step, and the --check summary against the reference."""

from __future__ import annotations

import json
import math
import os
import sys


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


def step_line(step: int, steps: int, loss: float | None, seconds: float, errors: tuple | None = None) -> str:
    width = len(str(steps))
    text = f"step {step + 1:>{width}}/{steps}: loss {_num(loss)}, {seconds:.3f} s"
    if errors is not None:
        loss_err, grad_err, param_err = errors
        text += f"  | rel err vs reference: loss {loss_err:.1e}, grads {grad_err:.1e}, params {param_err:.1e}"
    return text


def _num(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isinf(x)) else f"{x:.6f}"


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
