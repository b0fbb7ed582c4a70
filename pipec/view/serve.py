"""The playground behind `pipec serve`: a schedule's source in the browser, checked and simulated as it is
typed, through the one driver.

The server is the standard library's `http.server.ThreadingHTTPServer`: no dependency to vet, and a
playground on loopback serves one person. Every request is bounded, because a page that re-simulates on
each keystroke must not be able to stop it: bodies above `MAX_BODY` are refused unread, a schedule above
`MAX_OPS` ops is refused with a message, work runs on a small pool with a `TIMEOUT_S` deadline (a request
past it gets an error answer; the language's evaluation budget ends the work itself), and any failure of
a handler is answered as JSON. pipec.cli.serve prints the URL; nothing here prints.

Endpoints (JSON in, JSON out):
- `GET /`: the page (viewer and playground inlined, like `pipec view`'s file);
- `GET /api/library`, `GET /api/library/NAME`: the library's names; one schedule's text and parameters;
- `POST /api/simulate` {source, params, costs, compare}: diagnostics (line and column), the parameters the
  source declares, the makespan and the view's document; with `compare` ({source, params}: a baseline,
  under the same costs) the document draws the baseline above the source, as `pipec view --compare` does;
- `POST /api/download` {source, params, costs, what}: the `.pipe`, the Program (text), the torch CSV or the
  view's HTML, as a file.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_BODY = 1 << 20  # a schedule's source is a few KiB; a MiB leaves room and bounds what one request holds
MAX_OPS = 200_000  # what one keystroke may simulate and send to the page (about 0.3 s and a few MB)
TIMEOUT_S = 20.0
BODY_TIMEOUT_S = 30.0  # seconds a client may take to send its request (headers and body)
MAX_DEPTH = 8  # how deep a request's JSON may nest (a request is {source, params: {...}, costs: {...}})
CACHE = 4  # compiled targets kept for the next requests: a cost edit redraws without parsing or compiling
COST_KEYS = ("F", "B", "W", "comm", "overhead")
DOWNLOADS = {
    "pipe": ("text/plain; charset=utf-8", "schedule.pipe"),
    "program": ("text/plain; charset=utf-8", "schedule.program.txt"),
    "csv": ("text/csv; charset=utf-8", "schedule.csv"),
    "html": ("text/html; charset=utf-8", "view.html"),
}


@dataclass(frozen=True)
class Answer:
    """An HTTP answer: status, content type, body, and the file name for a download (None: shown inline)."""

    status: int
    content_type: str
    body: bytes
    filename: str | None = None


class RequestError(Exception):
    """A request the playground refuses: its HTTP status and the message of its JSON answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def content_length(values: list[str]) -> int:
    """The body's length from its Content-Length header(s): ASCII digits, at most MAX_BODY (RequestError 400
    for a malformed value or two that differ, 413 above the bound: the body is then left unread)."""
    texts = {v.strip() for v in values}
    if len(texts) != 1:
        raise RequestError(400, "the request has Content-Length headers that differ")
    text = texts.pop()
    if not (text.isascii() and text.isdigit()) or len(text) > 20:
        raise RequestError(400, f"malformed Content-Length {text[:40]!r}: expected a number of bytes (ASCII digits)")
    n = int(text)
    if n > MAX_BODY:
        raise RequestError(413, f"the request is {n:,} bytes; the limit is {MAX_BODY:,}")
    return n


_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def json_depth(raw: bytes) -> int:
    """How deep a JSON text nests its arrays and objects (brackets inside strings do not count); a cheap scan
    before json.loads, which would recurse once per level."""
    depth = deepest = 0
    for m in _JSON_TOKEN.finditer(raw):
        c = m.group()[:1]
        if c in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        elif c in (b"]", b"}"):
            depth -= 1
    return deepest


def parse_body(raw: bytes) -> object:
    """A request body as JSON (RequestError 400 when it is not UTF-8 JSON, or nests deeper than MAX_DEPTH:
    a request is an object of strings and numbers, two levels deep)."""
    depth = json_depth(raw)
    if depth > MAX_DEPTH:
        raise RequestError(400, f"the request body nests {depth:,} levels deep; a request takes at most {MAX_DEPTH}")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise RequestError(400, "the request body is not JSON") from None


def _json(obj: object, status: int = 200) -> Answer:
    return Answer(status, "application/json", json.dumps(obj, separators=(",", ":")).encode())


def diagnostics_json(err: Exception) -> list[dict[str, Any]]:
    """A PipecError's diagnostics as the page shows them (`Diagnostic.to_json`: code, message, line and
    column, the formatted text)."""
    return [d.to_json() for d in getattr(err, "diagnostics", ())]


def _request(body: object) -> tuple[str, list[tuple[str, str]], list[dict]]:
    """The source, the parameters given a value, and the cost documents of a request (RequestError if ill-formed)."""
    from pipec import driver

    if not isinstance(body, dict) or not isinstance(body.get("source"), str):
        raise RequestError(400, "expected a JSON object with `source` (the schedule's text)")
    params = body.get("params") or {}
    costs = body.get("costs") or {}
    if not isinstance(params, dict) or not isinstance(costs, dict):
        raise RequestError(400, "`params` and `costs` must be JSON objects")
    for k, v in [*params.items(), *costs.items()]:
        if v is not None and (isinstance(v, (dict, list)) or not isinstance(v, (str, int, float))):
            raise RequestError(400, f"`{k[:40]}` must be a string or a number, not a JSON {type(v).__name__}")
    given = [(str(k), str(v).strip()) for k, v in params.items() if v is not None and str(v).strip() != ""]
    spec = []
    for k, v in costs.items():
        if k not in COST_KEYS:
            raise RequestError(400, f"unknown cost `{k[:40]}` (expected {', '.join(COST_KEYS)})")
        if v is None or isinstance(v, bool):
            raise RequestError(400, f"cost `{k}` must be a number")
        if str(v).strip() == "":
            continue
        try:
            x = float(v)
        except (TypeError, ValueError):
            raise RequestError(400, f"cost `{k}` must be a number, not {str(v)[:40]!r}") from None
        if not x >= 0 or x == float("inf"):
            raise RequestError(400, f"cost `{k}` must be a finite number >= 0")
        spec.append(f"{k}={x!r}")
    return body["source"], given, driver.cost_docs(",".join(spec)) if spec else []


def _target(text: str, params: list[tuple[str, str]], path: str = "<playground>"):
    """The Schedule or Program the source holds (its parameters: those it declares, given a value)."""
    from pipec import driver
    from pipec.errors import Source
    from pipec.formats.program_file import is_program_text, parse_program

    source = Source(path, text)
    if is_program_text(text):
        return parse_program(text, path), ()
    names = driver.param_names(source)
    sched = driver.build(source, [(k, v) for k, v in params if k in names], check=False)
    if sched.num_ops > MAX_OPS:
        raise RequestError(413, f"{sched.num_ops:,} ops: the playground simulates at most {MAX_OPS:,} (use pipec view)")
    return driver.checked(sched), names  # checked once it is known to be small, not evaluated twice


_compiled: OrderedDict[tuple, tuple[Any, tuple[str, ...], Any]] = OrderedDict()
_compiled_lock = threading.Lock()


def _prepared(text: str, params: list[tuple[str, str]], docs: list[dict], path: str = "<playground>"):
    """The target of a source at its parameters, the parameter names it declares, and the target compiled
    (None where compiling refuses with a deadlock, E401, which the panel draws with its chain of waits). The
    last `CACHE` are kept, keyed by the source, its parameters and what the compile reads of the cost
    documents (their memory overrides and MoE layers): a request that changes only the costs (F, B, W, comm,
    overhead) redraws without parsing, checking or compiling again. Errors are not kept."""
    from pipec import driver
    from pipec.errors import PipecError

    overrides = driver.memory_overrides(docs)
    layers = repr([d["moe_layers"] for d in docs if "moe_layers" in d])
    key = (path, text, tuple(params), repr(sorted(overrides.items())), layers)
    with _compiled_lock:
        hit = _compiled.get(key)
        if hit is not None:
            _compiled.move_to_end(key)
            return hit
    obj, names = _target(text, params, path)
    try:
        c = driver.compiled(obj, overrides, None, None, None, None, driver.moe_layers_of(obj, docs))
    except PipecError as e:
        if e.code != "E401":
            raise
        c = None
    with _compiled_lock:
        _compiled[key] = (obj, names, c)
        while len(_compiled) > CACHE:
            _compiled.popitem(last=False)
    return obj, names, c


def clear_cache() -> None:
    """Forget every compiled target (benchmarks time a cold request with it)."""
    with _compiled_lock:
        _compiled.clear()


def _compare_request(body: object) -> tuple[str, list[tuple[str, str]]] | None:
    """The baseline a request compares with (`compare`: {source, params}; absent or null: none)."""
    cmp = body.get("compare") if isinstance(body, dict) else None
    if cmp is None:
        return None
    if not isinstance(cmp, dict) or not isinstance(cmp.get("source"), str):
        raise RequestError(400, "`compare` must be a JSON object with `source` (the baseline's text)")
    text, params, _ = _request({"source": cmp["source"], "params": cmp.get("params")})
    return text, params


def _values(sched) -> dict[str, str]:
    return {k: str(v) for k, v in sched.params}


def simulate(body: object, level: int = 1) -> dict[str, Any]:
    """What the page shows for a request: diagnostics, parameter names, makespan and the view's document.
    With `compare` (a baseline's source and parameters, the same costs), the document draws the baseline
    first and the source second, the way `pipec view --compare` draws its two (`pipec.view.html.
    target_panel`, one code path), so the page's summary gives the second minus the first per rank; the
    answer's `compare` says what the baseline is drawn at, or why it is not drawn. `level`: how hard the
    view's columns are deflated (1 for an answer drawn once; a download keeps 6, as `pipec view` does)."""
    from pipec import driver
    from pipec.errors import PipecError, Source
    from pipec.view.html import compression, drawn_document, new_sources, target_panel

    text, params, docs = _request(body)
    baseline = _compare_request(body)
    names: tuple[str, ...] = ()
    try:
        names = driver.param_names(Source("<playground>", text))
        obj, names, c = _prepared(text, params, docs)
        sources = new_sources()
        memory = driver.memory_overrides(docs)
        with compression(level):  # an answer drawn once and dropped: deflate fast (pipec.view.html.encode)
            compared = _baseline(baseline, sources, docs, memory) if baseline else None  # the first panel
            drawn = [target_panel(obj, None, sources, docs, memory, compiled=c)]
        if compared is not None and "drawn" in compared:
            base = compared.pop("drawn")
            base.panel["title"] = "baseline: " + base.panel["title"]
            drawn.insert(0, base)
        view = drawn_document(drawn, sources, docs)
        now = drawn[-1]
        answer: dict[str, Any] = {
            "params": list(names),
            "values": _values(now.schedule),  # what the picture is drawn at
            "view": view,
        }
        if compared is not None:
            answer["compare"] = compared
        if now.refusal is not None:
            return {"ok": False, "diagnostics": diagnostics_json(now.refusal), "makespan": None, **answer}
        sim = now.sim
        return {
            "ok": True,
            "diagnostics": [],
            "makespan": float(sim.timeline.makespan),
            "ops": int(sim.schedule.num_ops),
            **answer,
        }
    except PipecError as e:
        return {"ok": False, "diagnostics": diagnostics_json(e), "params": list(names), "makespan": None, "view": None}


def _baseline(baseline: tuple[str, list[tuple[str, str]]], sources, docs, memory) -> dict[str, Any]:
    """The baseline's panel (`drawn`) and what the page says of it; a baseline that fails or is refused is
    not drawn, and its diagnostics say why (the source's own picture is drawn alone)."""
    from pipec.errors import PipecError
    from pipec.view.html import target_panel

    text, params = baseline
    try:
        obj, _, c = _prepared(text, params, docs, "<baseline>")
        drawn = target_panel(obj, None, sources, docs, memory, compiled=c)
    except PipecError as e:
        return {"ok": False, "diagnostics": diagnostics_json(e), "error": None}
    except RequestError as e:
        return {"ok": False, "diagnostics": [], "error": str(e)}
    out: dict[str, Any] = {"ok": drawn.refusal is None, "values": _values(drawn.schedule)}
    out["title"] = drawn.panel["title"]
    out["diagnostics"] = diagnostics_json(drawn.refusal) if drawn.refusal is not None else []
    out["makespan"] = float(drawn.sim.timeline.makespan) if drawn.sim is not None else None
    out["drawn"] = drawn
    return out


def download(body: object) -> Answer:
    """One of the downloads the page offers (`what`: pipe, program, csv or html) for the request's schedule."""
    from pipec import driver
    from pipec.errors import PipecError
    from pipec.formats import program_file
    from pipec.formats.torch_csv_writer import export_csv
    from pipec.view.html import page

    what = body.get("what") if isinstance(body, dict) else None
    if what not in DOWNLOADS:
        raise RequestError(400, f"`what` must be one of {', '.join(DOWNLOADS)}")
    ctype, name = DOWNLOADS[what]
    text, params, docs = _request(body)
    if what == "pipe":
        return Answer(200, ctype, text.encode(), name)
    try:
        if what == "html":
            result = simulate(body, 6)
            if result["view"] is None:
                raise RequestError(422, "the schedule has errors: " + result["diagnostics"][0]["text"])
            return Answer(200, ctype, page(result["view"]).encode(), name)
        obj, _ = _target(text, params)
        c = driver.compiled(obj, driver.memory_overrides(docs))
        if what == "program":
            return Answer(200, ctype, program_file.to_text(c.program).encode(), name)
        return Answer(200, ctype, export_csv(c.schedule, c.program).encode(), name)
    except PipecError as e:
        raise RequestError(422, "\n".join(d["text"] for d in diagnostics_json(e))) from None


def library_answer(path: str) -> Answer:
    """`/api/library` (the names) or `/api/library/NAME` (its text and parameters)."""
    from pipec import driver
    from pipec.errors import PipecError
    from pipec.frontend import library

    names = library.names()
    if path in ("/api/library", "/api/library/"):
        return _json({"names": names})
    name = path.removeprefix("/api/library/")
    if name not in names:
        raise RequestError(404, f"no library schedule `{name[:80]}`")
    source = library.read(name)
    try:
        params = list(driver.param_names(source))
    except PipecError:
        params = []
    return _json({"name": name, "text": source.text, "params": params})


def playground_page() -> str:
    """The playground's page: its HTML with the viewer's and its own CSS and JS inlined."""
    from pipec.view.html import static_text

    html = static_text("playground.html")
    for marker, name in (
        ("/*VIEWER_CSS*/", "viewer.css"),
        ("/*PLAYGROUND_CSS*/", "playground.css"),
        ("/*VIEWER_JS*/", "viewer.js"),
        ("/*PLAYGROUND_JS*/", "playground.js"),
    ):
        html = html.replace(marker, static_text(name))
    return html


class Playground(ThreadingHTTPServer):
    """The playground's server: one thread per connection, the work of each on a bounded pool."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], timeout_s: float = TIMEOUT_S) -> None:
        super().__init__(address, Handler)
        self.timeout_s = timeout_s
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pipec-serve")
        self.page = playground_page()

    def run(self, fn, *args):
        """fn(*args) on the pool, or RequestError 503 past the deadline (the work ends on its own budget)."""
        future = self.pool.submit(fn, *args)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise RequestError(503, f"the request took over {self.timeout_s:g} s; simplify the schedule") from None

    def server_close(self) -> None:
        super().server_close()
        self.pool.shutdown(wait=False, cancel_futures=True)


class Handler(BaseHTTPRequestHandler):
    """Routes a request and answers it; every failure is an answer (JSON with `error`), never a crash."""

    server: Playground
    timeout = BODY_TIMEOUT_S  # socketserver's: a client that stops sending holds no thread for ever
    protocol_version = "HTTP/1.1"
    server_version = "pipec-serve"

    def log_message(self, format: str, *args: object) -> None:  # quiet: pipec.cli.serve prints the URL only
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._answer(self._get)

    def do_POST(self) -> None:  # noqa: N802
        self._answer(self._post)

    def _get(self) -> Answer:
        path = self.path.split("?", 1)[0]
        if path in ("/", "/index.html"):
            return Answer(200, "text/html; charset=utf-8", self.server.page.encode())
        if path.startswith("/api/library"):
            return library_answer(path)
        raise RequestError(404, f"no such page `{path[:80]}`")

    def _post(self) -> Answer:
        path = self.path.split("?", 1)[0]
        if path not in ("/api/simulate", "/api/download"):
            raise RequestError(404, f"no such endpoint `{path[:80]}`")
        body = parse_body(self._body())
        if path == "/api/simulate":
            return _json(self.server.run(simulate, body))
        return self.server.run(download, body)

    def _body(self) -> bytes:
        """The request's body, as its Content-Length says (RequestError: 411 without one, 400 for a malformed
        one or a body cut short, 413 above MAX_BODY, 408 when it does not arrive within `timeout`)."""
        lengths = self.headers.get_all("Content-Length") or []
        if not lengths:
            raise RequestError(411, "a POST needs a Content-Length")
        n = content_length(lengths)
        try:
            raw = self.rfile.read(n)
        except TimeoutError:
            self.close_connection = True
            raise RequestError(408, f"the request body did not arrive within {self.timeout:g} s") from None
        if len(raw) != n:
            self.close_connection = True
            raise RequestError(400, f"the request body has {len(raw):,} bytes, not the {n:,} its Content-Length says")
        return raw

    def _answer(self, route) -> None:
        try:
            answer = route()
        except RequestError as e:
            answer = _json({"error": str(e)}, e.status)
            if e.status == 413:  # the body was not read: close rather than parse it as the next request
                self.close_connection = True
        except Exception as e:  # a bug must not stop the server: answer it
            answer = _json({"error": f"internal error: {type(e).__name__}: {str(e)[:200]}"}, 500)
        try:
            self.send_response(answer.status, HTTPStatus(answer.status).phrase)
            self.send_header("Content-Type", answer.content_type)
            self.send_header("Content-Length", str(len(answer.body)))
            self.send_header("Cache-Control", "no-store")
            if answer.filename:
                self.send_header("Content-Disposition", f'attachment; filename="{answer.filename}"')
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(answer.body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def make_server(host: str = "127.0.0.1", port: int = 0, timeout_s: float = TIMEOUT_S) -> Playground:
    """A playground bound to host:port (port 0: one the system picks); serve it with `serve_forever`."""
    return Playground((host, port), timeout_s)


def start_in_thread(host: str = "127.0.0.1", port: int = 0, timeout_s: float = TIMEOUT_S) -> Playground:
    """A playground serving from a daemon thread (tests, notebooks); stop it with shutdown() and server_close()."""
    srv = make_server(host, port, timeout_s)
    threading.Thread(target=srv.serve_forever, daemon=True, name="pipec-serve").start()
    return srv
