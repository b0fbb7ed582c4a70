"""The launch path's bad Program files (issue 41): `python -m pipec.runtime.job.launch PROGRAM` (what torchrun
runs) and `pipec run PROGRAM` given a Program whose parameters nest thousands deep (once a RecursionError
traceback), or a damaged Program JSON (once read as schedule source: "unexpected `{`; expected
`schedule`"). Each is "PATH: error[E501]: this is not a valid Program file: ...", exit status 1, before
any process group is started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import pipec
from pipec.cli import app as cli
from pipec.formats import program_file as pf

MODEL = str(Path(__file__).resolve().parents[2] / "examples" / "mlp.py")


def _deep_text() -> str:
    lines = pf.to_text(pipec.compile("gpipe", p=2, m=2)).split("\n")
    lines[1] = 'schedule "gpipe" {"x": ' + "[" * 5000 + "]" * 5000 + "}"
    return "\n".join(lines)


def _bad_files(tmp_path: Path) -> dict[str, Path]:
    whole = pf.to_json(pipec.compile("gpipe", p=2, m=2))
    files = {
        "deep.txt": _deep_text(),
        "deep.json": whole.replace('"params":{', '"params":{"x":' + "[" * 5000 + "]" * 5000 + ",", 1),
        "cut.json": whole[:12],  # cut inside its header: no whole `"pipec-program"` to tell it by
        "damaged.json": "{" + whole[40:],
        "garbage.json": "not json at all",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return {name: tmp_path / name for name in files}


def test_the_launch_entry_refuses_bad_program_files_before_starting(tmp_path):
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    env.pop("MASTER_ADDR", None)  # no rendezvous is reachable: the refusal must come before one
    for name, path in _bad_files(tmp_path).items():
        res = subprocess.run(
            [sys.executable, "-m", "pipec.runtime.job.launch", str(path), "--model", MODEL],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        said = res.stdout + res.stderr
        assert res.returncode == 1, (name, said)
        assert "Traceback" not in said and "RecursionError" not in said, (name, said)
        assert f"{path}" in said and "error[E501]: this is not a valid Program file" in said, (name, said)
        assert "expected `schedule`" not in said, (name, said)


@pytest.mark.parametrize("name", ["deep.txt", "deep.json", "cut.json", "damaged.json", "garbage.json"])
def test_pipec_run_refuses_bad_program_files_before_starting(tmp_path, capsys, name):
    path = _bad_files(tmp_path)[name]
    try:
        code = cli.main(["run", str(path), "--model", MODEL])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 1, err
    assert err.startswith(f"{path}") and "error[E501]: this is not a valid Program file" in err, err
    assert "Traceback" not in err
