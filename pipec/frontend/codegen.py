"""Syntax tree to Python code, once per file: names resolved and types checked statically.

Why generate code: a schedule with a million ops must evaluate in seconds, so
the per-op path is plain Python (`for` loops and list appends), not a tree
walk. The generated module defines `_schedule(_rt, <params>)`, which runs the
top-level statements and hands declarations and the rank block to `_rt` (see
`pipec.frontend.evaluate`). The language has no mutation and no recursion (a function
sees only names defined before it), loops run over finite ranges under a work
budget, and `while` must emit ops every iteration, so evaluation always ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipec.errors import PipecError, Source, Span, error
from pipec.frontend import ast
from pipec.ir.opcodes import MEMOPS
from pipec.ir.schedule import MEMORY_RANK_KEYS, MEMORY_STAGE_KEYS, STAGE_COST_KEYS

OP_KINDS = ("F", "B", "W")
KEYWORDS = frozenset(
    "schedule require let def for in by repeat while if elif else then and or not true false rank stages ranks"
    " microbatches place ops cost memory topology dc link default latency bandwidth int float bool str"
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
METRICS = {"bubble": "float", "bubble_time": "float", "makespan": "float", "ideal": "float"}
METRIC_FUNCS = {"peak_memory": "float", "in_flight": "int"}
MAX_CALLS = 1_000_000  # function calls one call may make: nesting must not hide exponential work


@dataclass
class _Value:
    pyname: str
    type: str


@dataclass
class _Func:
    node: ast.Def
    pyname: str
    scope: _Scope
    checked: dict = field(default_factory=dict)
    weight: int = 1  # function calls one call makes, itself included (loops inside charge at run time)


@dataclass
class _MetricFn:
    name: str
    type: str


@dataclass
class _Scope:
    parent: _Scope | None
    names: dict = field(default_factory=dict)

    def lookup(self, name: str):
        s = self
        while s is not None:
            if name in s.names:
                return s.names[name]
            s = s.parent
        return None

    def snapshot(self) -> _Scope:
        return _Scope(self.parent, dict(self.names))


@dataclass(frozen=True)
class GeneratedCode:
    """The generated Python source and the spans its statement ids refer to."""

    code: str
    spans: tuple[Span, ...]
    params: tuple[ast.Param, ...]
    param_types: tuple[str, ...]
    kinds: tuple[str, ...]
    counts_ops: bool
    name: str
    header: Span
    line_spans: tuple[Span, ...] = ()  # per line of `code`: the statement it came from
    # Whether any rank block places a collective: without one, evaluation keeps its plain path (no
    # `_coll` helper, no per-rank list) and the Schedule's `collectives` stays empty.
    collectives: bool = False
    # Likewise for memory ops: whether any rank block places one (`_mem`), and the statement ids of the
    # forwards that ask for their default RECOMPUTE (`F(i, recompute: true)`): an op emitted with one of
    # these ids is recomputed, so the op's tuple and the per-op path stay as they are without it.
    memops: bool = False
    recompute_sids: frozenset[int] = frozenset()


class _Compiler:
    def __init__(self, tree: ast.ScheduleAst, source: Source) -> None:
        self.tree = tree
        self.source = source
        self.spans: list[Span] = []
        self.out: list[str] = []
        self.where: list[Span] = []  # parallel to `out`
        self.cur = tree.span
        self.n = 0
        self.counts_ops = False
        self.collectives = False
        self.memops = False
        self.recompute_sids: set[int] = set()
        self.weights: list[int] = [0]  # function calls made by the code being generated, per open loop/def
        self.kinds = self._find_kinds()
        # Token slices (docs/terapipe.md): declared at the top or not at all, so whether an op must say its
        # slice (`F(i, slice: j)`) is known here, and an unsliced schedule's ops pay nothing for slices.
        self.sliced = any(isinstance(s, ast.Decl) and s.kind == "slices" for s in tree.body)

    # ---- helpers
    def err(self, code: str, message: str, span: Span, notes: tuple[str, ...] = ()) -> PipecError:
        return error(code, message, span, self.source, notes)

    def sid(self, span: Span) -> int:
        self.spans.append(span)
        return len(self.spans) - 1

    def fresh(self, name: str) -> str:
        self.n += 1
        return f"v_{name}_{self.n}"

    def line(self, indent: int, text: str) -> None:
        self.out.append("    " * indent + text)
        self.where.append(self.cur)

    def _find_kinds(self) -> tuple[str, ...]:
        decls = [s for s in self.tree.body if isinstance(s, ast.OpsDecl)]
        if len(decls) > 1:
            raise self.err("E106", "`ops` declared twice", decls[1].span)
        if not decls:
            return ("F", "B")
        d = decls[0]
        for name, span in zip(d.names, d.name_spans):
            if name not in OP_KINDS:
                raise self.err("E110", f"unknown op kind `{name}`; ops are F, B and (split backward) W", span)
        if d.names not in (("F", "B"), ("F", "B", "W")):
            raise self.err("E110", "declare `ops F, B` (full backward) or `ops F, B, W` (split backward)", d.span)
        return d.names

    def bind(self, scope: _Scope, name: str, value, span: Span) -> None:
        if name in KEYWORDS:
            raise self.err("E104", f"`{name}` is a keyword and cannot name a value", span)
        if name in OP_KINDS or name in BUILTINS or name in COLLECTIVES or name in MEMOP_NAMES:
            raise self.err("E104", f"`{name}` is a built-in name and cannot be redefined", span)
        if name in scope.names:
            raise self.err("E104", f"`{name}` is already defined in this block", span)
        scope.names[name] = value

    # ---- expressions: return (python code, type)
    def expr(self, e: ast.Expr, scope: _Scope) -> tuple[str, str]:
        if isinstance(e, ast.Num):
            return repr(e.value), "int" if isinstance(e.value, int) else "float"
        if isinstance(e, ast.Str):
            return repr(e.value), "str"
        if isinstance(e, ast.Bool):
            return repr(e.value), "bool"
        if isinstance(e, ast.Var):
            return self.var(e, scope)
        if isinstance(e, ast.Unary):
            code, t = self.expr(e.operand, scope)
            if e.op == "-":
                self.want(t, NUMERIC, e.operand.span, "`-`")
                return f"(-{code})", t
            self.want(t, ("bool",), e.operand.span, "`not`")
            return f"(not {code})", "bool"
        if isinstance(e, ast.BinOp):
            return self.binop(e, scope)
        if isinstance(e, ast.IfExpr):
            c, ct = self.expr(e.cond, scope)
            self.want(ct, ("bool",), e.cond.span, "a condition")
            a, at = self.expr(e.then, scope)
            b, bt = self.expr(e.orelse, scope)
            return f"({a} if {c} else {b})", self.unify(at, bt, e.span)
        if isinstance(e, ast.Call):
            return self.call(e, scope)
        raise AssertionError(e)  # pragma: no cover

    def var(self, e: ast.Var, scope: _Scope) -> tuple[str, str]:
        if e.name in OP_KINDS:
            self.check_kind(e.name, e.span)
            return repr(self.kinds.index(e.name)), "kind"
        if e.name in COLLECTIVES:
            raise self.err("E103", f"`{e.name}` is a collective; place it with `{e.name}(stage: s)`", e.span)
        if e.name in MEMOP_NAMES:
            raise self.err("E103", f"`{e.name}` is a memory op; place it with `{e.name}(i)`", e.span)
        b = scope.lookup(e.name)
        if b is None:
            if e.name in BUILTINS:
                raise self.err("E103", f"`{e.name}` is a function; call it", e.span)
            raise self.err("E101", f"unknown name `{e.name}`", e.span)
        if isinstance(b, (_Func, _MetricFn)):
            raise self.err("E103", f"`{e.name}` is a function; call it with its arguments", e.span)
        return b.pyname, b.type

    def check_kind(self, name: str, span: Span) -> None:
        if name not in self.kinds:
            raise self.err(
                "E306",
                f"`{name}` is not an op of this schedule: it declares `ops {', '.join(self.kinds)}`",
                span,
                ("split backward needs `ops F, B, W`",),
            )

    def want(self, t: str, allowed: tuple[str, ...], span: Span, what: str) -> None:
        if t != "any" and t not in allowed:
            raise self.err("E103", f"{what} needs {' or '.join(allowed)}, got {t}", span)

    def unify(self, a: str, b: str, span: Span) -> str:
        if a == b or b == "any":
            return a
        if a == "any":
            return b
        if a in NUMERIC and b in NUMERIC:
            return "float"
        raise self.err("E103", f"both branches must have one type, got {a} and {b}", span)

    def binop(self, e: ast.BinOp, scope: _Scope) -> tuple[str, str]:
        a, at = self.expr(e.left, scope)
        b, bt = self.expr(e.right, scope)
        op = e.op
        if op in ("and", "or"):
            self.want(at, ("bool",), e.left.span, f"`{op}`")
            self.want(bt, ("bool",), e.right.span, f"`{op}`")
            return f"({a} {op} {b})", "bool"
        if op in ("==", "!="):
            if "op" in (at, bt) or "coll" in (at, bt) or "memop" in (at, bt):
                raise self.err("E103", "ops cannot be compared; compare their micro-batches or stages", e.op_span)
            if "any" not in (at, bt) and at != bt and not (at in NUMERIC and bt in NUMERIC):
                raise self.err("E103", f"cannot compare {at} with {bt}", e.op_span)
            return f"({a} {op} {b})", "bool"
        self.want(at, NUMERIC, e.left.span, f"`{op}`")
        self.want(bt, NUMERIC, e.right.span, f"`{op}`")
        if op in ("<", "<=", ">", ">="):
            return f"({a} {op} {b})", "bool"
        t = "int" if at == bt == "int" else ("any" if "any" in (at, bt) else "float")
        if op in ("/", "//", "%"):
            rt = "float" if op == "/" else t
            if op != "/" and isinstance(e.right, ast.Num) and e.right.value != 0:
                return f"({a} {op} {b})", rt
            if bt in NUMERIC and self.pure(e.right, scope):
                # Inline, as `a // (b or _zero_div(sid))`: a number is zero exactly when it is false, and a
                # then b are evaluated in the helper's order, so the results and errors are the helper's.
                # Only for a divisor without divisions or calls: it nests two parentheses deeper than the
                # call did, once, so the generated code stays well inside Python's 200 (see MAX_DEPTH).
                zero = "_zero_mod" if op == "%" else "_zero_div"
                return f"({a} {op} ({b} or {zero}({self.sid(e.op_span)})))", rt
            helper = {"/": "_tdiv", "//": "_fdiv", "%": "_mod"}[op]
            return f"{helper}({a}, {b}, {self.sid(e.op_span)})", rt
        return f"({a} {op} {b})", t

    def pure(self, e: ast.Expr, scope: _Scope) -> bool:
        """Numbers, plain names, and + - * of them: no call, no division inside."""
        if isinstance(e, (ast.Num, ast.Bool)):
            return True
        if isinstance(e, ast.Var):
            b = scope.lookup(e.name)
            return isinstance(b, _Value) and b.pyname.isidentifier()
        if isinstance(e, ast.Unary):
            return e.op == "-" and self.pure(e.operand, scope)
        if isinstance(e, ast.BinOp):
            return e.op in ("+", "-", "*") and self.pure(e.left, scope) and self.pure(e.right, scope)
        return False

    def call(self, e: ast.Call, scope: _Scope) -> tuple[str, str]:
        if e.name in OP_KINDS:
            return self.op_call(e, scope, emit=False)
        if e.name in COLLECTIVES:
            return self.coll_call(e, scope, emit=False)
        if e.name in MEMOP_NAMES:
            return self.mem_call(e, scope, emit=False)
        b = scope.lookup(e.name)
        if b is None and e.name in BUILTINS:
            return self.builtin(e, scope)
        if b is None:
            raise self.err("E101", f"unknown function `{e.name}`", e.name_span)
        if isinstance(b, _MetricFn):
            return self.metric_call(e, b, scope)
        if not isinstance(b, _Func):
            raise self.err("E103", f"`{e.name}` is a value of type {b.type}, not a function", e.name_span)
        if e.kwargs:
            raise self.err("E105", f"`{e.name}` takes no keyword arguments", e.kwargs[0].span)
        if len(e.args) != len(b.node.params):
            raise self.err(
                "E102",
                f"`{e.name}` takes {len(b.node.params)} argument(s), got {len(e.args)}",
                e.span,
            )
        codes, types = zip(*(self.expr(a, scope) for a in e.args)) if e.args else ((), ())
        rtype = self.check_func(b, tuple(types), e.span)
        self.weights[-1] += b.weight
        return f"{b.pyname}({', '.join(codes)})", rtype

    def builtin(self, e: ast.Call, scope: _Scope) -> tuple[str, str]:
        if e.kwargs:
            raise self.err("E105", f"`{e.name}` takes no keyword arguments", e.kwargs[0].span)
        if e.name == "done":
            if len(e.args) != 2:
                raise self.err("E102", f"`done(op, stage)` takes 2 arguments, got {len(e.args)}", e.span)
            k, kt = self.expr(e.args[0], scope)
            self.want(kt, ("kind",), e.args[0].span, "the first argument of `done`")
            s, st = self.expr(e.args[1], scope)
            self.want(st, ("int",), e.args[1].span, "the stage of `done`")
            self.counts_ops = True
            return f"_done({k}, {s}, {self.sid(e.span)})", "int"
        if e.name == "abs":
            if len(e.args) != 1:
                raise self.err("E102", f"`abs` takes 1 argument, got {len(e.args)}", e.span)
            c, t = self.expr(e.args[0], scope)
            self.want(t, NUMERIC, e.args[0].span, "`abs`")
            return f"abs({c})", t
        if not e.args:
            raise self.err("E102", f"`{e.name}` takes at least 1 argument", e.span)
        parts = [self.expr(a, scope) for a in e.args]
        for (_, t), a in zip(parts, e.args):
            self.want(t, NUMERIC, a.span, f"`{e.name}`")
        types = {t for _, t in parts}
        t = "int" if types == {"int"} else ("any" if "any" in types else "float")
        if len(parts) == 1:
            return parts[0][0], t
        return f"{e.name}({', '.join(c for c, _ in parts)})", t

    def metric_call(self, e: ast.Call, f: _MetricFn, scope: _Scope) -> tuple[str, str]:
        """`peak_memory(r)`, `in_flight(r)` inside an `expect`: a measure of rank r."""
        if e.kwargs:
            raise self.err("E105", f"`{e.name}` takes no keyword arguments", e.kwargs[0].span)
        if len(e.args) != 1:
            raise self.err("E102", f"`{e.name}(rank)` takes 1 argument, got {len(e.args)}", e.span)
        code, t = self.expr(e.args[0], scope)
        self.want(t, ("int",), e.args[0].span, f"the rank of `{e.name}`")
        return f"_M.{e.name}({code}, {self.sid(e.span)})", f.type

    def op_call(self, e: ast.Call, scope: _Scope, emit: bool, sid: int | None = None) -> tuple[str, str]:
        """An op: as a value `(kind, mb, stage, sid)`; as a statement, appended to the rank's list."""
        self.check_kind(e.name, e.name_span)
        k = self.kinds.index(e.name)
        if len(e.args) > 1:
            raise self.err("E102", f"`{e.name}` takes at most one micro-batch argument, got {len(e.args)}", e.span)
        mb = None
        if e.args:
            mb, t = self.expr(e.args[0], scope)
            self.want(t, ("int",), e.args[0].span, "a micro-batch")
        stage = "_ds"
        recompute = None
        piece = None
        seen = set()
        for kw in e.kwargs:
            if kw.name == "slice":
                if not self.sliced:
                    raise self.err(
                        "E105",
                        "`slice:` names a token slice, but the schedule declares no `slices`",
                        kw.span,
                        ("declare `slices n` at the top of the schedule (docs/terapipe.md)",),
                    )
                if kw.name in seen:
                    raise self.err("E105", "slice given twice", kw.span)
                seen.add(kw.name)
                piece, t = self.expr(kw.value, scope)
                self.want(t, ("int",), kw.value.span, "`slice:`")
                continue
            if kw.name == "recompute" and e.name != "F":
                raise self.err(
                    "E105",
                    f"`recompute:` belongs on a forward: {e.name} keeps nothing to recompute",
                    kw.span,
                    ("write `F(i, recompute: true)`, or place `RECOMPUTE(i)` before the B",),
                )
            if kw.name not in ("stage", "mb", "recompute") or kw.name in seen:
                extra = ", `mb:` or `recompute:`" if e.name == "F" else " or `mb:`"
                raise self.err("E105", f"`{e.name}` has no argument `{kw.name}`; use `stage:`{extra}", kw.span)
            seen.add(kw.name)
            code, t = self.expr(kw.value, scope)
            if kw.name == "recompute":
                if self.sliced:
                    raise self.err(
                        "E105",
                        "`recompute:` of a token slice is not supported",
                        kw.span,
                        ('docs/terapipe.md, "What is left"',),
                    )
                self.want(t, ("bool",), kw.value.span, "`recompute:`")
                recompute = code
                continue
            self.want(t, ("int",), kw.value.span, f"`{kw.name}:`")
            if kw.name == "stage":
                stage = code
            elif mb is not None:
                raise self.err("E105", "micro-batch given twice", kw.span)
            else:
                mb = code
        if sid is None:
            sid = self.sid(e.span)
        if self.sliced and mb is not None:
            if piece is None:
                raise self.err(
                    "E105",
                    f"the schedule cuts micro-batches into slices: say which, `{e.name}(i, slice: j)`",
                    e.span,
                )
            mb = f"_unit({mb}, {piece}, {sid})"
        elif piece is not None:
            raise self.err("E105", f"`slice:` needs the micro-batch too: `{e.name}(i, slice: j)`", e.span)
        if recompute is not None and recompute != "False":
            # A second statement id for the same span: the op emitted with it is recomputed (evaluate places
            # its RECOMPUTE before its B), so neither the op's tuple nor the per-op path changes.
            rc = self.sid(self.spans[sid])
            self.recompute_sids.add(rc)
            sid = rc if recompute == "True" else f"({rc} if {recompute} else {sid})"
        if mb is None:
            self.counts_ops = True
        if not emit:
            return f"({k}, {'None' if mb is None else mb}, {stage}, {sid})", "op"
        if mb is None:
            return f"_next({k}, {stage}, {sid})", "none"
        return f"_emit(({k}, {mb}, {stage}, {sid}))", "none"

    def coll_call(self, e: ast.Call, scope: _Scope, emit: bool, sid: int | None = None) -> tuple[str, str]:
        """A collective: as a value `(index in COLLECTIVES, stage)`; as a statement, `_coll(...)`, which
        records it before the rank's next op (pipec.frontend.evaluate). The stage defaults to the rank's
        only stage, as an op's does; a collective has no micro-batch, so the stage is always named."""
        if e.args:
            raise self.err(
                "E102",
                f"`{e.name}` takes no micro-batch, only a stage: write `{e.name}(stage: s)`",
                e.args[0].span,
            )
        stage = "_ds"
        for i, kw in enumerate(e.kwargs):
            if kw.name != "stage" or i > 0:
                what = "the stage given twice" if kw.name == "stage" else f"no argument `{kw.name}`"
                raise self.err("E105", f"`{e.name}` has {what}; it takes `stage:` only", kw.span)
            code, t = self.expr(kw.value, scope)
            self.want(t, ("int",), kw.value.span, "`stage:`")
            stage = code
        self.collectives = True
        k = COLLECTIVES.index(e.name)
        if not emit:
            return f"({k}, {stage})", "coll"
        return f"_coll({k}, {stage}, {self.sid(e.span) if sid is None else sid})", "none"

    def mem_call(self, e: ast.Call, scope: _Scope, emit: bool, sid: int | None = None) -> tuple[str, str]:
        """A memory op: as a value `(index in MEMOP_NAMES, mb, stage)`; as a statement, `_mem(...)`, which
        records it before the rank's next op (pipec.frontend.evaluate). Its micro-batch is always given
        (positionally or `mb:`): a memory op acts on one forward's activations, named, not the next."""
        if self.sliced:
            raise self.err(
                "E105",
                f"`{e.name}` of a token slice is not supported: slices keep their keys and values for the later slices",
                e.span,
                ('docs/terapipe.md, "What is left"',),
            )
        if len(e.args) > 1:
            raise self.err("E102", f"`{e.name}` takes one micro-batch argument, got {len(e.args)}", e.span)
        mb = None
        if e.args:
            mb, t = self.expr(e.args[0], scope)
            self.want(t, ("int",), e.args[0].span, "a micro-batch")
        stage = "_ds"
        seen = set()
        for kw in e.kwargs:
            if kw.name not in ("stage", "mb") or kw.name in seen or (kw.name == "mb" and mb is not None):
                what = "the micro-batch given twice" if kw.name == "mb" else f"no argument `{kw.name}`"
                if kw.name == "stage" and kw.name in seen:
                    what = "the stage given twice"
                raise self.err("E105", f"`{e.name}` has {what}; it takes a micro-batch and `stage:`", kw.span)
            seen.add(kw.name)
            code, t = self.expr(kw.value, scope)
            self.want(t, ("int",), kw.value.span, f"`{kw.name}:`")
            if kw.name == "stage":
                stage = code
            else:
                mb = code
        if mb is None:
            raise self.err("E102", f"`{e.name}` needs the micro-batch it acts on: `{e.name}(i)`", e.span)
        self.memops = True
        k = MEMOP_NAMES.index(e.name)
        if not emit:
            return f"({k}, {mb}, {stage})", "memop"
        return f"_mem({k}, {mb}, {stage}, {self.sid(e.span) if sid is None else sid})", "none"

    def check_func(self, f: _Func, types: tuple[str, ...], span: Span) -> str:
        """Type-check a function body for these argument types (once per distinct types)."""
        if types in f.checked:
            return f.checked[types]
        inner = _Scope(f.scope)
        for name, t in zip(f.node.params, types):
            inner.names[name] = _Value(f"_chk_{name}", t)
        saved = self.out, self.where
        self.weights.append(0)
        self.out, self.where = [], []
        try:
            if isinstance(f.node.body, tuple):
                self.block(f.node.body, inner, 0, "func")
                rtype = "none"
            else:
                _, rtype = self.expr(f.node.body, inner)
        except PipecError as err:
            d = err.diagnostics[0]
            notes = d.notes + (f"in `{f.node.name}` called at line {span.line} with ({', '.join(types)})",)
            raise self.err(d.code, d.message, d.span, notes) from None
        finally:
            self.out, self.where = saved
            self.weights.pop()
        f.checked[types] = rtype
        return rtype

    # ---- statements
    def block(self, body: tuple, scope: _Scope, indent: int, ctx: str) -> None:
        start = len(self.out)
        for st in body:
            self.stmt(st, scope, indent, ctx)
        if len(self.out) == start:
            self.line(indent, "pass")

    def loop_body(self, body: tuple, scope: _Scope, indent: int, ctx: str) -> tuple[list[str], int]:
        """Generate a loop body aside; return its lines and the function calls one iteration makes."""
        saved = self.out
        self.out = []
        self.weights.append(0)
        try:
            self.block(body, scope, indent, ctx)
            return self.out, self.weights[-1]
        finally:
            self.out = saved
            self.weights.pop()

    def budget(self, indent: int, count: str, span: Span) -> str:
        """Charge a loop's iteration count to the evaluation budget before it runs."""
        var = f"_n{self.n}"
        self.n += 1
        self.line(indent, f"{var} = {count}")
        self.line(indent, f"_charge({var}, {self.sid(span)})")
        return var

    def stmt(self, st, scope: _Scope, indent: int, ctx: str) -> None:
        outer, self.cur = self.cur, st.span
        try:
            self._stmt(st, scope, indent, ctx)
        finally:
            self.cur = outer

    def _stmt(self, st, scope: _Scope, indent: int, ctx: str) -> None:
        top = ctx == "top"
        if isinstance(st, ast.Let):
            code, t = self.expr(st.value, scope)
            if t == "none":
                raise self.err("E103", "a block function returns no value", st.value.span)
            py = self.fresh(st.name)
            self.bind(scope, st.name, _Value(py, t), st.span)
            self.line(indent, f"{py} = {code}")
        elif isinstance(st, ast.Def):
            self.define(st, scope, indent)
        elif isinstance(st, ast.Require):
            code, t = self.expr(st.cond, scope)
            self.want(t, ("bool",), st.cond.span, "`require`")
            self.line(indent, f"if not {code}: _require_failed({self.sid(st.span)}, {st.message!r})")
        elif isinstance(st, (ast.Decl, ast.Place, ast.OpsDecl, ast.Topology)):
            if not top:
                raise self.err("E109", "declarations belong at the top of the schedule, not in a block", st.span)
            self.decl(st, scope, indent)
        elif isinstance(st, ast.Expect):
            self.expect(st, scope, indent, ctx)
        elif isinstance(st, ast.RankBlock):
            if not top:
                raise self.err("E109", "a `rank` block belongs at the top of the schedule", st.span)
            self.rank_block(st, scope, indent)
        elif isinstance(st, ast.OrderBlock):
            if not top:
                raise self.err("E109", "an `order` block belongs at the top of the schedule", st.span)
            self.order_block(st, scope, indent)
        elif top:
            raise self.err("E109", "ops and loops belong inside the `rank r { ... }` block", st.span)
        elif isinstance(st, ast.For):
            lo, lt = self.expr(st.lo, scope)
            hi, ht = self.expr(st.hi, scope)
            self.want(lt, ("int",), st.lo.span, "a range bound")
            self.want(ht, ("int",), st.hi.span, "a range bound")
            lo_v, hi_v = f"_lo{self.n}", f"_hi{self.n}"
            self.n += 1
            self.line(indent, f"{lo_v} = {lo}")
            self.line(indent, f"{hi_v} = {hi}")
            bounds = f"{lo_v}, {hi_v}"
            if st.step is not None:
                step, t = self.expr(st.step, scope)
                self.want(t, ("int",), st.step.span, "a `for` step")
                bounds += f", _step({step}, {self.sid(st.step.span)})"
            inner = _Scope(scope)
            py = self.fresh(st.var)
            self.bind(inner, st.var, _Value(py, "int"), st.span)
            body, weight = self.loop_body(st.body, inner, indent + 1, ctx)
            self.line(indent, f"_range = range({bounds})")
            self.line(indent, f"_charge(len(_range) * {1 + weight}, {self.sid(st.span)})")
            self.line(indent, f"for {py} in _range:")
            self.out.extend(body)
        elif isinstance(st, ast.Repeat):
            n, t = self.expr(st.count, scope)
            self.want(t, ("int",), st.count.span, "`repeat`")
            body, weight = self.loop_body(st.body, _Scope(scope), indent + 1, ctx)
            var = self.budget(indent, f"({n}) * {1 + weight}", st.span)
            self.line(indent, f"for _ in range({var} // {1 + weight}):")
            self.out.extend(body)
        elif isinstance(st, ast.While):
            c, t = self.expr(st.cond, scope)
            self.want(t, ("bool",), st.cond.span, "`while`")
            sid = self.sid(st.span)
            self.line(indent, f"while {c}:")
            before = f"_w{self.n}"
            self.n += 1
            self.line(indent + 1, f"{before} = len(_ops)")
            body, weight = self.loop_body(st.body, _Scope(scope), indent + 1, ctx)
            self.out.extend(body)
            self.line(indent + 1, f"_while_check({before}, len(_ops), {sid})")
            if weight:
                self.line(indent + 1, f"_charge({weight}, {sid})")
        elif isinstance(st, ast.If):
            for i, (cond, body) in enumerate(st.branches):
                c, t = self.expr(cond, scope)
                self.want(t, ("bool",), cond.span, "`if`")
                self.line(indent, f"{'if' if i == 0 else 'elif'} {c}:")
                self.block(body, _Scope(scope), indent + 1, ctx)
            if st.orelse is not None:
                self.line(indent, "else:")
                self.block(st.orelse, _Scope(scope), indent + 1, ctx)
        elif isinstance(st, ast.Emit):
            self.emit(st, scope, indent)
        else:  # pragma: no cover
            raise AssertionError(st)

    def expect(self, st: ast.Expect, scope: _Scope, indent: int, ctx: str) -> None:
        """Register a deferred check: the condition runs later, with the metrics as `_M` (pipec.passes.expect)."""
        if ctx not in ("top", "rank") or len(self.weights) > 1:
            raise self.err(
                "E109",
                "an `expect` belongs at the top of the schedule or of the `rank` block, not in a loop or function",
                st.span,
            )
        inner = _Scope(scope)  # the metrics shadow outer names, like a stage variable does
        for name, t in METRICS.items():
            inner.names[name] = _Value(f"_M.{name}", t)
        for name, t in METRIC_FUNCS.items():
            inner.names[name] = _MetricFn(name, t)
        cond = st.cond
        if isinstance(cond, ast.BinOp) and cond.op in ("<", "<=", ">", ">=", "=="):
            a, at = self.expr(cond.left, inner)
            b, bt = self.expr(cond.right, inner)
            self.want(at, NUMERIC, cond.left.span, f"`{cond.op}` in `expect`")
            self.want(bt, NUMERIC, cond.right.span, f"`{cond.op}` in `expect`")
            code = f"_cmp({a}, {cond.op!r}, {b})"  # both sides are kept, to report them
        else:
            c, t = self.expr(cond, inner)
            self.want(t, ("bool",), cond.span, "`expect`")
            code = f"({c}, None, None)"
        call = f"_expect({self.sid(st.span)}, {self.sid(cond.span)}, {st.message!r}, lambda _M: {code})"
        if st.guard is None:
            self.line(indent, call)
            return
        g, gt = self.expr(st.guard, scope)
        self.want(gt, ("bool",), st.guard.span, "`when`")
        self.line(indent, f"if {g}: {call}")

    def emit(self, st: ast.Emit, scope: _Scope, indent: int) -> None:
        if len(st.calls) > 2:
            raise self.err("E111", "an overlapped group pairs exactly two ops (`a & b`)", st.span)
        if len(st.calls) == 2:
            for call in st.calls:
                if call.name in COLLECTIVES or call.name in MEMOP_NAMES:
                    raise self.err("E111", f"`{call.name}` cannot be overlapped: only two ops pair with `&`", call.span)
            self.line(indent, "_pair()")
        for call in st.calls:
            sid = self.sid(call.span)
            if call.name in OP_KINDS:
                code, _ = self.op_call(call, scope, emit=True, sid=sid)
                self.line(indent, code)
                continue
            if call.name in COLLECTIVES:
                code, _ = self.coll_call(call, scope, emit=True, sid=sid)
                self.line(indent, code)
                continue
            if call.name in MEMOP_NAMES:
                code, _ = self.mem_call(call, scope, emit=True, sid=sid)
                self.line(indent, code)
                continue
            code, t = self.expr(call, scope)
            if t == "coll" and len(st.calls) == 1:
                self.line(indent, f"_coll((_cv := {code})[0], _cv[1], {sid})")
            elif t == "memop" and len(st.calls) == 1:
                self.line(indent, f"_mem((_mv := {code})[0], _mv[1], _mv[2], {sid})")
            elif t in ("coll", "memop"):
                what = "a collective" if t == "coll" else "a memory op"
                raise self.err("E111", f"{what} cannot be overlapped: only two ops pair with `&`", call.span)
            elif t == "op":
                # Inline, not a helper call per op: the value's micro-batch, or the next one when it has none.
                at = str(sid)
                if self.recompute_sids:
                    # An op value may carry `recompute: true` (its own statement id is one of them): emitted
                    # here, under this statement's id, or its recomputing twin. Only once the file has used
                    # `recompute:`: a value defined later cannot reach this statement.
                    rc = self.sid(self.spans[sid])
                    self.recompute_sids.add(rc)
                    at = f"({rc} if _ev[3] in _RC else {sid})"
                self.line(
                    indent,
                    f"_emit((_ev[0], _ev[1], _ev[2], {at})) if (_ev := {code})[1] is not None "
                    f"else _next(_ev[0], _ev[2], {at})",
                )
            elif t == "none" and len(st.calls) == 1:
                self.line(indent, code)
            elif t == "none":
                raise self.err("E111", "only single ops can be overlapped, not a block function", call.span)
            else:
                raise self.err("E103", f"a statement must emit an op, but this is a value of type {t}", call.span)

    def define(self, st: ast.Def, scope: _Scope, indent: int) -> None:
        if len(set(st.params)) != len(st.params):
            raise self.err("E104", f"`{st.name}` names a parameter twice", st.span)
        py = self.fresh(st.name)
        f = _Func(st, py, scope.snapshot())  # sees only what is defined before it: no recursion
        inner = _Scope(f.scope)
        pys = []
        for name in st.params:
            p = self.fresh(name)
            pys.append(p)
            self.bind(inner, name, _Value(p, "any"), st.span)
        self.line(indent, f"def {py}({', '.join(pys)}):")
        self.weights.append(0)
        try:
            if isinstance(st.body, tuple):
                self.block(st.body, inner, indent + 1, "func")
            else:
                code, t = self.expr(st.body, inner)
                if t == "none":
                    raise self.err("E103", "an expression function must return a value", st.body.span)
                self.line(indent + 1, f"return {code}")
        finally:
            f.weight = 1 + self.weights.pop()
        if f.weight > MAX_CALLS:
            raise self.err("E207", f"one call to `{st.name}` makes {f.weight:,} function calls", st.span)
        self.bind(scope, st.name, f, st.span)

    def decl(self, st, scope: _Scope, indent: int) -> None:
        if isinstance(st, ast.OpsDecl):
            self.line(indent, f"_rt.decl('ops', None, {self.kinds!r}, {self.sid(st.span)})")
        elif isinstance(st, ast.Place):
            if st.kind == "tokens" and not self.sliced:
                raise self.err("E106", "`tokens j -> ...` gives slice lengths: declare `slices n` too", st.span)
            inner = _Scope(scope)
            py = self.fresh(st.var)
            self.bind(inner, st.var, _Value(py, "int"), st.span)
            code, t = self.expr(st.value, inner)
            self.want(t, ("int",), st.value.span, f"`{st.kind}`")
            self.line(indent, f"_rt.decl({st.kind!r}, None, lambda {py}: {code}, {self.sid(st.span)})")
        elif isinstance(st, ast.Decl):
            self.value_decl(st, scope, indent)
        elif isinstance(st, ast.Topology):
            self.topology(st, scope, indent)

    def value_decl(self, st: ast.Decl, scope: _Scope, indent: int) -> None:
        sid = self.sid(st.span)
        if st.kind in ("stages", "ranks", "microbatches", "slices", "seqlen"):
            code, t = self.expr(st.value, scope)
            self.want(t, ("int",), st.value.span, f"`{st.kind}`")
            self.line(indent, f"_rt.decl({st.kind!r}, None, {code}, {sid})")
            return
        keys = STAGE_COST_KEYS if st.kind == "cost" else MEMORY_KEYS
        if st.key not in keys:
            raise self.err("E108", f"unknown {st.kind} `{st.key}`; known: {', '.join(keys)}", st.span)

        var = "r" if st.key in MEMORY_RANK_KEYS else "s"
        inner = _Scope(scope)
        py = self.fresh(var)
        inner.names[var] = _Value(py, "int")  # the stage (or rank) shadows any outer name
        code, t = self.expr(st.value, inner)
        self.want(t, NUMERIC, st.value.span, f"`{st.kind} {st.key}`")
        self.line(indent, f"_rt.decl({st.kind!r}, {st.key!r}, lambda {py}: {code}, {sid})")

    def topology(self, st: ast.Topology, scope: _Scope, indent: int) -> None:
        items = []
        for it in st.items:
            if isinstance(it, ast.TopoDc):
                lo, lt = self.expr(it.lo, scope)
                hi, ht = self.expr(it.hi, scope)
                what = "a replica bound" if it.replicas else "a rank bound"
                self.want(lt, ("int",), it.lo.span, what)
                self.want(ht, ("int",), it.hi.span, what)
                kind = "replicas" if it.replicas else "dc"
                items.append(f"({kind!r}, {it.name!r}, {lo}, {hi}, {self.sid(it.span)})")
            else:
                lat = None if it.latency is None else it.latency.value
                bw = None if it.bandwidth is None else it.bandwidth.value
                items.append(f"('link', {it.a!r}, {it.b!r}, {lat!r}, {bw!r}, {self.sid(it.span)})")
        self.line(indent, f"_rt.decl('topology', None, [{', '.join(items)}], {self.sid(st.span)})")

    def rank_block(self, st: ast.RankBlock, scope: _Scope, indent: int) -> None:
        inner = _Scope(scope)
        py = self.fresh(st.var)
        self.bind(inner, st.var, _Value(py, "int"), st.span)
        self.line(indent, f"def _rank({py}):")
        self.block(st.body, inner, indent + 1, "rank")
        self.line(indent, f"_rt.decl('rank', None, _rank, {self.sid(st.span)})")

    def order_block(self, st: ast.OrderBlock, scope: _Scope, indent: int) -> None:
        """`order r { ... }`: the policy per rank, as `(prefer, fill, lag kinds, fn(r) -> (inflight, stage
        inflight function, lag))`; pipec.frontend.evaluate derives the orders from it (pipec.passes.policy)."""
        seen: dict[tuple[str, str | None], ast.OrderItem] = {}
        prefer: tuple[str, ...] = ()
        fill = False
        inner = _Scope(scope)
        py = self.fresh(st.var)
        self.bind(inner, st.var, _Value(py, "int"), st.span)
        inflight = stage_inflight = lag = "None"
        for it in st.items:
            key = (it.kind, "stage" if it.var else None)
            if key in seen:
                raise self.err("E106", f"`{it.kind}` given twice in the `order` block", it.span)
            seen[key] = it
            for name, span in zip(it.names, it.name_spans):
                if name not in OP_KINDS:
                    raise self.err("E113", f"`{name}` is not an op kind; an `order` block names F, B and W", span)
                self.check_kind(name, span)
            if it.kind == "prefer":
                if sorted(it.names) != sorted(self.kinds):
                    raise self.err(
                        "E113",
                        f"`prefer` must list each op kind of the schedule once: {', '.join(self.kinds)}",
                        it.span,
                    )
                prefer = it.names
            elif it.kind in ("fill", "lag") and it.names != ("W",):
                raise self.err("E113", f"`{it.kind}` applies to W, the weight gradient", it.span)
            elif it.kind == "fill":
                fill = True
            elif it.kind == "lag":
                lag, t = self.expr(it.value, inner)
                self.want(t, ("int",), it.value.span, "`lag`")
            elif it.var is None:
                inflight, t = self.expr(it.value, inner)
                self.want(t, NUMERIC, it.value.span, "`inflight`")
            else:
                stage_scope = _Scope(inner)
                spy = self.fresh(it.var)
                self.bind(stage_scope, it.var, _Value(spy, "int"), it.span)
                code, t = self.expr(it.value, stage_scope)
                self.want(t, NUMERIC, it.value.span, "`inflight`")
                stage_inflight = f"(lambda {spy}: {code})"
        if not prefer:
            prefer = ("B", "F", "W") if "W" in self.kinds else ("B", "F")
        self.line(indent, f"def _order({py}):")
        self.line(indent + 1, f"return ({inflight}, {stage_inflight}, {lag})")
        self.line(indent, f"_rt.decl('order', None, ({prefer!r}, {fill!r}, _order), {self.sid(st.span)})")

    # ---- the whole file
    def compile(self) -> GeneratedCode:
        tree = self.tree
        scope = _Scope(None)
        pynames, types = [], []
        for prm in tree.params:
            t = prm.type
            if prm.default is not None:
                _, dt = self.expr(prm.default, scope)
                if t is None:
                    t = dt
                elif not (dt == t or (t == "float" and dt == "int")):
                    raise self.err("E103", f"default of `{prm.name}` must be {t}, got {dt}", prm.default.span)
            t = t or "int"
            py = self.fresh(prm.name)
            if prm.name in scope.names:
                raise self.err("E104", f"parameter `{prm.name}` declared twice", prm.span)
            self.bind(scope, prm.name, _Value(py, t), prm.span)
            pynames.append(py)
            types.append(t)
        self.line(0, f"def _schedule(_rt, {', '.join(pynames)}):" if pynames else "def _schedule(_rt):")
        self.block(tree.body, scope, 1, "top")
        defaults = []
        dscope = _Scope(None)
        for prm, py, t in zip(tree.params, pynames, types):
            if prm.default is None:
                defaults.append(f"def _default_{py}(): return None")
            else:
                code, _ = self.expr(prm.default, dscope)
                args = ", ".join(v.pyname for v in dscope.names.values())
                defaults.append(f"def _default_{py}({args}): return {code}")
            dscope.names[prm.name] = _Value(py, t)
        self.out.extend(defaults)
        self.where.extend(prm.span for prm in tree.params)
        return GeneratedCode(
            code="\n".join(self.out) + "\n",
            spans=tuple(self.spans),
            params=tree.params,
            param_types=tuple(types),
            kinds=self.kinds,
            counts_ops=self.counts_ops,
            collectives=self.collectives,
            memops=self.memops,
            recompute_sids=frozenset(self.recompute_sids),
            name=tree.name,
            header=tree.span,
            line_spans=tuple(self.where),
        )


def compile_ast(tree: ast.ScheduleAst, source: Source) -> GeneratedCode:
    """Check names and types and generate the Python code of a schedule."""
    try:
        return _Compiler(tree, source).compile()
    except RecursionError:
        raise error("E003", "the file nests expressions or blocks too deeply", tree.span, source) from None
