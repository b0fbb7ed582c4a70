"""Fuzz the front end at length: the properties of tests/test_fuzz.py, 10,000 examples each.

    python benchmarks/fuzz.py                 # 10,000 examples per property
    python benchmarks/fuzz.py 500 soup        # fewer, and only properties whose name contains "soup"

Prints one JSON line per property: {"property", "examples", "seconds", "failures"}; on a
failure, the falsifying example and its traceback go to stderr, and the exit status is 1.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str]) -> int:
    examples = int(argv[0]) if argv else 10_000
    wanted = argv[1] if len(argv) > 1 else ""
    os.environ["PIPEC_FUZZ_EXAMPLES"] = str(examples)  # read when the test module is imported
    spec = importlib.util.spec_from_file_location("pipec_test_fuzz", ROOT / "tests" / "test_fuzz.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    status = 0
    for name in module.PROPERTIES:
        if wanted not in name:
            continue
        start = time.perf_counter()
        failures = 0
        try:
            getattr(module, name)()
        except Exception:  # hypothesis re-raises the (shrunk) failure
            failures = 1
            status = 1
            traceback.print_exc()
        seconds = round(time.perf_counter() - start, 2)
        print(json.dumps({"property": name, "examples": examples, "seconds": seconds, "failures": failures}))
        sys.stdout.flush()
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
