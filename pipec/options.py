"""Command-line values and run options, in one room: one parser per kind of value, the data-parallel
flags, and `RunOptions`, every option of `pipec run`.

Every command of `pipec` (pipec.cli) and the runtime's worker entry point (pipec.runtime.job.launch)
read their values here, so a value means the same and is refused the same way wherever it is given: a
parser raises `argparse.ArgumentTypeError`, which argparse reports as `PROG: error: argument --X: ...`
and exit status 2; a combination of options that no single parser can see is an `OptionError`, which
the CLI reports the same way. `RunOptions.to_argv` writes the options back as the worker's arguments,
so a new run option is added once (a field, its flag) and reaches every rank.

Stdlib and pipec's base floors only: the runtime's worker parser imports this before torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from pipec.errors import PipecError, brief
from pipec.ir.dataparallel import KINDS, DataParallel
from pipec.ir.experts import Experts

# A command-line number: ASCII digits, an optional sign, point and exponent. float() would also take `1_0`,
# `٤`, `nan` and `inf`; int() `1_0` and `٤`.
_FLOAT = re.compile(r"\+?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
_DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0}  # `pipec test --budget`, `--pipec-budget`


class OptionError(Exception):
    """Options that are each well formed but do not go together (`--resume` without `--checkpoint`): the
    CLI reports it as misuse, exit status 2, with the subcommand's usage."""


def finite(text: str, least: str = ">= 0") -> float:
    """A number >= 0 given on the command line, in ASCII digits (with an optional point and exponent),
    finite and at most 1e300. `least` is the bound the refusal names (`positive` passes "> 0")."""
    t = text.strip()
    if not _FLOAT.fullmatch(t):
        raise argparse.ArgumentTypeError(f"expected a number {least} (ASCII digits), got `{brief(text)}`")
    value = float(t)
    if not math.isfinite(value) or value > 1e300:
        raise argparse.ArgumentTypeError(f"`{brief(text)}` is out of range")
    return value


def positive(text: str) -> float:
    """A finite number > 0 (`--tol`, `--loss-scale`, `--timeout`)."""
    value = finite(text, "> 0")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got `{brief(text)}`")
    return value


def integer(text: str) -> int:
    """An integer in ASCII digits with an optional sign (at most 12 digits); its range is the caller's."""
    t = text.strip()
    digits = t[1:] if t[:1] in "+-" else t
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 12:
        raise argparse.ArgumentTypeError(f"expected an integer (ASCII digits), got `{brief(text)}`")
    return int(t)


def count(lo: int, hi: int) -> Callable[[str], int]:
    """An integer option between lo and hi, in ASCII digits."""

    def parse(text: str) -> int:
        value = integer(text)
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected an integer from {lo:,} to {hi:,}, got {brief(text.strip())}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its messages
    return parse


def device(text: str) -> str:
    """A torch device as `pipec profile --device` takes it: `cpu`, `cuda` or `cuda:N` (whether this machine has
    it is the command's to check, with torch at hand)."""
    t = text.strip()
    kind, sep, index = t.partition(":")
    if kind == "cpu" and not sep:
        return t
    if kind == "cuda":
        if not sep:
            return t
        try:
            return f"cuda:{count(0, 1023)(index)}"
        except argparse.ArgumentTypeError:
            pass
    raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got `{brief(text)}`")


def amount(text: str) -> float:
    """A memory amount: a number (as `finite` reads it), or bytes with a unit (`80GiB`, `12GB`;
    pipec.ir.units.SIZE)."""
    from pipec.ir.units import quantity

    t = text.strip()
    if not t[-1:].isalpha() or t.lower() in ("nan", "inf", "infinity"):
        return finite(text)  # no unit: a plain number, with its messages
    try:
        return quantity(t, "bytes", "memory")
    except PipecError as e:
        raise argparse.ArgumentTypeError(e.diagnostics[0].message) from None


def duration(text: str) -> float:
    """A time > 0 in seconds, with an optional unit: `30`, `30s`, `500ms`, `2m`."""
    t = text.strip()
    unit = next((u for u in sorted(_DURATION_UNITS, key=len, reverse=True) if t.endswith(u)), "")
    number = t[: len(t) - len(unit)]
    try:
        value = finite(number) * _DURATION_UNITS.get(unit, 1.0)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a time such as 30s, 2m or 500ms, got `{brief(text)}`") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"the time must be more than 0, got `{brief(text)}`")
    return value


def span(text: str) -> tuple[str, int, int]:
    """`NAME=LO..HI`: a name and a half-open range of integers >= 0 (`pipec synth --dc`; the caller checks
    it against its sizes)."""
    name, sep, rng = text.partition("=")
    lo, dots, hi = rng.partition("..")
    try:
        if not (sep and dots and name.strip()):
            raise ValueError
        return name.strip(), count(0, 10**12)(lo), count(0, 10**12)(hi)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"expected NAME=LO..HI, got `{brief(text)}`") from None


def schedule_name(text: str) -> str:
    """A schedule's name as the language writes it (`schedule "NAME"`, grammar/pipe.lark's STRING): printable,
    one line, no double quote, at most 100 characters (`pipec synth --name`)."""
    if not text or len(text) > 100 or '"' in text or not text.isprintable():
        raise argparse.ArgumentTypeError(
            f'expected a schedule name: 1 to 100 printable characters on one line, no `"`, got {brief(text)!r}'
        )
    return text


def define(text: str) -> tuple[str, str]:
    """`-D NAME=VALUE`: a schedule parameter, as (name, value text)."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got `{brief(text)}`")
    return name.strip(), value.strip()


def add_define_argument(p: argparse.ArgumentParser, help: str | None = None) -> None:
    """`-D NAME=VALUE` (repeatable) into `defines`, a list of (name, value)."""
    help = help or "set a schedule parameter (repeatable), e.g. -D p=4 -D m=8"
    p.add_argument("-D", dest="defines", metavar="NAME=VALUE", type=define, action="append", default=[], help=help)


# --- data parallelism -------------------------------------------------------------------------------


def add_dp_arguments(p: argparse.ArgumentParser) -> None:
    """`--dp`, `--dp-kind`, `--prefetch`, `--max-gathered` (the lowering's, pipec.ir.dataparallel): shared
    by `pipec check`, `compile`, `show`, `simulate`, `export`, `profile` and `run`; `dp_of` reads them.
    Their ranges are DataParallel's (E421), so a Program's and the command line's are checked alike."""
    g = p.add_argument_group("data parallelism (docs/program.md)")
    g.add_argument("--dp", type=integer, default=1, metavar="N", help="data-parallel replicas of each rank (default 1)")
    g.add_argument("--dp-kind", choices=KINDS, default="ddp", help="ddp (replicated, default) or fsdp (sharded)")
    g.add_argument(
        "--prefetch", type=integer, default=1, metavar="K", help="fsdp: UNSHARD a stage K steps before its use"
    )
    g.add_argument(
        "--max-gathered",
        type=integer,
        default=None,
        metavar="K",
        help="fsdp: at most K stages of a rank gathered at once",
    )
    g = p.add_argument_group("expert parallelism (pipec/ir/experts.py)")
    g.add_argument(
        "--ep", type=integer, default=1, metavar="N", help="ranks each MoE layer's experts are sharded over (in --dp)"
    )
    g.add_argument("--experts", type=integer, default=0, metavar="N", help="experts per MoE layer (default 0: none)")


def dp_of(ns: argparse.Namespace | RunOptions) -> DataParallel:
    """The data parallelism `add_dp_arguments` parsed (E421 for a value out of range)."""
    return DataParallel(
        size=getattr(ns, "dp", 1),
        kind=getattr(ns, "dp_kind", "ddp"),
        prefetch=getattr(ns, "prefetch", 1),
        max_gathered=getattr(ns, "max_gathered", None),
    )


def experts_of(ns: argparse.Namespace | RunOptions) -> Experts:
    """The expert parallelism `add_dp_arguments` parsed (E425 for a value out of range)."""
    return Experts(size=getattr(ns, "ep", 1), num=getattr(ns, "experts", 0))


def moe_layers(text: str) -> tuple[int, ...]:
    """`--moe-layers`: the MoE layers of every stage (`2`), or of each stage in order (`1,2,2,1`): integers
    from 0 to pipec.ir.experts.MAX_LAYERS. Whether a list has one count per stage is the compiler's (E425)."""
    from pipec.ir.experts import MAX_LAYERS

    parse = count(0, MAX_LAYERS)
    parts = text.split(",")
    if len(parts) > 10_000_000:
        raise argparse.ArgumentTypeError("too many MoE layer counts")
    return tuple(parse(x) for x in parts)


def add_fault_arguments(p: argparse.ArgumentParser, verb: str = "emulate") -> None:
    """`--static`, `--straggler`, `--jitter` and `--fault-seed`, read by `pipec.sim.faults.faults_of`: one
    definition for `pipec run` (verb "emulate": the faults are emulated) and `pipec simulate` ("model": the
    family machine predicts the gain under them), so the two take the very same values."""
    static = (
        "run its compiled order, not orders chosen at run time"
        if verb == "emulate"
        else "predict only its compiled order (the static step), not orders chosen at run time"
    )
    p.add_argument(
        "--static",
        action="store_true",
        help=f"a schedule with an order family (`window`, `any`): {static} (docs/runtime.md 'Orders chosen at run "
        "time')",
    )
    p.add_argument(
        "--straggler",
        metavar="RANK[:FACTOR[:SHARE]]",
        default=None,
        help=f"{verb} a straggler: RANK FACTOR times slower (default 2) on a random SHARE (default 0.3) of its ops",
    )
    p.add_argument(
        "--jitter",
        metavar="DIST",
        default=None,
        help=f"{verb} link jitter: each message between ranks delayed by a draw of exp:MEAN, uniform:LO:HI or "
        "const:D (times such as 2ms)",
    )
    p.add_argument(
        "--fault-seed", type=integer, default=0, metavar="N", help="the seed of --straggler's and --jitter's draws"
    )


def add_moe_layers_argument(p: argparse.ArgumentParser) -> None:
    """`--moe-layers L` or `L0,L1,...` into `moe_layers` (None: not given), for the commands that compile a
    schedule (`pipec run` counts a model's MoE layers itself); `moe_layers_of` reads it."""
    p.add_argument(
        "--moe-layers",
        type=moe_layers,
        default=None,
        metavar="L|L0,L1,..",
        help="MoE layers of every stage, or of each stage (default: the cost file's `moe_layers`, else none)",
    )


def dp_given(ns: argparse.Namespace | RunOptions) -> bool:
    """Whether the command line set any data-parallel option (a Program file then must agree with them)."""
    return (
        getattr(ns, "dp", 1) != 1
        or getattr(ns, "dp_kind", "ddp") != "ddp"
        or getattr(ns, "prefetch", 1) != 1
        or getattr(ns, "max_gathered", None) is not None
    )


# --- pipec run ----------------------------------------------------------------------------------------

TRANSPORTS = ("auto", "gloo", "shm")  # = pipec.runtime.exec.shm.CHOICES
CPU_BIND_MODES = ("auto", "none")  # = pipec.runtime.host.affinity.MODES (test_options.py holds them equal)
MAX_STEPS = 10**9
# More local processes than this per CPU is refused before any starts (a typo in --dp or -D p), unless --force.
LOCAL_PROCESSES_PER_CPU = 16


@dataclass(frozen=True)
class RunOptions:
    """Every option of `pipec run`, read once (`from_args`) and written back as a worker's arguments
    (`to_argv`). `launcher` options are for `pipec run` alone (how to start the job, what to print
    besides); the rest reach every rank. `memory_out`, `links`, `records` and `source` are files the
    launcher names for its workers (hidden flags)."""

    model: str
    steps: int = 3
    check: bool = False
    tol: float | None = None
    trace: str | None = None
    timeout: float = 60.0
    heartbeat_grace: float = 20.0
    backend: str = "gloo"
    seed: int = 0
    recv_ahead: int | None = None
    transport: str = "auto"
    cpu_bind: str = "auto"
    checkpoint: str | None = None
    checkpoint_every: int | None = None
    resume: bool = False
    loss_scale: float | None = None
    dp: int = 1
    dp_kind: str = "ddp"
    prefetch: int = 1
    max_gathered: int | None = None
    dp_unit: str = "stage"
    ep: int = 1
    experts: int = 0
    no_overlap: bool = False
    static: bool = False
    straggler: str | None = None
    jitter: str | None = None
    fault_seed: int = 0
    compile: bool = False
    cuda_graphs: bool = False
    # files the launcher names for its workers
    links: str | None = None
    family: str | None = None  # the Program's order family (a Program file does not carry it yet)
    memory_out: str | None = None
    records: str | None = None
    source: str | None = None  # the schedule the Program was compiled from (its source lines locate diagnostics)
    # launcher only
    nproc: int | None = None
    partition: str | None = None
    local: bool = False
    memory: bool = False
    device: str | None = None
    emulate_links: bool = False
    link_scale: float = 1.0
    topology: str | None = None
    force: bool = False

    LAUNCHER = (
        "nproc",
        "partition",
        "local",
        "memory",
        "device",
        "emulate_links",
        "link_scale",
        "topology",
        "force",
    )

    def __post_init__(self) -> None:
        if (self.checkpoint_every is not None or self.resume) and not self.checkpoint:
            raise OptionError("--checkpoint-every and --resume need --checkpoint DIR")
        if self.checkpoint and self.local:
            raise OptionError("--checkpoint needs the distributed runtime (torch.distributed.checkpoint), not --local")

    @staticmethod
    def add_arguments(ap: argparse.ArgumentParser, launcher: bool = True) -> None:
        """The options on a parser: `pipec run`'s (launcher=True), or a worker's (launcher=False: no
        launcher options, the hidden files instead)."""
        ap.add_argument("--model", required=True, metavar="PATH", help="the model file (see docs/runtime.md)")
        ap.add_argument("--steps", type=count(1, MAX_STEPS), default=3, metavar="K", help="training steps (default 3)")
        ap.add_argument("--check", action="store_true", help="compare with a single-process reference every step")
        ap.add_argument(
            "--tol",
            type=positive,
            default=None,
            metavar="X",
            help="--check tolerance on relative errors (default 1e-10 in float64, 1e-4 otherwise)",
        )
        ap.add_argument("--trace", metavar="OUT", help="write the last step's measured timeline as a Chrome trace")
        ap.add_argument(
            "--timeout",
            type=positive,
            default=60.0,
            metavar="S",
            help="seconds a rank waits for a peer before giving up (default 60)",
        )
        ap.add_argument(
            "--heartbeat-grace",
            type=positive,
            default=20.0,
            metavar="S",
            help="seconds a rank may go without a heartbeat (stopped, frozen, killed) before the job ends "
            "naming it (default 20; docs/reliability.md)",
        )
        ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="gloo (CPU) or nccl (CUDA)")
        ap.add_argument("--seed", type=integer, default=0, help="weights are seeded by (seed, stage)")
        ap.add_argument(
            "--recv-ahead",
            type=count(0, 10**9),
            default=None,
            metavar="N",
            help="gloo: post each receive up to N receives before the Program places it (default 4; 0: where it says)",
        )
        ap.add_argument(
            "--transport",
            choices=TRANSPORTS,
            default="auto",
            help="gloo: messages between ranks through shared memory (shm) or gloo; auto (default): shm when every "
            "rank of a pipeline is on one host",
        )
        ap.add_argument(
            "--cpu-bind",
            choices=CPU_BIND_MODES,
            default="auto",
            help="gloo: bind each local rank to its own share of the CPUs when there are enough (default auto)",
        )
        ap.add_argument(
            "--checkpoint",
            metavar="DIR",
            default=None,
            help="save checkpoints (torch.distributed.checkpoint) in DIR, a folder every rank can reach",
        )
        ap.add_argument(
            "--checkpoint-every",
            type=count(1, MAX_STEPS),
            default=None,
            metavar="K",
            help="with --checkpoint: save every K steps (default: at the end only)",
        )
        ap.add_argument(
            "--resume",
            action="store_true",
            help="with --checkpoint: continue from DIR's newest complete checkpoint (from step 0 when it has none)",
        )
        ap.add_argument(
            "--loss-scale",
            type=positive,
            default=None,
            metavar="X",
            help="each micro-batch's loss is multiplied by X (default 1/m: the mean)",
        )
        add_dp_arguments(ap)
        ap.add_argument(
            "--no-overlap",
            action="store_true",
            help="run an overlapped pair (F & B) one op after the other, its all-to-alls not hidden (the baseline)",
        )
        ap.add_argument(
            "--dp-unit",
            choices=("stage", "block"),
            default="stage",
            help="fsdp: fully_shard each stage (default), or each of its child blocks and then the stage",
        )
        ap.add_argument(
            "--compile",
            action="store_true",
            help="run each stage through torch.compile, its split backward included (docs/runtime.md)",
        )
        ap.add_argument(
            "--cuda-graphs",
            action="store_true",
            help="CUDA: capture each stage's compiled forward and backward as CUDA graphs and replay them (implies "
            "--compile; needs CUDA)",
        )
        add_fault_arguments(ap)
        if not launcher:
            ap.add_argument("--family", default=None, help=argparse.SUPPRESS)  # the order family's JSON file
            ap.add_argument(
                "--links",
                metavar="FILE.json",
                default=None,
                help="emulated links, as `pipec run --emulate-links` writes them (pipec.runtime.exec.links)",
            )
            ap.add_argument("--memory-out", default=None, help=argparse.SUPPRESS)  # `pipec run --memory`: peaks here
            ap.add_argument("--records", default=None, help=argparse.SUPPRESS)  # the run's JSON records (rank 0)
            ap.add_argument("--source", default=None, help=argparse.SUPPRESS)  # launch.schedule_source's file
            return
        ap.add_argument(
            "--nproc",
            type=count(1, 1_000_000),
            default=None,
            metavar="N",
            help="processes (default: the schedule's ranks)",
        )
        ap.add_argument(
            "--partition",
            metavar="PART.json",
            help="stages from the model's layers(), as `pipec partition` split them",
        )
        ap.add_argument("--local", action="store_true", help="run every rank in this process (in-memory messages)")
        ap.add_argument(
            "--force",
            action="store_true",
            help=f"start the job even when it needs more than {LOCAL_PROCESSES_PER_CPU} local processes per CPU",
        )
        ap.add_argument(
            "--memory",
            action="store_true",
            help="measure each rank's peak saved activation bytes and print them against the memory model's",
        )
        ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="--local: where to run (default cpu)")
        ap.add_argument(
            "--emulate-links",
            action="store_true",
            help="hold back each message between datacenters, and with --dp each collective between replica "
            "datacenters, by its link's latency and bandwidth (docs/cross-dc.md)",
        )
        ap.add_argument(
            "--link-scale",
            type=finite,
            default=1.0,
            metavar="X",
            help="--emulate-links: latencies times X, bandwidths divided by X (default 1)",
        )

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> RunOptions:
        """The options a parser with `add_arguments` read (OptionError for ones that do not go together)."""
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{k: getattr(ns, k) for k in names if hasattr(ns, k)})

    def to_argv(self) -> list[str]:
        """The worker's arguments for these options (after its FILE|NAME): every option that is not the
        launcher's and differs from its default, so a worker parses back these same options."""
        out: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in self.LAUNCHER or (value == f.default and f.name != "model"):
                continue
            flag = "--" + f.name.replace("_", "-")
            if value is True:
                out.append(flag)
            elif value is not False:
                out += [flag, repr(value) if isinstance(value, float) else str(value)]
        return out
