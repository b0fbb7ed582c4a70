"""Partition files edited by hand, or damaged, are refused by name (issue 32): the file's `fingerprint`
covers its split (the model's fingerprint, its layer names in order, the stages), and a file whose layers do
not cover the model exactly once, in order, is E810 naming the layer, before any process starts. Each
hostile edit below once trained another model silently (a layer removed or swapped, the fingerprint left as
it was) or was a traceback (a layer duplicated or renamed); now each is one diagnostic, through the reader,
`pipec run --partition` and `split_model(partition=)`."""

from __future__ import annotations

import copy
import json

import pytest

from pipec.errors import PipecError
from pipec.formats.partition_files import coverage, fingerprint, read_partition, split_fingerprint

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from pipec.runtime.errors import ModelError  # noqa: E402

MODEL = "examples/uneven.py"
LAYERS = ["embed", *(f"block{i}" for i in range(10)), "head"]


@pytest.fixture
def uneven(monkeypatch):
    """The uneven example, small, and a valid partition document for it (2 stages)."""
    monkeypatch.setenv("UNEVEN_BATCH", "8")
    monkeypatch.setenv("UNEVEN_HEAD", "32")
    from pipec.runtime.model.contract import load_model
    from pipec.runtime.model.partitioned import layer_list, model_fingerprint

    model = load_model(MODEL)
    layers = layer_list(model)
    assert [n for n, _ in layers] == LAYERS
    return model, _doc(model_fingerprint(layers), LAYERS, [LAYERS[:6], LAYERS[6:]])


def _doc(fp: str, layers: list[str], stages: list[list[str]], seal: bool = True) -> dict:
    doc = {
        "format": "pipec-partition",
        "version": 2,
        "fingerprint": split_fingerprint(fp, layers, stages) if seal else "0" * 64,
        "model": {"fingerprint": fp, "layers": layers, "path": MODEL},
        "schedule": {"name": "1f1b", "params": {"p": 2, "m": 2}},
        "stages": stages,
    }
    return doc


def _edit(doc: dict, layers: list[str], stages: list[list[str]], reseal: bool) -> dict:
    """The document with other layer lists; the file's fingerprint left as it was, or made again (a hostile
    user who recomputes it: the model check still refuses)."""
    out = copy.deepcopy(doc)
    out["model"]["layers"], out["stages"] = layers, stages
    if reseal:
        out["fingerprint"] = split_fingerprint(doc["model"]["fingerprint"], layers, stages)
    return out


def _without(xs: list[str], name: str) -> list[str]:
    return [x for x in xs if x != name]


def _swap(xs: list[str], a: str, b: str) -> list[str]:
    return [b if x == a else a if x == b else x for x in xs]


def _rename(xs: list[str], a: str, b: str) -> list[str]:
    return [b if x == a else x for x in xs]


def _dup(xs: list[str], a: str) -> list[str]:
    return [y for x in xs for y in ((x, x) if x == a else (x,))]


HOSTILE = {  # name: (layers, stages) from the valid split, and the words the refusal must say
    "removed": (lambda ls, st: (_without(ls, "block3"), [_without(s, "block3") for s in st]),
                "`block3` is in no stage"),
    "swapped": (lambda ls, st: (_swap(ls, "block1", "block2"), [_swap(s, "block1", "block2") for s in st]),
                "`block1` comes after `block2`"),
    "duplicated": (lambda ls, st: (_dup(ls, "block1"), [_dup(s, "block1") for s in st]), "`block1` appears twice"),
    "renamed": (lambda ls, st: (_rename(ls, "block1", "blockX"), [_rename(s, "block1", "blockX") for s in st]),
                "`blockX` is not a layer"),
    "unknown": (lambda ls, st: ([*ls[:-1], "extra", ls[-1]], [st[0], [*st[1][:-1], "extra", st[1][-1]]]),
                "`extra` is not a layer"),
}  # fmt: skip


def _run(part: str, capsys) -> str:
    """`pipec run --partition` on the file: refused before any process starts, with no traceback."""
    from pipec.cli.app import main

    argv = ["run", "1f1b", "-D", "p=2", "-D", "m=2", "--model", MODEL, "--partition", part, "--local", "--steps", "1"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err


@pytest.mark.parametrize("reseal", [False, True], ids=["fingerprint-left", "fingerprint-recomputed"])
@pytest.mark.parametrize("edit", sorted(HOSTILE))
def test_hostile_layer_edits_are_refused_by_name(uneven, tmp_path, capsys, edit, reseal):
    model, doc = uneven
    make, words = HOSTILE[edit]
    path = tmp_path / "part.json"
    path.write_text(json.dumps(_edit(doc, *make(doc["model"]["layers"], doc["stages"]), reseal)))
    from pipec.runtime.model.partitioned import check_partition

    with pytest.raises(PipecError) as e:
        check_partition(model, str(path), 2, "1f1b")
    assert e.value.code == "E810", str(e.value)
    message = e.value.diagnostics[0].message
    assert str(path) in message and words in message, message
    err = _run(str(path), capsys)
    assert "error[E810]" in err and words in err, err
    if edit == "duplicated" or not reseal:  # the reader alone (no model) refuses these too
        with pytest.raises(PipecError) as e:
            read_partition(str(path))
        assert e.value.code == "E810" and str(path) in str(e.value)


def test_the_valid_file_is_accepted_and_builds_the_stages(uneven, tmp_path):
    model, doc = uneven
    path = tmp_path / "part.json"
    path.write_text(json.dumps(doc))
    from pipec.runtime.model.partitioned import build_stages, check_partition

    part = check_partition(model, str(path), 2, "1f1b")
    build = build_stages(model, part)
    assert [len(build(s, 2)) for s in range(2)] == [6, 6]


@pytest.mark.parametrize(
    "change, code, words",
    [
        (lambda d: d.update(fingerprint=d["fingerprint"][:-1] + ("0" if d["fingerprint"][-1] != "0" else "1")),
         "E810", "was edited"),
        (lambda d: d.update(stages=[d["stages"][0][:-1], [d["stages"][0][-1], *d["stages"][1]]]), "E810", "was edited"),
        (lambda d: d["model"].update(fingerprint="f" * 64), "E804", "made for another model"),
        (lambda d: d.update(version=1), "E803", "version 1"),
        (lambda d: d.update(fingerprint=None), "E803", "`fingerprint` must be a SHA-256"),
        (lambda d: d.update(fingerprint="G" * 64), "E803", "`fingerprint` must be a SHA-256"),
        (lambda d: d.update(stages="embed"), "E803", "`stages` must be a list"),
        (lambda d: d.update(stages=[[1, 2], ["head"]]), "E803", "`stages` must be a list"),
        (lambda d: d.update(stages=[[*d["stages"][0], *d["stages"][1]], []]), "E803", "`stages` must be a list"),
        (lambda d: d["model"].update(layers={"embed": 0}), "E803", "`model.layers` must be"),
        (lambda d: d["model"].update(layers=[]), "E803", "`model.layers` must be"),
        (lambda d: d.update(model=[1]), "E803", "no `model` object"),
        (lambda d: d.update(schedule="1f1b"), "E803", "no `schedule.name`"),
        (lambda d: d["schedule"].update(params=[1]), "E803", "`schedule.params` must be an object"),
        (lambda d: d.update(format="pipec-layer-costs"), "E803", "not a pipec-partition file"),
    ],
)  # fmt: skip
def test_damaged_files_are_diagnostics(uneven, tmp_path, capsys, change, code, words):
    model, doc = uneven
    doc = copy.deepcopy(doc)
    change(doc)
    path = tmp_path / "part.json"
    path.write_text(json.dumps(doc))
    from pipec.runtime.model.partitioned import check_partition

    with pytest.raises(PipecError) as e:
        check_partition(model, str(path), 2, "1f1b")
    assert e.value.code == code and words in str(e.value), str(e.value)
    assert str(path) in e.value.diagnostics[0].message
    err = _run(str(path), capsys)
    assert f"error[{code}]" in err


@pytest.mark.parametrize(
    "text, words",
    [("{", "not valid JSON"), ("[1, 2]", "expected a JSON object"), ('"x"', "expected a JSON object"),
     (b"\xff\xfe{", "not UTF-8"), ("", "not valid JSON"), ("[" * 100000, "")],
)  # fmt: skip
def test_not_json_is_a_diagnostic(tmp_path, text, words):
    path = tmp_path / "part.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(PipecError) as e:
        read_partition(str(path))
    assert e.value.code == "E803" and words in str(e.value)


def test_split_model_refuses_edited_files_with_the_code():
    """`split_model(partition=)`: the same refusals as ModelErrors that carry the code."""
    from pipec.runtime.model.split import model_fingerprint, split_model

    model = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 3), nn.Linear(3, 1))
    names = ["0", "1", "2", "3"]
    doc = _doc(model_fingerprint(model, names), names, [names[:2], names[2:]])
    assert [s.fqns for s in split_model(model, partition=doc)] == [("0", "1"), ("2", "3")]
    removed = _edit(doc, ["0", "1", "3"], [["0", "1"], ["3"]], reseal=False)
    with pytest.raises(ModelError, match=r"error\[E810\]: the partition was edited"):
        split_model(model, partition=removed)
    swapped = _edit(doc, ["0", "2", "1", "3"], [["0", "2"], ["1", "3"]], reseal=True)
    with pytest.raises(ModelError, match=r"error\[E810\]: the partition does not split .*`1` comes after `2`"):
        split_model(model, partition=swapped)
    dup = _edit(doc, ["0", "1", "1", "2", "3"], [["0", "1", "1"], ["2", "3"]], reseal=True)
    with pytest.raises(ModelError, match=r"error\[E810\].*`1` appears twice"):
        split_model(model, partition=dup)


def test_coverage_names_the_first_problem():
    model = ["a", "b", "c", "d"]
    assert coverage(model, model) is None
    assert "`b` appears twice" in coverage(["a", "b", "b", "c", "d"], model)
    assert "`x` is not a layer" in coverage(["a", "x", "c", "d"], model)
    assert "`c` is in no stage" in coverage(["a", "b", "d"], model)
    assert "`b` comes after `c`" in coverage(["a", "c", "b", "d"], model)


def test_the_writer_seals_the_split():
    from pipec.formats.partition_files import make_table, parse_partition, partition_doc

    table = make_table([{"name": n, "params": [["w", [2, 2]]]} for n in "abcd"])
    doc = partition_doc(table, "1f1b", {"p": 2, "m": 2}, [["a", "b"], ["c", "d"]])
    assert doc["version"] == 2 and doc["model"]["fingerprint"] == table.fingerprint
    assert doc["fingerprint"] == split_fingerprint(table.fingerprint, "abcd", [["a", "b"], ["c", "d"]])
    assert parse_partition(doc).stages == (("a", "b"), ("c", "d"))
    assert table.fingerprint == fingerprint([(n, [("w", (2, 2))]) for n in "abcd"])
