"""Emulated links between datacenters (`pipec run --emulate-links`, pipec.runtime.exec.links): messages across
the link reach compute no earlier than the latency (plus the time on the wire) after they were sent, links
inside a datacenter are left alone, and training still equals the single-process reference."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from runtime_harness import ROOT  # noqa: E402

from pipec.api import load  # noqa: E402
from pipec.frontend.topology import with_topology  # noqa: E402
from pipec.ir.schedule import Datacenter, Link, Topology  # noqa: E402
from pipec.passes.compiler import compile_schedule  # noqa: E402
from pipec.runtime import LocalPipeline, Reference, StageOptions, Transport, load_model  # noqa: E402
from pipec.runtime.exec.links import Links, links_of  # noqa: E402
from pipec.runtime.reference import compare  # noqa: E402

MLP_ENV = {"MLP_WIDTH": "16", "MLP_DEPTH": "8", "MLP_BATCH": "16", "MLP_DTYPE": "float64"}
TOPO = 'dc "east" ranks 0 .. 1  dc "west" ranks 1 .. 2  link "east" <-> "west" latency {lat} bandwidth 1Gbps'


def two_dc(p: int, cut: int, latency: float, bandwidth: float) -> Topology:
    return Topology((Datacenter("a", 0, cut), Datacenter("b", cut, p)), (Link("a", "b", latency, bandwidth),))


def test_links_of_takes_only_pairs_across_datacenters_and_scales_them():
    sched = with_topology(load("1f1b", p=4, m=4), two_dc(4, 2, 0.04, 10e9))
    links = links_of(sched, scale=0.5)
    assert not links.emulated(0, 1) and not links.emulated(3, 2)
    assert links.emulated(1, 2) and links.emulated(2, 1) and links.emulated(0, 3)
    assert links.latency[1][2] == pytest.approx(0.02)
    assert links.bandwidth[1][2] == pytest.approx(10e9 / 8 / 0.5)  # bytes/s, scaled up: wire time halves too
    assert Links.from_json(links.to_json()) == links
    with pytest.raises(ValueError, match="needs datacenters"):
        links_of(load("1f1b", p=2, m=2))
    with pytest.raises(ValueError, match="positive"):
        links_of(sched, scale=0.0)


@pytest.mark.parametrize("name", ["1f1b", "crossdc-zb"])
def test_local_with_emulated_links_is_late_by_the_latency_and_exact(name, monkeypatch):
    for k, v in MLP_ENV.items():
        monkeypatch.setenv(k, v)
    model = load_model(str(ROOT / "examples" / "mlp.py"))
    lat = 0.05
    sched = with_topology(load(name, p=2, m=4), two_dc(2, 1, lat, 1e9))
    program = compile_schedule(sched).program
    kw = dict(optimizer=model.optimizer, dtype=model.dtype)
    transport = Transport(links=links_of(sched))
    pipe = LocalPipeline(program, model.build_stage, model.loss_fn, options=StageOptions(**kw), transport=transport)
    ref = Reference(model.build_stage, model.loss_fn, 2, 4, **kw)
    for step in range(2):
        x, y = model.batch(step)
        res = pipe.step(x, y)
        assert math.isclose(res.loss, ref.step(x, y), rel_tol=1e-12)
        assert max(compare(pipe.named_gradients(), ref.named_gradients()).values()) <= 1e-12
        # the first activation crosses the link, and the last gradient comes back across it: 2 (p - 1) L at least
        assert res.seconds >= 2 * lat


def pipec(*args: str) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ, OMP_NUM_THREADS="1", **MLP_ENV)
    cmd = [sys.executable, "-m", "pipec", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # the same in one process: test_local_with_emulated_links_is_late_by_the_latency_and_exact
def test_pipec_run_emulate_links_delays_every_message_and_stays_exact(tmp_path):
    from pipec.formats.trace import read_trace

    lat, scale = 0.2, 0.5  # 200 ms declared, 100 ms emulated
    trace = tmp_path / "run.json"
    r = pipec(
        "run", "1f1b", "-D", "p=2", "-D", "m=2", "--model", "examples/mlp.py", "--steps", "2", "--check",
        "--emulate-links", "--link-scale", str(scale), "--topology", TOPO.format(lat="200ms"), "--trace", str(trace),
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "emulated links: 0->1 100 ms, 2 Gbps; 1->0 100 ms, 2 Gbps" in r.stdout
    assert any(line.startswith("OK: largest relative error") for line in r.stdout.splitlines())
    times = [float(t) for t in re.findall(r"^step \d+/2: loss \S+, ([0-9.]+) s", r.stdout, re.M)]
    assert len(times) == 2 and all(t >= 2 * lat * scale for t in times), times
    tl = read_trace(trace)
    assert len(tl.msg_send) == 4
    assert (tl.msg_arrival - tl.msg_send >= lat * scale - 1e-3).all(), (tl.msg_send, tl.msg_arrival)


def test_pipec_run_emulate_links_needs_datacenters():
    r = pipec("run", "1f1b", "-D", "p=2", "-D", "m=2", "--model", "examples/mlp.py", "--emulate-links", "--local")
    assert r.returncode == 2 and "--emulate-links needs datacenters" in r.stderr
