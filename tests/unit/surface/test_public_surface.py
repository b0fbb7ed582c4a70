"""The public surface is a promise (docs/api.md): what `pipec`, `pipec.runtime` and `pipec.testing` export, the
CLI's commands and flags, torchrun's entry point, and the version of every file format a reader checks.

Each list is pinned here or in `cli_surface.json` beside this file. A failure means the surface changed: if that
is deliberate, change the pin *and* add a CHANGELOG.md entry (a removed or renamed name also gets a row in
pipec/moved.py, so the old path keeps working with a DeprecationWarning for a release).
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from pathlib import Path

import pytest
from repo import ROOT

HERE = Path(__file__).parent

PIPEC = [
    "DataParallel",
    "Experts",
    "MemOp",
    "PipecError",
    "Program",
    "Schedule",
    "__version__",
    "check",
    "compile",
    "load",
    "read_program",
    "read_trace",
    "simulate",
    "write_program",
    "write_trace",
]

RUNTIME = [
    "LocalPipeline",
    "Model",
    "PipelineError",
    "PipelineSchedule",
    "Reference",
    "Runner",
    "StageOptions",
    "StepResult",
    "Transport",
    "clip_grad_norm_",
    "load_model",
    "model_fingerprint",
    "propose_split",
    "split_model",
    "split_with_pipeline",
    "stage_indices",
]

TESTING = [
    "DEFAULT_BOUNDS",
    "Checked",
    "Coverage",
    "Failure",
    "FileResult",
    "InvariantError",
    "Listing",
    "Mutation",
    "Sampler",
    "Space",
    "check_file",
    "check_invariants",
    "default_budget",
    "deps",
    "find_schedule_files",
    "mutations",
    "parameter_space",
    "params",
    "program_problem",
    "runtime_check",
    "sample_space",
    "schedule_problem",
    "schedules",
]

FACADES = {"pipec": PIPEC, "pipec.runtime": RUNTIME, "pipec.testing": TESTING}

# Every file format pipec writes and reads back: (module, constant, value). A reader refuses any other version
# with a diagnostic (the readers' own tests show it); a writer writes this one.
FORMATS = {
    "Program (JSON and text)": ("pipec.formats.program_file", "VERSION", 1),
    "Program with a stage graph": ("pipec.formats.program_file", "GRAPH_VERSION", 2),
    "Program with a buffer plan": ("pipec.formats.program_file", "PLAN_VERSION", 3),
    "Program versions read": ("pipec.formats.program_file", "READS", (1, 2, 3)),
    "partition file": ("pipec.formats.partition_files", "PARTITION_VERSION", 2),
    "layer table": ("pipec.formats.partition_files", "VERSION", 1),
    "cost file": ("pipec.sim.cost_files", "VERSION", 2),
    "trace": ("pipec.formats.trace", "VERSION", 1),
    "checkpoint": ("pipec.runtime.job.checkpoint", "FORMAT", "pipec-checkpoint 2"),
    "--json documents": ("pipec.cli.envelope", "JSON_VERSION", 1),
}


@pytest.mark.parametrize("facade", sorted(FACADES))
def test_each_facade_exports_exactly_its_pinned_names_and_each_resolves(facade: str) -> None:
    module = importlib.import_module(facade)
    pinned = FACADES[facade]
    gone, new = sorted(set(pinned) - set(module.__all__)), sorted(set(module.__all__) - set(pinned))
    assert not gone, f"{facade} no longer exports {gone}: keep them, or alias them in pipec/moved.py + CHANGELOG"
    assert not new, f"{facade} exports new names {new}: pin them here, document them in docs/api.md + CHANGELOG"
    for name in pinned:
        assert getattr(module, name) is not None, f"{facade}.{name} does not resolve"


def _commands(parser) -> dict[str, dict]:
    """Each subcommand's aliases, flags (every option string) and positionals, as argparse holds them."""
    out = {}
    for name, sub in sorted(parser.commands.items()):
        if sub.prog.split()[-1] != name:  # an alias: listed under its command
            continue
        out[name] = _arguments(sub)
        out[name]["aliases"] = sorted(n for n, p in parser.commands.items() if p is sub and n != name)
    return out


def _arguments(parser) -> dict[str, list[str]]:
    flags, positionals = [], []
    for action in parser._actions:
        if action.option_strings:
            flags.extend(action.option_strings)
        else:
            positionals.append(action.dest)
    return {"flags": sorted(flags), "positionals": positionals}


def current_cli() -> dict:
    """The command line as the code declares it: `pipec`'s subcommands, and torchrun's entry point."""
    from pipec.cli.app import parser
    from pipec.runtime.job import launch

    return {"pipec": _commands(parser()), "python -m pipec.runtime.job.launch": _arguments(launch.parser())}


def test_the_command_line_keeps_every_command_flag_and_positional_it_had() -> None:
    pinned = json.loads((HERE / "cli_surface.json").read_text())
    now = current_cli()
    lost = []
    for cmd, spec in pinned["pipec"].items():
        have = now["pipec"].get(cmd)
        if have is None:
            lost.append(f"pipec {cmd}")
            continue
        lost += [f"pipec {cmd} {f}" for f in spec["flags"] if f not in have["flags"]]
        lost += [f"pipec {cmd} alias {a}" for a in spec["aliases"] if a not in have["aliases"]]
        if have["positionals"][: len(spec["positionals"])] != spec["positionals"]:
            lost.append(f"pipec {cmd} positionals {spec['positionals']} -> {have['positionals']}")
    launch, have = pinned["python -m pipec.runtime.job.launch"], now["python -m pipec.runtime.job.launch"]
    lost += [f"launch {f}" for f in launch["flags"] if f not in have["flags"]]
    assert not lost, f"the command line lost {lost}: keep them (a flag may alias a new one) + CHANGELOG"
    assert now == pinned, (
        "the command line grew: pin it (`PYTHONPATH=tests/support python tests/unit/surface/test_public_surface.py`"
        " writes cli_surface.json),"
        " document it in docs/cli.md and CHANGELOG.md"
    )


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_file_format_has_its_pinned_version(name: str) -> None:
    module, constant, value = FORMATS[name]
    assert getattr(importlib.import_module(module), constant) == value, (
        f"the {name} format's version changed: the reader must still read the old one; say so in CHANGELOG.md"
    )


def test_pipec_version_prints_the_package_and_program_format_versions(tmp_path: Path) -> None:
    import subprocess
    import sys

    import pipec
    from pipec.formats import program_file

    out = subprocess.run([sys.executable, "-m", "pipec", "--version"], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert pipec.__version__ in out.stdout and f"Program format {program_file.VERSION}" in out.stdout, out.stdout
    project = (ROOT / "pyproject.toml").read_text()
    assert re.search(rf'^version = "{re.escape(pipec.__version__)}"$', project, re.M), "pyproject and __version__"
    assert f"## {pipec.__version__}" in (ROOT / "CHANGELOG.md").read_text(), "CHANGELOG.md has no entry for it"


def signature(obj: object) -> str | None:
    """A function's or class's call signature as inspect prints it; None for constants and exceptions."""
    if not callable(obj) or (inspect.isclass(obj) and issubclass(obj, BaseException)):
        return None
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return None


def _api_entries() -> dict[str, str]:
    """docs/api.md's entries: `### facade.name` and the text up to the next heading."""
    text = (ROOT / "docs" / "api.md").read_text()
    parts = re.split(r"^### `([\w.]+)`\s*$", text, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def test_docs_api_documents_every_public_name_with_its_docstring_summary_and_signature() -> None:
    entries = _api_entries()
    for facade, names in FACADES.items():
        module = importlib.import_module(facade)
        for name in names:
            if name.startswith("__"):
                continue
            key = f"{facade}.{name}"
            assert key in entries, f"docs/api.md has no entry `### \\`{key}\\``"
            obj = getattr(module, name)
            summary = (inspect.getdoc(obj) or "").strip().split("\n\n")[0]
            summary = " ".join(summary.split())
            assert summary, f"{key} has no docstring"
            assert summary in " ".join(entries[key].split()), f"docs/api.md's {key} does not quote its docstring"
            sig = signature(obj)
            if sig is not None:
                assert f"{name}{sig}" in " ".join(entries[key].split()), f"docs/api.md's {key}: signature {sig}"
    stray = sorted(k for k in entries if k.rpartition(".")[2] not in FACADES.get(k.rpartition(".")[0], ()))
    assert not stray, f"docs/api.md documents names no facade exports: {stray}"


def refresh_api_signatures() -> None:
    """Rewrite the signature line of each docs/api.md entry to the object's signature now (after a deliberate
    change; the prose around it is the maintainers' to keep true)."""
    path = ROOT / "docs" / "api.md"
    text = path.read_text()
    for facade, names in FACADES.items():
        module = importlib.import_module(facade)
        for name in names:
            sig = None if name.startswith("__") else signature(getattr(module, name))
            if sig is None:
                continue
            entry = rf"(^### `{re.escape(facade)}\.{re.escape(name)}`\s*\n\n```python\n)"
            head = re.compile(entry + rf"{re.escape(name)}\(.*$", re.M)
            text = head.sub(lambda m, line=f"{name}{sig}": m.group(1) + line, text)
    path.write_text(text)


if __name__ == "__main__":  # re-pin the command line and docs/api.md's signatures after a deliberate change
    (HERE / "cli_surface.json").write_text(json.dumps(current_cli(), indent=1, sort_keys=True) + "\n")
    refresh_api_signatures()
