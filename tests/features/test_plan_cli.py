"""`pipec plan` end to end: from a layer table to the plan, its baselines, its files (the partition file read
back by the one reader, the .pipe checked by pipec check, the picture) and its JSON; and every bad input a
located, coded diagnostic (E830 to E833, docs/errors.md), never a traceback."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from cli_helpers import run_cli
from repo import ROOT
from tables import random_layer_table

from pipec.formats.partition_files import make_table, read_partition, write_json

pytest.importorskip("ortools")


def _table(tmp_path, layers=6, names=None, seed=0) -> str:
    t = random_layer_table(np.random.default_rng(seed), layers)
    doc = t.to_json()
    doc["microbatches"] = 4
    if names:
        for row, name in zip(doc["layers"], names):
            row["name"] = name
        doc["model"]["layers"] = list(names)
        doc["model"]["fingerprint"] = make_table(doc["layers"]).fingerprint
    path = str(tmp_path / "layers.json")
    write_json(path, doc)
    return path


def test_plan_prints_the_plan_beside_the_baselines_and_writes_its_files(tmp_path):
    names = ["embed", "b0", "b1", "b2", "b3", "head"]
    table = _table(tmp_path, names=names)
    out = str(tmp_path / "plan")
    rc, stdout, stderr = run_cli(
        "plan", "--layers-cost", table, "-p", "2", "--global-batch", "8", "--time-limit", "15", "--json", "-o", out
    )
    assert rc == 0, stderr
    doc = json.loads(stdout)
    assert doc["plan"]["step"] > 0 and doc["lower_bound"] <= doc["plan"]["step"] + 1e-12
    assert doc["megatron"] is not None and doc["megatron"]["gain"] >= 1 - 1e-9
    assert doc["library"] is not None and doc["library"]["gain"] >= 1 - 1e-9
    assert doc["pareto"][0]["step"] == doc["plan"]["step"]
    assert "--pipeline-model-parallel-layout" in doc["megatron_lm"]["flags"]
    assert os.path.isfile(os.path.join(out, "pareto.png")) and os.path.isfile(os.path.join(out, "pareto.svg"))
    part = read_partition(os.path.join(out, "partition.json"))
    assert [n for stage in part.stages for n in stage] == names
    assert doc["plan"]["layers_per_stage"] == [len(s) for s in part.stages]
    assert doc["run"].startswith("pipec run ") and "--partition" in doc["run"]
    if os.path.isfile(os.path.join(out, "plan.pipe")):  # memory ops per stage: a schedule of its own
        rc, _, err = run_cli("check", os.path.join(out, "plan.pipe"))
        assert rc == 0, err


def test_plan_text_report_shows_why_and_the_bound(tmp_path):
    table = _table(tmp_path, names=["embed", "b0", "b1", "b2", "b3", "head"], seed=1)
    rc, stdout, stderr = run_cli("plan", "--layers-cost", table, "-p", "2", "--global-batch", "8", "--time-limit", "10")
    assert rc == 0, stderr
    assert "(a) Megatron-LM default" in stdout and "(b) best library + partition" in stdout
    assert "bubble" in stdout and "imbalance" in stdout and "Pareto front" in stdout
    assert "bound: no plan in the space steps below" in stdout
    assert "pipec plan: screened" in stderr  # progress


def test_a_limit_no_plan_meets_is_e830_with_the_excess(tmp_path):
    table = _table(tmp_path)
    rc, _, stderr = run_cli(
        "plan", "--layers-cost", table, "-p", "2", "--global-batch", "8", "--memory-limit", "10B", "--time-limit", "5"
    )
    assert rc == 1
    assert "error[E830]: no plan fits the memory limits" in stderr and "over its limit of 10 B" in stderr
    assert "Traceback" not in stderr


def test_ranks_that_disagree_with_p_are_e831(tmp_path):
    table = _table(tmp_path)
    args = ("plan", "--layers-cost", table, "-p", "2", "--global-batch", "8")
    rc, _, stderr = run_cli(*args, "--ranks", "speed=1,1,0.5")
    assert rc == 1 and "error[E831]: --ranks gives 3 values for `speed`, but -p is 2: 1 too many" in stderr
    ranks = tmp_path / "ranks.toml"
    ranks.write_text("speed = [1, 0.5]\nmem = ['1GiB', '1GiB', '1GiB']\n")
    rc, _, stderr = run_cli("plan", "--layers-cost", table, "--global-batch", "8", "--ranks", str(ranks))
    assert rc == 1 and f"{ranks}: error[E831]" in stderr and "3 values for `mem` but 2 for `speed`" in stderr


def test_microbatches_that_do_not_divide_the_batch_are_e832(tmp_path):
    table = _table(tmp_path)
    rc, _, stderr = run_cli("plan", "--layers-cost", table, "-p", "2", "--global-batch", "8", "--microbatches", "3")
    assert rc == 1 and "error[E832]: --microbatches 3 does not divide --global-batch 8" in stderr


def test_a_layer_table_of_another_model_is_e833(tmp_path):
    pytest.importorskip("torch")
    table = _table(tmp_path, layers=12)
    model = os.path.join(ROOT, "examples", "uneven.py")
    rc, _, stderr = run_cli("plan", "--layers-cost", table, "--model", model, "-p", "2", "--global-batch", "8")
    assert rc == 1
    want = f"{table}: error[E833]: the layer table is not of `{model}`: its layer 0 is `l0`, the model's `embed`"
    assert want in stderr
    assert "Traceback" not in stderr
