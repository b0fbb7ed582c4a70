"""Every old path of pipec/moved.py works and warns with its new path (docs/api.md, CHANGELOG.md).

The statements below are the imports that README.md, docs/ and examples/ showed users before 0.2.0 (found in
the git history of those files); each must still run, give the same object as its new path, and warn with a
DeprecationWarning naming that path. Each row of the table must be used by at least one of them, an old path
must not shadow a real module, and every home must exist. `python -m pipec.runtime.launch` (what torchrun
was given) runs the launcher, warning on standard error.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import warnings
from importlib.machinery import PathFinder

import pytest

from pipec import moved

SHOWN = [
    "from pipec.runtime.split_model import split_model",
    "from pipec.runtime.split_model import propose_split, split_model",
    "import pipec.runtime.launch",
    "from pipec.api import build, load",
    "from pipec.compiler import compile_schedule",
    "from pipec.costs import cost_model, parse_overrides",
    "from pipec.costs import normalize",
    "from pipec.dryrun import check_channels",
    "from pipec.dryrun import dry_run",
    "from pipec.formats.torch_csv import export_csv, read_csv, to_pipe",
    "from pipec.interop.torch_csv import export_csv, read_csv, to_pipe",
    "from pipec.torch_csv import export_csv, read_csv, to_pipe",
    "from pipec.interop.pipe_text import quantity",
    "from pipec.ir.program import to_json, from_json, to_text, from_text",
    "from pipec.ir.program import validate",
    "from pipec.library import read",
    "from pipec.lower import lower",
    "from pipec.memory import memory_model",
    "from pipec.passes.memory import memory_model, program_memory",
    "from pipec.program import to_json, from_json, to_text, from_text",
    "from pipec.program import validate",
    "from pipec.runtime.profile import profile",
    "from pipec.runtime.profile import stage_bytes",
    "from pipec.runtime.profile.insitu import deliveries",
    "from pipec.schedule import MemOp, Slicing",
    "from pipec.simulate import simulate, stats",
    "from pipec.sim import report",
    "from pipec.report import to_json",
    "from pipec.sim.report import to_json",
    "from pipec.sim.costs import dump_costs, normalize, parse_overrides, read_cost_file",
    "from pipec.sim.costs import quantity",
    "from pipec.costs import dump_costs",
    "from pipec.render import plot_timelines",
    "from pipec.sim.render import plot_timelines",
    "from pipec.sim.trace import read_trace, write_trace",
    "from pipec.trace import read_trace, write_trace",
    "from pipec.timeline import Timeline",
    "from pipec.policy import derive",
    "from pipec.sim.grid import unit_label",
    "from pipec.view.grid import unit_json",
    "from pipec.partition import Problem",
    "from pipec.partition.search import step_lp",
    "from pipec.partition.files import fingerprint",
    "from pipec.runtime.affinity import bind_local_rank",
    "from pipec.runtime.job.affinity import bind_local_rank",
    "from pipec.runtime.slices import KVCache, LengthWarning",
    "from pipec.runtime.microbatch import MicroBatches",
    "from pipec.runtime.partitioned import model_fingerprint",
    "from pipec.runtime.layer_profile import profile_layers",
]

# Run each statement in a fresh interpreter (an old path imported once is cached), all in one process.
_PROBE = r"""
import json, sys, warnings
out = []
for stmt in json.loads(sys.argv[1]):
    for name in [m for m in sys.modules if m == "pipec" or m.startswith("pipec.")]:
        del sys.modules[name]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            exec(stmt, {})
            error = None
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    out.append({"stmt": stmt, "error": error, "warnings": [
        {"category": w.category.__name__, "message": str(w.message), "file": w.filename} for w in seen]})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def probed() -> dict[str, dict]:
    res = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(SHOWN)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return {r["stmt"]: r for r in json.loads(res.stdout)}


@pytest.mark.parametrize("stmt", SHOWN)
def test_an_import_the_docs_once_showed_still_works_and_warns_with_the_new_path(probed, stmt: str) -> None:
    r = probed[stmt]
    assert r["error"] is None, f"{stmt}: {r['error']}"
    ours = [w for w in r["warnings"] if w["category"] == "DeprecationWarning" and "pipec" in w["message"]]
    assert ours, f"{stmt}: no DeprecationWarning"
    for w in ours:
        assert " use pipec." in w["message"], w["message"]
        assert w["file"] == "<string>", f"the warning points at {w['file']}, not the user's line"
        new = w["message"].rsplit(" use ", 1)[1]
        try:
            importlib.import_module(new)  # the new path is a module
        except ModuleNotFoundError:
            module, _, name = new.rpartition(".")
            assert name in vars(importlib.import_module(module)), new


def test_the_old_path_is_the_same_object_as_the_new_one() -> None:
    import pipec.runtime.model.split as split

    with pytest.warns(DeprecationWarning, match="pipec.runtime.model.split"):
        sys.modules.pop("pipec.runtime.split_model", None)
        old = importlib.import_module("pipec.runtime.split_model")
    assert old is split and old.split_model is split.split_model
    with warnings.catch_warnings():  # whether it warns is the test above's (it may be cached here)
        warnings.simplefilter("ignore", DeprecationWarning)
        from pipec.costs import parse_overrides
    from pipec.sim.cost_files import parse_overrides as new

    assert parse_overrides is new


def test_an_old_module_path_never_replaces_the_facade_name_it_shares() -> None:
    """`pipec.runtime.split_model` and `pipec.simulate` are functions of the facades and were modules in 0.1."""
    code = (
        "import warnings; warnings.simplefilter('ignore')\n"
        "from pipec.runtime.split_model import split_model as old_split\n"
        "from pipec.simulate import stats\n"
        "import pipec, pipec.runtime, types\n"
        "from pipec.runtime import split_model\n"
        "from pipec.sim.simulate import stats as new_stats\n"
        "assert old_split is split_model and callable(split_model), split_model\n"
        "assert not isinstance(pipec.simulate, types.ModuleType) and stats is new_stats\n"
        "assert pipec.simulate('1f1b', p=2, m=2).stats.makespan > 0\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_every_row_of_the_table_is_exercised_and_points_at_modules_that_exist() -> None:
    used = " ".join(SHOWN)
    for old, homes in moved.MODULES.items():
        assert old in used, f"pipec/moved.py's {old} has no statement in SHOWN"
        for home in homes:
            importlib.import_module(home)
        parent, _, leaf = old.rpartition(".")
        if parent not in moved.MODULES and parent != "pipec.interop":
            path = importlib.import_module(parent).__path__
            assert PathFinder.find_spec(old, path) is None, f"{old} is a real module again: drop its alias"
    for module, names in moved.NAMES.items():
        real = importlib.import_module(module)
        for name, home in names.items():
            assert f"from {module} import" in used and name in used, f"{module}.{name} untested"
            assert name not in vars(real) or vars(real)[name] is vars(importlib.import_module(home))[name]
            assert name in vars(importlib.import_module(home)), f"{home} has no {name}"


def test_changelog_lists_every_old_path_with_its_new_one() -> None:
    from repo import ROOT

    text = (ROOT / "CHANGELOG.md").read_text()
    rows = [(old, homes[0]) for old, homes in moved.MODULES.items()]
    rows += [(f"{m}.{n}", f"{home}.{n}") for m, names in moved.NAMES.items() for n, home in names.items()]
    missing = [old for old, new in rows if f"`{old}` -> `{new}" not in text]
    assert not missing, f"CHANGELOG.md's deprecated list lacks {missing}"


def test_an_unknown_name_of_an_old_module_is_an_attribute_error_naming_it() -> None:
    import pipec.costs

    with pytest.raises(AttributeError, match="pipec.costs.*no_such_thing"):
        pipec.costs.no_such_thing  # noqa: B018


def test_python_m_pipec_runtime_launch_runs_the_launcher_and_warns(tmp_path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "pipec.runtime.launch", "--help"], capture_output=True, text=True, cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    assert "usage: python -m pipec.runtime.job.launch" in res.stdout
    assert "DeprecationWarning: python -m pipec.runtime.launch is deprecated" in res.stderr
    assert "use python -m pipec.runtime.job.launch" in res.stderr


def test_a_users_script_sees_the_warning_by_default(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text("from pipec.runtime.split_model import split_model\nprint(split_model.__module__)\n")
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "pipec.runtime.model.split"
    assert f"{script}:1: DeprecationWarning: pipec.runtime.split_model is deprecated" in res.stderr
