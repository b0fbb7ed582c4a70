"""`pipec view` and `pipec serve` in a real (headless) Chromium: the page loads without console errors, hover
names an op's micro-batch and source line, the playground shows a diagnostic at its line and the driver's
makespan when a cost changes, and a measured run is drawn over its simulation."""

from __future__ import annotations

import json
from dataclasses import replace

import browser
import pytest

from pipec import driver as pipeline
from pipec.formats.trace import write_trace
from pipec.sim.cost_files import normalize
from pipec.view.html import page, view_document


def _open(chrome, path):
    chrome.get(path.as_uri())
    browser.wait_for(chrome, "document.getElementById('pipec-view').dataset.ready === '1'")


def _op_point(chrome, panel, i):
    return chrome.execute_script(f"return window.pipecView.opPoint({panel}, {i})")


def test_view_loads_without_errors_and_hover_names_the_op_and_its_source_line(chrome, tmp_path):
    out = tmp_path / "view.html"
    out.write_text(page(view_document("1f1b", [("p", 4), ("m", 8)])))
    _open(chrome, out)
    assert browser.console_errors(chrome) == []
    # op 3 of rank 0 (ops are sorted by rank and start): what it is and where it came from
    want = chrome.execute_script(
        "const P = pipecView.doc.panels[0]; return [P.ops.mb[3], P.ops.src[3], pipecView.doc.sources[P.ops.src[3]]]"
    )
    pt = _op_point(chrome, 0, 3)
    browser.hover(chrome, pt["cx"], pt["cy"])
    tip = browser.wait_for(chrome, "document.getElementById('pipec-tip').innerText")
    path, line, text = want[2]
    assert f"micro-batch {want[0]}" in tip
    assert f"{path}:{line}: {text}" in tip and "1f1b.pipe" in path
    # wheel zooms and drag pans without errors
    browser.hover(chrome, pt["cx"], pt["cy"])
    before = chrome.execute_script("return [pipecView.v0, pipecView.v1]")
    chrome.execute_script(
        "pipecView.canvas.dispatchEvent(new WheelEvent('wheel', "
        "{deltaY: -300, clientX: 400, clientY: 100, bubbles: true}))"
    )
    after = browser.wait_for(
        chrome, "pipecView.v1 - pipecView.v0 < %r && [pipecView.v0, pipecView.v1]" % (before[1] - before[0])
    )
    assert after[1] - after[0] < before[1] - before[0]
    assert browser.console_errors(chrome) == []


def test_measured_over_simulated_shows_both(chrome, tmp_path):
    sim = pipeline.simulation(pipeline.target_of("1f1b", {"p": 2, "m": 4})[0])
    tl = sim.timeline
    write_trace(replace(tl, start=tl.start * 1.2, end=tl.end * 1.2 + 0.1, origin="measured"), tmp_path / "run.json")
    out = tmp_path / "overlay.html"
    # given costs (the defaults): the simulation is theirs, so each measured op is longer than its twin
    given = [normalize({"F": 1})]
    out.write_text(page(view_document("1f1b", [("p", 2), ("m", 4)], given, measured=str(tmp_path / "run.json"))))
    _open(chrome, out)
    assert browser.console_errors(chrome) == []
    summary = chrome.execute_script("return document.querySelector('[data-role=summary]').innerText")
    assert f"makespan {tl.makespan:g}" in summary and "measured makespan" in summary
    pt = _op_point(chrome, 0, 2)
    browser.hover(chrome, pt["cx"], pt["cy"] + 12)  # the lower half of the lane: the measured op
    tip = browser.wait_for(chrome, "document.getElementById('pipec-tip').innerText")
    assert "simulated" in tip and "measured: start" in tip and "error: duration +" in tip


@pytest.fixture(scope="module")
def playground():
    from pipec.view import serve

    srv = serve.start_in_thread("127.0.0.1", 0)
    yield f"http://127.0.0.1:{srv.server_address[1]}/"
    srv.shutdown()
    srv.server_close()


def _set_value(chrome, css, value):
    chrome.execute_script(
        "const e = document.querySelector(arguments[0]); e.value = arguments[1];"
        "e.dispatchEvent(new Event('input', {bubbles: true}))",
        css,
        value,
    )


def test_playground_shows_a_diagnostic_at_its_line_and_the_drivers_makespan(chrome, playground):
    chrome.get(playground + "?schedule=1f1b")
    browser.wait_for(chrome, "document.getElementById('makespan').dataset.value")
    assert browser.console_errors(chrome) == []
    text = chrome.execute_script("return document.getElementById('source').value")
    lines = text.split("\n")
    at = next(i for i, x in enumerate(lines) if x.strip().startswith("stages"))
    lines[at] = lines[at] + " +"  # an expression cut short: a syntax error on this line or the next
    _set_value(chrome, "#source", "\n".join(lines))
    diag = browser.wait_for(chrome, "document.querySelector('[data-role=diag]')")
    line = int(diag.get_attribute("data-line"))
    assert line in (at + 1, at + 2) and "error[E" in diag.text
    assert (
        chrome.execute_script(f"return document.querySelector('#gutter span[data-line=\"{line}\"]').className") == "bad"
    )
    # fix it, then change a cost: the makespan shown is the driver's
    _set_value(chrome, "#source", text)
    browser.wait_for(
        chrome, "!document.querySelector('[data-role=diag]') && document.getElementById('makespan').dataset.value"
    )
    _set_value(chrome, "input[data-cost=B]", "2.5")
    want = pipeline.simulation(pipeline.target_of("1f1b", {})[0], pipeline.cost_docs("B=2.5")).timeline.makespan
    got = browser.wait_for(
        chrome, f"document.getElementById('makespan').dataset.value === '{json.dumps(want)}' && {json.dumps(want)}"
    )
    assert got == want
    assert browser.console_errors(chrome) == []
