"""Command-line values and run options (pipec.options): each kind of value is read by one parser and
refused the same way by every command (exit status 2, argparse's `argument --X: ...`), and `RunOptions`
goes to a worker's argv and back unchanged."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
from cli_helpers import run_cli

from pipec import options
from pipec.options import OptionError, RunOptions


@pytest.fixture
def layers(tmp_path) -> str:
    """A layer table for `pipec partition --layers-cost`, written as `--save-layers` writes one."""
    from pipec.formats.partition_files import make_table, write_json

    rows = [
        {
            "name": f"l{i}",
            "F": 1.0,
            "B": 2.0,
            "W": 1.0,
            "full_backward": 3.0,
            "act_bytes": 64,
            "out_bytes": 8,
            "param_bytes": 32,
            "params": [["weight", [i + 1, 2]]],
        }
        for i in range(4)
    ]
    path = str(tmp_path / "layers.json")
    write_json(path, make_table(rows).to_json())
    return path


def _misuse(argv: list[str], want: str) -> str:
    rc, out, err = run_cli(*argv)
    assert rc == 2, (argv, rc, err)
    assert want in err and "Traceback" not in err, (argv, err)
    return err


def test_a_bad_amount_is_misuse_in_check_and_in_partition_alike(layers):
    """`--memory-limit 12XB` was exit 2 in `check` but exit 1 (E803) in `partition`."""
    check = _misuse(["check", "1f1b", "--memory-limit", "12XB"], "argument --memory-limit: ")
    part = _misuse(
        ["partition", "1f1b", "-D", "p=2", "-D", "m=2", "--layers-cost", layers, "--memory-limit", "12XB"],
        "argument --memory-limit: ",
    )
    assert check.splitlines()[-1].split(": error: ")[1] == part.splitlines()[-1].split(": error: ")[1]
    assert "pipec partition: error: argument --memory-limit" in part


@pytest.mark.parametrize("value", ["nan", "-1", "inf", "1_0", "٤"])
def test_partition_time_limit_is_a_finite_number(layers, value):
    _misuse(
        ["partition", "1f1b", "-D", "p=2", "-D", "m=2", "--layers-cost", layers, "--time-limit", value],
        "argument --time-limit: ",
    )


def test_partition_reps_is_a_count(layers):
    _misuse(
        ["partition", "1f1b", "--layers-cost", layers, "--reps", "0"], "argument --reps: expected an integer from 1"
    )


@pytest.mark.parametrize("value", ["1_0", "0", "x", "٤"])
def test_slice_counts_are_ascii_integers_of_at_least_one(value):
    """`pipec slice --max-slices 1_0` read 10."""
    _misuse(["slice", "--max-slices", value], "argument --max-slices: ")
    _misuse(["slice", "--granularity", value], "argument --granularity: ")


def test_the_memory_limit_reads_units_the_same_in_every_command(layers):
    assert options.amount("1.5GiB") == 1.5 * 2**30 and options.amount("12GB") == 12e9 and options.amount("7") == 7.0
    rc, out, err = run_cli(
        "partition", "1f1b", "-D", "p=2", "-D", "m=2", "--layers-cost", layers, "--memory-limit", "1KiB", "--json"
    )
    assert rc == 0, err
    assert json.loads(out)["ranks"]["memory_limit"] == [1024.0, 1024.0]


def test_value_parsers():
    bad = argparse.ArgumentTypeError
    assert options.finite("1e3") == 1000.0 and options.finite(" 2.5 ") == 2.5
    for text in ("nan", "inf", "-1", "1_0", "٤", "", "1e400"):
        with pytest.raises(bad):
            options.finite(text)
    assert options.count(1, 5)("+3") == 3
    for text in ("0", "6", "1_0", "٤", "1.0", "1" * 13):
        with pytest.raises(bad):
            options.count(1, 5)(text)
    assert options.integer("-7") == -7
    assert options.duration("500ms") == 0.5 and options.duration("2m") == 120.0 and options.duration("3") == 3.0
    for text in ("0s", "nan", "1_0s", "-1s", "fast"):
        with pytest.raises(bad):
            options.duration(text)
    assert options.define(" p = 4 ") == ("p", "4")
    assert options.span("east=0..4") == ("east", 0, 4)
    for text in ("east", "east=0..", "=0..2", "east=1_0..12", "east=٤..5", "east=-1..2"):
        with pytest.raises(bad, match="expected NAME=LO..HI"):
            options.span(text)
    for text in ("p", "=3"):
        with pytest.raises(bad, match="expected NAME=VALUE"):
            options.define(text)
    for text in ("12XB", "nan", "lots"):
        with pytest.raises(bad):
            options.amount(text)


def test_dp_flags_read_into_data_parallelism():
    ap = argparse.ArgumentParser()
    options.add_dp_arguments(ap)
    ns = ap.parse_args(["--dp", "2", "--dp-kind", "fsdp", "--prefetch", "0"])
    assert options.dp_given(ns) and options.dp_of(ns) == options.DataParallel(2, "fsdp", 0, None)
    assert not options.dp_given(ap.parse_args([]))
    _misuse(["check", "1f1b", "--dp", "1_0"], "argument --dp: expected an integer")


def _worker_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    RunOptions.add_arguments(ap, launcher=False)
    return ap


@pytest.mark.parametrize(
    "opts",
    [
        RunOptions(model="m.py"),
        RunOptions(
            model="m.py",
            steps=7,
            check=True,
            tol=1e-7,
            trace="/t/trace.json",
            timeout=12.5,
            backend="nccl",
            seed=-3,
            recv_ahead=0,
            cpu_bind="none",
            checkpoint="/t/ck",
            checkpoint_every=2,
            resume=True,
            loss_scale=0.1,
            dp=2,
            dp_kind="fsdp",
            prefetch=0,
            max_gathered=1,
            dp_unit="block",
            no_overlap=True,
            links="/t/links.json",
            memory_out="/t/memory.json",
            records="/t/records.jsonl",
        ),
    ],
)
def test_run_options_go_to_a_worker_and_back_unchanged(opts):
    """Every option a worker takes survives to_argv and the worker's parser (launcher-only ones stay)."""
    back = RunOptions.from_args(_worker_parser().parse_args(opts.to_argv()))
    assert back == opts
    launcher = dataclasses.replace(opts, nproc=4, local=False, memory=True, link_scale=2.0, topology="x")
    assert launcher.to_argv() == opts.to_argv()


def test_every_run_option_has_its_flag():
    """A field of RunOptions without a flag would never reach `pipec run` or a worker."""
    cli, worker = argparse.ArgumentParser(), _worker_parser()
    RunOptions.add_arguments(cli)
    cli.add_argument("--topology")  # pipec run's, shared with show and simulate (pipec.cli.args)
    for f in dataclasses.fields(RunOptions):
        dest = {a.dest for a in (worker if f.name not in RunOptions.LAUNCHER else cli)._actions}
        assert f.name in dest, f.name


def test_run_options_that_do_not_go_together_are_misuse():
    with pytest.raises(OptionError, match="need --checkpoint DIR"):
        RunOptions(model="m.py", resume=True)
    _misuse(["run", "1f1b", "--model", "m.py", "--checkpoint-every", "2"], "pipec run: error: --checkpoint-every")
    _misuse(["run", "1f1b", "--model", "m.py", "--steps", "0"], "argument --steps: expected an integer from 1")
    err = _misuse(["run", "1f1b", "--model", "m.py", "--tol", "nan", "--json"], "argument --tol: ")
    assert "usage: pipec run" in err


def test_cpu_bind_choices_are_the_runtime_s():
    from pipec.runtime.host.affinity import MODES

    assert options.CPU_BIND_MODES == MODES


@pytest.mark.parametrize("name", ["a\nb", 'say "hi"', "", "x" * 101, "tab\there"])
def test_a_synth_name_the_language_cannot_write_is_misuse(name, tmp_path):
    rc, out, err = run_cli("synth", "-p", "2", "-m", "2", "--name", name, "-o", str(tmp_path / "s.pipe"))
    assert rc == 2 and "expected a schedule name" in err and not (tmp_path / "s.pipe").exists(), err


def test_an_output_that_is_a_folder_or_in_no_folder_is_misuse_before_any_work(tmp_path):
    table = tmp_path / "t.json"
    for argv in (
        ["synth", "-p", "2", "-m", "2", "-o", str(tmp_path)],
        ["partition", "1f1b", "-D", "p=2", "-D", "m=2", "--layers-cost", str(table), "-o", str(tmp_path)],
        ["partition", "1f1b", "-D", "p=2", "-D", "m=2", "--layers-cost", str(table), "-o", str(tmp_path / "no/x.json")],
        ["partition", "1f1b", "-D", "p=2", "-D", "m=2", "--model", "m.py", "--save-layers", str(tmp_path)],
    ):
        rc, out, err = run_cli(*argv)  # the table and model do not exist: refused before they are read
        assert rc == 2 and ("is a folder" in err or "does not exist" in err) and "Traceback" not in err, (argv, err)
