"""The per-user cache (pipec.cachedir): a fresh process loads what an earlier one computed, never a stale
or foreign entry, and compiles as well without one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from repo import ROOT

PROBE = "import sys, pipec\nn = pipec.compile('zb-v', p=2, m=4).num_instructions\nprint(n, 'lark' in sys.modules)\n"


def fresh(cache: Path | str) -> tuple[int, bool]:
    env = dict(os.environ, PIPEC_CACHE_DIR=str(cache))
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    n, lark = out.stdout.split()
    return int(n), lark == "True"


def test_a_second_process_loads_the_generated_code_and_skips_the_parser(tmp_path):
    first = fresh(tmp_path)
    assert first[1]  # the first process parsed the text
    # only the code: the parser's tables ship with the package (pipec.frontend.tables)
    assert sorted(p.name.split("-")[0] for p in tmp_path.iterdir()) == ["code"]
    assert fresh(tmp_path) == (first[0], False)  # the second loaded the code: lark never imported


def test_a_damaged_entry_is_computed_again(tmp_path):
    n, _ = fresh(tmp_path)
    for entry in tmp_path.iterdir():
        entry.write_bytes(b"not a pickle")
    assert fresh(tmp_path) == (n, True)
    assert fresh(tmp_path) == (n, False)  # and written back whole


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="ownership and modes are POSIX")
def test_no_cache_in_a_folder_others_may_write_or_in_place_of_a_file(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    n, _ = fresh(shared)
    assert fresh(shared) == (n, True) and not list(shared.iterdir())  # nothing written, nothing read
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert fresh(blocker) == (n, True)


def test_an_edited_text_is_not_served_from_the_cache(tmp_path, monkeypatch):
    from pipec.errors import Source
    from pipec.frontend import load

    monkeypatch.setenv("PIPEC_CACHE_DIR", str(tmp_path))
    text = (ROOT / "schedules" / "1f1b.pipe").read_text()
    a = load.compile_source(Source("a.pipe", text))
    b = load.compile_source(Source("b.pipe", text.replace("p: int = 4", "p: int = 3")))
    assert a.code != b.code or a.params != b.params
    assert len(list(tmp_path.glob("code-*.pickle"))) == 2
