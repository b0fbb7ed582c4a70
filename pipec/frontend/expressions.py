"""Expressions: names resolved, types checked and Python code generated, one expression at a time.

The half of the compiler that statements build on (pipec.frontend.codegen's compiler extends this class):
it holds the state of one file's compilation (the generated lines, the statement ids and their spans, the
work weights of the open loops and functions) and turns each expression into `(python code, type)`,
ops, collectives and memory ops included, since a statement that emits one is an expression with `emit`.
A function is type-checked here when it is called, once per distinct argument types; its block body is
a statement list, so `block` is the statements' (declared here, defined by the subclass).
"""

from __future__ import annotations

from pipec.errors import PipecError, Source, Span, error
from pipec.frontend import ast
from pipec.frontend.names import (
    BUILTINS,
    COLLECTIVES,
    KEYWORDS,
    MEMOP_NAMES,
    NUMERIC,
    OP_KINDS,
    Func,
    MetricFn,
    Scope,
    Value,
)


class ExpressionCompiler:
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

    def bind(self, scope: Scope, name: str, value, span: Span) -> None:
        if name in KEYWORDS:
            raise self.err("E104", f"`{name}` is a keyword and cannot name a value", span)
        if name in OP_KINDS or name in BUILTINS or name in COLLECTIVES or name in MEMOP_NAMES:
            raise self.err("E104", f"`{name}` is a built-in name and cannot be redefined", span)
        if name in scope.names:
            raise self.err("E104", f"`{name}` is already defined in this block", span)
        scope.names[name] = value

    # ---- expressions: return (python code, type)
    def expr(self, e: ast.Expr, scope: Scope) -> tuple[str, str]:
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

    def var(self, e: ast.Var, scope: Scope) -> tuple[str, str]:
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
        if isinstance(b, (Func, MetricFn)):
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

    def binop(self, e: ast.BinOp, scope: Scope) -> tuple[str, str]:
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

    def pure(self, e: ast.Expr, scope: Scope) -> bool:
        """Numbers, plain names, and + - * of them: no call, no division inside."""
        if isinstance(e, (ast.Num, ast.Bool)):
            return True
        if isinstance(e, ast.Var):
            b = scope.lookup(e.name)
            return isinstance(b, Value) and b.pyname.isidentifier()
        if isinstance(e, ast.Unary):
            return e.op == "-" and self.pure(e.operand, scope)
        if isinstance(e, ast.BinOp):
            return e.op in ("+", "-", "*") and self.pure(e.left, scope) and self.pure(e.right, scope)
        return False

    def call(self, e: ast.Call, scope: Scope) -> tuple[str, str]:
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
        if isinstance(b, MetricFn):
            return self.metric_call(e, b, scope)
        if not isinstance(b, Func):
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

    def builtin(self, e: ast.Call, scope: Scope) -> tuple[str, str]:
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

    def metric_call(self, e: ast.Call, f: MetricFn, scope: Scope) -> tuple[str, str]:
        """`peak_memory(r)`, `in_flight(r)` inside an `expect`: a measure of rank r."""
        if e.kwargs:
            raise self.err("E105", f"`{e.name}` takes no keyword arguments", e.kwargs[0].span)
        if len(e.args) != 1:
            raise self.err("E102", f"`{e.name}(rank)` takes 1 argument, got {len(e.args)}", e.span)
        code, t = self.expr(e.args[0], scope)
        self.want(t, ("int",), e.args[0].span, f"the rank of `{e.name}`")
        return f"_M.{e.name}({code}, {self.sid(e.span)})", f.type

    def op_call(self, e: ast.Call, scope: Scope, emit: bool, sid: int | None = None) -> tuple[str, str]:
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

    def coll_call(self, e: ast.Call, scope: Scope, emit: bool, sid: int | None = None) -> tuple[str, str]:
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

    def mem_call(self, e: ast.Call, scope: Scope, emit: bool, sid: int | None = None) -> tuple[str, str]:
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

    def check_func(self, f: Func, types: tuple[str, ...], span: Span) -> str:
        """Type-check a function body for these argument types (once per distinct types)."""
        if types in f.checked:
            return f.checked[types]
        inner = Scope(f.scope)
        for name, t in zip(f.node.params, types):
            inner.names[name] = Value(f"_chk_{name}", t)
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

    def block(self, body: tuple, scope: Scope, indent: int, ctx: str) -> None:
        """The statements of a block (pipec.frontend.codegen): a function's block body is checked through it."""
        raise NotImplementedError
