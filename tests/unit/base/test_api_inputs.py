"""The Python API's arguments (pipec/api.py): every bad one is a PipecError naming it (E840), never a bare
TypeError, and never silently taken (a NaN memory limit read as none); the property test feeds the five
functions bad values of every kind and holds them to PipecError."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipec
from pipec import api
from pipec.errors import PipecError


def _deep(n: int) -> list:
    d: list = [1]
    for _ in range(n):
        d = [d]
    return d


BAD = [
    ("memory limit negative", lambda: api.check("1f1b", p=2, m=2, memory={"limit": -1}), "memory['limit']"),
    ("memory limit NaN", lambda: api.check("1f1b", p=2, m=2, memory={"limit": math.nan}), "memory['limit']"),
    ("memory limit inf", lambda: api.compile("1f1b", p=2, m=2, memory={"limit": math.inf}), "memory['limit']"),
    ("memory value text", lambda: api.check("1f1b", p=2, m=2, memory={"act": "lots"}), "memory['act']"),
    ("memory value bool", lambda: api.check("1f1b", p=2, m=2, memory={"limit": True}), "memory['limit']"),
    ("memory unknown key", lambda: api.check("1f1b", p=2, m=2, memory={"foo": 1}), "unknown key 'foo'"),
    ("memory a list", lambda: api.simulate("1f1b", p=2, m=2, memory=[1, 2]), "`memory`"),
    ("memory bytes per stage NaN", lambda: api.check("1f1b", p=2, m=2, memory={"saved_bytes": [1, math.nan]}), "[1]"),
    ("params a list", lambda: api.load("1f1b", [1, 2]), "`params`"),
    ("params a string", lambda: api.compile("1f1b", "p=2"), "`params`"),
    ("parameter a list", lambda: api.load("1f1b", p=[2]), "`p`"),
    ("parameter deeply nested", lambda: api.load("1f1b", p=_deep(5000)), "`p`"),
    ("parameter of 5000 digits", lambda: api.load("1f1b", p=10**5000), "`p`"),
    ("name an int", lambda: api.load(5), "`name_or_path`"),
    ("target a list", lambda: api.check([1]), "`target`"),
    ("target a dict", lambda: api.compile({"a": 1}), "`target`"),
    ("cost a number", lambda: api.simulate("1f1b", p=2, m=2, cost=5), "`cost`"),
    ("cost list of numbers", lambda: api.simulate("1f1b", p=2, m=2, cost=["F=1", 5]), "`cost[1]`"),
    ("cost nested deep", lambda: api.simulate("1f1b", p=2, m=2, cost={"F": _deep(100_000)}), "`cost`"),
    ("topology a number", lambda: api.simulate("1f1b", p=2, m=2, topology=5), "`topology`"),
    ("data_parallel an int", lambda: api.compile("1f1b", p=2, m=2, data_parallel=2), "`data_parallel`"),
    ("experts an int", lambda: api.check("1f1b", p=2, m=2, experts=2), "`experts`"),
    ("moe_layers text", lambda: api.compile("1f1b", p=2, m=2, moe_layers="x"), "`moe_layers`"),
    ("moe_layers NaN", lambda: api.compile("1f1b", p=2, m=2, moe_layers=[math.nan]), "`moe_layers`"),
    ("overlap text", lambda: api.simulate("1f1b", p=2, m=2, overlap="no"), "`overlap`"),
    ("read_program an int", lambda: api.read_program(5), "`path`"),
    ("read_program None", lambda: api.read_program(None), "`path`"),
]


@pytest.mark.parametrize(("what", "call", "named"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_argument_is_e840_naming_it(what, call, named):
    with pytest.raises(PipecError) as e:
        call()
    assert e.value.code == "E840", what
    assert named in str(e.value), (what, str(e.value))


def test_the_top_level_names_check_too():
    with pytest.raises(PipecError) as e:
        pipec.check("1f1b", p=4, m=8, memory={"limit": float("nan")})
    assert str(e.value) == "pipec: error[E840]: `memory['limit']` must be a finite number from 0 to 1e18, got nan"


def test_good_arguments_still_work():
    c = api.check("1f1b", p=2, m=2, memory={"limit": 3, "saved_bytes": [1.0, 2.0]})
    assert c.program.num_ranks == 2
    sim = api.simulate("1f1b", {"p": 2}, m=2, cost=["F=1", {"B": 2}], memory={"act": 1}, overlap=False)
    assert sim.stats.makespan > 0
    assert api.load("1f1b", p=2, m=2).num_ranks == 2


def test_trace_and_program_readers_refuse_non_paths():
    with pytest.raises(PipecError) as e:
        api.read_trace(5)
    assert e.value.code == "E802" and "takes a path" in str(e.value)
    with pytest.raises(PipecError) as e:
        api.write_trace("not a timeline", "/tmp/never-written.json")
    assert e.value.code == "E903" and "takes a Timeline" in str(e.value)


def test_trace_writer_names_an_unwritable_path(tmp_path):
    timeline = api.simulate("1f1b", p=2, m=2).timeline
    with pytest.raises(PipecError) as e:
        api.write_trace(timeline, tmp_path / "no-such-folder" / "t.json")
    assert e.value.code == "E903" and "cannot write" in str(e.value) and "t.json" in str(e.value)


# ---- the property: bad values of every kind, PipecError and nothing else ---------------------------------

_bad_number = st.one_of(
    st.just(math.nan),
    st.just(math.inf),
    st.just(-math.inf),
    st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False),
    st.integers(max_value=-1),
    st.integers(min_value=2**64, max_value=10**400),
)
_wrong_kind = st.one_of(
    st.none(),
    st.booleans(),
    st.lists(st.text(max_size=2), min_size=1, max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), min_size=1, max_size=2),
    st.builds(_deep, st.integers(min_value=1, max_value=3000)),
    st.binary(max_size=4),
    st.just(object()),
)
_anything_bad = st.one_of(_bad_number, _wrong_kind, st.text(max_size=8))


@settings(max_examples=60, deadline=None)
@given(
    fn=st.sampled_from(["check", "compile", "simulate"]),
    argument=st.sampled_from(["memory_value", "memory", "params", "p", "cost", "moe_layers", "target", "dp"]),
    value=_anything_bad,
)
def test_property_bad_values_raise_only_pipec_error(fn, argument, value):
    kwargs: dict = {"p": 2, "m": 2}
    target: object = "1f1b"
    params = None
    if argument == "memory_value":
        kwargs["memory"] = {"limit": value}
    elif argument == "memory":
        kwargs["memory"] = value
    elif argument == "params":
        params = value
    elif argument == "p":
        if isinstance(value, str):
            return  # text is a -D value, which the language parses (E206), tested by its own suite
        kwargs["p"] = value
    elif argument == "cost":
        if fn != "simulate" or isinstance(value, str):
            return  # a string is a cost spec or a file name: E801 or E000, tested by the readers
        kwargs["cost"] = value
    elif argument == "moe_layers":
        kwargs["moe_layers"] = value
    elif argument == "target":
        if isinstance(value, str):
            return  # a string names a schedule: E000 when none has that name
        target = value
    else:
        kwargs["data_parallel"] = value
    if value is None and argument in ("memory", "params", "cost", "moe_layers", "dp"):
        return  # None means "not given" for these
    try:
        getattr(api, fn)(target, params, **kwargs)
    except PipecError as e:
        assert e.diagnostics and e.diagnostics[0].code.startswith("E")
    else:
        pytest.fail(f"pipec.{fn} accepted {argument}={value!r}")


@settings(max_examples=30, deadline=None)
@given(value=_wrong_kind)
def test_property_readers_refuse_what_is_no_path(value):
    for fn in (api.read_program, api.load):
        with pytest.raises(PipecError):
            fn(value)
