"""The pytest plugin: `pytest --pipec PATH...` property-tests every .pipe file under the paths.

Registered by the distribution (entry point `pytest11` in pyproject.toml), so it loads in every pytest
run; it does nothing without `--pipec`, and imports nothing of pipec until a .pipe file is collected.
Each file becomes one test item running what `pipec test` runs (pipec.testing.check_file), for
`--pipec-budget` seconds (30, or 5 where CI=true, as `pipec test`); a failure reports the smallest
failing parameter set, its diagnostic and a `pipec check` command reproducing it, and the terminal
summary lists, per file, the values each parameter took (the coverage).

    pytest --pipec schedules/ my_schedules/ --pipec-budget 10s --pipec-seed 1
"""

from __future__ import annotations

import pytest


def _budget(text: str) -> float:
    from pipec.options import duration

    return duration(text)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pipec", "property-testing of pipec schedules (.pipe files)")
    group.addoption(
        "--pipec", action="store_true", default=False, help="collect .pipe files and property-test each one"
    )
    group.addoption(
        "--pipec-budget", type=_budget, default=None, metavar="TIME", help="time per file (30s; 5s where CI=true)"
    )
    group.addoption("--pipec-examples", type=int, default=None, metavar="N", help="at most N parameter sets per file")
    group.addoption("--pipec-seed", type=int, default=0, metavar="S", help="random seed (0)")
    group.addoption("--pipec-runtime", action="store_true", default=False, help="also run small cases on the runtime")


def pytest_collect_file(parent: pytest.Collector, file_path):
    if file_path.suffix == ".pipe" and parent.config.getoption("pipec"):
        return PipeFile.from_parent(parent, path=file_path)
    return None


class _Coverage:
    """The terminal summary's lines, gathered from the test reports: each item puts its lines in its
    report's `user_properties`, which pytest-xdist carries from a worker to the controller, where the
    summary is printed (a list kept in the worker would never reach it)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call":
            self.lines += [line for key, value in report.user_properties if key == "pipec" for line in value]

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.lines:
            terminalreporter.section("pipec coverage")
            for line in self.lines:
                terminalreporter.write_line(line)


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("pipec", False):
        config.pluginmanager.register(_Coverage(), "pipec-coverage")


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
            budget=cfg.getoption("pipec_budget"),
            runtime=cfg.getoption("pipec_runtime"),
        )
        state = "ok" if res.ok else f"FAILED at {res.failure.params_text}"
        summary = [f"{res.target}: {state} ({res.sets_text}, {res.seconds:.1f} s)"]
        if res.coverage is not None and res.examples:
            summary.append(f"  tried: {res.coverage.text()}")
        self.user_properties.append(("pipec", summary))
        if not res.ok:
            f = res.failure
            lines = [
                f"{f.target}: fails at {f.params_text} (smallest of {res.failing} failing; {res.sets_text} checked)",
                f.message,
                f"reproduce: {f.command}",
            ]
            if res.coverage is not None and res.examples:
                lines.append(f"tried: {res.coverage.text()}")
            raise PipecFailure("\n".join(lines))

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, PipecFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"pipec test {self.path}"
