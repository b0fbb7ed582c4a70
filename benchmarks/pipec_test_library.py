"""`pipec test` over the whole library, with 200 parameter sets per file (CI runs a dozen).

The bounds are wider than `pipec test`'s defaults (p 1..8, m 1..32, v 1..4 where a file has them, unless
that makes the space too large to list), so that 200 distinct parameter sets exist for every file. Prints
one JSON line per file (examples checked, size of the bounded parameter space, result, seconds, seconds
per parameter set) and a last line with the totals. Exit status 1 when a file fails.

    python benchmarks/pipec_test_library.py                 # 200 examples per file, seed 0
    python benchmarks/pipec_test_library.py 500 --seed 3    # more, another seed
    python benchmarks/pipec_test_library.py 200 --runtime   # also train small cases on the runtime (torch)
    python benchmarks/pipec_test_library.py 50 tests/seeded # other paths (the seeded bugs fail, as they should)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("examples", nargs="?", type=int, default=200, help="parameter sets per file (200)")
    ap.add_argument("paths", nargs="*", default=[str(ROOT / "schedules")], help="files or directories")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runtime", action="store_true", help="also run small cases on the runtime's --local mode")
    ap.add_argument("--default-bounds", action="store_true", help="pipec test's bounds (p 1..6, m 1..12, v 1..3)")
    args = ap.parse_args()

    from pipec.api import compile_source
    from pipec.frontend.library import read
    from pipec.testing import check_file, find_schedule_files

    wide = {"p": range(1, 9), "m": range(1, 33), "v": range(1, 5)}

    started = time.perf_counter()
    failed = checked = 0
    files = find_schedule_files(args.paths)
    for target in files:
        names = {prm.name for prm in compile_source(read(target)).params}
        bounds = {} if args.default_bounds else {k: v for k, v in wide.items() if k in names}
        try:
            res = check_file(target, args.examples, args.seed, bounds=bounds, runtime=args.runtime)
        except ValueError:  # too many parameter sets to list: the default bounds
            bounds = {}
            res = check_file(target, args.examples, args.seed, runtime=args.runtime)
        checked += res.examples
        failed += not res.ok
        line = {
            "benchmark": "pipec_test_library",
            "file": str(Path(target).resolve().relative_to(ROOT)) if Path(target).exists() else target,
            "examples": args.examples,
            "checked": res.examples,
            "space": res.space,
            "runtime_checked": res.runtime_checked,
            "ok": res.ok,
            "seconds": round(res.seconds, 3),
            "seconds_per_set": round(res.seconds / max(res.examples, 1), 5),
            "seed": args.seed,
            "bounds": {k: [v.start, v.stop - 1] for k, v in bounds.items()},
        }
        if not res.ok:
            f = res.failure
            line["failure"] = {"params": f.params, "kind": f.kind, "command": f.command}
        print(json.dumps(line), flush=True)
    total = {
        "benchmark": "pipec_test_library",
        "files": len(files),
        "failed": failed,
        "checked": checked,
        "seconds": round(time.perf_counter() - started, 3),
    }
    print(json.dumps(total), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
