"""The syntax tree of a schedule file: small frozen nodes, each with its span."""

from __future__ import annotations

from dataclasses import dataclass

from pipec.errors import Span


@dataclass(frozen=True)
class Node:
    span: Span


# ---- expressions -----------------------------------------------------------


@dataclass(frozen=True)
class Num(Node):
    value: int | float


@dataclass(frozen=True)
class Str(Node):
    value: str


@dataclass(frozen=True)
class Bool(Node):
    value: bool


@dataclass(frozen=True)
class Var(Node):
    name: str


@dataclass(frozen=True)
class Unary(Node):
    op: str  # "-" or "not"
    operand: Expr


@dataclass(frozen=True)
class BinOp(Node):
    op: str  # + - * / // % == != < <= > >= and or
    left: Expr
    right: Expr
    op_span: Span


@dataclass(frozen=True)
class IfExpr(Node):
    cond: Expr
    then: Expr
    orelse: Expr


@dataclass(frozen=True)
class KwArg(Node):
    name: str
    value: Expr


@dataclass(frozen=True)
class Call(Node):
    name: str
    name_span: Span
    args: tuple[Expr, ...]
    kwargs: tuple[KwArg, ...]


Expr = Num | Str | Bool | Var | Unary | BinOp | IfExpr | Call


# ---- statements -------------------------------------------------------------


@dataclass(frozen=True)
class Let(Node):
    name: str
    value: Expr


@dataclass(frozen=True)
class Def(Node):
    """`def f(x) = expr` (body is an Expr) or `def f(x) { ... }` (a tuple of statements)."""

    name: str
    params: tuple[str, ...]
    body: Expr | tuple[Stmt, ...]


@dataclass(frozen=True)
class Require(Node):
    cond: Expr
    message: str | None


@dataclass(frozen=True)
class Expect(Node):
    """`expect cond [when guard] [, "message"]`: a promise checked after evaluation (see pipec.passes.expect)."""

    cond: Expr
    guard: Expr | None
    message: str | None


@dataclass(frozen=True)
class For(Node):
    """`for i in lo .. hi [by step] { ... }`: half-open, like Python's range."""

    var: str
    lo: Expr
    hi: Expr
    body: tuple[Stmt, ...]
    step: Expr | None = None


@dataclass(frozen=True)
class Repeat(Node):
    count: Expr
    body: tuple[Stmt, ...]


@dataclass(frozen=True)
class While(Node):
    cond: Expr
    body: tuple[Stmt, ...]


@dataclass(frozen=True)
class If(Node):
    branches: tuple[tuple[Expr, tuple[Stmt, ...]], ...]
    orelse: tuple[Stmt, ...] | None


@dataclass(frozen=True)
class RankBlock(Node):
    var: str
    body: tuple[Stmt, ...]


@dataclass(frozen=True)
class OrderItem(Node):
    """One line of an `order` block: `prefer B, F, W`, `inflight [(s)] <= e`, `fill W`, `lag W = e`."""

    kind: str  # "prefer", "inflight", "fill" or "lag"
    names: tuple[str, ...]  # the op kinds named (prefer, fill, lag)
    name_spans: tuple[Span, ...]
    var: str | None  # the stage variable of `inflight(s)`
    value: Expr | None


@dataclass(frozen=True)
class OrderBlock(Node):
    """`order r { ... }`: a policy from which the compiler derives each rank's order (pipec.passes.policy)."""

    var: str
    items: tuple[OrderItem, ...]


@dataclass(frozen=True)
class Window(Node):
    """`window e [prefer NAME]` in a rank block: the rank may run any op less than e places past its earliest
    op not yet run (docs/language.md, section 20); `prefer` names the runtime's choice among them."""

    value: Expr
    prefer: str | None
    prefer_span: Span | None


@dataclass(frozen=True)
class AnyGroup(Node):
    """`any { ... }` in a rank block: the ops emitted inside may run in any order among themselves."""

    body: tuple[Stmt, ...]


@dataclass(frozen=True)
class Emit(Node):
    """One op, or an overlapped pair `a & b` that the runtime may interleave."""

    calls: tuple[Call, ...]


@dataclass(frozen=True)
class Decl(Node):
    """`stages e`, `ranks e`, `microbatches e`, `slices e`, `seqlen e`, `cost K = e`, `memory K = e`."""

    kind: str
    key: str | None
    value: Expr


@dataclass(frozen=True)
class Place(Node):
    """`place s -> e`, and the other per-index maps: `tokens j -> e` (slice j's tokens), `length i -> e`
    (micro-batch i's tokens), `edge s -> e` (one output of stage s: an edge s -> e of the stage graph where
    e >= 0; a schedule may declare several)."""

    var: str
    value: Expr
    kind: str = "place"


@dataclass(frozen=True)
class OpsDecl(Node):
    names: tuple[str, ...]
    name_spans: tuple[Span, ...]


@dataclass(frozen=True)
class Quantity(Node):
    """A number with an optional unit, for example `40ms` or `10Gbps`."""

    value: float
    unit: str


@dataclass(frozen=True)
class TopoDc(Node):
    """`dc "name" ranks lo .. hi`, or with `replicas` (`replicas=True`): the data-parallel replicas
    lo .. hi - 1 sit in that datacenter (PP x DP across datacenters)."""

    name: str
    lo: Expr
    hi: Expr
    replicas: bool = False


@dataclass(frozen=True)
class TopoLink(Node):
    a: str | None  # None for the default link
    b: str | None
    latency: Quantity | None
    bandwidth: Quantity | None


@dataclass(frozen=True)
class Topology(Node):
    items: tuple[TopoDc | TopoLink, ...]


Stmt = (
    Let
    | Def
    | Require
    | Expect
    | For
    | Repeat
    | While
    | If
    | RankBlock
    | OrderBlock
    | Window
    | AnyGroup
    | Emit
    | Decl
    | Place
    | OpsDecl
    | Topology
)


@dataclass(frozen=True)
class Param(Node):
    name: str
    type: str | None
    default: Expr | None


@dataclass(frozen=True)
class ScheduleAst(Node):
    name: str
    params: tuple[Param, ...]
    body: tuple[Stmt, ...]
