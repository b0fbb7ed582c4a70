"""The PyTorch executor of a Program (installed as `pipec.runtime`); the only part of pipec that imports torch.

    from pipec.runtime import Runner, LocalPipeline, load_model

Rooms: `exec/` runs one rank's instruction stream (executor: one table, opcode -> method; stage, comm,
shapes, saved tensors, slices, split backward, replicas, emulated links); `model/` is the user's model (the
model-file contract, `split` of one nn.Module into stages by module names, partition files); `job/` is
`pipec run` and torchrun's entry point (launch, monitor, checkpoint, measure, report); `profile/` is
`pipec profile` (stages: per-stage ops and bytes; slices: token slices and their fit; links: the gloo link;
collectives: the data-parallel collectives, fitted with the simulator's ring formula; insitu, overhead,
layers; common: what they share). At this level: the Python API (`runner` with its two option values,
`StageOptions` and `Transport`; `local`, `reference`, `pipeline_schedule`, whose `eval` runs a
forward-only Program) and `errors`. Names are imported lazily, so `import pipec.runtime` alone imports no
torch.
"""

from __future__ import annotations

_EXPORTS = {
    "Runner": "pipec.runtime.runner",
    "StepResult": "pipec.runtime.runner",
    "StageOptions": "pipec.runtime.runner",
    "Transport": "pipec.runtime.runner",
    "LocalPipeline": "pipec.runtime.local",
    "load_model": "pipec.runtime.model.contract",
    "Model": "pipec.runtime.model.contract",
    "Reference": "pipec.runtime.reference",
    "PipelineError": "pipec.runtime.errors",
    "PipelineSchedule": "pipec.runtime.pipeline_schedule",
    "clip_grad_norm_": "pipec.runtime.pipeline_schedule",
    "stage_indices": "pipec.runtime.pipeline_schedule",
    "propose_split": "pipec.runtime.model.split",
    "model_fingerprint": "pipec.runtime.model.split",
    "split_with_pipeline": "pipec.runtime.model.split",
    "split_model": "pipec.runtime.model.split",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pipec.runtime' has no attribute {name!r}")
