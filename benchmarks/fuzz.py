"""Fuzz the front end at length: the properties of tests/test_fuzz.py, 10,000 examples each.

    python benchmarks/fuzz.py                 # 10,000 examples per property
    python benchmarks/fuzz.py 500 mutations   # fewer, and only properties whose name contains "mutations"

Prints one JSON line per property: {"property", "examples", "seconds", "failures"}; on a
failure, the falsifying example and its traceback go to stderr, and the exit status is 1.
Each property runs as consecutive hypothesis runs of at most 1,000 examples (each with
its own random seed): hypothesis keeps every choice of a run in memory, and a run of
10,000 grammar-generated texts holds gigabytes.
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
CHUNK = 1_000


def main(argv: list[str]) -> int:
    examples = int(argv[0]) if argv else 10_000
    wanted = argv[1] if len(argv) > 1 else ""
    chunk = min(examples, CHUNK)
    os.environ["PIPEC_FUZZ_EXAMPLES"] = str(chunk)  # read when the test module is imported
    spec = importlib.util.spec_from_file_location("pipec_test_fuzz", ROOT / "tests" / "test_fuzz.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    status = 0
    for name in module.PROPERTIES:
        if wanted not in name:
            continue
        start = time.perf_counter()
        failures = done = 0
        while done < examples and not failures:
            try:
                getattr(module, name)()
            except Exception:  # hypothesis re-raises the (shrunk) failure
                failures = 1
                status = 1
                traceback.print_exc()
            done += chunk
        seconds = round(time.perf_counter() - start, 2)
        print(json.dumps({"property": name, "examples": done, "seconds": seconds, "failures": failures}))
        sys.stdout.flush()
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
