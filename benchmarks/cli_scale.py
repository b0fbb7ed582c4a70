"""The command line at a million ops against the library call doing the same work, each in a fresh process.

`pipec compile 1f1b -D p=128 -D m=4096` (1,048,576 ops, about 3.1M instructions) to a file and to
standard output, and `pipec simulate ... --json`, side by side with a fresh `python -c` that makes the
same library calls (`benchmarks/sidebyside`: alternating rounds, medians, load average). Two library
baselines for compile: the call alone (`pipec.compile`, the Program in memory) and the call plus the
library's own writer to the same destination, so the record shows what writing the output costs and
what the command adds on top. One JSON line per comparison; the issue's bar is ratio <= 1.3 against
the library call.

    python benchmarks/cli_scale.py                 # p=128 m=4096, 3 rounds (a few minutes on 2 cores)
    python benchmarks/cli_scale.py -p 16 -m 256    # a quick look
    python benchmarks/cli_scale.py --smoke         # p=4 m=8, 1 round: the format (the test suite's)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from sidebyside import Timing, alternate, emit, load_average, run_process, smoke_flag, summarize

PY = sys.executable


def _fresh(argv: list[str], stdout_path: str | None = None) -> Timing:
    """Wall and CPU seconds of one fresh process (its standard output to a file, or discarded)."""
    return run_process(argv, stdout_path)


def _lib(code: str) -> list[str]:
    return [PY, "-c", "import pipec, sys\n" + code]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-p", type=int, default=128)
    ap.add_argument("-m", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", choices=("compile", "simulate"), default=None)
    smoke_flag(ap)
    a = ap.parse_args()
    if a.smoke:
        a.p, a.m, a.rounds = 4, 8, 1
    d = ["-D", f"p={a.p}", "-D", f"m={a.m}"]
    cli = [PY, "-m", "pipec"]
    tmp = tempfile.mkdtemp(prefix="pipec-cli-scale-")
    f_json, f_txt, f_out = (os.path.join(tmp, n) for n in ("cli.json", "lib.json", "stdout"))
    size = {"schedule": "1f1b", "p": a.p, "m": a.m, "ops": 2 * a.p * a.m}
    call = f'prog = pipec.compile("1f1b", p={a.p}, m={a.m})'

    if a.only in (None, "compile"):
        start = load_average()
        runs = alternate(
            {
                "cli_to_file": lambda: _fresh([*cli, "compile", "1f1b", *d, "-o", f_json]),
                "library_call": lambda: _fresh(_lib(call)),
                "library_call_and_write": lambda: _fresh(
                    _lib(
                        f"{call}\nfrom pipec.formats.program_file import write_json\nwith open({f_txt!r}, 'w') as f:\n"
                        "    write_json(prog, f)\n    f.write('\\n')"
                    )
                ),
                "cli_to_stdout": lambda: _fresh([*cli, "compile", "1f1b", *d], f_out),
                "library_call_and_write_text": lambda: _fresh(
                    _lib(f"{call}\nfrom pipec.formats.program_file import write_text\nwrite_text(prog, sys.stdout)"),
                    f_out,
                ),
            },
            rounds=a.rounds,
        )
        same = open(f_json).read() == open(f_txt).read()
        for pair in (
            ("cli_to_file", "library_call"),
            ("cli_to_file", "library_call_and_write"),
            ("cli_to_stdout", "library_call_and_write_text"),
        ):
            sub = {k: runs[k] for k in pair}
            emit(summarize("cli_scale_compile", sub, pair, start, **size, same_output=same))

    if a.only in (None, "simulate"):
        start = load_average()
        code = (
            f'sim = pipec.simulate("1f1b", p={a.p}, m={a.m})\n'
            "import json\nfrom pipec.view.report import to_json\n"
            'print(json.dumps({"results": [to_json(sim)]}))'
        )
        runs = alternate(
            {
                "cli_simulate_json": lambda: _fresh([*cli, "simulate", "1f1b", *d, "--json"]),
                "library_simulate": lambda: _fresh(_lib(code)),
            },
            rounds=a.rounds,
        )
        emit(summarize("cli_scale_simulate", runs, ("cli_simulate_json", "library_simulate"), start, **size))


if __name__ == "__main__":
    main()
