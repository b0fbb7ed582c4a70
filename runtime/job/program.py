"""The Program a run executes, built in one place for every entry, and the schedule source its workers
locate diagnostics in.

`pipec run` compiles before any process starts and hands its workers the Program as a file; a worker that
torchrun starts on a schedule compiles it itself; both go through `run_program`, so the Program carries the
same data parallelism and experts whichever way the job was started (pipec.runtime.job.launch reads the
experts from it). A Program file has no source lines, so `pipec run` also writes the schedule's source for its
workers (`write_source`), and a worker's start-up diagnostic (expert parallelism's E427) is located there
(`read_source`).
"""

from __future__ import annotations

from pipec.options import RunOptions, dp_of, experts_of


def run_program(obj, where: str | None, opts: RunOptions | None = None):
    """The Program a run executes (a CompiledSchedule), built here for every entry: `pipec run` before any
    process starts, a worker torchrun starts on a schedule, a worker reading the launcher's Program file.
    A schedule (on the network `opts.topology` names, if any) is lowered with the command line's data
    parallelism and experts (--dp, --ep, --experts: E421, E425 at the command line) over the MoE layers it
    declares (`pipec.driver.moe_layers_of`: the model's own are counted at start-up); a Program file is
    checked as it stands and must agree with the flags given (E422, E426). `opts` None: no flag given."""
    from pipec.driver import compiled, moe_layers_of
    from pipec.errors import PipecError, error
    from pipec.ir.experts import Experts
    from pipec.ir.program import Program
    from pipec.options import dp_given
    from pipec.passes.experts import COMMAND_LINE

    file = isinstance(obj, Program)
    dp = experts = None
    if opts is not None:
        dp = dp_of(opts) if not file or dp_given(opts) else None
        try:
            experts = experts_of(opts)
        except PipecError as e:  # a value out of range: E425, said of the command line
            d = e.diagnostics[0]
            raise error(d.code, d.message, source=COMMAND_LINE, notes=d.notes) from None
        experts = None if file and experts == Experts() else experts
    topology = opts.topology if opts is not None else None
    return compiled(obj, None, where, dp, topology, experts, moe_layers_of(obj))


def write_source(schedule, path: str) -> bool:
    """Write the source of the Schedule a Program was compiled from (its text and parameters) for the
    workers to `path`, so that their start-up diagnostics name its lines (`read_source`); False when it has
    none (a Program file)."""
    import json

    if schedule is None or schedule.source is None or not schedule.source.text:
        return False
    with open(path, "w") as f:
        json.dump({"path": schedule.source.path, "text": schedule.source.text, "params": schedule.params}, f)
    return True


def read_source(path: str | None, rank: int):
    """The Schedule `write_source` wrote, evaluated for pipeline rank `rank` alone (its source lines, for
    diagnostics); None without one."""
    import json

    from pipec.driver import build
    from pipec.errors import Source

    if path is None:
        return None
    with open(path) as f:
        doc = json.load(f)
    return build(Source(doc["path"], doc["text"]), [tuple(p) for p in doc["params"]], ranks=[rank])
