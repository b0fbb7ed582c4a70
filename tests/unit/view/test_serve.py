"""`pipec serve`'s answers to real HTTP requests, the malformed ones included: an error answer, and the
server keeps serving."""

from __future__ import annotations

import http.client
import json
import time

import pytest

from pipec.frontend import library
from pipec.view import serve


@pytest.fixture(scope="module")
def server():
    srv = serve.start_in_thread("127.0.0.1", 0, timeout_s=5.0)
    yield srv
    srv.shutdown()
    srv.server_close()


def _ask(server, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers=headers or {})
    r = conn.getresponse()
    out = r.status, r.getheader("Content-Type"), r.read()
    conn.close()
    return out


def _alive(server):
    status, _, body = _ask(server, "GET", "/api/library")
    assert status == 200 and "1f1b" in json.loads(body)["names"]


def test_the_page_and_the_library(server):
    status, ctype, body = _ask(server, "GET", "/")
    assert status == 200 and ctype.startswith("text/html") and b"PipecView" in body
    status, _, body = _ask(server, "GET", "/api/library/zb-h1")
    doc = json.loads(body)
    assert status == 200 and doc["params"] == ["p", "m"] and "schedule" in doc["text"]


def test_simulate_answers_the_drivers_makespan(server):
    from pipec import driver

    text = library.read("1f1b").text
    status, _, body = _ask(server, "POST", "/api/simulate", {"source": text, "params": {"p": "3"}, "costs": {"B": 2}})
    doc = json.loads(body)
    sim = driver.simulation(driver.target_of("1f1b", {"p": 3})[0], driver.cost_docs("B=2"))
    assert status == 200 and doc["ok"] and doc["makespan"] == sim.timeline.makespan
    assert doc["view"]["panels"][0]["makespan"] == sim.timeline.makespan


def test_a_schedule_error_is_a_diagnostic_at_its_line(server):
    text = library.read("1f1b").text.replace("stages p", "stages p +", 1)
    status, _, body = _ask(server, "POST", "/api/simulate", {"source": text})
    doc = json.loads(body)
    line = text.split("\n").index(next(x for x in text.split("\n") if "stages p +" in x)) + 1
    assert status == 200 and not doc["ok"] and doc["diagnostics"][0]["code"].startswith("E")
    assert doc["diagnostics"][0]["line"] in (line, line + 1)


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("POST", "/api/simulate", b"{not json", 400),
        ("POST", "/api/simulate", b"[1, 2]", 400),
        ("POST", "/api/simulate", {"source": 5}, 400),
        ("POST", "/api/simulate", {"source": "x", "costs": {"F": "fast"}}, 400),
        ("POST", "/api/simulate", {"source": "x", "costs": {"Q": 1}}, 400),
        ("POST", "/api/simulate", b"\xff\xfe", 400),
        ("POST", "/api/download", {"source": "x", "what": "exe"}, 400),
        ("POST", "/api/nowhere", {}, 404),
        ("GET", "/etc/passwd", None, 404),
        ("GET", "/api/library/../../x", None, 404),
    ],
)
def test_malformed_requests_get_an_error_answer_and_the_server_keeps_serving(server, method, path, body, status):
    got, ctype, answer = _ask(server, method, path, body)
    assert got == status and ctype == "application/json" and json.loads(answer)["error"]
    _alive(server)


def test_a_huge_body_is_refused_unread(server):
    got, _, answer = _ask(server, "POST", "/api/simulate", b"{}", {"Content-Length": str(serve.MAX_BODY + 1)})
    assert got == 413 and "limit" in json.loads(answer)["error"]
    _alive(server)


def test_too_many_ops_is_refused_with_a_message(server):
    text = library.read("gpipe").text
    got, _, answer = _ask(server, "POST", "/api/simulate", {"source": text, "params": {"p": 8, "m": 20000}})
    assert got == 413 and "at most" in json.loads(answer)["error"]
    _alive(server)


def test_work_past_the_deadline_is_an_error_answer(monkeypatch):
    srv = serve.start_in_thread("127.0.0.1", 0, timeout_s=0.3)
    try:
        monkeypatch.setattr(serve, "simulate", lambda body: time.sleep(1.0))
        got, _, answer = _ask(srv, "POST", "/api/simulate", {"source": "x"})
        assert got == 503 and "took over" in json.loads(answer)["error"]
        _alive(srv)
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("what", ["pipe", "program", "csv", "html"])
def test_downloads(server, what):
    text = library.read("1f1b").text
    status, ctype, body = _ask(
        server, "POST", "/api/download", {"source": text, "params": {"p": 2, "m": 2}, "what": what}
    )
    assert status == 200 and ctype == serve.DOWNLOADS[what][0]
    assert {"pipe": b"schedule", "program": b"FWD", "csv": b"0F0", "html": b"PipecView"}[what] in body


def test_a_cost_edit_redraws_without_compiling_and_draws_what_a_cold_request_draws(monkeypatch):
    """The compiled target is kept between requests: a request that changes only the costs compiles nothing
    and answers exactly what the same request answers with nothing kept; a new parameter, a new source or
    a deadlock (drawn, never kept compiled) compiles again."""
    from pipec import driver

    calls = []
    real = driver.compiled

    def counted(obj, *a, **kw):
        calls.append(obj)
        return real(obj, *a, **kw)

    monkeypatch.setattr(driver, "compiled", counted)
    serve.clear_cache()
    body = {"source": library.read("zb-h1").text, "params": {"p": 4, "m": 8}, "costs": {}}
    first = serve.simulate(body)
    edited = serve.simulate({**body, "costs": {"F": "2", "B": "1.5"}})
    assert first["ok"] and edited["ok"] and len(calls) == 1
    assert edited["makespan"] != first["makespan"]
    serve.clear_cache()
    cold = serve.simulate({**body, "costs": {"F": "2", "B": "1.5"}})
    assert len(calls) == 2 and cold == edited
    serve.simulate({**body, "params": {"p": 4, "m": 6}})
    serve.simulate({**body, "source": body["source"] + "\n"})
    assert len(calls) == 4
    for _ in range(serve.CACHE + 1):  # the oldest go: the first request compiles again
        serve.simulate({**body, "params": {"p": 2, "m": 2 + _}})
    serve.simulate(body)
    assert len(calls) == 4 + serve.CACHE + 2
    # a deadlock: kept without a compiled target, the panel compiles (and refuses) on every request, drawn
    from deadlocks import DEADLOCK_1F1B

    dead = {"source": DEADLOCK_1F1B, "params": {}, "costs": {}}
    answers = [serve.simulate(dead), serve.simulate({**dead, "costs": {"F": "2"}})]
    assert all(a["view"]["panels"][0]["kind"] == "deadlock" for a in answers)
