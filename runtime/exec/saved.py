"""What autograd saves, per micro-batch and stage: counted in bytes, moved to the host and back.

Every tensor autograd saves during a forward (a FWD, or the RECOMPUTE that reruns one) goes through
torch's saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`) into the `Holder` of its
(micro-batch, stage); the graph keeps only an index into the holder. So the holder owns the saved
activations: it can count them, OFFLOAD them to host memory and RELOAD them, and the graph's unpack
returns whatever the holder holds then (the device tensor after a RELOAD). The holder is released when
the backward is done: after BWD without split backward (autograd frees the graph), after WGRAD with it
(BWD keeps the graph for WGRAD: what a holder holds between the two is the `wsaved` part).

What counts: activations only. Parameters and buffers (the Linear's weight, saved for its input
gradient) and the first stage's inputs (the step's data, which the runtime holds for the whole step
anyway) pass through the hooks untouched and uncounted. Each storage is counted once per rank, however
many saved tensors view it and however many holders share it, at its whole size (a view keeps its whole
storage alive).

Two pools per rank, `device` and `host`; the peaks of each over a step are what `pipec run --memory`
prints. On a CPU device the host pool is the same memory: OFFLOAD and RELOAD move the accounting only
(nothing is copied). On CUDA, OFFLOAD copies each saved tensor into pinned host memory on a side stream
(`non_blocking`, after the forward's kernels), RELOAD copies it back on that stream, and the BWD that
needs it waits for the copy (`ready`); the device bytes leave the pool when the OFFLOAD is issued. On
CUDA `Pool.cuda_peak` is also `torch.cuda.max_memory_allocated` over the step (all of the device's
memory, not only saved tensors). That path has not run on a GPU here.

Without measuring and without OFFLOAD in the Program there is no Pool and no hook: the forward runs as
plain autograd (the hooks cost about a microsecond per saved tensor).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from pipec.runtime.errors import PipelineError

DEVICE, HOST = "device", "host"


@dataclass(frozen=True)
class Peaks:
    """A rank's peak saved bytes over one step, per pool; `cuda`: torch.cuda.max_memory_allocated over the
    step (None off CUDA)."""

    device: int
    host: int
    cuda: int | None = None


class Holder:
    """The saved tensors of one (micro-batch, stage): the graph's unpack hook looks them up by index."""

    def __init__(self, mb: int, stage: int) -> None:
        self.mb, self.stage = mb, stage
        self.tensors: list[torch.Tensor | None] = []
        self.where = DEVICE
        self.event: Any = None  # CUDA: the copy a RELOAD started, which the BWD waits for
        self.extra: list[torch.Tensor] = []  # tensors counted but not saved by autograd (a recomputed input)


class Pool:
    """One rank's holders and the bytes they keep, per pool (see the module docstring)."""

    def __init__(self) -> None:
        self.holders: dict[tuple[int, int], Holder] = {}
        self.refs: dict[tuple[str, int], list[int]] = {}  # (pool, storage pointer) -> [count, bytes]
        self.bytes = {DEVICE: 0, HOST: 0}
        self.peak = {DEVICE: 0, HOST: 0}
        self.cuda_device: torch.device | None = None
        self.stream: Any = None  # CUDA: the side stream offload and reload copies run on

    # ---- accounting -------------------------------------------------------------------------------
    def _add(self, pool: str, t: torch.Tensor, sign: int) -> None:
        st = t.untyped_storage()
        key = (pool, st.data_ptr())
        ref = self.refs.get(key)
        if sign > 0:
            if ref is None:
                self.refs[key] = [1, st.nbytes()]
                self.bytes[pool] += st.nbytes()
                self.peak[pool] = max(self.peak[pool], self.bytes[pool])
            else:
                ref[0] += 1
        elif ref is not None:
            ref[0] -= 1
            if ref[0] == 0:
                del self.refs[key]
                self.bytes[pool] -= ref[1]

    def _tensors(self, h: Holder) -> Iterator[torch.Tensor]:
        yield from (t for t in h.tensors if t is not None)
        yield from h.extra

    def reset_peaks(self) -> None:
        """Start a step: the peaks are those of what is held from now on."""
        self.peak = dict(self.bytes)
        if self.cuda_device is not None:
            torch.cuda.reset_peak_memory_stats(self.cuda_device)

    def peaks(self) -> Peaks:
        cuda = None
        if self.cuda_device is not None:
            cuda = int(torch.cuda.max_memory_allocated(self.cuda_device))
        return Peaks(self.peak[DEVICE], self.peak[HOST], cuda)

    def held(self, mb: int, stage: int) -> int:
        """Bytes the holder of (mb, stage) counts now, alone (its storages, each once)."""
        h = self.holders.get((mb, stage))
        if h is None:
            return 0
        seen: dict[int, int] = {}
        for t in self._tensors(h):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())

    # ---- the hooks --------------------------------------------------------------------------------
    def holder(self, mb: int, stage: int) -> Holder:
        h = self.holders.get((mb, stage))
        if h is None:
            h = self.holders[(mb, stage)] = Holder(mb, stage)
        return h

    @contextmanager
    def saving(self, mb: int, stage: int, exclude: set[int]) -> Iterator[Holder]:
        """Within this block, what autograd saves goes to (mb, stage)'s holder; tensors whose storage is
        in `exclude` (parameters, buffers, the step's inputs) are saved as they are, uncounted."""
        h = self.holder(mb, stage)
        if h.where != DEVICE:
            raise PipelineError(f"micro-batch {mb} of stage {stage} runs a forward while its activations are offloaded")

        def pack(t: torch.Tensor) -> Any:
            if t.untyped_storage().data_ptr() in exclude or t.device.type == "meta":
                return t
            if t.is_cuda and self.cuda_device is None:
                self.cuda_device = t.device
            h.tensors.append(t)
            self._add(DEVICE, t, +1)
            return len(h.tensors) - 1

        def unpack(x: Any) -> torch.Tensor:
            if isinstance(x, torch.Tensor):
                return x
            t = h.tensors[x] if x < len(h.tensors) else None
            if t is None:
                raise PipelineError(
                    f"micro-batch {mb} of stage {stage}: a saved activation was used after its holder was released"
                )
            if h.where == HOST and t.device.type == "cpu" and self.cuda_device is not None:
                raise PipelineError(f"micro-batch {mb} of stage {stage}: its backward needs a RELOAD after its OFFLOAD")
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield h

    def keep(self, mb: int, stage: int, tensors: Iterable[torch.Tensor], exclude: set[int]) -> list[int]:
        """Hold `tensors` in (mb, stage)'s holder without autograd saving them (a recomputed FWD's input), so
        that OFFLOAD and RELOAD move them too; the positions among `tensors` it holds (`kept` gives their
        current copies, the device ones after a RELOAD)."""
        h = self.holder(mb, stage)
        held = []
        for i, t in enumerate(tensors):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in exclude:
                h.extra.append(t)
                self._add(DEVICE, t, +1)
                held.append(i)
        return held

    def kept(self, mb: int, stage: int) -> list[torch.Tensor]:
        """What `keep` holds for (mb, stage), where it is now; a RELOAD's copy is waited for (`ready`)."""
        self.ready(mb, stage)
        return list(self.holders[(mb, stage)].extra)

    def release(self, mb: int, stage: int) -> None:
        """The backward of (mb, stage) is done: its saved tensors go (the graph holds only indices)."""
        h = self.holders.pop((mb, stage), None)
        if h is None:
            return
        for t in h.tensors:
            if t is not None:
                self._add(h.where, t, -1)
        for t in h.extra:
            self._add(h.where, t, -1)
        h.tensors.clear()
        h.extra.clear()

    # ---- offload and reload -----------------------------------------------------------------------
    def offload(self, mb: int, stage: int) -> None:
        """OFFLOAD: start moving (mb, stage)'s saved tensors to host memory (see the module docstring)."""
        h = self.holders.get((mb, stage))
        if h is None or h.where != DEVICE:
            raise PipelineError(f"OFFLOAD {mb} {stage}: nothing saved on the device for it")
        if self.cuda_device is not None:
            stream = self._side()
            stream.wait_stream(torch.cuda.current_stream(self.cuda_device))
            with torch.cuda.stream(stream):
                for held in (h.tensors, h.extra):
                    for i, t in enumerate(held):
                        if t is not None and t.is_cuda:
                            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
                            host.copy_(t, non_blocking=True)
                            t.record_stream(stream)  # its memory is reused only once the copy is done
                            self._add(DEVICE, t, -1)
                            self._add(HOST, host, +1)
                            held[i] = host
        else:  # a CPU device: the host is the same memory, so the bytes change pools and nothing moves
            for t in (*h.tensors, *h.extra):
                if t is not None:
                    self._add(DEVICE, t, -1)
                    self._add(HOST, t, +1)
        h.where = HOST

    def reload(self, mb: int, stage: int) -> None:
        """RELOAD: start moving (mb, stage)'s saved tensors back to the device; `ready` waits for it."""
        h = self.holders.get((mb, stage))
        if h is None or h.where != HOST:
            raise PipelineError(f"RELOAD {mb} {stage}: nothing of it is offloaded")
        if self.cuda_device is not None:
            stream = self._side()
            with torch.cuda.stream(stream):
                for held in (h.tensors, h.extra):
                    for i, t in enumerate(held):
                        if t is not None and not t.is_cuda:
                            dev = t.to(self.cuda_device, non_blocking=True)
                            self._add(HOST, t, -1)
                            self._add(DEVICE, dev, +1)
                            held[i] = dev
                h.event = torch.cuda.Event()
                h.event.record(stream)
        else:
            for t in (*h.tensors, *h.extra):
                if t is not None:
                    self._add(HOST, t, -1)
                    self._add(DEVICE, t, +1)
        h.where = DEVICE

    def ready(self, mb: int, stage: int) -> None:
        """Before the BWD of (mb, stage): its activations are on the device (a RELOAD's copy is waited for)."""
        h = self.holders.get((mb, stage))
        if h is None:
            return
        if h.where != DEVICE:
            raise PipelineError(f"the backward of micro-batch {mb} on stage {stage} runs while it is offloaded")
        if h.event is not None:
            current = torch.cuda.current_stream(self.cuda_device)
            current.wait_event(h.event)
            for t in (*h.tensors, *h.extra):
                if t is not None and t.is_cuda:
                    t.record_stream(current)
            h.event = None

    def _side(self) -> Any:
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.cuda_device)
        return self.stream


def storages(tensors: Iterable[Any]) -> set[int]:
    """The storage pointers of the tensors among `tensors` (for a Pool's `exclude`)."""
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)}


def module_storages(module: torch.nn.Module) -> set[int]:
    """A module's parameters and buffers: saved by autograd, but state, not activations."""
    return storages(module.parameters()) | storages(module.buffers())


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages among `tensors`."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def state_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Parameters, their gradients and the optimizer's state (after a step has created it)."""
    params = [p for p in module.parameters()]
    grads = [p.grad for p in params if p.grad is not None]
    opt: list[torch.Tensor] = []
    if optimizer is not None:
        for st in optimizer.state.values():
            opt += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return tensor_bytes(params) + tensor_bytes(grads) + tensor_bytes(opt)


# ---- a run's measured peaks, gathered on rank 0 -------------------------------------------------------


def publish_peaks(store: Any, rank: int, world: int, peaks: Peaks | None, path: str, timeout: float) -> None:
    """Every rank's last-step peaks through the job's c10d store; rank 0 writes them, one per global rank,
    as JSON to `path` (for `pipec run --memory`, which prints them against the prediction)."""
    import json
    from datetime import timedelta

    doc = None if peaks is None else {"device": peaks.device, "host": peaks.host, "cuda": peaks.cuda}
    store.set(f"pipec/memory/{rank}", json.dumps(doc))
    if rank != 0:
        return
    keys = [f"pipec/memory/{r}" for r in range(world)]
    store.wait(keys, timedelta(seconds=timeout))
    with open(path, "w") as f:
        json.dump([json.loads(store.get(k).decode()) for k in keys], f)
