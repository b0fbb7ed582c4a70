"""Checkpoints of a pipeline job with torch.distributed.checkpoint (DCP), complete or absent.

Layout of a checkpoint folder DIR:

    DIR/step-000010/     one DCP checkpoint: every rank's stages (parameters and optimizer state, keyed
                         by stage and parameter name), each rank's RNG state, and the job's metadata
    DIR/latest           the name of the newest complete checkpoint ("step-000010")

A save writes `step-N.partial` (all ranks, collectively), waits for every rank, then rank 0 renames it to
`step-N` and replaces `latest` atomically: a job killed during a save leaves `latest` naming the previous
checkpoint, and the partial folder is removed by the next save or resume. Keys name stages, not ranks, so
a checkpoint taken under one schedule resumes under any schedule with the same stages; one with other
stages (or other parameter names) is refused with a message. Training is deterministic given the step
(the model file's `batch(step)` gives the data of each step), so the step is the data position.

DIR must be one folder that every rank can read and write (a shared file system across nodes).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import torch

from pipec.runtime.errors import PipelineError

LATEST = "latest"
FORMAT = "pipec-checkpoint 1"


@dataclass(frozen=True)
class Restored:
    step: int  # steps done when the checkpoint was taken: training resumes at this step
    path: str


def _name(step: int) -> str:
    return f"step-{step:06d}"


def _state(runner, steps_done: int) -> dict:
    """What this rank contributes: its stages' model and optimizer state, its RNG, the job's metadata."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state: dict = {
        "meta": {
            "format": FORMAT,
            "step": steps_done,
            "num_stages": runner.program.num_stages,
            "schedule": runner.program.name,
        }
    }
    for s, st in runner.stages.items():
        entry = {"model": get_model_state_dict(st.module)}
        if st.optimizer is not None:
            entry["optim"] = get_optimizer_state_dict(st.module, st.optimizer)
        state[f"stage{s}"] = entry
    state[_rng_key(runner)] = {"cpu": torch.get_rng_state()}
    return state


def _job_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _rng_key(runner) -> str:
    """Each process's RNG state: by Program rank, and replica under data parallelism (the model and
    optimizer keys name stages and parameters; FSDP2's DTensors save each shard once)."""
    replicas = getattr(runner, "replicas", None)
    return f"rng{runner.rank}" + (f"dp{replicas.dp_rank}" if replicas is not None else "")


def _has_key(path: str, key: str) -> bool:
    """Whether the checkpoint holds `key` at its top level (its metadata, no tensor read)."""
    import torch.distributed.checkpoint as dcp

    try:
        names = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001 - unreadable: the load that follows says so
        return True
    return any(n == key or n.startswith(key + ".") for n in names)


def _atomic_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _clean_partials(folder: str) -> None:
    for entry in os.listdir(folder):
        if entry.endswith(".partial"):
            shutil.rmtree(os.path.join(folder, entry), ignore_errors=True)


def save(folder: str, runner, steps_done: int, barrier) -> str:
    """Collectively save every rank's stages after `steps_done` steps; returns the checkpoint's path."""
    import torch.distributed.checkpoint as dcp

    final = os.path.join(folder, _name(steps_done))
    partial = final + ".partial"
    first = _job_rank() == 0  # with data parallelism every replica has a Program rank 0
    if first:
        os.makedirs(folder, exist_ok=True)
        _clean_partials(folder)
    barrier()
    dcp.save(_state(runner, steps_done), checkpoint_id=partial)
    barrier()  # every rank's part is written
    if first:
        shutil.rmtree(final, ignore_errors=True)  # an earlier run's checkpoint of the same step
        os.replace(partial, final)
        _atomic_text(os.path.join(folder, LATEST), _name(steps_done) + "\n")
    barrier()
    return final


def latest(folder: str) -> str | None:
    """The newest complete checkpoint in `folder`, or None."""
    try:
        with open(os.path.join(folder, LATEST)) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    path = os.path.join(folder, name)
    if not name.startswith("step-") or not os.path.isdir(path):
        raise PipelineError(f"{folder}/{LATEST} names {name!r}, which is not a checkpoint in {folder}")
    return path


def restore(folder: str, runner) -> Restored | None:
    """Load the newest complete checkpoint into this rank's stages (collectively); None when there is none."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    path = latest(folder)
    if path is None:
        return None
    meta_only = {"meta": {"format": "", "step": 0, "num_stages": 0, "schedule": ""}}
    try:
        dcp.load(meta_only, checkpoint_id=path)
    except Exception as e:  # noqa: BLE001 - DCP raises many kinds; the message says which file
        raise PipelineError(f"{path}: not a readable pipec checkpoint ({type(e).__name__}: {e})") from None
    meta = meta_only["meta"]
    if meta["format"] != FORMAT:
        raise PipelineError(f"{path}: not a pipec checkpoint (format {meta['format']!r})")
    if meta["num_stages"] != runner.program.num_stages:
        raise PipelineError(
            f"{path} holds {meta['num_stages']} stages (schedule `{meta['schedule']}`), but this program has "
            f"{runner.program.num_stages}: a checkpoint resumes only under a schedule with the same stages"
        )
    state = _state(runner, meta["step"])
    if meta.get("schedule") != runner.program.name or not _has_key(path, _rng_key(runner)):
        # (a checkpoint of another data parallelism names its RNG states by other processes)
        state.pop(_rng_key(runner))  # ranks differ under another schedule: their RNG streams do not carry
    try:
        dcp.load(state, checkpoint_id=path)
    except Exception as e:  # noqa: BLE001
        raise PipelineError(
            f"{path}: cannot load this rank's stages ({type(e).__name__}: {str(e).splitlines()[0][:300]}); "
            "was it written for another model?"
        ) from None
    for s, st in runner.stages.items():
        entry = state[f"stage{s}"]
        set_model_state_dict(st.module, entry["model"])
        if st.optimizer is not None:
            set_optimizer_state_dict(st.module, st.optimizer, entry["optim"])
    if _rng_key(runner) in state:
        torch.set_rng_state(state[_rng_key(runner)]["cpu"])
    runner.steps_done = meta["step"]
    return Restored(meta["step"], path)
