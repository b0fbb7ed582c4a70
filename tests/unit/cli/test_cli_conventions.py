"""The conventions every `pipec` subcommand follows (docs/cli.md): `--json` shapes, on success and on error;
exit statuses (1 a schedule or input error, 2 misuse); the subcommand's own usage; `--version`; shell
completion; Program files as input; and the public Python API the commands are built on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import run_cli as run
from repo import ROOT

import pipec
from pipec.frontend import library

ENVELOPE = {"version", "command", "ok"}
DIAGNOSTIC = {"code", "severity", "message", "path", "line", "col", "end_line", "end_col", "notes", "text"}
SMALL = ("-D", "p=2", "-D", "m=2")


def doc_of(out: str) -> dict:
    """Standard output under --json: exactly one line, one JSON object."""
    assert out.endswith("\n") and out.count("\n") == 1, out[:200]
    return json.loads(out)


def ok_doc(*argv: str) -> dict:
    rc, out, err = run(*argv)
    assert rc == 0, err
    doc = doc_of(out)
    assert ENVELOPE <= set(doc) and doc["version"] == 1 and doc["ok"] is True
    return doc


def failed_doc(status: int, *argv: str) -> dict:
    rc, out, err = run(*argv)
    assert rc == status, err
    doc = doc_of(out)
    assert set(doc) == ENVELOPE | {"exit", "diagnostics"}
    assert doc["ok"] is False and doc["exit"] == status and doc["diagnostics"]
    for d in doc["diagnostics"]:
        assert set(d) == DIAGNOSTIC
        assert d["text"] in err  # the human text still goes to stderr
    return doc


@pytest.fixture(scope="module")
def programs(tmp_path_factory) -> dict[str, Path]:
    """zb-h1 p=4 m=8 compiled to both Program forms."""
    d = tmp_path_factory.mktemp("programs")
    out = {"json": d / "zb.json", "text": d / "zb.txt"}
    for path in out.values():
        assert run("compile", "zb-h1", "-D", "p=4", "-D", "m=8", "-o", str(path))[0] == 0
    return out


# ---- --json: one shape per subcommand ------------------------------------------------------------------------------


def test_check_json():
    doc = ok_doc("check", "1f1b", *SMALL, "--json")
    assert doc["command"] == "check" and doc["input"] == "schedule"
    assert (doc["schedule"], doc["params"], doc["ops"]) == ("1f1b", {"p": 2, "m": 2}, 8)
    assert doc["instructions"] == pipec.compile("1f1b", p=2, m=2).num_instructions
    assert [m["rank"] for m in doc["memory"]] == [0, 1]


def test_compile_json_to_a_file_and_to_stdout(tmp_path):
    out = tmp_path / "p.json"
    doc = ok_doc("compile", "1f1b", *SMALL, "-o", str(out), "--json")
    assert (doc["command"], doc["output"], doc["format"], doc["ranks"]) == ("compile", str(out), "json", 2)
    on_file = json.loads(out.read_text())
    assert doc["instructions"] == sum(len(r["instructions"]) for r in on_file["ranks"])
    doc = ok_doc("compile", "1f1b", *SMALL, "--json")
    assert doc["output"] is None and doc["program"] == on_file  # the program itself, embedded
    assert run("compile", "1f1b", *SMALL, "--json", "--format", "text")[0] == 2


def test_show_json_is_the_grid():
    doc = ok_doc("show", "1f1b", *SMALL, "--json")
    assert doc["grid"] == [
        {"rank": 0, "cells": ["F0", "F1", "B0", "B1"]},
        {"rank": 1, "cells": ["F0", "B0", "F1", "B1"]},
    ]
    doc = ok_doc("show", "1f1b", *SMALL, "--json", "--ranks", "1")
    assert [g["rank"] for g in doc["grid"]] == [1]


def test_show_timeline_json_is_the_simulated_spans():
    doc = ok_doc("show", "1f1b", *SMALL, "--timeline", "--json", "--cost", "F=1,B=2")
    assert doc["makespan"] == 9  # rank 0's last B starts when rank 1's B of micro-batch 1 ends, at 7
    rank1 = [(s["op"], s["mb"], s["start"], s["end"]) for s in doc["spans"] if s["rank"] == 1]
    assert rank1 == [("FWD", 0, 1, 2), ("BWD", 0, 2, 4), ("FWD", 1, 4, 5), ("BWD", 1, 5, 7)]


@pytest.mark.parametrize("names", [["1f1b"], ["1f1b", "zb-h1"]])
def test_simulate_json_is_results_whether_one_schedule_or_several(names):
    doc = ok_doc("simulate", *names, *SMALL, "--json")
    assert set(doc) == ENVELOPE | {"results"}
    assert [r["schedule"] for r in doc["results"]] == names
    for r in doc["results"]:
        assert {"makespan", "bubble_rate", "per_rank", "trace", "plot"} <= set(r)
    assert ok_doc("compare", *names, *SMALL, "--json")["command"] == "simulate"


def test_export_json(tmp_path):
    doc = ok_doc("export", "1f1b", *SMALL, "--json")
    assert doc["format"] == "torch-csv compute-only" and doc["output"] is None
    assert doc["csv"] == run("export", "1f1b", *SMALL)[1]
    out = tmp_path / "x.csv"
    doc = ok_doc("export", "1f1b", *SMALL, "--json", "--comms", "-o", str(out))
    assert doc["csv"] is None and doc["output"] == str(out) and out.read_text()


def test_import_json(tmp_path):
    csv = tmp_path / "x.csv"
    assert run("export", "1f1b", *SMALL, "-o", str(csv))[0] == 0
    doc = ok_doc("import", str(csv), "--json")
    assert (doc["csv"], doc["ranks"], doc["ops"], doc["output"]) == (str(csv), 2, 8, None)
    assert doc["pipe"].startswith("#") or "schedule" in doc["pipe"]


def test_list_json():
    doc = ok_doc("list", "--json")
    assert [s["name"] for s in doc["schedules"]] == library.names()
    assert all(s["summary"] == library.summary(s["name"]) for s in doc["schedules"])


def test_synth_json():
    doc = ok_doc("synth", "-p", "2", "-m", "2", "--no-solver", "-q", "--json")
    assert doc["command"] == "synth" and doc["p"] == 2 and doc["makespan"] > 0
    assert "schedule" in doc["pipe"]  # no -o: the .pipe text is in the document


def test_run_text_and_json_are_made_from_one_record_per_step(tmp_path, capsys):
    """The run reports each step once (pipec.runtime.job.report): its line of text, and with a records file
    the record `pipec run --json` gives, with the run's other lines kept in order as its log."""
    from pipec.runtime.job.report import Report, StepRecord, read_records

    path = str(tmp_path / "records.jsonl")
    report = Report(path)
    report.line("1f1b (p=2 m=2): 2 stages on 2 ranks, 2 micro-batches, gloo, 2 processes, model m.py")
    report.step(StepRecord.of(0, 2, 0.626738, 1.471, (0.0, 1.5e-17, 0.0)))
    report.step(StepRecord.of(1, 2, float("-inf"), 0.042))  # no rank had a loss
    report.line("check against a single-process reference\nOK: largest relative error 0.00e+00 (tolerance 1e-10)")
    assert capsys.readouterr().out.splitlines()[1:3] == [
        "step 1/2: loss 0.626738, 1.471 s  | rel err vs reference: loss 0.0e+00, grads 1.5e-17, params 0.0e+00",
        "step 2/2: loss -, 0.042 s",
    ]
    doc = read_records(path)
    assert doc["steps"] == [
        {"step": 1, "loss": 0.626738, "seconds": 1.471, "rel_err": {"loss": 0.0, "grads": 1.5e-17, "params": 0.0}},
        {"step": 2, "loss": None, "seconds": 0.042, "rel_err": None},
    ]
    assert doc["log"][0].startswith("1f1b (p=2 m=2)") and doc["log"][-1].startswith("OK:") and len(doc["log"]) == 3
    assert Report(None).records is None and read_records(str(tmp_path / "none.jsonl")) == {"steps": [], "log": []}


def test_run_local_json_gives_each_step():
    pytest.importorskip("torch")
    model = str(ROOT / "examples" / "mlp.py")
    rc, out, err = run("run", "1f1b", *SMALL, "--model", model, "--local", "--steps", "2", "--json")
    assert rc == 0, err
    doc = doc_of(out)
    assert (doc["command"], doc["ok"], doc["exit"]) == ("run", True, 0)
    assert [s["step"] for s in doc["steps"]] == [1, 2]
    assert all(s["loss"] > 0 and s["seconds"] > 0 for s in doc["steps"])
    assert "step 1/2" in err  # the run's own lines go to stderr


# ---- --json on an error: the diagnostics ---------------------------------------------------------------------------

ONE_SCHEDULE = ["check", "compile", "show", "simulate", "export"]


@pytest.mark.parametrize("command", ONE_SCHEDULE)
def test_json_on_a_schedule_error_is_its_diagnostics(command):
    doc = failed_doc(1, command, "1f1b", "-D", "m=0", "--json")
    assert doc["command"] == command
    d = doc["diagnostics"][0]
    assert d["code"] == "E202" and d["path"] == "<library>/1f1b.pipe" and d["line"] > 0 and d["col"] > 0
    assert d["notes"] == ["with p=4, m=0"]


@pytest.mark.parametrize("command", [*ONE_SCHEDULE, "run", "profile"])
def test_json_on_an_unknown_schedule_is_E000(command):
    extra = ["--model", "m.py"] if command in ("run", "profile") else []
    doc = failed_doc(1, command, "no-such-schedule", *extra, "--json")
    assert doc["diagnostics"][0]["code"] == "E000"


@pytest.mark.parametrize("command", ["check", "compile", "show", "simulate", "export", "list", "import"])
def test_json_on_misuse_is_an_uncoded_diagnostic(command):
    argv = {"list": ["list"], "import": ["import", "x.csv"]}.get(command, [command, "1f1b"])
    doc = failed_doc(2, *argv, "--bogus", "--json")
    assert doc["command"] == command
    d = doc["diagnostics"][0]
    assert d["code"] is None and d["message"] == "unrecognized arguments: --bogus"


def test_json_on_a_misused_value_names_the_command():
    doc = failed_doc(2, "show", "1f1b", "--ranks", "zero", "--json")
    assert doc["command"] == "show" and "--ranks expects numbers" in doc["diagnostics"][0]["message"]


# ---- exit statuses: one rule ---------------------------------------------------------------------------------------

WITH_D = ["check", "compile", "show", "simulate", "export", "view"]


@pytest.mark.parametrize("command", WITH_D)
def test_exit_1_for_input_errors(command):
    for argv in (["no-such-schedule"], ["missing/file.pipe"], ["1f1b", "-D", "q=3"], ["1f1b", "-D", "m=0"]):
        rc, out, err = run(command, *argv)
        assert (rc, out) == (1, ""), (command, argv, err)
        assert "error[E" in err


@pytest.mark.parametrize("command", WITH_D + ["run", "profile"])
def test_exit_2_for_misuse_with_the_subcommands_own_usage(command):
    extra = ["--model", "m.py"] if command in ("run", "profile") else []
    for argv in (["1f1b", "--bogus"], ["1f1b", "-D", "p"]):
        with pytest.raises(SystemExit) as e:
            pipec.cli.app.main([command, *argv, *extra])
        assert e.value.code == 2
    rc, out, err = run(command, "1f1b", "--bogus", *extra)
    assert (rc, out) == (2, "")
    assert err.startswith(f"usage: pipec {command} ") and f"pipec {command}: error: unrecognized arguments" in err


def test_simulate_with_a_parameter_no_schedule_takes_is_E205():
    rc, out, err = run("simulate", "1f1b", "zb-h1", "-D", "q=3")
    assert (rc, out) == (1, "")
    assert "error[E205]: no schedule here takes parameter `q`" in err


def test_a_bad_cost_is_an_input_error():
    rc, _, err = run("simulate", "1f1b", "--cost", "bogus=1")
    assert rc == 1 and "error[E801]" in err
    rc, _, err = run("simulate", "1f1b", "--cost", "missing.toml")
    assert rc == 1 and "error[E801]" in err


def test_an_unwritable_output_is_misuse(tmp_path):
    for command in ("compile", "export"):
        rc, _, err = run(command, "1f1b", *SMALL, "-o", str(tmp_path / "no" / "such" / "dir" / "x"))
        assert rc == 2 and "cannot write" in err


# ---- Program files as input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["json", "text"])
def test_check_show_simulate_take_a_program_file(programs, form):
    path = str(programs[form])
    doc = ok_doc("check", path, "--json")
    assert (doc["input"], doc["source"], doc["schedule"], doc["ops"]) == ("program", path, "zb-h1", 96)
    rc, out, _ = run("check", path)
    assert (rc, out) == (0, "zb-h1 (p=4 m=8): 4 stages, 4 ranks, 96 ops: OK\n")
    assert run("show", path)[1] == run("show", "zb-h1", "-D", "p=4", "-D", "m=8")[1]
    from_file = ok_doc("simulate", path, "--cost", "F=1,B=1,W=1", "--json")["results"][0]
    direct = ok_doc("simulate", "zb-h1", "-D", "p=4", "-D", "m=8", "--cost", "F=1,B=1,W=1", "--json")["results"][0]
    for key in ("makespan", "bubble_rate", "per_rank", "compute_ops", "messages"):
        assert from_file[key] == direct[key], key


def test_a_program_takes_no_parameters(programs):
    doc = failed_doc(1, "check", str(programs["json"]), "-D", "p=3", "--json")
    assert doc["diagnostics"][0]["code"] == "E205" and doc["diagnostics"][0]["path"] == str(programs["json"])


def test_a_broken_program_file_is_a_diagnostic_at_its_line(programs, tmp_path):
    lines = programs["text"].read_text().split("\n")
    i = next(j for j, line in enumerate(lines) if line.startswith("FWD"))
    del lines[i]  # a forward never runs
    bad = tmp_path / "bad.txt"
    bad.write_text("\n".join(lines))
    for command in ("check", "show", "simulate"):
        rc, out, err = run(command, str(bad))
        assert (rc, out) == (1, ""), err
        assert err.startswith(f"{bad}:") and "error[E50" in err and "Traceback" not in err
    bad.write_text('{"format": "pipec-program", "version": 1, "ranks": 3}')
    assert failed_doc(1, "check", str(bad), "--json")["diagnostics"][0]["code"] == "E501"


# ---- --version and completion --------------------------------------------------------------------------------------


def test_version():
    rc, out, err = run("--version")
    from pipec.formats.program_file import VERSION

    assert (rc, out, err) == (0, f"pipec {pipec.__version__} (Program format {VERSION})\n", "")


def _complete(line: str) -> list[str]:
    """argcomplete's protocol: the shell sets _ARGCOMPLETE, COMP_LINE and COMP_POINT and reads the
    completions from file descriptor 8 (separated by the IFS character, a vertical tab by default)."""
    pytest.importorskip("argcomplete")
    r, w = os.pipe()
    env = dict(os.environ, _ARGCOMPLETE="1", COMP_LINE=line, COMP_POINT=str(len(line)), _ARGCOMPLETE_IFS="\n")
    code = "import os, sys; os.dup2(int(sys.argv[1]), 8); os.dup2(os.open(os.devnull, os.O_WRONLY), 9); "
    code += "from pipec.cli.app import main; main()"
    done = subprocess.run(
        [sys.executable, "-c", code, str(w)], env=env, pass_fds=(w,), capture_output=True, timeout=120, cwd=ROOT
    )
    os.close(w)
    with os.fdopen(r) as f:
        words = f.read().split("\n")
    assert done.returncode == 0, done.stderr
    return [x.strip() for x in words if x.strip()]


def test_completion_of_subcommands_options_and_schedule_names():
    assert "check" in _complete("pipec che") and "compile" in _complete("pipec com")
    assert _complete("pipec simulate 1f1b --tr") == ["--trace"]
    assert {"1f1b"} <= set(_complete("pipec check 1f")) and "gpipe" in _complete("pipec show gp")
    assert "examples/" in _complete("pipec check exa")


# ---- the Python API ------------------------------------------------------------------------------------------------


def test_the_api_is_at_the_top_level_and_typed():
    assert {"load", "check", "compile", "simulate", "read_program", "PipecError"} <= set(pipec.__all__)
    assert set(pipec.__all__) <= set(dir(pipec))
    for name in ("load", "check", "compile", "simulate", "read_program"):
        fn = getattr(pipec, name)
        assert fn.__doc__ and ">>>" in fn.__doc__ and "return" in fn.__annotations__, name


def test_importing_pipec_loads_no_torch_no_matplotlib_not_even_numpy():
    code = "import sys, pipec; print(sorted(m for m in ('torch', 'matplotlib', 'numpy', 'lark') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, "[]\n"), done.stderr


def test_the_api_gives_what_the_commands_print(programs):
    sim = pipec.simulate("zb-h1", p=4, m=8, cost="F=1,B=2,W=1")
    doc = ok_doc("simulate", "zb-h1", "-D", "p=4", "-D", "m=8", "--cost", "F=1,B=2,W=1", "--json")["results"][0]
    assert (sim.stats.makespan, sim.stats.bubble_rate) == (doc["makespan"], doc["bubble_rate"])
    prog = pipec.compile("zb-h1", {"p": 4}, m=8)
    assert pipec.read_program(programs["json"]) == prog == pipec.read_program(programs["text"])
    assert pipec.check(programs["text"]).program == prog
    assert pipec.load("zb-h1", p=4, m=8).num_ops == pipec.check("zb-h1", p=4, m=8).schedule.num_ops == 96
    again = pipec.simulate(programs["json"], cost=[{"F": 1, "B": 2}, "W=1"])
    assert again.stats.makespan == sim.stats.makespan


def test_the_api_raises_pipec_errors_only():
    with pytest.raises(pipec.PipecError) as e:
        pipec.compile("1f1b", q=3)
    assert e.value.code == "E205"
    with pytest.raises(pipec.PipecError) as e:
        pipec.load("no-such-schedule")
    assert e.value.code == "E000"
    with pytest.raises(pipec.PipecError) as e:
        pipec.simulate("1f1b", cost="bogus=1")
    assert e.value.code == "E801"


def test_the_api_docstrings_run():
    import doctest

    import pipec.api

    for module in (pipec, pipec.api):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__
