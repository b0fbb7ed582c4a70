"""Compiled stages (issue 43, part 3; `pipec run --compile`, `PipelineSchedule(compile=True)`): each stage's
forward through torch.compile, its backward AOTAutograd's compiled backward, split backward included.

The module's own `forward` is replaced by its compiled version on the instance, so the module keeps its
parameter names (the reference compares by name), its hooks run as before around the compiled region
(FSDP2's unshard and reshard among them), and the shape exchange's forward on meta tensors takes the plain
forward (compiling for meta tensors would cost a compilation and buy nothing). With split backward, BWD
and WGRAD of a compiled stage are pipec.runtime.exec.split_backward's `whole` case: one compiled backward at
B for the input and the weight gradients, the weight gradients accumulated at W.

CUDA graphs (`--cuda-graphs`, issue 43 part 4): on CUDA the stage is compiled with mode "reduce-overhead",
inductor's CUDA-graph trees: the compiled forward and backward are captured once per shape and replayed,
parameters static, each received activation (a slot of pipec.runtime.exec.buffers, the same memory step after
step) copied into the graph's static input. `replays` counts the graph replays (`count_replays` wraps
torch's) and inductor's skips (a graph it ran without capture).
"""

from __future__ import annotations

from typing import Any

import torch

MODES = {False: None, True: "reduce-overhead"}  # cuda_graphs -> torch.compile mode
BACKEND = "inductor"  # torch.compile's backend (benchmarks/compile_stages.py --smoke sets "aot_eager": seconds)


def needs_cuda(device: torch.device) -> str | None:
    """Why CUDA graphs cannot run on `device` (None: they can)."""
    if device.type != "cuda":
        return f"CUDA graphs need CUDA, and this run's tensors are on {device.type}"
    if not torch.cuda.is_available():
        return "CUDA graphs need CUDA, and torch sees no GPU here"
    return None


def compile_module(module: torch.nn.Module, cuda_graphs: bool = False, backend: str | None = None) -> None:
    """Replace `module.forward` by its torch.compile'd version (meta tensors take the plain forward)."""
    if getattr(module, "_pipec_compiled", False):
        return
    plain = module.forward
    fast = torch.compile(plain, mode=MODES[bool(cuda_graphs)], backend=backend or BACKEND)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            return plain(*args, **kwargs)
        return fast(*args, **kwargs)

    module.forward = forward
    module._pipec_compiled = True


def compile_stages(stages: dict[int, Any], cuda_graphs: bool = False, backend: str | None = None) -> None:
    """Compile every stage's module (pipec.runtime.exec.stage.Stage), marking each compiled for split backward
    (`backend`: torch.compile's, default `BACKEND`)."""
    for st in stages.values():
        compile_module(st.module, cuda_graphs, backend)
        st.compiled = True


_REPLAYS = [0]


def count_replays() -> None:
    """Count every CUDA-graph replay of this process from now on (torch keeps no count: `CUDAGraph.replay`,
    which inductor's CUDA-graph trees call, wrapped once)."""
    graph = torch.cuda.CUDAGraph
    if getattr(graph.replay, "_pipec_counted", False):
        return
    plain = graph.replay

    def replay(self: Any) -> Any:
        _REPLAYS[0] += 1
        return plain(self)

    replay._pipec_counted = True
    graph.replay = replay


def replays() -> tuple[int, int]:
    """(CUDA-graph replays counted since `count_replays`, the compiled graphs inductor ran without CUDA graphs)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover
        return _REPLAYS[0], 0
    return _REPLAYS[0], int(counters.get("inductor", {}).get("cudagraph_skips", 0))
