"""The tools' last bad inputs (issue 41): a layer table whose bytes would overflow `pipec partition`'s
integers (an activation of 1e18 bytes once raised OR-Tools' int64 overflow as a traceback), a memory limit
above anything the rows count, and `pipec slice` of a schedule whose slice prices would not fit in memory
(`-D p=100000` once ended in numpy's 6 GiB MemoryError). Each is a diagnostic naming its bound, or the
right answer."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tables import random_layer_table

from pipec.cli import app as cli
from pipec.errors import PipecError
from pipec.slicing import MAX_PRICES, slice_schedule

pytest.importorskip("ortools")


def _table(tmp_path, **edit: float) -> str:
    doc = random_layer_table(np.random.default_rng(0), 8).to_json()
    for key, value in edit.items():
        doc["layers"][2][key] = value
    path = tmp_path / "layers.json"
    path.write_text(json.dumps(doc))
    return str(path)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("field", ["act_bytes", "param_bytes", "state_bytes"])
def test_a_layer_of_1e18_bytes_with_a_memory_limit_is_a_diagnostic_naming_the_bound(tmp_path, capsys, field):
    argv = ["partition", "1f1b", "-D", "p=4", "-D", "m=8", "--layers-cost", _table(tmp_path, **{field: 1e18})]
    code, _, err = _run(capsys, *argv, "--memory-limit", "1GiB")
    assert code == 1, err
    assert "Traceback" not in err
    assert f"error[E803]: layer table: `{field}` of layer `l2` is 1e+18 bytes, too large to partition" in err
    assert "each layer's bytes may be at most 7,407,236,229,227" in err


def test_the_largest_accepted_bytes_partition(tmp_path, capsys):
    """The bound the diagnostic states is one the partition takes (every layer at it, rows below 2^53)."""
    doc = random_layer_table(np.random.default_rng(0), 8).to_json()
    for row in doc["layers"]:
        row.update(act_bytes=7_407_236_229_227, param_bytes=7_407_236_229_227, state_bytes=7_407_236_229_227)
        row.pop("wact_bytes", None)
    path = tmp_path / "layers.json"
    path.write_text(json.dumps(doc))
    code, out, err = _run(
        capsys, "partition", "1f1b", "-D", "p=4", "-D", "m=8", "--layers-cost", str(path), "--memory-limit", "1e15"
    )
    assert code in (0, 1), err  # a split, or E806 naming the closest: either way the integers held
    assert "Traceback" not in err
    assert code == 0 or "error[E806]" in err


def test_a_memory_limit_above_anything_a_row_counts_is_no_limit(tmp_path, capsys):
    base = ["partition", "1f1b", "-D", "p=4", "-D", "m=8", "--layers-cost", _table(tmp_path)]
    code, free, err = _run(capsys, *base)
    assert code == 0, err
    code, huge, err = _run(capsys, *base, "--memory-limit", "1e30")
    assert code == 0, err

    def split(out: str) -> list[str]:  # the stage table, the split's layers
        return out.split("predicted step")[0].splitlines()[1:]

    assert len(split(free)) == 5 and split(free) == split(huge)


def test_slice_of_100000_stages_is_a_size_diagnostic_before_allocating(capsys):
    code, _, err = _run(capsys, "slice", "terapipe", "-D", "p=100000", "--cost", "attn=0.3")
    assert code == 1, err
    assert "Traceback" not in err and "MemoryError" not in err
    assert "error[E809]: pricing every slice on every stage takes 100,000 stages x 8,256 slices" in err
    assert f"the search takes at most {MAX_PRICES:,}" in err
    assert "--granularity 128 (16 positions)" in err  # the coarser grid it names fits the bound
    assert 100_000 * 16 * 17 // 2 <= MAX_PRICES


def test_slice_just_past_the_bound_is_refused_and_its_hint_runs():
    from pipec.driver import read_source

    source = read_source("terapipe")
    with pytest.raises(PipecError) as e:  # 2,100 stages x 8,256 slices of 128 positions > 2^24
        slice_schedule(source, {"p": 2100}, [{"attn": 0.3}])
    assert e.value.code == "E809" and "2,100 stages x 8,256 slices" in str(e.value)
