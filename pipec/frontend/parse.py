"""Text to syntax tree: the lark grammar in `grammar/pipe.lark`, a Transformer to frozen nodes."""

from __future__ import annotations

import contextlib
import gc
import math
import re

# isort: off
from pipec.frontend import tables  # first: it imports lark without its `regex` (tables._import_lark)

import lark
from lark import Token, Transformer, Tree, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError

# isort: on
from pipec.errors import PipecError, Source, Span, error
from pipec.frontend import ast
from pipec.ir.units import LANGUAGE, UNITS, of_kind

# Deeper syntax trees are refused (E003): the AST transformer and the code generator recurse, and the
# generated Python may nest at most 200 parentheses and 100 indentation levels.
MAX_DEPTH = 150
# Longer lines are refused (E901, input too large) before parsing: lark takes about 0.1 ms a statement,
# so a 1 MB line of `F(0)` would take 20 s or more; pipec's own writers (`pipec import`, `pipec synth`)
# put at most 8 ops on a line.
MAX_LINE = 10_000


def _tok_span(tok: Token) -> Span:
    return Span(tok.line, tok.column, tok.end_line, tok.end_column)


def _meta_span(meta) -> Span:
    if getattr(meta, "empty", True):
        return Span(1, 1, 1, 2)
    return Span(meta.line, meta.column, meta.end_line, meta.end_column)


def _span_of(x) -> Span:
    return _tok_span(x) if isinstance(x, Token) else x.span


def _join(a: Span, b: Span) -> Span:
    return Span(a.line, a.col, b.end_line, b.end_col)


MAX_INT = 2**63 - 1  # the largest integer literal: ops are stored as int64


def _number(tok: Token) -> int | float:
    text = str(tok)
    if any(c in text for c in ".eE"):
        value = float(text)
        if not math.isfinite(value):
            raise _Bad(error("E004", f"number `{_clip(text)}` is too large for a float", _tok_span(tok)))
        return value
    if len(text.lstrip("0")) > 19 or int(text) > MAX_INT:  # int() refuses over 4300 digits
        raise _Bad(error("E004", f"number `{_clip(text)}` is too large (integers go up to 2**63 - 1)", _tok_span(tok)))
    return int(text)


def _clip(text: str) -> str:
    return text if len(text) <= 24 else text[:20] + "..."


@v_args(meta=True)
class _ToAst(Transformer):
    # ---- expressions
    def number(self, meta, c):
        return ast.Num(_tok_span(c[0]), _number(c[0]))

    def quantity(self, meta, c):
        """`1GiB`, `40ms`, `10Gbps` in an expression: a float in bytes, seconds or bits per second."""
        q = self._quantity(c[0], "a quantity", LANGUAGE)
        return ast.Num(q.span, q.value)

    def string(self, meta, c):
        return ast.Str(_tok_span(c[0]), str(c[0])[1:-1])

    def true(self, meta, c):
        return ast.Bool(_meta_span(meta), True)

    def false(self, meta, c):
        return ast.Bool(_meta_span(meta), False)

    def var(self, meta, c):
        return ast.Var(_tok_span(c[0]), str(c[0]))

    def neg(self, meta, c):
        return ast.Unary(_meta_span(meta), "-", c[0])

    def not_(self, meta, c):
        return ast.Unary(_meta_span(meta), "not", c[0])

    def binop(self, meta, c):
        left, op, right = c
        return ast.BinOp(_join(left.span, right.span), str(op), left, right, _tok_span(op))

    compare = binop

    def _logic(self, meta, c, op):
        left, right = c
        return ast.BinOp(_join(left.span, right.span), op, left, right, _meta_span(meta))

    def and_(self, meta, c):
        return self._logic(meta, c, "and")

    def or_(self, meta, c):
        return self._logic(meta, c, "or")

    def ifexpr(self, meta, c):
        return ast.IfExpr(_meta_span(meta), *c)

    def kwarg(self, meta, c):
        return ast.KwArg(_join(_tok_span(c[0]), c[1].span), str(c[0]), c[1])

    def call(self, meta, c):
        name, *rest = c
        args = tuple(a for a in rest if a is not None and not isinstance(a, ast.KwArg))
        kwargs = tuple(a for a in rest if isinstance(a, ast.KwArg))
        return ast.Call(_meta_span(meta), str(name), _tok_span(name), args, kwargs)

    # ---- statements
    def block(self, meta, c):
        return tuple(s for s in c if s is not None)

    def empty(self, meta, c):
        return None

    def let_stmt(self, meta, c):
        return ast.Let(_meta_span(meta), str(c[0]), c[1])

    def def_expr(self, meta, c):
        name, *params, body = c
        return ast.Def(_meta_span(meta), str(name), tuple(str(p) for p in params if p is not None), body)

    def_block = def_expr

    def require_stmt(self, meta, c):
        msg = str(c[1])[1:-1] if len(c) > 1 else None  # `("," STRING)?` leaves no placeholder
        return ast.Require(_meta_span(meta), c[0], msg)

    def expect_stmt(self, meta, c):
        # `("when" expr)?` and `("," STRING)?` leave no placeholders: a message is a STRING token.
        msg = next((str(x)[1:-1] for x in c[1:] if isinstance(x, Token)), None)
        guard = next((x for x in c[1:] if not isinstance(x, Token)), None)
        return ast.Expect(_meta_span(meta), c[0], guard, msg)

    def for_stmt(self, meta, c):
        return ast.For(_meta_span(meta), str(c[0]), c[1], c[2], c[4], c[3])

    def repeat_stmt(self, meta, c):
        return ast.Repeat(_meta_span(meta), c[0], c[1])

    def while_stmt(self, meta, c):
        return ast.While(_meta_span(meta), c[0], c[1])

    def if_stmt(self, meta, c):
        orelse = c[-1] if len(c) % 2 == 1 else None
        pairs = c[: len(c) - (len(c) % 2)]
        branches = tuple((pairs[i], pairs[i + 1]) for i in range(0, len(pairs), 2))
        return ast.If(_meta_span(meta), branches, orelse)

    def rank_block(self, meta, c):
        return ast.RankBlock(_meta_span(meta), str(c[0]), c[1])

    def order_block(self, meta, c):
        return ast.OrderBlock(_meta_span(meta), str(c[0]), tuple(x for x in c[1:] if x is not None))

    def order_prefer(self, meta, c):
        return ast.OrderItem(_meta_span(meta), "prefer", tuple(map(str, c)), tuple(map(_tok_span, c)), None, None)

    def order_inflight(self, meta, c):
        var, value = c  # `["(" NAME ")"]` leaves None when there is no stage variable
        return ast.OrderItem(_meta_span(meta), "inflight", (), (), None if var is None else str(var), value)

    def order_fill(self, meta, c):
        return ast.OrderItem(_meta_span(meta), "fill", (str(c[0]),), (_tok_span(c[0]),), None, None)

    def order_lag(self, meta, c):
        return ast.OrderItem(_meta_span(meta), "lag", (str(c[0]),), (_tok_span(c[0]),), None, c[1])

    def window_stmt(self, meta, c):
        value, name = c  # `["prefer" NAME]` leaves None without a policy
        prefer = None if name is None else str(name)
        return ast.Window(_meta_span(meta), value, prefer, None if name is None else _tok_span(name))

    def any_block(self, meta, c):
        return ast.AnyGroup(_meta_span(meta), c[0])

    def emit_stmt(self, meta, c):
        return ast.Emit(_meta_span(meta), tuple(c))

    def _decl(self, kind):
        def build(meta, c):
            if len(c) == 2:
                return ast.Decl(_meta_span(meta), kind, str(c[0]), c[1])
            return ast.Decl(_meta_span(meta), kind, None, c[0])

        return build

    def stages_decl(self, meta, c):
        return self._decl("stages")(meta, c)

    def ranks_decl(self, meta, c):
        return self._decl("ranks")(meta, c)

    def microbatches_decl(self, meta, c):
        return self._decl("microbatches")(meta, c)

    def cost_decl(self, meta, c):
        return self._decl("cost")(meta, c)

    def memory_decl(self, meta, c):
        return self._decl("memory")(meta, c)

    def place_decl(self, meta, c):
        return ast.Place(_meta_span(meta), str(c[0]), c[1])

    def edge_decl(self, meta, c):
        return ast.Place(_meta_span(meta), str(c[0]), c[1], "edge")

    def slices_decl(self, meta, c):
        return self._decl("slices")(meta, c)

    def seqlen_decl(self, meta, c):
        return self._decl("seqlen")(meta, c)

    def tokens_decl(self, meta, c):
        return ast.Place(_meta_span(meta), str(c[0]), c[1], "tokens")

    def length_decl(self, meta, c):
        return ast.Place(_meta_span(meta), str(c[0]), c[1], "length")

    def ops_decl(self, meta, c):
        return ast.OpsDecl(_meta_span(meta), tuple(str(t) for t in c), tuple(_tok_span(t) for t in c))

    # ---- topology
    def topology_decl(self, meta, c):
        return ast.Topology(_meta_span(meta), tuple(x for x in c if x is not None))

    def topo_dc(self, meta, c):
        return ast.TopoDc(_meta_span(meta), str(c[0])[1:-1], c[1], c[2])

    def topo_replicas(self, meta, c):
        return ast.TopoDc(_meta_span(meta), str(c[0])[1:-1], c[1], c[2], replicas=True)

    def _link(self, meta, a, b, attrs):
        found = {}
        for key, value in attrs:
            if key in found:
                raise _Bad(error("E107", f"{key} given twice", value.span))
            found[key] = value
        return ast.TopoLink(_meta_span(meta), a, b, found.get("latency"), found.get("bandwidth"))

    def topo_link(self, meta, c):
        return self._link(meta, str(c[0])[1:-1], str(c[1])[1:-1], c[2:])

    def topo_default(self, meta, c):
        return self._link(meta, None, None, c)

    def _quantity(self, tok: Token, kind: str, units: tuple[str, ...]) -> ast.Quantity:
        text = str(tok)
        digits = text.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
        unit = text[len(digits) :]
        if unit not in units:
            raise _Bad(
                error(
                    "E107",
                    f"{kind} needs a unit, one of {', '.join(units)} (got `{text}`)",
                    _tok_span(tok),
                )
            )
        _, mul, div = UNITS[unit]
        value = float(digits) * mul / div
        if not math.isfinite(value):
            raise _Bad(error("E004", f"{kind} `{_clip(text)}` is too large", _tok_span(tok)))
        return ast.Quantity(_tok_span(tok), value, unit)

    def latency(self, meta, c):
        return ("latency", self._quantity(c[0], "latency", of_kind("time", LANGUAGE)))

    def bandwidth(self, meta, c):
        return ("bandwidth", self._quantity(c[0], "bandwidth", of_kind("bandwidth", LANGUAGE)))

    # ---- top
    def param(self, meta, c):
        # `(":" TYPE)?` and `("=" expr)?` leave no placeholder: a type is a TYPE token, a default a node.
        typ = next((str(x) for x in c[1:] if isinstance(x, Token) and x.type == "TYPE"), None)
        default = next((x for x in c[1:] if not isinstance(x, Token)), None)
        return ast.Param(_meta_span(meta), str(c[0]), typ, default)

    def param_list(self, meta, c):
        return tuple(p for p in c if p is not None)

    def schedule(self, meta, c):
        # `param_list?` leaves no placeholder when a schedule has no parameter list.
        name, *params, body = c
        return ast.ScheduleAst(_meta_span(meta), str(name)[1:-1], params[0] if params else (), body)

    def start(self, meta, c):
        return c[0]


class _Bad(Exception):
    def __init__(self, err: PipecError) -> None:
        self.err = err


def _describe(parser: lark.Lark, names) -> str:
    """The expected tokens, in words; long lists (anything may follow) are cut to the first few."""
    shown = []
    for name in sorted(names):
        try:
            term = parser.get_terminal(name)
        except KeyError:
            shown.append(name)
            continue
        pattern = term.pattern
        if pattern.type == "str":
            shown.append(f"`{pattern.value}`")
        else:
            shown.append({"NAME": "a name", "NUMBER": "a number", "STRING": "a string"}.get(name, name.lower()))
    shown = list(dict.fromkeys(shown))
    if len(shown) > 8:
        words = [w for w in shown if w.startswith("`") and w[1:-1] in ("}", ")", ",", "{")]
        return ", ".join(words + ["a statement" if "`let`" in shown else "an operator"]) + " or more"
    return ", ".join(shown)


def parse(source: Source) -> ast.ScheduleAst:
    """Parse one schedule file; syntax errors become E001/E002 diagnostics, a line above MAX_LINE
    characters E901 and nesting above MAX_DEPTH E003."""
    _check_parentheses(source)
    _check_lines(source)
    with _no_gc():
        return _parse(source)


@contextlib.contextmanager
def _no_gc():
    """The cyclic collector off while lark builds the tree: parse trees hold no cycles, and each full
    collection walks every node made so far, which made a long file's parse time grow faster than its
    length (40,000 statements: 10 s with the collector, 6.5 s without)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _check_lines(source: Source) -> None:
    """E901 at the first line longer than MAX_LINE characters (a scan at C speed, before lark)."""
    text = source.text
    if len(text) <= MAX_LINE:
        return
    start = 0
    line = 1
    while start <= len(text):
        end = text.find("\n", start)
        if end < 0:
            end = len(text)
        if end - start > MAX_LINE:
            span = Span(line, MAX_LINE + 1, line, MAX_LINE + 2)
            raise error(
                "E901",
                f"line {line} is {end - start:,} characters long, above the limit of {MAX_LINE:,}",
                span,
                source,
                ("break it into several lines (statements need no separator)",),
            )
        start = end + 1
        line += 1


_PARENTHESES = re.compile(r'"[^"\n]*"|#[^\n]*|[()]')


def _check_parentheses(source: Source) -> None:
    """E003 at the first `(` nested more than MAX_DEPTH deep, counted on the text (strings and comments
    skipped) before lark: parentheses leave no node in the tree, so `_check_depth` cannot see them, and
    10,000 of them were parsed and compiled. (Blocks are nodes: `_check_depth` counts them.)"""
    text = source.text
    if text.count("(") <= MAX_DEPTH:
        return
    depth = 0
    for m in _PARENTHESES.finditer(text):
        c = m.group()
        if c == "(":
            depth += 1
            if depth > MAX_DEPTH:
                line = text.count("\n", 0, m.start()) + 1
                col = m.start() - (text.rfind("\n", 0, m.start()) + 1) + 1
                raise error(
                    "E003",
                    f"the file nests expressions or blocks more than {MAX_DEPTH} levels deep",
                    Span(line, col, line, col + 1),
                    source,
                )
        elif c == ")":
            depth = max(depth - 1, 0)


def _parse(source: Source) -> ast.ScheduleAst:
    parser = tables.parser()
    try:
        tree = parser.parse(source.text)
    except UnexpectedToken as e:
        tok = e.token
        if tok.type == "$END":
            span = _eof_span(source.text)
            found = "end of file"
        else:
            span = _tok_span(tok)
            found = f"`{tok}`"
        raise error("E001", f"unexpected {found}; expected {_describe(parser, e.expected)}", span, source) from None
    except UnexpectedCharacters as e:
        span = Span(e.line, e.column, e.line, e.column + 1)
        char = source.text[e.pos_in_stream] if e.pos_in_stream < len(source.text) else "?"
        raise error("E002", f"unexpected character `{char}`", span, source) from None
    except UnexpectedEOF:
        raise error("E001", "unexpected end of file", _eof_span(source.text), source) from None
    except UnexpectedInput as e:  # pragma: no cover - lark's other parse errors
        raise error("E001", str(e).splitlines()[0], _eof_span(source.text), source) from None
    _check_depth(tree, source)
    try:
        return _ToAst().transform(tree)
    except VisitError as e:
        if isinstance(e.orig_exc, _Bad):
            d = e.orig_exc.err.diagnostics[0]
            raise error(d.code, d.message, d.span, source) from None
        raise


def _check_depth(tree: Tree, source: Source) -> None:
    """E003 at the first node nested deeper than MAX_DEPTH (iterative: the tree may be very deep)."""
    stack = [(tree, 1, _meta_span(tree.meta))]
    while stack:
        node, depth, outer = stack.pop()
        span = outer if getattr(node.meta, "empty", True) else _meta_span(node.meta)
        if depth > MAX_DEPTH:
            raise error("E003", f"the file nests expressions or blocks more than {MAX_DEPTH} levels deep", span, source)
        stack.extend((c, depth + 1, span) for c in reversed(node.children) if isinstance(c, Tree))


def _eof_span(text: str) -> Span:
    lines = text.rstrip("\r\n").split("\n")  # as the parser counts lines (see Source.line)
    last = lines[-1].removesuffix("\r")
    return Span(len(lines), len(last) + 1, len(lines), len(last) + 2)
