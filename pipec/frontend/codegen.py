"""Syntax tree to Python code, once per file: names resolved and types checked statically.

Why generate code: a schedule with a million ops must evaluate in seconds, so
the per-op path is plain Python (`for` loops and list appends), not a tree
walk. The generated module defines `_schedule(_rt, <params>)`, which runs the
top-level statements and hands declarations and the rank block to `_rt` (see
`pipec.frontend.evaluate`). The language has no mutation and no recursion (a function
sees only names defined before it), loops run over finite ranges under a work
budget, and `while` must emit ops every iteration, so evaluation always ends.

The compiler is split by what it compiles: expressions (and the state of one compilation) in
pipec.frontend.expressions, what a name means in pipec.frontend.names, and here the statements, the
declarations and the whole file, with the GeneratedCode they make.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipec.errors import Source, Span, error
from pipec.frontend import ast
from pipec.frontend.expressions import ExpressionCompiler
from pipec.frontend.names import (
    COLLECTIVES,
    MAX_CALLS,
    MEMOP_NAMES,
    MEMORY_KEYS,
    METRIC_FUNCS,
    METRICS,
    NUMERIC,
    OP_KINDS,
    Func,
    MetricFn,
    Scope,
    Value,
)
from pipec.ir.family import PREFER
from pipec.ir.schedule import MEMORY_RANK_KEYS, STAGE_COST_KEYS


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
    # Whether a rank block says `window` or `any`: evaluation then records each rank's order family.
    family: bool = False


class _Compiler(ExpressionCompiler):
    """Statements, declarations and the whole file, on the expressions of ExpressionCompiler."""

    family = False  # whether a rank block says `window` or `any` (then evaluation records the family)
    in_any = False

    # ---- statements
    def block(self, body: tuple, scope: Scope, indent: int, ctx: str) -> None:
        start = len(self.out)
        for st in body:
            self.stmt(st, scope, indent, ctx)
        if len(self.out) == start:
            self.line(indent, "pass")

    def loop_body(self, body: tuple, scope: Scope, indent: int, ctx: str) -> tuple[list[str], int]:
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

    def stmt(self, st, scope: Scope, indent: int, ctx: str) -> None:
        outer, self.cur = self.cur, st.span
        try:
            self._stmt(st, scope, indent, ctx)
        finally:
            self.cur = outer

    def _stmt(self, st, scope: Scope, indent: int, ctx: str) -> None:
        top = ctx == "top"
        if isinstance(st, ast.Let):
            code, t = self.expr(st.value, scope)
            if t == "none":
                raise self.err("E103", "a block function returns no value", st.value.span)
            py = self.fresh(st.name)
            self.bind(scope, st.name, Value(py, t), st.span)
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
        elif isinstance(st, (ast.Window, ast.AnyGroup)):
            self.family_stmt(st, scope, indent, ctx)
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
            inner = Scope(scope)
            py = self.fresh(st.var)
            self.bind(inner, st.var, Value(py, "int"), st.span)
            body, weight = self.loop_body(st.body, inner, indent + 1, ctx)
            self.line(indent, f"_range = range({bounds})")
            self.line(indent, f"_charge(len(_range) * {1 + weight}, {self.sid(st.span)})")
            self.line(indent, f"for {py} in _range:")
            self.out.extend(body)
        elif isinstance(st, ast.Repeat):
            n, t = self.expr(st.count, scope)
            self.want(t, ("int",), st.count.span, "`repeat`")
            body, weight = self.loop_body(st.body, Scope(scope), indent + 1, ctx)
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
            body, weight = self.loop_body(st.body, Scope(scope), indent + 1, ctx)
            self.out.extend(body)
            self.line(indent + 1, f"_while_check({before}, len(_ops), {sid})")
            if weight:
                self.line(indent + 1, f"_charge({weight}, {sid})")
        elif isinstance(st, ast.If):
            for i, (cond, body) in enumerate(st.branches):
                c, t = self.expr(cond, scope)
                self.want(t, ("bool",), cond.span, "`if`")
                self.line(indent, f"{'if' if i == 0 else 'elif'} {c}:")
                self.block(body, Scope(scope), indent + 1, ctx)
            if st.orelse is not None:
                self.line(indent, "else:")
                self.block(st.orelse, Scope(scope), indent + 1, ctx)
        elif isinstance(st, ast.Emit):
            self.emit(st, scope, indent)
        else:  # pragma: no cover
            raise AssertionError(st)

    def family_stmt(self, st: ast.Window | ast.AnyGroup, scope: Scope, indent: int, ctx: str) -> None:
        """`window e [prefer NAME]` and `any { ... }` (docs/language.md, section 20): calls that record, as
        the rank's ops are emitted, which of them the rank may reorder (pipec.frontend.family)."""
        what = "`window`" if isinstance(st, ast.Window) else "an `any` group"
        if ctx != "rank":
            raise self.err("E109", f"{what} belongs inside the `rank r {{ ... }}` block", st.span)
        self.family = True
        sid = self.sid(st.span)
        if isinstance(st, ast.Window):
            if st.prefer is not None and st.prefer not in PREFER:
                raise self.err(
                    "E219", f"unknown `prefer` policy `{st.prefer}`; known: {', '.join(PREFER)}", st.prefer_span
                )
            code, t = self.expr(st.value, scope)
            self.want(t, ("int",), st.value.span, "`window`")
            self.line(indent, f"_window({code}, {st.prefer or 'order'!r}, {sid})")
            return
        if self.in_any:
            raise self.err("E219", "an `any` group inside another: the outer one already lets them reorder", st.span)
        self.in_any = True
        try:
            self.line(indent, f"_any_open({sid})")
            self.block(st.body, Scope(scope), indent, ctx)
            self.line(indent, "_any_close()")
        finally:
            self.in_any = False

    def expect(self, st: ast.Expect, scope: Scope, indent: int, ctx: str) -> None:
        """Register a deferred check: the condition runs later, with the metrics as `_M` (pipec.passes.expect)."""
        if ctx not in ("top", "rank") or len(self.weights) > 1:
            raise self.err(
                "E109",
                "an `expect` belongs at the top of the schedule or of the `rank` block, not in a loop or function",
                st.span,
            )
        inner = Scope(scope)  # the metrics shadow outer names, like a stage variable does
        for name, t in METRICS.items():
            inner.names[name] = Value(f"_M.{name}", t)
        for name, t in METRIC_FUNCS.items():
            inner.names[name] = MetricFn(name, t)
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

    def emit(self, st: ast.Emit, scope: Scope, indent: int) -> None:
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

    def define(self, st: ast.Def, scope: Scope, indent: int) -> None:
        if len(set(st.params)) != len(st.params):
            raise self.err("E104", f"`{st.name}` names a parameter twice", st.span)
        py = self.fresh(st.name)
        f = Func(st, py, scope.snapshot())  # sees only what is defined before it: no recursion
        inner = Scope(f.scope)
        pys = []
        for name in st.params:
            p = self.fresh(name)
            pys.append(p)
            self.bind(inner, name, Value(p, "any"), st.span)
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

    def decl(self, st, scope: Scope, indent: int) -> None:
        if isinstance(st, ast.OpsDecl):
            self.line(indent, f"_rt.decl('ops', None, {self.kinds!r}, {self.sid(st.span)})")
        elif isinstance(st, ast.Place):
            if st.kind == "tokens" and not self.sliced:
                raise self.err("E106", "`tokens j -> ...` gives slice lengths: declare `slices n` too", st.span)
            inner = Scope(scope)
            py = self.fresh(st.var)
            self.bind(inner, st.var, Value(py, "int"), st.span)
            code, t = self.expr(st.value, inner)
            self.want(t, ("int",), st.value.span, f"`{st.kind}`")
            self.line(indent, f"_rt.decl({st.kind!r}, None, lambda {py}: {code}, {self.sid(st.span)})")
        elif isinstance(st, ast.Decl):
            self.value_decl(st, scope, indent)
        elif isinstance(st, ast.Topology):
            self.topology(st, scope, indent)

    def value_decl(self, st: ast.Decl, scope: Scope, indent: int) -> None:
        sid = self.sid(st.span)
        if st.kind in ("stages", "ranks", "microbatches", "slices", "seqlen"):
            code, t = self.expr(st.value, scope)
            self.want(t, ("int",), st.value.span, f"`{st.kind}`")
            if st.kind == "stages":  # the count, a name for what follows (`edge s -> if s < stages - 1 ...`)
                self.line(indent, f"_n_stages = {code}")
                code = "_n_stages"
                scope.names["stages"] = Value(code, "int")
            self.line(indent, f"_rt.decl({st.kind!r}, None, {code}, {sid})")
            return
        keys = STAGE_COST_KEYS if st.kind == "cost" else MEMORY_KEYS
        if st.key not in keys:
            raise self.err("E108", f"unknown {st.kind} `{st.key}`; known: {', '.join(keys)}", st.span)

        var = "r" if st.key in MEMORY_RANK_KEYS else "s"
        inner = Scope(scope)
        py = self.fresh(var)
        inner.names[var] = Value(py, "int")  # the stage (or rank) shadows any outer name
        code, t = self.expr(st.value, inner)
        self.want(t, NUMERIC, st.value.span, f"`{st.kind} {st.key}`")
        self.line(indent, f"_rt.decl({st.kind!r}, {st.key!r}, lambda {py}: {code}, {sid})")

    def topology(self, st: ast.Topology, scope: Scope, indent: int) -> None:
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

    def rank_block(self, st: ast.RankBlock, scope: Scope, indent: int) -> None:
        inner = Scope(scope)
        py = self.fresh(st.var)
        self.bind(inner, st.var, Value(py, "int"), st.span)
        self.line(indent, f"def _rank({py}):")
        self.block(st.body, inner, indent + 1, "rank")
        self.line(indent, f"_rt.decl('rank', None, _rank, {self.sid(st.span)})")

    def order_block(self, st: ast.OrderBlock, scope: Scope, indent: int) -> None:
        """`order r { ... }`: the policy per rank, as `(prefer, fill, lag kinds, fn(r) -> (inflight, stage
        inflight function, lag))`; pipec.frontend.evaluate derives the orders from it (pipec.passes.policy)."""
        seen: dict[tuple[str, str | None], ast.OrderItem] = {}
        prefer: tuple[str, ...] = ()
        fill = False
        inner = Scope(scope)
        py = self.fresh(st.var)
        self.bind(inner, st.var, Value(py, "int"), st.span)
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
                stage_scope = Scope(inner)
                spy = self.fresh(it.var)
                self.bind(stage_scope, it.var, Value(spy, "int"), it.span)
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
        scope = Scope(None)
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
            self.bind(scope, prm.name, Value(py, t), prm.span)
            pynames.append(py)
            types.append(t)
        self.line(0, f"def _schedule(_rt, {', '.join(pynames)}):" if pynames else "def _schedule(_rt):")
        self.block(tree.body, scope, 1, "top")
        defaults = []
        dscope = Scope(None)
        for prm, py, t in zip(tree.params, pynames, types):
            if prm.default is None:
                defaults.append(f"def _default_{py}(): return None")
            else:
                code, _ = self.expr(prm.default, dscope)
                args = ", ".join(v.pyname for v in dscope.names.values())
                defaults.append(f"def _default_{py}({args}): return {code}")
            dscope.names[prm.name] = Value(py, t)
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
            family=self.family,
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
