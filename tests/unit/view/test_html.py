"""The view's document (pipec.view.html): the column encoding round trip and what the panels hold."""

from __future__ import annotations

import json

import numpy as np
import pytest
from deadlocks import DEADLOCK_1F1B

from pipec import driver
from pipec.formats.trace import read_trace, write_trace
from pipec.sim.cost_files import costs_of_timeline, normalize
from pipec.view.html import CRITICAL, IN_CYCLE, PAIR_FIRST, decode, encode, page, view_document


@pytest.mark.parametrize(
    ("values", "dtype"),
    [
        (np.array([0.0, 1.5, -2.25, 3e7, np.nan], dtype=np.float32), "f4"),
        (np.array([0, -1, 2**31 - 1, -(2**31)], dtype=np.int32), "i4"),
        (np.array([0, 7, -3, 32767], dtype=np.int16), "i2"),
        (np.array([0, 1, 255], dtype=np.uint8), "u1"),
        (np.zeros(0, dtype=np.float32), "f4"),
        (np.arange(100_000, dtype=np.int32) % 97, "i4"),
    ],
)
def test_columns_round_trip(values, dtype):
    col = json.loads(json.dumps(encode(values, dtype)))  # as the page receives it
    assert col["n"] == len(values)
    np.testing.assert_array_equal(decode(col), values)


def test_a_view_holds_the_ops_sorted_with_their_source_lines_pairs_and_critical_path():
    doc = view_document("dualpipe-v", [("p", 4)])
    (panel,) = doc["panels"]
    ops = {k: decode(v) for k, v in panel["ops"].items()}
    sim = driver.simulation(driver.target_of("dualpipe-v", {"p": 4})[0])
    assert len(ops["start"]) == len(sim.timeline.start)
    assert panel["makespan"] == sim.timeline.makespan == panel["critical_length"]
    order = np.lexsort((ops["start"], ops["rank"]))
    np.testing.assert_array_equal(order, np.arange(len(order)))  # the page binary-searches each rank's lane
    assert (ops["src"] >= 0).all()
    path, line, text = doc["sources"][int(ops["src"][0])]
    assert path.endswith("dualpipe-v.pipe") and text and line > 0
    assert (ops["flags"] & PAIR_FIRST).any() and (ops["flags"] & CRITICAL).any()
    assert panel["memory"]["ranks"][0]["peak"] > 0


def test_a_deadlocked_schedule_is_drawn_with_its_chain_of_waits(tmp_path):
    src = tmp_path / "dead.pipe"
    src.write_text(DEADLOCK_1F1B)
    doc = view_document(str(src))
    (panel,) = doc["panels"]
    assert panel["kind"] == "deadlock" and "E401" in panel["diagnostic"]
    assert panel["chain"] and (decode(panel["ops"]["flags"]) & IN_CYCLE).any()
    assert "<script" in page(doc)


def test_a_measured_run_is_matched_op_by_op(tmp_path):
    from dataclasses import replace

    sim = driver.simulation(driver.target_of("1f1b", {"p": 2, "m": 4})[0])
    tl = sim.timeline
    run = replace(tl, start=tl.start * 1.1, end=tl.end * 1.1 + 0.05, origin="measured")
    write_trace(run, tmp_path / "run.json")
    # given costs (the defaults, F=1): the simulation is theirs, the error is the run's stretch
    doc = view_document("1f1b", [("p", 2), ("m", 4)], [normalize({"F": 1})], measured=str(tmp_path / "run.json"))
    (panel,) = doc["panels"]
    assert panel["kind"] == "overlay" and panel["matched"] == len(tl.start)
    ops = {k: decode(v) for k, v in panel["ops"].items()}
    err = (ops["mend"] - ops["mstart"]) - (ops["end"] - ops["start"])
    np.testing.assert_allclose(err, (ops["end"] - ops["start"]) * 0.1 + 0.05, rtol=1e-5)
    # no costs given: simulated in the run's own median op times, so each op's duration is the run's
    (panel,) = view_document("1f1b", [("p", 2), ("m", 4)], measured=str(tmp_path / "run.json"))["panels"]
    ops = {k: decode(v) for k, v in panel["ops"].items()}
    np.testing.assert_allclose(ops["end"] - ops["start"], ops["mend"] - ops["mstart"], rtol=1e-5)
    again = driver.simulation(
        driver.target_of("1f1b", {"p": 2, "m": 4})[0], [costs_of_timeline(read_trace(tmp_path / "run.json"))]
    )
    assert panel["makespan"] == pytest.approx(again.timeline.makespan, rel=1e-12)
    # the trace alone is a view too
    alone = view_document(str(tmp_path / "run.json"))
    assert alone["panels"][0]["origin"] == "measured"


def test_import_pipec_loads_no_viewer_and_no_server():
    import subprocess
    import sys

    code = "import pipec, sys; print(sorted(m for m in sys.modules if m in WATCH))"
    watch = ("pipec.view.html", "pipec.view.serve", "pipec.view.critical", "http.server", "selenium")
    argv = [sys.executable, "-c", f"WATCH = {watch!r}; {code}"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
