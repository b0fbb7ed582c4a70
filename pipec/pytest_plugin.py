"""The pytest plugin: `pytest --pipec PATH...` property-tests every .pipe file under the paths.

Registered by the distribution (entry point `pytest11` in pyproject.toml), so it loads in every pytest
run; it does nothing without `--pipec`, and imports nothing of pipec until a .pipe file is collected.
Each file becomes one test item running what `pipec test` runs (pipec.testing.check_file); a failure
reports the smallest failing parameter set, its diagnostic and a `pipec check` command reproducing it.

    pytest --pipec schedules/ my_schedules/ --pipec-examples 200 --pipec-seed 1
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pipec", "property-testing of pipec schedules (.pipe files)")
    group.addoption(
        "--pipec", action="store_true", default=False, help="collect .pipe files and property-test each one"
    )
    group.addoption("--pipec-examples", type=int, default=50, metavar="N", help="parameter sets per file (50)")
    group.addoption("--pipec-seed", type=int, default=0, metavar="S", help="random seed (0)")
    group.addoption("--pipec-runtime", action="store_true", default=False, help="also run small cases on the runtime")


def pytest_collect_file(parent: pytest.Collector, file_path):
    if file_path.suffix == ".pipe" and parent.config.getoption("pipec"):
        return PipeFile.from_parent(parent, path=file_path)
    return None


class PipecFailure(Exception):
    """The smallest failing case of one file."""


class PipeFile(pytest.File):
    def collect(self):
        yield PipeItem.from_parent(self, name="properties")


class PipeItem(pytest.Item):
    def runtest(self) -> None:
        import os

        from pipec.testing import check_file

        cfg = self.config
        res = check_file(
            os.path.relpath(self.path, cfg.invocation_params.dir),
            cfg.getoption("pipec_examples"),
            cfg.getoption("pipec_seed"),
            runtime=cfg.getoption("pipec_runtime"),
        )
        if not res.ok:
            f = res.failure
            lines = [
                f"{f.target}: fails at {f.params_text} "
                f"(smallest of {res.failing} failing; {res.examples} of {res.space} parameter sets checked)",
                f.message,
                f"reproduce: {f.command}",
            ]
            raise PipecFailure("\n".join(lines))

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, PipecFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"pipec test {self.path}"
