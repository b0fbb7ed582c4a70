"""What a name means while a schedule compiles: the language's reserved names and the compile-time scope.

Shared by the two halves of the compiler (pipec.frontend.expressions, pipec.frontend.codegen), and by
whatever needs the language's own vocabulary without compiling (pipec.synth writes only the `memory`
keys the language knows). A scope maps a name to a Value (its generated Python name and its static
type), a Func (a `def`, type-checked per distinct argument types) or a MetricFn (a function only an
`expect` sees).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipec.frontend import ast
from pipec.ir.opcodes import MEMOPS
from pipec.ir.schedule import MEMORY_RANK_KEYS, MEMORY_STAGE_KEYS

OP_KINDS = ("F", "B", "W")
KEYWORDS = frozenset(
    "schedule require let def for in by repeat while if elif else then and or not true false rank stages ranks"
    " microbatches place edge ops cost memory topology dc link default latency bandwidth int float bool str"
    " expect when slices seqlen tokens length".split()
)
BUILTINS = ("min", "max", "abs", "done")
# Data-parallel collectives a rank block may place itself (rows of pipec.ir.opcodes; PP x DP, docs/language.md
# section 16): statements like ops, but they take a stage only and become `Schedule.collectives`.
COLLECTIVES = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
# Memory ops a rank block may place (rows of pipec.ir.opcodes, docs/language.md section 17): statements like
# ops, with a micro-batch and a stage, that become `Schedule.memops`. `F(i, recompute: true)` asks for a
# RECOMPUTE at its default place instead.
MEMOP_NAMES = MEMOPS
MEMORY_KEYS = MEMORY_STAGE_KEYS + MEMORY_RANK_KEYS
NUMERIC = ("int", "float")
# Names only an `expect` sees (pipec.passes.expect computes them): numbers, and functions of a rank.
METRICS = {"bubble": "float", "bubble_time": "float", "makespan": "float", "ideal": "float", "overlap_gain": "float"}
METRIC_FUNCS = {"peak_memory": "float", "in_flight": "int"}
MAX_CALLS = 1_000_000  # function calls one call may make: nesting must not hide exponential work


@dataclass
class Value:
    pyname: str
    type: str


@dataclass
class Func:
    node: ast.Def
    pyname: str
    scope: Scope
    checked: dict = field(default_factory=dict)
    weight: int = 1  # function calls one call makes, itself included (loops inside charge at run time)


@dataclass
class MetricFn:
    name: str
    type: str


@dataclass
class Scope:
    parent: Scope | None
    names: dict = field(default_factory=dict)

    def lookup(self, name: str):
        s = self
        while s is not None:
            if name in s.names:
                return s.names[name]
            s = s.parent
        return None

    def snapshot(self) -> Scope:
        return Scope(self.parent, dict(self.names))
