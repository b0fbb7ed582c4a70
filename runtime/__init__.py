"""The PyTorch executor of a Program (installed as `pipec.runtime`); the only part of pipec that imports torch.

    from pipec.runtime import Runner, LocalPipeline, load_model

Modules: `model` (the model-file contract), `microbatch` (splitting a batch), `shapes` (tensor specs and
the first-step handshake), `comm` (torch.distributed point-to-point), `stage` (forward, backward, weight
gradient of one stage), `split` (split backward), `executor` (one rank's instruction loop), `runner` (the
Python API), `local` (all ranks in one process), `reference` (the single-process reference), `monitor`
(fault handling), `measure` (events to a Timeline), `report` (printed lines), `affinity` (CPU binding of
gloo ranks), `launch` (the torchrun entry point), `run` (`pipec run`), `links` (emulated links between
datacenters), `schedule_api` (a torch-native schedule over the user's own modules), `split_model` (one
nn.Module into stages by module names), `profile` (`pipec profile`), `overhead` and `insitu` (what it
measures in the executor and in steps of the schedule), `spawned` (its local worker processes). Names are
imported lazily, so `import pipec.runtime` alone imports no torch.
"""

from __future__ import annotations

_EXPORTS = {
    "Runner": "pipec.runtime.runner",
    "StepResult": "pipec.runtime.runner",
    "LocalPipeline": "pipec.runtime.local",
    "load_model": "pipec.runtime.model",
    "Model": "pipec.runtime.model",
    "Reference": "pipec.runtime.reference",
    "PipelineError": "pipec.runtime.errors",
    "PipelineSchedule": "pipec.runtime.schedule_api",
    "clip_grad_norm_": "pipec.runtime.schedule_api",
    "stage_indices": "pipec.runtime.schedule_api",
    "propose_split": "pipec.runtime.split_model",
    "model_fingerprint": "pipec.runtime.split_model",
    "split_with_pipeline": "pipec.runtime.split_model",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pipec.runtime' has no attribute {name!r}")
