"""The shared-memory transport (pipec.runtime.exec.shm): which messages a channel carries, when it is
chosen, that it computes bitwise what gloo computes, and that a peer dying mid-step is named, not waited
on, with nothing left in /dev/shm."""

from __future__ import annotations

import json
import os
import re
from datetime import timedelta

import pytest

pytest.importorskip("torch")

import torch  # noqa: E402
from runtime_harness import launch  # noqa: E402

from pipec import options  # noqa: E402
from pipec.runtime.errors import CommError  # noqa: E402
from pipec.runtime.exec import shm  # noqa: E402
from pipec.runtime.exec.comm import ACT, GRAD  # noqa: E402

MLP_ENV = {"MLP_WIDTH": "16", "MLP_DEPTH": "8", "MLP_BATCH": "16", "MLP_DTYPE": "float64"}
needs_shm = pytest.mark.skipif(shm.supported() is not None, reason=f"shared memory: {shm.supported()}")


def leftovers(results: list) -> list[str]:
    """What the job's own ranks left in /dev/shm: the other tests' jobs, running beside this one on the
    same host, have channels there of their own for a moment (shm is the default transport)."""
    pids = {r.pid for r in results}
    names = os.listdir(shm.DIR) if os.path.isdir(shm.DIR) else []
    return [n for n in names if (m := shm.LEFTOVER.fullmatch(n)) and int(m.group(1)) in pids]


def test_a_channel_carries_every_message_between_its_two_ranks_and_no_other():
    """A V placement (ZB-V, p=2): rank 0 holds stages 0 and 3, rank 1 stages 1 and 2."""
    place = (0, 1, 1, 0)
    assert shm.channel_keys(place, 2, 0, 1) == [(ACT, 0, 0), (ACT, 1, 0), (GRAD, 0, 3), (GRAD, 1, 3)]
    assert shm.channel_keys(place, 2, 1, 0) == [(GRAD, 0, 1), (GRAD, 1, 1), (ACT, 0, 2), (ACT, 1, 2)]
    # stage 1 -> 2 is a local hand-off: in no channel
    assert all(k[2] != 1 or k[0] != ACT for k in shm.channel_keys(place, 2, 1, 0))


class DictStore:
    """The c10d store's calls `choose` makes, over a dict (the other ranks have published already)."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values = dict(values)

    def set(self, key: str, value: str) -> None:
        self.values[key] = value

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        if not all(k in self.values for k in keys):
            raise RuntimeError("Socket Timeout")

    def get(self, key: str) -> bytes:
        return self.values[key].encode()


def test_the_transport_flag_offers_what_the_runtime_chooses_from():
    assert options.TRANSPORTS == shm.CHOICES


@needs_shm
def test_shm_is_chosen_on_one_host_with_cpu_tensors_and_gloo_otherwise():
    cpu = torch.device("cpu")
    here = DictStore({"shm/host/1": shm.host_id()})
    assert shm.choose("auto", cpu, False, here, 0, 2, 1.0) == "shm"
    assert shm.choose("gloo", cpu, False, here, 0, 2, 1.0) == "gloo"
    assert shm.choose("auto", cpu, True, here, 0, 2, 1.0) == "gloo"  # emulated links stay on gloo
    assert shm.choose("auto", torch.device("cuda"), False, here, 0, 2, 1.0) == "gloo"
    elsewhere = DictStore({"shm/host/1": "another-host/0"})
    assert shm.choose("auto", cpu, False, elsewhere, 0, 2, 1.0) == "gloo"
    with pytest.raises(CommError, match="rank 1 is on another host"):
        shm.choose("shm", cpu, False, elsewhere, 0, 2, 1.0)
    with pytest.raises(CommError, match=r"reading rank 1's host"):  # a rank that never publishes: a timeout
        shm.choose("auto", cpu, False, DictStore({}), 0, 2, 0.1)


# 1F1B, interleaved, zero-bubble split backward, DualPipeV's overlapped pairs, recomputation, offload
SPECS = [
    "1f1b:p=2,m=4",
    "interleaved-1f1b:p=2,m=4,v=2",
    "zb-h1:p=2,m=4",
    "dualpipe-v:p=2,m=4",
    "1f1b-recompute:p=2,m=4",
]


@needs_shm
def test_shm_and_gloo_compute_bitwise_the_same(tmp_path):
    """The same job on both transports: the same losses, gradients and parameters to the bit (the
    arithmetic is the same; only how the bytes travel differs), both equal to the reference, and nothing
    left in /dev/shm."""
    rows = {}
    for p2p in ("gloo", "shm"):
        out = tmp_path / p2p
        out.mkdir()
        env = {**MLP_ENV, "PIPEC_TEST_TRANSPORT": p2p}
        results, _, _ = launch(2, "worker", [str(out), "2", *SPECS], env=env, timeout=240)
        for r in results:
            assert r.returncode == 0, f"{p2p} rank {r.rank} failed:\n{r.stderr[-3000:]}"
        rows[p2p] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
        assert leftovers(results) == [], p2p
    for spec in SPECS:
        for rank in range(2):
            g, s = rows["gloo"][rank][spec], rows["shm"][rank][spec]
            assert (g["transport"], s["transport"]) == ("DistComm", "ShmComm")
            assert g["loss"] == s["loss"], (spec, rank)
            assert g["grad_digest"] == s["grad_digest"], (spec, rank)
            assert g["param_digest"] == s["param_digest"], (spec, rank)
            assert s["grad_err"] <= 1e-10 and s["param_err"] <= 1e-10, s


@needs_shm
def test_a_peer_killed_mid_step_on_shm_is_named_and_nothing_is_left():
    """Rank 1 is SIGKILLed in its FWD of step 2: its peers, blocked on its shared-memory channels, learn
    it from the channel's hang-up (or the heartbeat), name it, and end well before the 20 s timeout."""
    argv = ["1f1b", "-D", "p=3", "-D", "m=3", "--model", "tests/models/faulty.py", "--timeout", "20"]
    env = {"PIPEC_FAULT": "kill", "PIPEC_FAULT_STAGE": "1", "PIPEC_FAULT_CALL": "4"}
    results, elapsed, _ = launch(3, "launch", [*argv, "--transport", "shm"], env=env, timeout=60)
    assert results[1].returncode == -9
    dead = r"rank 1 stopped responding or died \((no heartbeat for [\d.]+ s; )?its last reported position: step 2, "
    for r in (results[0], results[2]):
        assert r.returncode != 0
        assert re.search(dead, r.stderr), r.stderr
    assert "shared-memory channel" in results[0].stderr + results[2].stderr
    assert elapsed < 15
    assert leftovers(results) == []


class GrowsOffMeta(torch.nn.Module):
    """Stage 0 outputs twice its input's rows when it really runs: its shape does not follow from the
    handshake's inference (on meta tensors), which every transport's buffers were sized from."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.device.type == "meta" else torch.cat([x, x])


def test_a_send_whose_shape_differs_from_the_handshake_is_refused():
    from pipec.api import load
    from pipec.passes.compiler import compile_schedule
    from pipec.runtime import LocalPipeline, StageOptions
    from pipec.runtime.errors import ShapeError

    prog = compile_schedule(load("1f1b", p=2, m=2)).program
    build = {0: GrowsOffMeta(), 1: torch.nn.Linear(4, 4).double()}
    pipe = LocalPipeline(prog, build, lambda out, y: ((out - y) ** 2).mean(), options=StageOptions())
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    with pytest.raises(
        ShapeError,
        match=r"stage 0 produced float64 \[4, 4\] as the activation of micro-batch 0 .*"
        r"established float64 \[2, 4\]",
    ):
        pipe.step(x, y)


@needs_shm
def test_shapes_exchanged_again_remake_the_channels():
    """examples/varlen.py changes its micro-batches' lengths at step 3: the shapes are exchanged again and
    every channel gets a segment of the new size (a new generation), between steps; the run still equals
    the reference, and nothing is left in /dev/shm."""
    argv = ["1f1b", "-D", "p=2", "-D", "m=4", "--model", "examples/varlen.py", "--steps", "4", "--check"]
    results, _, _ = launch(2, "launch", [*argv, "--transport", "shm"], env={}, timeout=120)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank}:\n{r.stdout}\n{r.stderr[-3000:]}"
    assert re.search(r"OK: largest relative error \S+ \(tolerance 1e-10\)", results[0].stdout), results[0].stdout
    assert leftovers(results) == []


def test_a_wrapper_s_forwarded_take_is_not_the_wrappers_own():
    """The executor takes messages by a plain call only from a transport that has `take` itself: through a
    wrapper that forwards attributes (EmulatedComm holds messages back in its `wait`), it must use `wait`."""
    from pipec.runtime.exec.executor import _own
    from pipec.runtime.exec.links import EmulatedComm

    class Inner:
        one_by_one = True

        def take(self, recv):
            return recv

    wrapped = EmulatedComm.__new__(EmulatedComm)
    wrapped.inner = Inner()
    assert wrapped.take is not None  # forwarded by __getattr__ ...
    assert _own(wrapped, "take", None) is None  # ... but not the wrapper's own
    assert _own(wrapped, "one_by_one", False) is False
    assert _own(Inner(), "take", None) is not None


def test_a_dead_ranks_leftover_channels_are_swept_and_a_live_ones_kept(tmp_path):
    """A rank killed between making its channel and its peer attaching cannot unlink it: the next job's
    ranks (and `pipec run` when its job ends) remove what processes that no longer exist left."""
    import subprocess

    from pipec.runtime.exec.shm import sweep_leftovers

    dead = subprocess.Popen(["true"])
    dead.wait()
    names = {
        f"pipec-{dead.pid}-0a1b2c3d-1to0-g0": "dead",
        f"pipec-{dead.pid}-0a1b2c3d-1to0-g0.fifo": "dead",
        f"pipec-{os.getpid()}-0a1b2c3d-0to1-g2": "live",
        "pipec-notapid-x": "other",
        "something-else": "other",
    }
    for name in names:
        (tmp_path / name).write_bytes(b"")
    gone = sweep_leftovers(str(tmp_path))
    assert sorted(gone) == sorted(n for n, who in names.items() if who == "dead")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for n, who in names.items() if who != "dead")


def test_the_poll_before_sleeping_is_set_by_its_variable_and_refuses_bad_values(monkeypatch):
    from pipec.runtime.errors import PipelineError

    monkeypatch.delenv("PIPEC_SHM_POLL_US", raising=False)
    assert shm.poll_seconds() == shm.POLL
    monkeypatch.setenv("PIPEC_SHM_POLL_US", "0")
    assert shm.poll_seconds() == 0.0
    monkeypatch.setenv("PIPEC_SHM_POLL_US", "120")
    assert shm.poll_seconds() == pytest.approx(120e-6)
    for bad in ("fast", "-1", "2e6"):
        monkeypatch.setenv("PIPEC_SHM_POLL_US", bad)
        with pytest.raises(PipelineError, match="PIPEC_SHM_POLL_US"):
            shm.poll_seconds()


@needs_shm
@pytest.mark.parametrize("poll_us", [0, 200_000])
def test_a_reader_polls_before_it_sleeps(monkeypatch, poll_us):
    """Two ranks' transports in two threads of this process, the message sent 20 ms after the reader
    starts waiting: with a 200 ms poll the reader sees it without a futex sleep (and the sender, finding no
    sleeper, wakes nobody); with no poll it sleeps on the futex and the sender wakes it. Both receive the
    same bytes."""
    import threading
    import time

    import torch.distributed as dist

    from pipec.api import load
    from pipec.passes.compiler import compile_schedule
    from pipec.runtime.exec.shapes import TensorSpec

    monkeypatch.setenv("PIPEC_SHM_POLL_US", str(poll_us))
    calls = []
    real = shm._syscall

    def counted(nr, addr, op, *rest):
        calls.append(op)
        return real(nr, addr, op, *rest)

    monkeypatch.setattr(shm, "_syscall", counted)
    prog = compile_schedule(load("1f1b", p=2, m=1)).program
    store = dist.HashStore()
    spec = (TensorSpec((3,), torch.float64),)
    specs = {(ACT, 0, 0): spec, (GRAD, 0, 1): spec}
    comms = [None, None]

    def make(rank: int) -> None:
        comms[rank] = c = shm.ShmComm(prog, rank, 10.0, None, store)
        c.prepare(specs, specs)

    makers = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in makers:
        t.start()
    for t in makers:
        t.join(30)
    reader, writer = comms[1], comms[0]
    try:
        recv = reader.post((ACT, 0, 0), 0, spec)
        sender = threading.Timer(0.02, lambda: writer.send((ACT, 0, 0), 1, (torch.arange(3.0, dtype=torch.float64),)))
        t0 = time.perf_counter()
        sender.start()
        got = reader.take(recv)
        waited = time.perf_counter() - t0
        sender.join(10)
    finally:
        for c in comms:
            c.close()
    assert got[0].tolist() == [0.0, 1.0, 2.0]
    assert waited >= 0.015
    if poll_us:
        assert calls == [], f"futex calls within the poll: {calls}"
    else:
        assert shm.FUTEX_WAIT in calls and shm.FUTEX_WAKE in calls
