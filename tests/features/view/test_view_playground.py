"""The playground's compare mode, the legend of what a view holds, and a 10,000-rank schedule in the
playground, in a real headless Chromium (1600x857). What the page holds is read from the page (the
summary's data attributes, `window.pipecView`), and the numbers it shows are held to the simulator's own
(pipec.driver) and to `pipec view --compare`'s document. Timing is benchmarks/view_scale.py's
(`--playground`), never asserted here."""

from __future__ import annotations

import json
import urllib.request

import browser
import numpy as np
import pytest

from pipec import driver
from pipec.frontend import library
from pipec.ir.opcodes import OPCODES
from pipec.view.html import decode, page, view_document

LEGEND_CASES = [
    ("zb-v", (("p", 4), ("m", 8))),  # W, two chunks per rank
    ("1f1b", (("p", 4), ("m", 8))),  # F and B only
    ("1f1b-offload", ()),  # the host link and its pool
    ("1f1b-recompute", ()),  # recompute
    ("dualpipe-v", (("p", 4),)),  # overlapped pairs
]
SELECTION_ENTRIES = {"selected", "depends on (selected)", "depended on by", "its micro-batch"}


WINDOW = (1600, 857)  # the window the pictures and geometry assume (conftest's `chrome`)


@pytest.fixture(scope="module")
def playground():
    from pipec.view import serve

    # the request deadline raised from 20 s: on a loaded shared machine a 10,000-rank build may pass it
    srv = serve.start_in_thread("127.0.0.1", 0, timeout_s=600)
    yield f"http://127.0.0.1:{srv.server_address[1]}/"
    srv.shutdown()
    srv.server_close()


def _set_value(chrome, css, value, event="input"):
    chrome.execute_script(
        "const e = document.querySelector(arguments[0]); e.value = arguments[1];"
        "e.dispatchEvent(new Event(arguments[2], {bubbles: true}))",
        css,
        value,
        event,
    )


def _sim(name, **params):
    return driver.simulation(driver.target_of(name, params)[0])


def _rank_facts(sim):
    """Per rank: the end of its last compute op, its busy time (the union of its ops) and its device peak;
    and the bubble rate 1 - busy / (ranks x makespan)."""
    tl = sim.timeline
    ends, busy = np.zeros(tl.num_ranks), np.zeros(tl.num_ranks)
    for r in range(tl.num_ranks):
        sel = np.flatnonzero(tl.rank == r)
        cur = -np.inf
        for i in sel[np.argsort(tl.start[sel], kind="stable")]:
            busy[r] += max(0.0, tl.end[i] - max(tl.start[i], cur))
            cur = max(cur, tl.end[i])
        ends[r] = tl.end[sel].max()
    bubble = 1 - busy.sum() / (tl.num_ranks * tl.makespan)
    return ends, np.asarray(sim.curves.device_peak, float), bubble


def _deltas(chrome):
    return chrome.execute_script(
        "const box = document.querySelector('[data-role=delta]'); if (!box) return null;"
        "const v = (role) => { const e = box.querySelector(`[data-role=${role}]`);"
        " return e ? +e.dataset.value : null; };"
        "return {makespan: v('delta-makespan'), bubble: v('delta-bubble'), peak: v('delta-peak'),"
        " ranks: [...box.querySelectorAll('tr[data-rank]')].map((t) => [+t.dataset.rank, +t.dataset.dend,"
        " +t.dataset.dpeak, t.classList.contains('diff'),"
        " [...t.cells].slice(1).map((c) => getComputedStyle(c).color === 'rgb(164, 22, 26)')]), text: box.innerText}"
    )


def _legend(chrome):
    items = chrome.execute_script("return [...document.querySelectorAll('[data-legend]')].map((e) => e.dataset.legend)")
    return set(items)


def _wait_drawn(chrome, condition, timeout=60):
    return browser.wait_for(
        chrome,
        "window.pipecView && document.getElementById('pipec-view').dataset.ready === '1' && "
        "!document.getElementById('pipec-view').classList.contains('pv-stale') && (" + condition + ")",
        timeout,
    )


def test_playground_compares_the_source_with_its_pinned_build_per_rank(chrome, playground):
    chrome.get(playground + "?schedule=1f1b&p=4&m=8")
    _wait_drawn(chrome, "pipecView.doc.panels.length === 1 && pipecView.doc.panels[0].maxMb === 7")
    assert _deltas(chrome) is None  # one schedule: no compare table
    chrome.find_element("css selector", "[data-role=pin]").click()
    _wait_drawn(chrome, "pipecView.doc.panels.length === 2")
    _set_value(chrome, "input[data-param=m]", "2")  # fewer micro-batches than ranks: ends and peaks move
    _wait_drawn(chrome, "pipecView.doc.panels.length === 2 && pipecView.doc.panels[1].maxMb === 1")
    titles = chrome.execute_script("return pipecView.doc.panels.map((P) => P.title)")
    assert titles == ["baseline: 1f1b (p=4 m=8)", "1f1b (p=4 m=2)"]
    fields = chrome.execute_script(
        "const f = {}; for (const i of document.querySelectorAll('input[data-param]')) f[i.dataset.param] = i.value;"
        "return [f, +document.getElementById('makespan').dataset.value]"
    )
    base, now = _sim("1f1b", p=4, m=8), _sim("1f1b", p=4, m=2)
    assert fields == [{"p": "4", "m": "2"}, pytest.approx(now.timeline.makespan)]  # the source's, not the baseline's
    (e0, k0, b0), (e1, k1, b1) = _rank_facts(base), _rank_facts(now)
    d = _deltas(chrome)
    assert d["makespan"] == pytest.approx(now.timeline.makespan - base.timeline.makespan, rel=1e-6)
    assert d["bubble"] == pytest.approx(b1 - b0, abs=1e-6)
    assert d["peak"] == pytest.approx(k1.max() - k0.max())
    assert [r for r, *_ in d["ranks"]] == [0, 1, 2, 3]
    for r, dend, dpeak, marked, (end_red, peak_red) in d["ranks"]:
        assert dend == pytest.approx(e1[r] - e0[r], rel=1e-6, abs=1e-6), r
        assert dpeak == pytest.approx(k1[r] - k0[r]), r
        assert marked and end_red  # every rank ends earlier
        assert peak_red == (k1[r] != k0[r]), r  # an unchanged peak is not red beside a moved end
    assert any(k1[r] != k0[r] for r in range(4)) and any(k1[r] == k0[r] for r in range(4))  # not all alike
    note = chrome.execute_script("return document.querySelector('[data-role=compare-note]').innerText")
    assert "p=4 m=8" in note and f"makespan {base.timeline.makespan:g}" in note
    # compare mode off again: one panel, no deltas
    _set_value(chrome, "[data-role=compare]", "", "change")
    _wait_drawn(chrome, "pipecView.doc.panels.length === 1")
    assert _deltas(chrome) is None
    assert browser.console_errors(chrome) == []


def _post(url, body):
    req = urllib.request.Request(url + "api/simulate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _columns(panel):
    """A panel's data with every column decoded (titles and source paths aside: they name the targets)."""

    def walk(x):
        if isinstance(x, dict):
            if "b64" in x:
                return decode(x).tolist()
            return {k: walk(v) for k, v in x.items() if k != "title"}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    return walk(panel)


def test_playground_compare_with_a_library_schedule_is_pipec_view_compare(chrome, playground):
    # in the page: the compare menu's library schedule, taking the source's parameters as --compare does
    chrome.get(playground + "?schedule=1f1b&p=4&m=8&compare=zb-h1")
    _wait_drawn(chrome, "pipecView.doc.panels.length === 2")
    titles = chrome.execute_script("return pipecView.doc.panels.map((P) => P.title)")
    assert titles == ["baseline: zb-h1 (p=4 m=8)", "1f1b (p=4 m=8)"]
    zb, f1 = _sim("zb-h1", p=4, m=8), _sim("1f1b", p=4, m=8)
    d = _deltas(chrome)
    assert d["makespan"] == pytest.approx(f1.timeline.makespan - zb.timeline.makespan, rel=1e-6)
    assert d["makespan"] > 0  # zb-h1 fills the bubble 1f1b leaves
    # through the API: the same document `pipec view zb-h1 --compare 1f1b` writes, column for column
    body = {
        "source": library.read("1f1b").text,
        "params": {"p": 4, "m": 8},
        "compare": {"source": library.read("zb-h1").text, "params": {"p": 4, "m": 8}},
    }
    status, answer = _post(playground, body)
    assert status == 200 and answer["ok"] and answer["compare"]["ok"]
    assert answer["compare"]["makespan"] == zb.timeline.makespan and answer["makespan"] == f1.timeline.makespan
    want = view_document("zb-h1", [("p", 4), ("m", 8)], compare="1f1b")
    assert [_columns(p) for p in answer["view"]["panels"]] == [_columns(p) for p in want["panels"]]
    assert browser.console_errors(chrome) == []


def test_a_baseline_that_fails_is_not_drawn_and_says_why(chrome, playground):
    source = library.read("1f1b").text
    status, answer = _post(playground, {"source": source, "params": {"p": 2}, "compare": {"source": "schedule ("}})
    assert status == 200 and answer["ok"]
    assert len(answer["view"]["panels"]) == 1 and answer["view"]["panels"][0]["ranks"] == 2
    assert not answer["compare"]["ok"] and answer["compare"]["diagnostics"][0]["path"] == "<baseline>"
    status, answer = _post(playground, {"source": source, "compare": "zb-h1"})
    assert status == 400 and "compare" in answer["error"]
    # in the page: a library baseline refused at these parameters (dualpipe-v requires m >= 2p)
    chrome.get(playground + "?schedule=1f1b&p=4&m=4&compare=dualpipe-v")
    note = browser.wait_for(chrome, "document.querySelector('[data-role=compare-note].bad')?.innerText")
    assert note.startswith("baseline not drawn: ") and "m >= 2p" in note
    assert chrome.execute_script("return pipecView.doc.panels.length") == 1
    assert _deltas(chrome) is None


def _expected_legend(doc):
    """The legend's entries from what the document holds, by the viewer's names."""
    names = {"FWD": "F", "BWD": "B", "WGRAD": "W", "RECOMPUTE": "recompute", "REDUCE_GRAD": "reduce-grad"}
    names |= {"UNSHARD": "unshard", "RESHARD": "reshard", "OFFLOAD": "offload", "RELOAD": "reload"}
    out = set()
    for P in doc["panels"]:
        ops = decode(P["ops"]["op"])
        held = {OPCODES[c] for c in np.unique(ops)}
        for lane in ("colls", "host", "a2a"):
            held |= {OPCODES[c] for c in np.unique(decode(P[lane]["op"]))}
        out |= {names[k] for k in held if k in names}
        rank, stage = decode(P["ops"]["rank"]), decode(P["ops"]["stage"])
        chunks = max(len(np.unique(stage[rank == r])) for r in range(P["ranks"]))
        out |= {f"chunk {c}" for c in range(min(chunks, 5))} if chunks > 1 else set()
        kinds = set(decode(P["msgs"]["kind"]).tolist())
        out |= {"activation msg"} if 0 in kinds else set()
        out |= {"gradient msg"} if 1 in kinds else set()
        flags = decode(P["ops"]["flags"])
        out |= {"critical path"} if (flags & 1).any() or (decode(P["msgs"]["flags"]) & 1).any() else set()
        out |= {"overlapped pair (&)"} if (flags & 6).any() else set()
        out |= {"idle gap"} if P["gaps"]["start"]["n"] else set()
        out |= {"memory (device)"} if P["memory"] else set()
        out |= {"host pool"} if P["memory"] and P["memory"]["host"] else set()
    return out


@pytest.mark.parametrize("case", LEGEND_CASES, ids=[c[0] for c in LEGEND_CASES])
def test_the_legend_lists_what_the_view_holds_and_the_selection_marks_only_with_a_selection(chrome, tmp_path, case):
    name, params = case
    doc = view_document(name, list(params))
    out = tmp_path / "view.html"
    out.write_text(page(doc))
    chrome.get(out.as_uri())
    browser.wait_for(chrome, "document.getElementById('pipec-view').dataset.ready === '1'")
    want = _expected_legend(doc)
    assert _legend(chrome) == want
    assert {"F", "B"} <= want and len(want) >= 6  # not a comparison of two near-empty sets
    chrome.execute_script("pipecView.select(0, pipecView.doc.panels[0].op_off[1] + 1); pipecView.draw()")
    assert _legend(chrome) == want | SELECTION_ENTRIES
    chrome.execute_script("pipecView.select(null); pipecView.draw()")
    assert _legend(chrome) == want
    chrome.execute_script("pipecView.search('mb 1', true); pipecView.draw()")
    assert _legend(chrome) == want | {"search match"}
    assert browser.console_errors(chrome) == []


def test_ten_thousand_ranks_open_and_draw_in_the_playground(chrome, playground):
    # the case: 1f1b p=10000 m=8, 160,000 ops (its time: benchmarks/view_scale.py --playground)
    chrome.get(playground + "?schedule=1f1b&p=10000&m=8")
    _wait_drawn(chrome, "pipecView.doc.panels[0].ranks === 10000", timeout=300)
    facts = chrome.execute_script(
        "const v = pipecView, P = v.doc.panels[0], f = {};"
        "for (const i of document.querySelectorAll('input[data-param]')) f[i.dataset.param] = i.value;"
        "v.draw(); return {ops: P.ops.op.length, mbs: P.maxMb + 1, fields: f,"
        " rows: v.shown.filter((L) => L.type === 'ops').map((L) => L.r),"
        " stats: document.querySelector('[data-role=stats]').innerText}"
    )
    assert facts["ops"] == 160_000 and facts["mbs"] == 8
    assert facts["fields"] == {"p": "10000", "m": "8"}
    assert 0 < len(facts["rows"]) < 100 and facts["rows"][0] == 0  # the rows in view, not ten thousand
    assert facts["stats"].count("10,000 ranks") == 1
    shown = chrome.execute_script("pipecView.scrollToRank(0, 9999); return pipecView.shown.map((L) => L.r)")
    assert 9999 in shown and 0 not in shown
    assert "depends on (selected)" not in _legend(chrome)
    assert browser.console_errors(chrome) == []
