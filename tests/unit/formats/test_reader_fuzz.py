"""Every file reader against the same bad inputs (issue 41, "Done when"): the Program reader (text and JSON
forms), the partition-file reader and the layer-table reader, fed deep nesting, huge, NaN and infinite
numbers, wrong versions, truncated files and binary garbage. Each either raises PipecError with its
format's codes or reads the file correctly (a Program read back is the one its own writer writes again);
nothing else escapes, and a version other than the writer's is always refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tables import random_layer_table

import pipec
from pipec.errors import PipecError
from pipec.formats import program_file as pf
from pipec.formats.partition_files import partition_doc, read_partition, read_table

PROGRAM_CODES = ("E501", "E502")
PARTITION_CODES = ("E803", "E810")
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# What a damaged or hostile file puts where a value belongs.
HOSTILE = [
    "1e400",
    "-1e400",
    "NaN",
    "Infinity",
    "-Infinity",
    "9" * 5000,
    "9" * 30,
    "-1",
    "0",
    "1.5",
    "true",
    "null",
    '"1"',
    "[]",
    "{}",
    "[" * 5000 + "]" * 5000,
    "[" * 900 + "]" * 900,
    '{"a":' * 40 + "1" + "}" * 40,
]
WORDS = ["1e400", "nan", "inf", "9" * 5000, "-1", "1_0", "+1", "٣", "0x10", "", "&", "FWD", "rank", "{", "["]


def _program() -> pipec.Program:
    return pipec.compile("1f1b", p=2, m=3)


def _read(text: str, path: str = "p") -> pipec.Program | None:
    """The Program the text reads as, or None when it is refused with a Program file's code."""
    try:
        return pf.parse_program(text, path)
    except PipecError as e:
        assert e.code in PROGRAM_CODES, e
        return None


def _read_correctly(prog: pipec.Program | None) -> None:
    """An accepted Program is one its writers write and read back unchanged, in both forms."""
    if prog is not None:
        assert pf.from_json(pf.to_json(prog)) == prog
        assert pf.from_text(pf.to_text(prog)) == prog


# ---- the Program reader -----------------------------------------------------------------------------


@FUZZ
@given(st.data())
def test_a_program_json_with_a_hostile_value_anywhere_is_refused_or_read(data):
    text = pf.to_json(_program())
    # a value is what follows a `:` or a `,` or a `[`; replace one of them, whatever it was
    cuts = [i + 1 for i, c in enumerate(text) if c in ":,["]
    at = data.draw(st.sampled_from(cuts))
    end = at + next(j for j, c in enumerate(text[at:]) if c in ",]}")
    _read_correctly(_read(text[:at] + data.draw(st.sampled_from(HOSTILE)) + text[end:], "p.json"))


@FUZZ
@given(st.data())
def test_a_program_text_with_a_hostile_word_or_line_is_refused_or_read(data):
    lines = pf.to_text(_program()).split("\n")
    i = data.draw(st.integers(0, len(lines) - 1))
    how = data.draw(st.sampled_from(["word", "delete", "copy", "params"]))
    if how == "word" and lines[i].split():
        words = lines[i].split()
        words[data.draw(st.integers(0, len(words) - 1))] = data.draw(st.sampled_from(WORDS))
        lines[i] = " ".join(words)
    elif how == "delete":
        del lines[i]
    elif how == "copy":
        lines.insert(i, lines[i])
    else:
        lines[1] = 'schedule "1f1b" {"p": ' + data.draw(st.sampled_from(HOSTILE)) + "}"
    _read_correctly(_read("\n".join(lines), "p.txt"))


@FUZZ
@given(st.sampled_from(["json", "text"]), st.floats(0, 1))
def test_a_truncated_program_is_refused(form, share):
    text = pf.to_json(_program()) if form == "json" else pf.to_text(_program())
    cut = int(len(text) * share)
    assume(text[cut:].strip())  # something of the file is lost, not only its last newline
    assert _read(text[:cut], f"p.{'json' if form == 'json' else 'txt'}") is None


@FUZZ
@given(st.binary(max_size=80))
def test_binary_garbage_as_a_program_file_is_a_diagnostic(tmp_path, raw):
    for name in ("p.json", "p.txt"):
        path = tmp_path / name
        path.write_bytes(raw)
        try:
            pipec.read_program(path)
        except PipecError as e:
            assert e.code in ("E000", *PROGRAM_CODES), e
        else:  # 80 random bytes are never a Program
            raise AssertionError(raw)


@pytest.mark.parametrize("depth", [900, 5000, 100_000])
@pytest.mark.parametrize("form", ["json", "text"])
def test_parameters_nested_thousands_deep_are_not_a_valid_program(depth, form):
    prog = _program()
    deep = "[" * depth + "]" * depth
    if form == "json":
        text = pf.to_json(prog).replace('"params":{', '"params":{"x":' + deep + ",", 1)
    else:
        lines = pf.to_text(prog).split("\n")
        lines[1] = 'schedule "1f1b" {"x": ' + deep + "}"
        text = "\n".join(lines)
    with pytest.raises(PipecError) as e:
        pf.parse_program(text, "p")
    assert e.value.code == "E501"
    assert "this is not a valid Program file" in str(e.value)


@pytest.mark.parametrize("version", ["4", "0", "true", "1.0", '"1"', "1e400", "9" * 5000, "null"])
def test_a_json_program_of_another_version_is_refused(version):
    text = pf.to_json(_program()).replace('"version":1', '"version":' + version, 1)
    with pytest.raises(PipecError) as e:
        pf.from_json(text, "p.json")
    assert e.value.code == "E501"
    assert "not supported" in str(e.value) or "malformed" in str(e.value)


@pytest.mark.parametrize("version", ["4", "0", "01", "+1", "1.0", "٣", "9" * 5000])
def test_a_text_program_of_another_version_is_refused(version):
    text = pf.to_text(_program()).replace(f"{pf.FORMAT} 1\n", f"{pf.FORMAT} {version}\n", 1)
    with pytest.raises(PipecError) as e:
        pf.from_text(text, "p.txt")
    assert e.value.code == "E501" and "is not supported (this pipec reads 1, 2 and 3)" in str(e.value)


def test_the_current_version_reads_in_both_forms():
    prog = _program()
    assert pf.from_json(pf.to_json(prog)) == prog and pf.from_text(pf.to_text(prog)) == prog


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ('{"format":"pipec-progr', "p"),  # cut inside its header: the format name is not whole
        ('{"schedule": 1, "format": "pipec-program", "version": 1', "p"),
        ("[1, 2, 3]", "p"),
        ("hello", "p.json"),
        ("", "p.json"),
        ("pipec-program 1\nschedule", "p.pipe"),
    ],
)
def test_a_damaged_program_is_read_as_a_program_not_as_a_schedule(tmp_path, text, path):
    from pipec.driver import target_of

    assert pf.is_program_text(text, path)
    file = tmp_path / path
    file.write_text(text)
    with pytest.raises(PipecError) as e:
        target_of(str(file))
    assert e.value.code == "E501" and "this is not a valid Program file" in str(e.value)


def test_a_schedule_is_still_a_schedule():
    assert not pf.is_program_text("schedule 't' (p: int = 2) {}", "t.pipe")
    assert not pf.is_program_text("{ not a program", "t.pipe")  # a .pipe file is a schedule unless a header says
    assert not pf.is_program_text("0F0,1F0", "t.csv")


# ---- the partition-file and layer-table readers -------------------------------------------------------


def _table_text() -> str:
    return json.dumps(random_layer_table(np.random.default_rng(3), 4).to_json())


def _partition_text() -> str:
    table = random_layer_table(np.random.default_rng(4), 4)
    names = list(table.names)
    return json.dumps(partition_doc(table, "1f1b", {"p": 2, "m": 4}, [names[:2], names[2:]]))


READERS = [(read_table, _table_text), (read_partition, _partition_text)]


def _refused_or_read(read, tmp_path, text: str) -> object | None:
    path = tmp_path / "f.json"
    path.write_text(text)
    try:
        return read(str(path))
    except PipecError as e:
        assert e.code in PARTITION_CODES, e
        return None


@FUZZ
@given(st.data(), st.sampled_from(READERS))
def test_a_hostile_value_anywhere_in_a_partition_file_or_table_is_refused_or_read(tmp_path, data, reader):
    read, valid = reader
    text = valid()
    cuts = [i + 1 for i, c in enumerate(text) if c in ":,["]
    at = data.draw(st.sampled_from(cuts))
    end = at + next(j for j, c in enumerate(text[at:]) if c in ",]}")
    hostile = data.draw(st.sampled_from(HOSTILE))
    got = _refused_or_read(read, tmp_path, text[:at] + hostile + text[end:])
    if hostile in ("1e400", "-1e400", "NaN", "Infinity", "-Infinity", "9" * 5000, "[" * 5000 + "]" * 5000):
        assert got is None, hostile  # never accepted without a word, wherever it stands


@FUZZ
@given(st.sampled_from(READERS), st.floats(0, 1))
def test_a_truncated_partition_file_or_table_is_refused(tmp_path, reader, share):
    read, valid = reader
    text = valid()
    cut = int(len(text) * share)
    assume(text[cut:].strip())
    assert _refused_or_read(read, tmp_path, text[:cut]) is None


@FUZZ
@given(st.sampled_from(READERS), st.binary(max_size=80))
def test_binary_garbage_as_a_partition_file_or_table_is_refused(tmp_path, reader, raw):
    path = tmp_path / "f.json"
    path.write_bytes(raw)
    with pytest.raises(PipecError) as e:
        reader[0](str(path))
    assert e.value.code in PARTITION_CODES


OTHER_VERSIONS = ["3", "true", "1.0", "2.0", '"1"', "1e400", "9" * 5000, "null"]


@pytest.mark.parametrize(
    ("reader", "version"),
    [(READERS[0], v) for v in ["2", *OTHER_VERSIONS]] + [(READERS[1], v) for v in ["1", *OTHER_VERSIONS]],
)
def test_a_partition_file_or_table_of_another_version_is_refused(tmp_path, reader, version):
    read, valid = reader
    want = '"version": 1' if read is read_table else '"version": 2'
    text = valid()
    assert want in text
    path = tmp_path / "f.json"
    path.write_text(text.replace(want, '"version": ' + version, 1))
    with pytest.raises(PipecError) as e:
        read(str(path))
    assert e.value.code == "E803" and ("version" in str(e.value) or "number" in str(e.value))


@pytest.mark.parametrize("reader", READERS, ids=["table", "partition"])
def test_a_partition_file_or_table_nested_deep_is_refused(tmp_path, reader):
    read, valid = reader
    for deep in ("[" * 20 + "]" * 20, "[" * 5000 + "]" * 5000):
        text = valid()[:-1] + ', "extra": ' + deep + "}"
        path = tmp_path / "f.json"
        path.write_text(text)
        with pytest.raises(PipecError) as e:
            read(str(path))
        assert e.value.code == "E803" and "deep" in str(e.value)


@pytest.mark.parametrize("reader", READERS, ids=["table", "partition"])
def test_the_current_versions_read(tmp_path, reader):
    read, valid = reader
    assert _refused_or_read(read, tmp_path, valid()) is not None
