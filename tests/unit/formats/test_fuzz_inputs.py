"""Fuzzing the inputs added since the schedule fuzzer (issue 32, item 7), as `benchmarks/fuzz.py` does for
schedule texts: partition files, layer tables and command-line flags, each mutated at random from a valid
one. Whatever the mutation, the answer is the document's content or a coded diagnostic (PipecError, exit
status 1 or 2), never a traceback; and a partition file is accepted only when its fingerprint seals the
split it holds, so no edit of a split passes unnoticed."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tables import random_layer_table

from pipec.cli import app as cli
from pipec.errors import PipecError
from pipec.formats.partition_files import partition_doc, read_partition, read_table, split_fingerprint

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=5,
)


def _nodes(doc: object, path: tuple = ()) -> list[tuple]:
    """Every place in a JSON document, as a path of keys and indices."""
    out = [path]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _nodes(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _nodes(v, (*path, i))
    return out


def mutate(doc: object, data: st.DataObject, times: int) -> object:
    """The document after `times` random edits: a value replaced, a key or item removed, an item copied
    or two swapped (what a hand edit, a merge or a damaged disk does)."""
    doc = copy.deepcopy(doc)
    for _ in range(times):
        paths = _nodes(doc)
        path = data.draw(st.sampled_from(paths))
        if not path:
            doc = data.draw(JSON)
            continue
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        key = path[-1]
        how = data.draw(st.sampled_from(["replace", "remove", "copy", "swap"]))
        if how == "replace" or not isinstance(parent, list) and how in ("copy", "swap"):
            parent[key] = data.draw(JSON)
        elif how == "remove":
            del parent[key]
        elif how == "copy":
            parent.insert(key, copy.deepcopy(parent[key]))
        elif len(parent) > 1:
            other = data.draw(st.integers(0, len(parent) - 1))
            parent[key], parent[other] = parent[other], parent[key]
    return doc


def _valid_partition() -> dict:
    table = random_layer_table(np.random.default_rng(0), 6)
    names = list(table.names)
    return partition_doc(table, "1f1b", {"p": 2, "m": 4}, [names[:3], names[3:]])


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(st.data(), st.integers(1, 4))
def test_a_mutated_partition_file_is_its_split_or_a_diagnostic(tmp_path, data, times):
    path = tmp_path / "part.json"
    doc = mutate(_valid_partition(), data, times)
    path.write_text(json.dumps(doc))
    try:
        part = read_partition(str(path))
    except PipecError as e:
        assert e.code in ("E803", "E810"), e
        return
    # accepted: its fingerprint is the seal of exactly the split it holds
    assert doc["fingerprint"] == split_fingerprint(part.fingerprint, part.layers, part.stages)
    assert [x for s in part.stages for x in s] == list(part.layers)


@FUZZ
@given(st.data(), st.integers(1, 4))
def test_a_mutated_layer_table_is_a_table_or_a_diagnostic(tmp_path, data, times):
    path = tmp_path / "table.json"
    doc = mutate(random_layer_table(np.random.default_rng(1), 5).to_json(), data, times)
    path.write_text(json.dumps(doc))
    try:
        table = read_table(str(path))
    except PipecError as e:
        assert e.code == "E803", e
        return
    assert len(set(table.names)) == len(table.names) > 0
    for col in (table.F, table.B, table.W, table.act_bytes, table.param_bytes):
        assert all(math.isfinite(x) and x >= 0 for x in col.tolist())


@FUZZ
@given(st.binary(max_size=64) | st.text(max_size=64).map(str.encode))
def test_any_bytes_as_a_partition_file_or_table_are_a_diagnostic_or_read(tmp_path, raw):
    path = tmp_path / "any.json"
    path.write_bytes(raw)
    for read in (read_partition, read_table):
        try:
            read(str(path))
        except PipecError as e:
            assert e.code == "E803", e


VALUES = ["0", "-1", "1", "2", "3", "8", "2.5", "nan", "inf", "-inf", "1e400", "x", "", "10000001", "٣", "0x10"]
FLAGS = st.lists(
    st.one_of(
        st.tuples(st.just("-D"), st.sampled_from(["p", "m", "v", "q", ""]), st.sampled_from(VALUES)).map(
            lambda t: ["-D", f"{t[1]}={t[2]}"]
        ),
        st.tuples(
            st.sampled_from(["--cost", "--mem", "--memory-limit", "--dp", "--prefetch"]), st.sampled_from(VALUES)
        ).map(list),
        st.sampled_from([["--json"], ["--memory"], ["--dp-kind", "fsdp"], ["--cost", "F=2,B=nan"], ["-D"]]),
    ),
    max_size=4,
).map(lambda parts: [x for part in parts for x in part])


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(["check", "simulate", "show"]), st.sampled_from(["1f1b", "zb-v", "gpipe"]), FLAGS)
def test_random_flags_exit_0_1_or_2_without_a_traceback(capsys, command, name, flags):
    # later -D win: sizes stay small unless fuzzed, and a fuzzed one is small (8) or past the bound (E210)
    argv = [command, name, "-D", "p=2", "-D", "m=2", *flags]
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code in (0, 1, 2), (argv, code, err)
    assert "Traceback" not in err, (argv, err)
