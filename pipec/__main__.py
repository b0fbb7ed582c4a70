"""`pipec` (the console script) and `python -m pipec`: the CLI's main, then a quick exit.

A process that has imported torch (`pipec run`, `pipec profile`, torchrun's agent in this process) takes
about a second to finalise its interpreter after the work is done, so a job that fails or ends would
keep its caller waiting that long; once the output is flushed, such a process exits at once.
"""

import os
import sys


def entry() -> None:
    from pipec.cli.app import main

    code = main()
    if "torch" in sys.modules:  # every file is closed and every folder removed by now
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)
    sys.exit(code)


if __name__ == "__main__":
    entry()
