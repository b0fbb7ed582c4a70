"""The view tells the truth on a stage graph (issue 42, part 2: pictures and the viewer), in a real headless
Chromium: clicking an op highlights exactly the ops `pipec.ir.rules.dependencies(..., graph=)` says it needs
and that need it, over the Program's own graph; every cross-rank message is drawn as an arrow and says its
edge; the summary and the legend name the graph; the idle gaps are attributed to the input each op needed;
the playground draws a graph schedule typed into it. The pictures and `pipec show` name the graph too.
A chain document carries none of it (its bytes per op unchanged). What is drawn is read from the page's
`window.pipecDebug`, not pixels."""

from __future__ import annotations

import re
from pathlib import Path

import browser
import numpy as np
import pytest
from cli_helpers import run_cli

from pipec import driver
from pipec.ir import rules
from pipec.ir.opcodes import IS_SEND, KIND_OF
from pipec.view.html import decode, page, view_document

ROOT = Path(__file__).resolve().parents[3]
UNET = (str(ROOT / "examples" / "unet.pipe"), (("p", 4),))
TWO = (str(ROOT / "examples" / "two_encoders.pipe"), ())
CASES = [UNET, TWO]
IDS = ["unet", "two-encoders"]


WINDOW = (1600, 1000)  # the window the pictures and geometry assume (conftest's `chrome`)


@pytest.fixture(scope="module")
def views(tmp_path_factory):
    """Each case's document, page and simulation, built once."""
    out = {}

    def get(case):
        if case not in out:
            target, params = case
            doc = view_document(target, list(params))
            path = tmp_path_factory.mktemp("view") / "graph.html"
            path.write_text(page(doc))
            sim = driver.simulation(driver.target_of(target, dict(params))[0])
            out[case] = (doc, path, sim)
        return out[case]

    return get


def _open(chrome, path):
    chrome.get(path.as_uri())
    browser.wait_for(chrome, "document.getElementById('pipec-view').dataset.ready === '1'", timeout=120)
    assert browser.console_errors(chrome) == []


def _columns(P, group, *names):
    return {k: decode(P[group][k]).astype(np.int64) for k in names}


def _expected(doc, sim):
    """Per op of the page, its dependencies and dependents by pipec.ir.rules.dependencies over the Program's
    graph, as sets of page indices."""
    P, prog = doc["panels"][0], sim.compiled.program
    assert prog.graph is not None and not prog.graph.is_chain
    ops = _columns(P, "ops", "op", "mb", "stage")
    kind = KIND_OF[ops["op"]]
    index = {(int(k), int(u), int(s)): j for j, (k, u, s) in enumerate(zip(kind, ops["mb"], ops["stage"])) if k >= 0}
    slices = sim.schedule.slicing.slices if sim.schedule.slicing else 1
    deps = [set() for _ in kind]
    needed = rules.dependencies(
        kind, ops["mb"], ops["stage"], prog.num_stages, prog.split_backward, slices, graph=prog.graph
    )
    for _, k, u, s, valid in needed:
        for i in np.flatnonzero(valid & (kind >= 0)).tolist():
            j = index.get((int(k[i]), int(u[i]), int(s[i])))
            if j is not None:
                deps[i].add(j)
    dependents = [set() for _ in kind]
    for i, d in enumerate(deps):
        for j in d:
            dependents[j].add(i)
    return deps, dependents


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_clicking_an_op_highlights_exactly_what_the_graph_rules_say(chrome, views, case):
    doc, path, sim = views(case)
    _open(chrome, path)
    deps, dependents = _expected(doc, sim)
    P = doc["panels"][0]
    n = int(P["ops"]["op"]["n"])
    # every op, through the page's own relations (no clicks): the whole schedule, not a sample
    got = chrome.execute_script(
        "const v = pipecView, P = v.doc.panels[0], out = [];"
        "for (let i = 0; i < P.ops.op.length; i++) { const r = v.relations(P, i); out.push([r.deps, r.dependents]); }"
        "return out"
    )
    assert len(got) == n
    for i, (d, e) in enumerate(got):
        assert sorted(d) == sorted(deps[i]) and sorted(e) == sorted(dependents[i]), i
    # the ops where the graph is not a chain, clicked with the real mouse: fan-ins and fan-outs both ways
    ops = _columns(P, "ops", "op", "stage")
    kind = KIND_OF[ops["op"]]
    graph = sim.compiled.program.graph
    fan_in = [s for s in range(graph.num_stages) if len(graph.inputs(s)) > 1]
    fan_out = [s for s in range(graph.num_stages) if len(graph.outputs(s)) > 1]
    picks = []
    for want_kind, stages in ((0, fan_in), (1, fan_out), (0, fan_out), (1, fan_in)):
        hits = np.flatnonzero((kind == want_kind) & np.isin(ops["stage"], stages))
        if len(hits):
            picks += [int(hits[len(hits) // 2]), int(hits[-1])]
    assert len(picks) >= 4
    ranks = decode(P["ops"]["rank"]).astype(np.int64)
    for i in picks:
        pt = chrome.execute_script(
            f"const v = pipecView, P = v.doc.panels[0], s = P.ops.start[{i}], e = P.ops.end[{i}], w = (e - s) * 12;"
            f"v.setWindow(s - w, e + w); return v.opPoint(0, {i})"
        )
        browser.click(chrome, pt["cx"], pt["cy"] + 4)
        sel = browser.wait_for(
            chrome, f"pipecDebug.selection() && pipecDebug.selection().i === {i} && pipecDebug.selection()"
        )
        assert sorted(sel["deps"]) == sorted(deps[i]) and sorted(sel["dependents"]) == sorted(dependents[i]), i
        assert len(deps[i]) + len(dependents[i]) >= 2, i  # a fan: more than one neighbour somewhere
        drawn = chrome.execute_script(
            "pipecView.setWindow(pipecView.full[0], pipecView.full[1]); const h = pipecDebug.highlight();"
            "h.ranks = pipecView.shown.filter((L) => L.type === 'ops').map((L) => L.r); return h"
        )
        on = set(drawn["ranks"])
        assert drawn["selected"] == i
        assert sorted(drawn["deps"]) == sorted(j for j in deps[i] if ranks[j] in on)
        assert sorted(drawn["dependents"]) == sorted(j for j in dependents[i] if ranks[j] in on)
        side = chrome.execute_script("return document.querySelector('[data-role=detail]').innerText")
        assert f"depends on ({len(deps[i])})" in side and f"depended on by ({len(dependents[i])})" in side
    assert browser.console_errors(chrome) == []


def _program_messages(prog):
    """The Program's sends in order: (rank, mb, stage, peer, other) per message."""
    rows = []
    for r, rp in enumerate(prog.ranks):
        for j in np.flatnonzero(IS_SEND[rp.op]).tolist():
            rows.append((r, int(rp.mb[j]), int(rp.stage[j]), int(rp.peer[j]), int(rp.other[j])))
    return rows


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_edge_s_messages_are_drawn_and_name_their_edge(chrome, views, case):
    doc, path, sim = views(case)
    _open(chrome, path)
    P, prog = doc["panels"][0], sim.compiled.program
    M = _columns(P, "msgs", "src", "dst", "kind", "mb", "stage", "to")
    page_rows = sorted(zip(*(M[k].tolist() for k in ("src", "mb", "stage", "dst", "to"))))
    assert page_rows == sorted(_program_messages(prog))  # each message's edge is the Program's
    # each edge between two ranks carries m activations and m gradients
    m = prog.num_microbatches
    for u, v in prog.graph.edges:
        if prog.placement[u] != prog.placement[v]:
            fwd = (M["kind"] == 0) & (M["stage"] == u) & (M["to"] == v)
            bwd = (M["kind"] == 1) & (M["stage"] == v) & (M["to"] == u)
            assert fwd.sum() == m and bwd.sum() == m, (u, v)
    # the whole step in view, every rank's rows on the screen: an arrow for every message
    chrome.execute_script("pipecView.setWindow(pipecView.full[0], pipecView.full[1])")
    arrows = chrome.execute_script("return pipecDebug.arrows()")
    shown = set(chrome.execute_script("return pipecView.shown.filter((L) => L.type === 'p2p').map((L) => L.r)"))
    assert shown == set(range(P["ranks"]))
    assert sorted(i for _, i in arrows) == list(range(len(M["src"])))
    # a message's words say its edge, producer first
    texts = chrome.execute_script(
        "const v = pipecView, P = v.doc.panels[0], out = [];"
        "for (let i = 0; i < P.msgs.kind.length; i++) out.push(v.describeMsg(P, i)[0][1]); return out"
    )
    for i, text in enumerate(texts):
        u, v = (M["stage"][i], M["to"][i]) if M["kind"][i] == 0 else (M["to"][i], M["stage"][i])
        assert f"along edge {u} → {v}: rank {M['src'][i]} → rank {M['dst'][i]}" in text, text
    assert browser.console_errors(chrome) == []


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_summary_and_the_legend_name_the_graph(chrome, views, case):
    doc, path, sim = views(case)
    _open(chrome, path)
    text = sim.compiled.program.graph.describe()
    assert doc["panels"][0]["graph"]["text"] == text
    summary = chrome.execute_script("return document.querySelector('[data-role=summary]').innerText")
    assert summary.endswith(f"stage graph: {text}")
    legend = chrome.execute_script("return document.querySelector('[data-legend=\"stage graph\"]').innerText")
    assert legend == f"stage graph: {text}"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_each_idle_gap_that_waited_for_a_message_waited_for_an_input_of_its_op(views, case):
    doc, _, sim = views(case)
    P = doc["panels"][0]
    assert P["critical_length"] == pytest.approx(P["makespan"])
    ops = _columns(P, "ops", "rank", "op", "mb", "stage")
    start = decode(P["ops"]["start"])
    M = _columns(P, "msgs", "dst", "kind", "mb", "stage", "to")
    G = _columns(P, "gaps", "wkind", "widx")
    gend = decode(P["gaps"]["end"])
    graph = sim.compiled.program.graph
    checked = 0
    for g in np.flatnonzero(G["wkind"] == 1).tolist():
        j = int(G["widx"][g])
        # the op whose start ends the gap, on the message's receiving rank
        i = int(np.flatnonzero((ops["rank"] == M["dst"][j]) & (np.abs(start - gend[g]) < 1e-6))[0])
        k = int(KIND_OF[ops["op"][i]])
        assert (k, int(ops["mb"][i]), int(ops["stage"][i])) == (int(M["kind"][j]), int(M["mb"][j]), int(M["to"][j]))
        sender = int(M["stage"][j])
        assert sender in (graph.inputs(int(ops["stage"][i])) if k == 0 else graph.outputs(int(ops["stage"][i])))
        checked += 1
    assert checked >= 4


def test_a_chain_document_carries_no_graph():
    doc = view_document("1f1b", [("p", 4), ("m", 8)])
    P = doc["panels"][0]
    assert "graph" not in P and "to" not in P["msgs"]
    assert set(P["msgs"]) == {"src", "dst", "kind", "mb", "stage", "send", "arrival", "flags", "recv"}


def test_pictures_and_show_name_the_graph(tmp_path):
    target, params = UNET
    text = "stage graph 0->1, 0->3, 1->2, 2->3"
    rc, out, err = run_cli("show", target, "-Dp=4")
    assert rc == 0, err
    assert out.splitlines()[0].endswith(text)
    rc, out, err = run_cli("show", target, "-Dp=4", "--timeline", "--width", "200")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].endswith(text)
    # the text Gantt draws every op the simulator ran, in its rank's order: F3, B3, ...
    sim = driver.simulation(driver.target_of(target, dict(params))[0])
    for r in range(4):
        row = next(x for x in lines if x.startswith(f"rank {r} "))
        want = [f"{op[0]}{mb}" for op, mb, *_ in sim.timeline.rank_events(r)]
        assert re.findall(r"[FBW]\d+", row[len(f"rank {r}") :]) == want
    png = tmp_path / "unet.png"
    rc, out, err = run_cli("simulate", target, "-Dp=4", "--plot", str(png))
    assert rc == 0, err and png.stat().st_size > 10_000


def test_the_playground_draws_a_graph_schedule_typed_into_it(chrome):
    from pipec.view import serve

    srv = serve.start_in_thread("127.0.0.1", 0, timeout_s=600)
    try:
        chrome.get(f"http://127.0.0.1:{srv.server_address[1]}/?schedule=1f1b")
        browser.wait_for(chrome, "window.pipecView && document.getElementById('makespan').dataset.value", 60)
        source = (ROOT / "examples" / "two_encoders.pipe").read_text()
        chrome.execute_script(
            "const e = document.getElementById('source'); e.value = arguments[0];"
            "e.dispatchEvent(new Event('input', {bubbles: true}))",
            source,
        )
        browser.wait_for(chrome, "pipecView.doc.panels[0].graph && pipecView.doc.panels[0].graph.text", 60)
        sim = driver.simulation(driver.target_of(TWO[0], {})[0])
        P = chrome.execute_script(
            "const P = pipecView.doc.panels[0];"
            "return {edges: P.graph.edges, makespan: P.makespan, n: P.ops.op.length,"
            " arrows: pipecDebug.arrows().length}"
        )
        assert [tuple(e) for e in P["edges"]] == list(sim.compiled.program.graph.edges)
        assert P["makespan"] == pytest.approx(sim.timeline.makespan) and P["n"] == len(sim.timeline.start)
        assert P["arrows"] > 0
        summary = chrome.execute_script("return document.querySelector('[data-role=summary]').innerText")
        assert "stage graph: 0->2, 1->2, 2->3" in summary
        assert browser.console_errors(chrome) == []
    finally:
        srv.shutdown()
        srv.server_close()
