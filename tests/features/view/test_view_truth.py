"""The view tells the truth at every zoom (issue 45), in a real headless Chromium: the memory curve's drawn
maximum per rank is `pipec check --memory`'s peak and it is drawn as steps; adjacent time ticks always
read differently; clicking an op highlights exactly what pipec.ir.rules says it needs and what needs it;
search finds ops by their source line; the playground greys a stale picture and its fields show what is
drawn. What is drawn is read from the page's `window.pipecDebug` (what the last draw drew), not pixels.

A library schedule and a 50,000-op one run by default; the million-op case is `slow`."""

from __future__ import annotations

import json
from dataclasses import replace

import browser
import numpy as np
import pytest
from cli_helpers import run_cli

from pipec import driver
from pipec.formats.trace import write_trace
from pipec.ir import rules
from pipec.ir.opcodes import KIND_OF
from pipec.view.html import decode, page, view_document

LIBRARY = ("zb-v", (("p", 4), ("m", 8)))
LARGE = ("1f1b", (("p", 8), ("m", 3125)))  # 50,000 ops
MILLION = ("1f1b", (("p", 8), ("m", 62500)))
ZOOMS = (1.0, 1 / 40, 1 / 5000)  # the share of the step in view


WINDOW = (1600, 857)  # the window the pictures and geometry assume (conftest's `chrome`)


@pytest.fixture(scope="module")
def views(tmp_path_factory):
    """Each schedule's document and page, built once."""
    out = {}

    def get(case):
        if case not in out:
            name, params = case
            doc = view_document(name, list(params))
            path = tmp_path_factory.mktemp("view") / f"{name}.html"
            path.write_text(page(doc))
            out[case] = (doc, path)
        return out[case]

    return get


def _open(chrome, path):
    chrome.get(path.as_uri())
    browser.wait_for(chrome, "document.getElementById('pipec-view').dataset.ready === '1'", timeout=120)
    assert browser.console_errors(chrome) == []


def _check_peaks(name, params):
    rc, out, err = run_cli("check", name, *[f"-D{k}={v}" for k, v in params], "--memory", "--json")
    assert rc == 0, err
    return [m["peak"] for m in json.loads(out)["memory"]]


def _is_steps(points):
    """Every segment of the polyline is a riser (same x) or a tread (same value)."""
    return all(a[0] == b[0] or a[1] == b[1] for a, b in zip(points, points[1:]))


def _memory_truth(chrome, doc, name, params, zooms=ZOOMS):
    peaks = _check_peaks(name, params)
    mem = doc["panels"][0]["memory"]
    t_all, v_all, off = decode(mem["t"]), decode(mem["v"]), mem["off"]
    full = chrome.execute_script("return pipecView.full[1]")
    for share in zooms:
        for r, peak in enumerate(peaks):
            t, v = t_all[off[r] : off[r + 1]], v_all[off[r] : off[r + 1]]
            at = float(t[int(np.argmax(v))])  # the window is centred where the rank peaks
            span = full * share
            chrome.execute_script(f"pipecView.setWindow({at - span / 2!r}, {at + span / 2!r})")
            drawn = chrome.execute_script(f"return pipecDebug.memory(0, {r})")
            pts = drawn["device"]
            assert len(pts) >= 2 and _is_steps(pts), (share, r, pts[:8])
            assert max(p[1] for p in pts) == pytest.approx(peak, rel=1e-6), (share, r)
            assert min(p[1] for p in pts) >= 0


def _ticks_differ(chrome, at_shares=(0.0, 0.5, 0.999)):
    full = chrome.execute_script("return pipecView.full[1]")
    seen = []
    for share in ZOOMS:
        for c in at_shares:
            span = full * share
            v0 = min(max(0.0, full * c - span / 2), full - span)
            chrome.execute_script(f"pipecView.setWindow({v0!r}, {v0 + span!r})")
            ticks = chrome.execute_script("return pipecDebug.ticks()")
            labels = ticks["labels"]
            assert len(labels) >= 2, (share, c, ticks)
            assert all(a != b for a, b in zip(labels, labels[1:])), (share, c, labels)
            seen.append(ticks["unit"])
    return seen


@pytest.mark.parametrize("case", [LIBRARY, LARGE], ids=["library-zb-v", "50k-ops"])
def test_memory_is_drawn_as_steps_and_reaches_the_checked_peak_at_three_zooms(chrome, views, case):
    doc, path = views(case)
    _open(chrome, path)
    _memory_truth(chrome, doc, *case)


@pytest.mark.parametrize("case", [LIBRARY, LARGE], ids=["library-zb-v", "50k-ops"])
def test_adjacent_time_ticks_read_differently_at_three_zooms(chrome, views, case):
    _, path = views(case)
    _open(chrome, path)
    assert set(_ticks_differ(chrome)) == {"units"}  # default costs: no unit of time


def test_measured_times_read_in_seconds_units(chrome, tmp_path):
    sim = driver.simulation(driver.target_of("1f1b", {"p": 2, "m": 4})[0])
    tl = sim.timeline
    k = 4.817e-5  # an F of 48.17 µs
    run = replace(
        tl,
        start=tl.start * k,
        end=tl.end * k,
        msg_send=tl.msg_send * k,
        msg_arrival=tl.msg_arrival * k,
        origin="measured",
    )
    write_trace(run, tmp_path / "run.json")
    out = tmp_path / "run.html"
    out.write_text(page(view_document(str(tmp_path / "run.json"))))
    _open(chrome, out)
    assert chrome.execute_script("return PipecView.fmtTime(4.817e-5, 's')") == "48.2 µs"
    summary = chrome.execute_script("return document.querySelector('[data-role=summary]').innerText")
    assert f"makespan {tl.makespan * k * 1e6:.3g} µs" in summary and "e-" not in summary
    assert f"critical path {tl.makespan * k * 1e6:.3g} µs" in summary
    units = _ticks_differ(chrome)
    assert set(units) <= {"s", "ms", "µs", "ns"} and "µs" in units


def _expected_relations(doc, sched, i):
    """Op i's dependencies and dependents by pipec.ir.rules, as indices of the page's ops."""
    P = doc["panels"][0]
    ops = {k: decode(P["ops"][k]).astype(np.int64) for k in ("op", "mb", "stage")}
    kind = KIND_OF[ops["op"]]
    index = {(int(k), int(u), int(s)): j for j, (k, u, s) in enumerate(zip(kind, ops["mb"], ops["stage"])) if k >= 0}
    slices = sched.slicing.slices if sched.slicing else 1
    active = rules.active(len(sched.kinds), slices)
    k, u, s = int(kind[i]), int(ops["mb"][i]), int(ops["stage"][i])
    deps = sorted(index[n] for n in rules.needs(k, u, s, sched.num_stages, active, slices))
    dependents = sorted(index[n] for _, n in rules.feeds(k, u, s, sched.num_stages, active, slices))
    return deps, dependents


@pytest.mark.parametrize("case", [LIBRARY, LARGE], ids=["library-zb-v", "50k-ops"])
def test_clicking_an_op_highlights_exactly_its_dependencies_and_dependents(chrome, views, case):
    doc, path = views(case)
    _open(chrome, path)
    sched = driver.target_of(case[0], dict(case[1]))[0]
    P = doc["panels"][0]
    off, n = P["op_off"], int(P["ops"]["op"]["n"])
    picks = [off[1] + 3, off[2] + (off[3] - off[2]) // 2, off[-1] - 2]  # early, middle and late ops, three ranks
    picks = [i for i in picks if 0 <= i < n]
    for i in picks:
        pt = chrome.execute_script(
            f"const v = pipecView, P = v.doc.panels[0], s = P.ops.start[{i}], e = P.ops.end[{i}], w = (e - s) * 12;"
            f"v.setWindow(s - w, e + w); return v.opPoint(0, {i})"
        )
        browser.click(chrome, pt["cx"], pt["cy"] + 4)
        sel = browser.wait_for(
            chrome, f"pipecDebug.selection() && pipecDebug.selection().i === {i} && pipecDebug.selection()"
        )
        deps, dependents = _expected_relations(doc, sched, i)
        assert sorted(sel["deps"]) == deps and sorted(sel["dependents"]) == dependents, (i, sel)
        # what is drawn highlighted, the whole step in view: exactly those on the ranks whose rows are in view
        drawn = chrome.execute_script(
            "pipecView.setWindow(pipecView.full[0], pipecView.full[1]); const h = pipecDebug.highlight();"
            "h.ranks = pipecView.shown.filter((L) => L.type === 'ops').map((L) => L.r); return h"
        )
        ranks = np.asarray(decode(P["ops"]["rank"]), np.int64)
        on = set(drawn["ranks"])
        assert drawn["selected"] == i
        assert sorted(drawn["deps"]) == [j for j in deps if ranks[j] in on]
        assert sorted(drawn["dependents"]) == [j for j in dependents if ranks[j] in on]
        assert deps or dependents  # each pick has some: the comparison is not between two empty lists
        side = chrome.execute_script("return document.querySelector('[data-role=detail]').innerText")
        assert f"depends on ({len(deps)})" in side and f"depended on by ({len(dependents)})" in side
    assert browser.console_errors(chrome) == []


def test_search_finds_ops_by_their_source_line(chrome, views):
    doc, path = views(LIBRARY)
    _open(chrome, path)
    P = doc["panels"][0]
    src = decode(P["ops"]["src"]).astype(np.int64)
    pick = int(src[P["op_off"][2] + 1])
    file, line, _ = doc["sources"][pick]
    want = {i for i, s in enumerate(src) if doc["sources"][s][1] == line and s >= 0}
    box = chrome.find_element("css selector", "[data-role=search]")
    box.clear()
    box.send_keys(f"{file.rsplit('/', 1)[-1]}:{line}\n")
    sel = browser.wait_for(chrome, "pipecDebug.selection()")
    found = chrome.execute_script("return pipecView.matches.map((m) => m[1])")
    assert set(found) == want and sel["i"] in want
    assert doc["sources"][src[sel["i"]]][1] == line
    count = chrome.execute_script("return document.querySelector('[data-role=search-count]').innerText")
    assert f"of {len(want)} ops" in count


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


def _drawn(chrome):
    """What the picture is drawn at, read off the drawn view (ranks, micro-batches), and the fields."""
    return chrome.execute_script(
        "const P = pipecView.doc.panels[0], f = {};"
        "for (const i of document.querySelectorAll('input[data-param]')) f[i.dataset.param] = i.value;"
        "return {ranks: P.ranks, mbs: P.maxMb + 1, fields: f, seq: document.body.dataset.seq,"
        " stale: document.getElementById('pipec-view').classList.contains('pv-stale')}"
    )


def test_playground_greys_a_stale_picture_and_its_fields_show_the_drawn_parameters(chrome, playground):
    chrome.get(playground + "?schedule=1f1b")
    browser.wait_for(chrome, "document.getElementById('makespan').dataset.value && window.pipecView")
    d = _drawn(chrome)
    assert d["fields"] == {"p": str(d["ranks"]), "m": str(d["mbs"])} and not d["stale"]
    _set_value(chrome, "input[data-param=p]", "2")
    browser.wait_for(chrome, "pipecView.doc.panels[0].ranks === 2")
    d = _drawn(chrome)
    assert d["fields"]["p"] == "2" and d["fields"]["m"] == str(d["mbs"]) and not d["stale"]
    # a refused schedule (p = 0 breaks `require p >= 1`): the p=2 picture is greyed and says what it is
    _set_value(chrome, "input[data-param=p]", "0")
    note = browser.wait_for(
        chrome, "document.querySelector('[data-role=stale]') && document.querySelector('.pv-stale-note.on')"
    )
    assert "p=2" in note.text and "Not current" in note.text
    d = _drawn(chrome)
    assert d["stale"] and d["ranks"] == 2
    assert chrome.execute_script("return document.querySelector('input[data-param=p]').classList.contains('undrawn')")
    assert chrome.execute_script("return document.getElementById('makespan').dataset.value") == ""
    # back to a good value, then a syntax error in the source: greyed again
    _set_value(chrome, "input[data-param=p]", "3")
    browser.wait_for(
        chrome,
        "pipecView.doc.panels[0].ranks === 3 && !document.getElementById('pipec-view').classList.contains('pv-stale')",
    )
    text = chrome.execute_script("return document.getElementById('source').value")
    _set_value(chrome, "#source", text + "\nstages = (")
    browser.wait_for(
        chrome,
        "document.querySelector('[data-role=diag]') && "
        "document.getElementById('pipec-view').classList.contains('pv-stale')",
    )
    d = _drawn(chrome)
    assert d["stale"] and d["ranks"] == 3 and d["fields"]["p"] == "3"
    _set_value(chrome, "#source", text)
    browser.wait_for(
        chrome,
        "!document.getElementById('pipec-view').classList.contains('pv-stale') && "
        "document.getElementById('makespan').dataset.value",
    )
    assert browser.console_errors(chrome) == []


def test_ten_thousand_ranks_open_and_draw_only_the_rows_in_view(chrome, tmp_path):
    # 1f1b p=10000 m=2: 40,000 ops over 10,000 ranks (the m=8 is benchmarks/view_scale.py --wide)
    doc = view_document("1f1b", [("p", 10000), ("m", 2)])
    out = tmp_path / "wide.html"
    out.write_text(page(doc))
    _open(chrome, out)
    shown = chrome.execute_script("pipecView.draw(); return pipecView.shown.map((L) => L.r)")
    assert 0 < len([r for r in shown if r is not None]) < 100
    # scroll to the last rank: its rows are drawn, with the summary beside them
    chrome.execute_script("pipecView.scrollToRank(0, 9999)")
    shown = chrome.execute_script("return pipecView.shown.map((L) => L.r)")
    assert 9999 in shown
    assert (
        chrome.execute_script("return document.querySelector('[data-role=stats]').innerText").count("10,000 ranks") == 1
    )
    assert browser.console_errors(chrome) == []


@pytest.mark.slow
def test_a_million_ops_tell_the_truth_at_three_zooms(chrome, views):
    doc, path = views(MILLION)
    _open(chrome, path)
    _memory_truth(chrome, doc, *MILLION)
    _ticks_differ(chrome)
