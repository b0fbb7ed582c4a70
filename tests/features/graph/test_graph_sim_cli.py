"""Simulating stage graphs end to end (issue 42): `pipec simulate` and `pipec check --memory` of a U-Net and of
two encoders fanning into a decoder, from the command line; and every library schedule with U-Net skips
simulated with data parallelism, experts and costs on the wire, its two passes equal and every op started
after all its inputs (pipec.ir.rules on the graph)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from cli_helpers import run_cli

import pipec
from pipec.frontend import library
from pipec.ir.opcodes import KIND_OF
from pipec.ir.rules import dependencies
from pipec.sim.cost_files import normalize
from pipec.sim.costs import cost_model
from pipec.sim.simulate import simulate

UNET = """schedule "unet-1f1b" (p: int = 4, m: int = 8) {
    stages p
    place s -> s
    edge s -> if s < p - 1 then s + 1 else -1
    edge s -> if s < p / 2 - 1 then p - 1 - s else -1
    ops F, B
    rank r { let warm = min(p - 1 - r, m)
        for i in 0 .. warm { F(i) }  for i in 0 .. m - warm { F(i + warm)  B(i) }  for i in m - warm .. m { B(i) } }
}
"""

TWO_ENCODERS = """schedule "two-encoders" (p: int = 5, m: int = 4) {
    stages 5
    place s -> s
    edge s -> if s == 1 or s == 3 then 4 else (if s == 0 or s == 2 then s + 1 else -1)
    ops F, B
    rank r { for i in 0 .. m { F(i) }  for i in 0 .. m { B(i) } }
}
"""


def _json(*argv: str) -> dict:
    rc, out, err = run_cli(*argv, "--json")
    assert rc == 0, err
    return json.loads(out)


@pytest.mark.parametrize("p", [4, 6])
def test_pipec_simulate_a_unet(tmp_path, p):
    """The skips add no depth: the chain's 1F1B makespan (m + p - 1)(F + B) = 33 at p = 4 (39 at p = 6), one
    activation and one gradient per edge and micro-batch, rank r holding p - r activations at its peak."""
    path = tmp_path / "unet.pipe"
    path.write_text(UNET)
    doc = _json("simulate", str(path), "-D", f"p={p}")["results"][0]
    edges = (p - 1) + (p // 2 - 1)
    assert doc["makespan"] == (8 + p - 1) * 3
    assert doc["messages"] == 2 * 8 * edges
    assert [r["peak_memory"] for r in doc["per_rank"]] == [p - r for r in range(p)]
    rc, out, err = run_cli("simulate", str(path), "-D", f"p={p}")
    assert rc == 0 and f"makespan {(8 + p - 1) * 3}" in out, err


def test_pipec_check_memory_of_a_unet(tmp_path):
    path = tmp_path / "unet.pipe"
    path.write_text(UNET)
    doc = _json("check", str(path), "--memory")
    assert doc["ok"] and [r["peak"] for r in doc["memory"]] == [4.0, 3.0, 2.0, 1.0]
    assert [r["at"] for r in doc["memory"]] == [f"F({3 - r}, stage {r})" for r in range(4)]
    rc, out, err = run_cli("check", str(path), "--memory")
    assert rc == 0 and "OK" in out, err


def test_pipec_simulate_two_encoders_with_bytes_on_the_wire(tmp_path):
    """m = 1, F = 1, full B = 2, 1 s per message (a byte at 8 bit/s, on every edge, gradients as large): the
    decoder waits for both encoders' activations (each at 2 + 1 s), the encoders' B for its gradient: four
    messages on the critical path, 3F + 3B + 4 = 13; eight messages of a byte."""
    path = tmp_path / "two.pipe"
    path.write_text(TWO_ENCODERS)
    doc = _json("simulate", str(path), "-D", "m=1", "--cost", "act_bytes=1,bandwidth=8bps")["results"][0]
    assert doc["makespan"] == pytest.approx(13.0)
    assert doc["messages"] == 8 and doc["message_bytes"] == 8


def _with_skips(name: str) -> str:
    """A library schedule's file with the U-Net's edges (the chain plus skips s -> S - 1 - s)."""
    src = library.read(name).text
    m = re.search(r"^(\s*)stages (.+)$", src, flags=re.M)
    assert m, name
    S, ind = f"({m.group(2).split('#')[0].strip()})", m.group(1)
    chain, skip = f"if s < {S} - 1 then s + 1 else -1", f"if s < {S} / 2 - 1 then {S} - 1 - s else -1"
    edges = f"\n{ind}edge s -> {chain}\n{ind}edge s -> {skip}"
    return src[: m.end()] + edges + src[m.end() :]


def _inputs_first(tl, prog) -> int:
    kind = KIND_OF[tl.op]
    mine = kind >= 0  # RECOMPUTE rows are no op of the schedule
    slices = prog.slicing.slices if prog.slicing else 1
    end = {(int(k), int(i), int(s)): e for k, i, s, e in zip(kind[mine], tl.mb[mine], tl.stage[mine], tl.end[mine])}
    k, mb, st, start = kind[mine], tl.mb[mine], tl.stage[mine], tl.start[mine]
    checked = 0
    for _, nk, nmb, nst, valid in dependencies(k, mb, st, prog.num_stages, prog.split_backward, slices, prog.graph):
        for j in np.flatnonzero(valid).tolist():
            assert start[j] >= end[(int(nk[j]), int(nmb[j]), int(nst[j]))] - 1e-9
            checked += 1
    return checked


OPTIONS = {
    "plain": {},
    "fsdp": {"data_parallel": pipec.DataParallel(2, "fsdp")},
    "experts": {"data_parallel": pipec.DataParallel(2), "experts": pipec.Experts(2, 4), "moe_layers": 1},
}


# A recomputed forward with expert parallelism is refused (E425) on the chain as on a graph.
CASES = [(n, o) for n in library.names() for o in sorted(OPTIONS) if not (o == "experts" and "recompute" in n)]


@pytest.mark.parametrize(("name", "option"), CASES)
def test_library_schedules_on_a_unet_simulate(tmp_path, name, option):
    path = tmp_path / f"{name}.pipe"
    path.write_text(_with_skips(name))
    sched = pipec.load(str(path), p=4, m=8)
    prog = pipec.compile(sched, **OPTIONS[option])
    assert prog.graph is not None and prog.graph.num_edges > prog.num_stages - 1
    doc = {"comm": 0.05, "overhead": 0.01, "act_bytes": 1e6, "bandwidth": "1Gbps", "param_bytes": 1e6, "a2a": 0.1}
    costs = cost_model(sched, [normalize(doc)])
    a, b = simulate(prog, costs), simulate(prog, costs, _events=True)
    for x in ("start", "end", "msg_send", "msg_arrival"):
        assert np.allclose(getattr(a, x), getattr(b, x), rtol=1e-12, atol=1e-9), x
    assert _inputs_first(a, prog) > 0
    remote = sum(prog.placement[u] != prog.placement[v] for u, v in prog.graph.edges)
    assert len(a.msg_kind) == 2 * prog.num_microbatches * remote
