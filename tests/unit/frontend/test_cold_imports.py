"""A cold parse imports what parsing uses: lark, but not the `regex` package lark imports when installed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

CODE = """
import json, sys
from pipec.frontend.library import read
from pipec.frontend.parse import parse
tree = parse(read("interleaved-1f1b"))
after_parse = "regex._main" in sys.modules
import lark.utils
import regex  # anyone's later import gets the real package
real = type(regex).__name__ == "module" and regex.compile(r"\\p{Lu}+").match("ABc").group() == "AB"
via_lark = lark.utils.regex.compile(r"\\p{Lu}").match("A") is not None  # lark's stand-in forwards to it
print(json.dumps({"after_parse": after_parse, "real": real, "via_lark": via_lark, "has": lark.utils._has_regex}))
"""


@pytest.mark.skipif(importlib.util.find_spec("regex") is None, reason="the `regex` package is not installed here")
def test_parsing_defers_the_regex_package_and_later_imports_get_it_whole(tmp_path) -> None:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc == {"after_parse": False, "real": True, "via_lark": True, "has": True}
