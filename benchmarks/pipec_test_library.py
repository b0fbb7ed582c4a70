"""`pipec test` over the whole library at the default budget: sets per second and coverage per parameter.

Each file gets what `pipec test` gives it (`--budget`, default 30 s per file, 5 s where CI=true). Prints one
JSON line per file (parameter sets checked, seconds, sets per second, for each parameter the values tried
and how many sets had each, the largest p x m, sets rejected by a `require`) and a last line with the totals
and the smallest largest-p over the files; every line carries the load average (the machine may be shared).
`--markdown` also prints the table docs/testing.md shows, on stderr. Exit status 1 when a file fails.

    python benchmarks/pipec_test_library.py                       # the library, default budget, seed 0
    python benchmarks/pipec_test_library.py --budget 5s --seed 3  # shorter, another seed
    python benchmarks/pipec_test_library.py --budget 10s --runtime  # also train small cases (torch)
    python benchmarks/pipec_test_library.py --budget 10s tests/seeded  # the seeded bugs fail, as they should
    python benchmarks/pipec_test_library.py --smoke    # schedules/1f1b.pipe, 2 sets: the format (tests)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sidebyside import emit, load_average, smoke_flag  # noqa: E402

from pipec.options import duration  # noqa: E402


def _span(vals: dict, name: str) -> str:
    v = vals.get(name)
    if not v:
        return "-"
    keys = sorted(int(k) if k.lstrip("-").isdigit() else k for k in v)
    return f"{len(keys)} values, {keys[0]}..{keys[-1]}"


def _table(rows: list[dict]) -> str:
    lines = [
        "| file | sets | sets/s | p tried | largest p x m | m tried | v tried |",
        "|---|---:|---:|---|---|---|---|",
    ]
    for r in rows:
        vals = r["coverage"]["values"]
        big = r["coverage"]["largest"]
        pm = f"{big['p']} x {big['m']}" if "p" in big and "m" in big else "-"
        lines.append(
            f"| {r['file']} | {r['checked']} | {r['sets_per_second']:.1f} | {_span(vals, 'p')} | {pm} | "
            f"{_span(vals, 'm')} | {_span(vals, 'v')} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", default=[str(ROOT / "schedules")], help="files or directories")
    ap.add_argument(
        "--budget", type=duration, default=None, help="time per file (default: pipec test's, 30s; 5s where CI=true)"
    )
    ap.add_argument("--examples", type=int, default=None, help="at most this many parameter sets per file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runtime", action="store_true", help="also run small cases on the runtime's --local mode")
    ap.add_argument("--markdown", action="store_true", help="print the docs/testing.md table on stderr")
    smoke_flag(ap)
    args = ap.parse_args()
    if args.smoke:  # one file, 2 parameter sets: the format (tests)
        args.paths, args.examples, args.budget = [str(ROOT / "schedules" / "1f1b.pipe")], 2, None

    from pipec.testing import check_file, default_budget, find_schedule_files

    budget = args.budget if args.budget else (None if args.examples else default_budget())
    started = time.perf_counter()
    failed = checked = 0
    rows = []
    files = find_schedule_files(args.paths)
    for target in files:
        load = load_average()
        res = check_file(target, args.examples, args.seed, budget=budget, runtime=args.runtime)
        checked += res.examples
        failed += not res.ok
        cov = res.coverage.to_json() if res.coverage is not None else {"values": {}, "largest": {}}
        row = {
            "benchmark": "pipec_test_library",
            "file": str(Path(target).resolve().relative_to(ROOT)) if Path(target).exists() else target,
            "budget": budget,
            "checked": res.examples,
            "ok": res.ok,
            "seconds": round(res.seconds, 3),
            "sets_per_second": round(res.examples / max(res.seconds, 1e-9), 2),
            "coverage": cov,
            "runtime_checked": res.runtime_checked,
            "seed": args.seed,
            "load_avg_start": load,
        }
        if not res.ok:
            f = res.failure
            row["failure"] = {"params": f.params, "kind": f.kind, "command": f.command}
        rows.append(row)
        emit(row)
    seconds = time.perf_counter() - started
    reach = [max((int(k) for k in r["coverage"]["values"].get("p", {})), default=0) for r in rows]
    emit(
        {
            "benchmark": "pipec_test_library",
            "files": len(files),
            "failed": failed,
            "checked": checked,
            "seconds": round(seconds, 3),
            "sets_per_second": round(checked / max(seconds, 1e-9), 2),
            "smallest_largest_p": min(reach, default=0),
            "budget": budget,
        }
    )
    if args.markdown:
        print(_table(rows), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
