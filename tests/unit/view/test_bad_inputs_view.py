"""Bad inputs of `pipec view` and `pipec serve`: a damaged trace (every event checked by the trace reader,
against the Program it is laid over), a damaged Program, malformed HTTP requests; each a located diagnostic
or a 400 answer, never a drawing, a hang or a 500. The property test feeds the trace reader bad values of
every kind in every field and holds it to PipecError."""

from __future__ import annotations

import copy
import json
import math
import socket

import pytest
from cli_helpers import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipec.api import compile as compile_program
from pipec.driver import simulation, target_of
from pipec.errors import PipecError
from pipec.formats.trace import Bounds, read_trace, trace_events
from pipec.ir.program import Program
from pipec.view import serve
from pipec.view.html import view_document


@pytest.fixture(scope="module")
def trace_doc() -> dict:
    """The trace of 1f1b at p=2, m=2 (8 compute events, 4 messages), as JSON."""
    return trace_events(simulation(target_of("1f1b", [("p", "2"), ("m", "2")])[0]).timeline)


def _x(doc: dict, cat: str) -> int:
    """The index of the first `X` event of a category."""
    return next(i for i, e in enumerate(doc["traceEvents"]) if e["ph"] == "X" and e["cat"] == cat)


def _damaged(doc: dict, tmp_path, change) -> str:
    d = copy.deepcopy(doc)
    change(d)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(d, allow_nan=True))
    return str(path)


def _set(cat: str, field: str, value):
    def change(d):
        ev = d["traceEvents"][_x(d, cat)]
        (ev if field == "pid" else ev["args"])[field] = value

    return change


DAMAGE = [
    ("NaN start", _set("FWD", "start_s", math.nan), "`args.start_s` must be a finite number of seconds"),
    ("infinite end", _set("BWD", "end_s", math.inf), "`args.end_s` must be a finite number of seconds"),
    ("end before start", _set("FWD", "end_s", -1.0), "`args.end_s` must be at least `args.start_s`"),
    ("rank out of range", _set("FWD", "pid", 7), "`pid` must be an integer from 0 to 1"),
    ("stage of 1e18", _set("FWD", "stage", 10**18), "`args.stage` must be an integer from 0 to 1"),
    ("stage 5 of 2", _set("FWD", "stage", 5), "`args.stage` must be an integer from 0 to 1"),
    ("negative micro-batch", _set("FWD", "mb", -1), "`args.mb` must be an integer from 0 to 1"),
    ("micro-batch a string", _set("FWD", "mb", "0"), "`args.mb` must be an integer"),
    ("negative bytes", _set("send", "bytes", -1), "`args.bytes` must be a number of bytes"),
    ("message to rank 9", _set("send", "dst", 9), "`args.dst` must be an integer from 0 to 1"),
    ("unknown message kind", _set("send", "kind", "x"), "`args.kind` must be act or grad"),
    ("unknown opcode", _set("FWD", "op", "JUMP"), "`args.op` must be one of"),
    ("no events at all", lambda d: d.__setitem__("traceEvents", []), "the trace has no compute events"),
    ("version true", lambda d: d["otherData"].__setitem__("version", True), "version true is not supported"),
    ("version 1.0", lambda d: d["otherData"].__setitem__("version", 1.0), "version 1.0 is not supported"),
    ("version 2", lambda d: d["otherData"].__setitem__("version", 2), "version 2 is not supported"),
    ("another schedule's ranks", lambda d: d["otherData"].__setitem__("num_ranks", 3), "the trace has 3 ranks"),
]


@pytest.mark.parametrize(("what", "change", "message"), DAMAGE, ids=[d[0] for d in DAMAGE])
def test_view_measured_refuses_a_damaged_trace_naming_the_event(trace_doc, tmp_path, what, change, message):
    path = _damaged(trace_doc, tmp_path, change)
    out = tmp_path / "v.html"
    rc, stdout, stderr = run_cli("view", "1f1b", "-D", "p=2", "-D", "m=2", "--measured", path, "-o", str(out))
    assert rc == 1, (what, stderr)
    assert "error[E802]" in stderr and message in stderr, (what, stderr)
    assert "Traceback" not in stderr and not out.exists()


def test_the_diagnostic_names_the_file_and_the_event(trace_doc, tmp_path):
    path = _damaged(trace_doc, tmp_path, _set("FWD", "stage", 10**18))
    i = _x(trace_doc, "FWD")
    with pytest.raises(PipecError) as e:
        view_document("1f1b", [("p", "2"), ("m", "2")], measured=path)
    assert str(e.value) == (
        f"{path}: error[E802]: event #{i} (`F0`): `args.stage` must be an integer from 0 to 1 (`1f1b`'s stages), "
        "got 1000000000000000000"
    )


def test_a_trace_alone_is_checked_against_its_own_header(trace_doc, tmp_path):
    path = _damaged(trace_doc, tmp_path, _set("FWD", "stage", 10**18))
    rc, _, stderr = run_cli("view", path, "-o", str(tmp_path / "v.html"))
    assert rc == 1 and "`args.stage` must be an integer from 0 to 9,999,999 (the trace's stages)" in stderr


def test_a_whole_trace_still_reads_and_draws(trace_doc, tmp_path):
    path = _damaged(trace_doc, tmp_path, lambda d: None)
    tl = read_trace(path, Bounds(2, 2, 2, "`1f1b`"))
    assert tl.num_ranks == 2 and len(tl.start) == 8
    rc, stdout, stderr = run_cli(
        "view", "1f1b", "-D", "p=2", "-D", "m=2", "--measured", path, "-o", str(tmp_path / "v.html")
    )
    assert rc == 0 and "8 ops" in stdout, stderr


def test_view_of_a_damaged_program_object_is_refused_with_the_validators_diagnostic():
    prog = compile_program("1f1b", p=2, m=2)
    rank0 = prog.ranks[0]
    bad = Program(**{**{f: getattr(prog, f) for f in prog.__dataclass_fields__}, "ranks": (rank0, rank0)})
    with pytest.raises(PipecError) as e:
        view_document(bad)
    assert e.value.code == "E502"


def test_view_of_a_damaged_program_file_is_refused(tmp_path):
    from pipec.formats.program_file import to_text

    text = to_text(compile_program("1f1b", p=2, m=2)).replace("FWD 1 1\n", "FWD 1 0\n")
    path = tmp_path / "p.txt"
    path.write_text(text)
    out = tmp_path / "v.html"
    rc, _, stderr = run_cli("view", str(path), "-o", str(out))
    assert rc == 1 and "error[E502]" in stderr and "stage 0 is placed on rank 0" in stderr and not out.exists()


# ---- the property: any bad value in any field of an event ----------------------------------------------

_BAD = st.one_of(
    st.just(math.nan),
    st.just(math.inf),
    st.just(-math.inf),
    st.just(10**18),
    st.just(10**400),
    st.integers(max_value=-1),
    st.just(1e300),
    st.none(),
    st.booleans(),
    st.text(max_size=4),
    st.just([[[[[]]]]]),
    st.just({"a": {"b": {}}}),
)
_FIELDS = [
    ("FWD", "pid"),
    ("FWD", "start_s"),
    ("FWD", "end_s"),
    ("FWD", "mb"),
    ("FWD", "stage"),
    ("FWD", "op"),
    ("send", "src"),
    ("send", "dst"),
    ("send", "send_s"),
    ("send", "arrival_s"),
    ("send", "bytes"),
    ("send", "kind"),
    ("send", "stage"),
]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(_FIELDS), value=_BAD)
def test_property_a_bad_field_is_e802(trace_doc, tmp_path, field, value):
    cat, name = field
    if isinstance(value, (int, float)) and not isinstance(value, bool) and name in ("start_s", "send_s"):
        if -1e12 <= value <= 1e12:
            return  # a start may be any time; only its end is bound to it
    if (name, value) in (("op", "FWD"), ("op", "BWD"), ("kind", "act"), ("kind", "grad"), ("bytes", 10**18)):
        return  # a value the field takes
    path = _damaged(trace_doc, tmp_path, _set(cat, name, value))
    with pytest.raises(PipecError) as e:
        read_trace(path, Bounds(2, 2, 2, "`1f1b`"))
    assert e.value.code == "E802"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(["num_ranks", "version", "dp", "dp_kind", "params", "slicing", "format"]), value=_BAD)
def test_property_a_bad_header_is_e802(trace_doc, tmp_path, field, value):
    if (field == "slicing" and value is None) or (field == "dp_kind" and value in ("ddp", "fsdp")):
        return  # values the header takes (no slicing; a kind)
    path = _damaged(trace_doc, tmp_path, lambda d: d["otherData"].__setitem__(field, value))
    with pytest.raises(PipecError) as e:
        read_trace(path)
    assert e.value.code == "E802"


# ---- pipec serve ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    srv = serve.start_in_thread("127.0.0.1", 0, timeout_s=5.0)
    yield srv
    srv.shutdown()
    srv.server_close()


def _raw(server, request: bytes, shutdown_write: bool = False) -> tuple[int, dict]:
    """Send raw bytes, read the whole answer: (status, its JSON body)."""
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=30) as s:
        s.sendall(request)
        if shutdown_write:
            s.shutdown(socket.SHUT_WR)
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(next(x for x in head.split(b"\r\n") if x.lower().startswith(b"content-length:")).split(b":")[1])
        while len(body) < length:
            body += s.recv(65536)
    return int(head.split()[1]), json.loads(body)


def _post(length: bytes, body: bytes) -> bytes:
    return b"POST /api/simulate HTTP/1.1\r\nHost: x\r\nContent-Length: " + length + b"\r\n\r\n" + body


@pytest.mark.parametrize(
    "length", [b"abc", b"\xc2\xb2", b"9" * 5000, b"-1", b"0x10", b"1, 2", b""], ids=lambda v: repr(v[:12])
)
def test_a_malformed_content_length_is_400(server, length):
    status, doc = _raw(server, _post(length, b'{"source": "x"}'))
    assert status == 400 and "Content-Length" in doc["error"]


def test_a_body_cut_short_is_400(server):
    status, doc = _raw(server, _post(b"100", b'{"source": "x"}'), shutdown_write=True)
    assert status == 400 and "not the 100 its Content-Length says" in doc["error"]


@pytest.mark.parametrize("depth", [20, 900, 5000, 100_000])
def test_deeply_nested_json_is_400(server, depth):
    body = b'{"source": "x", "params": {"p": ' + b"[" * depth + b"]" * depth + b"}}"
    status, doc = _raw(server, _post(str(len(body)).encode(), body))
    assert status == 400 and f"nests {depth + 2:,} levels deep" in doc["error"]


@pytest.mark.parametrize("body", [{"source": "x", "params": {"p": [2]}}, {"source": "x", "costs": {"F": True}}])
def test_values_that_are_no_string_or_number_are_400(server, body):
    data = json.dumps(body).encode()
    status, doc = _raw(server, _post(str(len(data)).encode(), data))
    assert status == 400 and "error" in doc


def test_the_server_still_serves_after_them(server):
    data = json.dumps({"source": "x"}).encode()
    status, doc = _raw(server, _post(str(len(data)).encode(), data))
    assert status == 200 and not doc["ok"] and doc["diagnostics"][0]["code"] == "E001"


def test_json_depth_skips_brackets_in_strings():
    assert serve.json_depth(b'{"a": "[[[[{{{{", "b": [1, [2]]}') == 3
    assert serve.json_depth(b'{"a": "\\"[[["}') == 1
