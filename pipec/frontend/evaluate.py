"""Generated code plus parameter values to a Schedule; one rank block run per rank.

Runtime errors inside the generated code (division by zero, failed `require`,
a runaway loop) are raised as `_Fail(code, message, sid)` and turned into
diagnostics at the span the statement id names.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable, Sequence

import numpy as np

from pipec.errors import PipecError, Source, Span, brief, error
from pipec.files import require_ops_fit
from pipec.frontend.codegen import GeneratedCode
from pipec.frontend.family import FamilyRecorder, family_of
from pipec.frontend.names import COLLECTIVES, MEMOP_NAMES
from pipec.frontend.params import bind_params
from pipec.frontend.shape import MAX_SIZE, graph_of, slicing_of
from pipec.frontend.shape import Fail as _Fail
from pipec.ir.schedule import (
    MEMORY_RANK_KEYS,
    Collective,
    Datacenter,
    Expectation,
    Link,
    MemOp,
    Policy,
    RankOps,
    Schedule,
    Topology,
)

MAX_OPS = 50_000_000  # ops a schedule may have in all
WORK_PER_OP = 16  # loop iterations a rank may spend per op it owns, beyond a fixed allowance
WORK_FIXED = 1_000_000


@functools.lru_cache(maxsize=64)
def _code_object(code: str):
    try:
        return compile(code, "<pipec schedule>", "exec")
    except (RecursionError, MemoryError, SyntaxError) as e:  # deeply nested input
        raise _Fail("E003", "the file nests expressions or blocks too deeply", None) from e


class _Runtime:
    """What the generated code calls: collects declarations and the rank block."""

    def __init__(self, spans: Sequence[Span]) -> None:
        self.decls: dict[str, tuple[object, int]] = {}
        self.costs: dict[str, tuple[object, int]] = {}
        self.memory: dict[str, tuple[object, int]] = {}
        self.edges: list[tuple[object, int]] = []  # `edge s -> e` declarations, in order: a schedule has several

    def decl(self, kind: str, key: str | None, value, sid: int) -> None:
        if kind == "edge":
            self.edges.append((value, sid))
            return
        table = self.costs if kind == "cost" else self.memory if kind == "memory" else self.decls
        name = key if key is not None else kind
        if name in table:
            what = f"{kind} {key}" if key else kind
            raise _Fail("E106", f"`{what}` declared twice", sid)
        table[name] = (value, sid)


def evaluate(
    compiled: GeneratedCode,
    source: Source,
    params: Iterable[tuple[str, object]] = (),
    ranks: Iterable[int] | None = None,
) -> Schedule:
    """Run a compiled schedule for these parameter values (strings from `-D`, or typed values)."""
    spans = compiled.spans

    def fail(f: _Fail) -> PipecError:
        span = spans[f.sid] if f.sid is not None else compiled.header
        return error(f.code, f.message, span, source, f.notes)

    values = bind_params(compiled, source, params)
    try:
        return _run(compiled, source, values, ranks)
    except _Fail as f:
        raise fail(f) from None
    except RecursionError:
        raise error("E003", "the file nests expressions or blocks too deeply", None, source) from None
    except OverflowError as e:  # int too large for a float, in the generated code
        raise error("E212", f"arithmetic overflow: {e}", _generated_span(compiled, e), source) from None


def _generated_span(compiled: GeneratedCode, exc: BaseException) -> Span:
    """The span of the statement whose generated code raised `exc` (the innermost such frame)."""
    span, tb = compiled.header, exc.__traceback__
    while tb is not None:
        lineno = tb.tb_lineno - 1
        if tb.tb_frame.f_code.co_filename == "<pipec schedule>" and 0 <= lineno < len(compiled.line_spans):
            span = compiled.line_spans[lineno]
        tb = tb.tb_next
    return span


def _float(value, sid: int | None) -> float:
    try:
        return float(value)
    except OverflowError as e:
        raise _Fail("E212", f"arithmetic overflow: {e}", sid) from None


def _run(compiled: GeneratedCode, source: Source, given: dict[str, object], only: Iterable[int] | None) -> Schedule:
    ns: dict[str, object] = {}
    exec(_code_object(compiled.code), ns)
    env = _Env(compiled, ns)  # defaults may divide, so the helpers come first
    # Defaults may refer to earlier parameters.
    values: list[object] = []
    for prm, typ in zip(compiled.params, compiled.param_types):
        py = f"_default_{_pyname(compiled, prm.name)}"
        if prm.name in given:
            values.append(given[prm.name])
            continue
        fn = ns[py]
        value = fn(*values[: fn.__code__.co_argcount])
        if value is None:
            raise _Fail("E203", f"parameter `{prm.name}` has no default: give it with `-D {prm.name}=...`", None)
        if typ == "float":
            value = _float(value, None)
        values.append(value)
    param_items = tuple((p.name, v) for p, v in zip(compiled.params, values))
    rt = _Runtime(compiled.spans)
    ns["_rt"] = rt
    ns["_params"] = param_items
    ns["_schedule"](rt, *values)
    pdict = dict(param_items)

    def size(kind: str, fallback: str) -> tuple[int, Span | None]:
        if kind in rt.decls:
            v, sid = rt.decls[kind]
            span = compiled.spans[sid]
        elif fallback in pdict and type(pdict[fallback]) is int:
            v, span = pdict[fallback], None
            sid = None
        else:
            raise _Fail("E106", f"declare `{kind}` (or a parameter `{fallback}`)", None)
        if not 1 <= v <= MAX_SIZE:
            raise _Fail("E210", f"`{kind}` must be between 1 and {MAX_SIZE:,}, got {brief(v)}", sid)
        return v, span

    if "stages" not in rt.decls:
        raise _Fail("E106", "the schedule needs a `stages` declaration", None)
    num_stages, _ = size("stages", "")
    num_ranks, _ = size("ranks", "p")
    m, _ = size("microbatches", "m")
    slicing = slicing_of(rt.decls, m)
    if slicing is not None:
        m = slicing.num_units  # the ops' micro-batch index is a unit: (micro-batch, slice)
        n = slicing.slices
        seqs = slicing.sequences

        def unit(i, j, sid):
            if not 0 <= j < n:
                raise _Fail("E209", f"slice {brief(j)} is out of range 0..{n - 1}", sid)
            if not 0 <= i < seqs:
                raise _Fail("E209", f"micro-batch {brief(i)} is out of range 0..{seqs - 1}", sid)
            return i * n + j

        ns["_unit"] = unit
    if num_stages * m * len(compiled.kinds) > MAX_OPS:
        raise _Fail("E210", f"the schedule would have more than {MAX_OPS:,} ops", rt.decls["stages"][1])
    # Before the arrays are allocated (E902): the ops a schedule would have if its rank blocks emit them all,
    # when every rank is evaluated (one rank of a run evaluates its own ops only).
    if only is None:
        try:
            require_ops_fit(num_stages * m * len(compiled.kinds), f"`{compiled.name}`")
        except PipecError as e:
            d = e.diagnostics[0]
            raise _Fail(d.code, d.message, rt.decls["stages"][1], d.notes) from None
    if "rank" in rt.decls and "order" in rt.decls:
        raise _Fail("E106", "a schedule has a `rank` block or an `order` block, not both", rt.decls["order"][1])
    if slicing is not None and slicing.slices > 1 and "order" in rt.decls:
        raise _Fail(
            "E106",
            "an `order` block cannot derive the order of token slices yet: write a `rank` block",
            rt.decls["order"][1],
        )
    if "rank" not in rt.decls and "order" not in rt.decls:
        raise _Fail("E106", "the schedule needs a `rank r { ... }` block", None)

    if "place" in rt.decls:
        place_fn, place_sid = rt.decls["place"]
    else:
        place_fn, place_sid = (lambda s: s % num_ranks), None
    placement = []
    for s in range(num_stages):
        owner = place_fn(s)
        if not 0 <= owner < num_ranks:
            raise _Fail(
                "E305",
                f"`place` maps stage {s} to rank {owner}, outside 0..{num_ranks - 1}",
                place_sid,
                (f"p = {num_ranks}, stages = {num_stages}",),
            )
        placement.append(owner)

    graph = graph_of(rt.edges, num_stages)
    costs = {k: tuple(_float(fn(s), sid) for s in range(num_stages)) for k, (fn, sid) in rt.costs.items()}
    memory = {}
    for key, (fn, sid) in rt.memory.items():
        n = num_ranks if key in MEMORY_RANK_KEYS else num_stages
        memory[key] = tuple(_float(fn(i), sid) for i in range(n))
    topology = _topology(rt.decls.get("topology"), num_ranks)

    owned: list[list[int]] = [[] for _ in range(num_ranks)]
    for s, owner in enumerate(placement):
        owned[owner].append(s)
    wanted = set(range(num_ranks)) if only is None else set(only)
    if not wanted <= set(range(num_ranks)):
        raise ValueError(f"ranks {sorted(wanted - set(range(num_ranks)))} are not in 0..{num_ranks - 1}")
    order = None
    if "order" in rt.decls:
        order = _policy(num_ranks, num_stages, owned, *rt.decls["order"])
    else:
        rank_fn, rank_sid = rt.decls["rank"]
    rank_ops = []
    coll_rows: list[list[tuple]] = []
    mem_rows: list[list[tuple]] = []
    with_memops = compiled.memops or bool(compiled.recompute_sids)
    families, family_spans = [], {}  # `window` and `any` (pipec.frontend.family)
    for r in range(num_ranks):
        if order is not None:
            rank_ops.append(_empty_rank())
        elif r in wanted:
            cap = len(compiled.kinds) * len(owned[r]) * m
            rank_ops.append(env.run_rank(rank_fn, r, owned[r][0] if len(owned[r]) == 1 else -1, cap))
            if compiled.collectives:
                coll_rows.append(_check_collectives(env.colls, r, owned[r], placement))
            if with_memops:
                mem_rows.append(_default_recomputes(env.mems, rank_ops[-1], compiled.recompute_sids, num_stages))
            if compiled.family:
                rec = env.family
                families.append(
                    rec.finish(r, rank_ops[-1], bool(mem_rows and mem_rows[-1]), bool(coll_rows and coll_rows[-1]))
                )
                if rec.sid is not None:
                    family_spans[r] = compiled.spans[rec.sid]
        else:
            rank_ops.append(_empty_rank())
            if compiled.collectives:
                coll_rows.append([])
            if with_memops:
                mem_rows.append([])
    collectives: tuple[tuple[Collective, ...], ...] = ()
    if any(coll_rows):
        spans = compiled.spans
        collectives = tuple(
            tuple(Collective(COLLECTIVES[k], s, before, spans[sid]) for k, s, before, sid in row) for row in coll_rows
        )
    memops: tuple[tuple[MemOp, ...], ...] = ()
    if any(mem_rows):
        spans = compiled.spans
        memops = tuple(
            tuple(MemOp(MEMOP_NAMES[k], i, s, before, spans[sid]) for k, i, s, before, sid in row) for row in mem_rows
        )
    decl_spans = {k: compiled.spans[sid] for k, (_, sid) in rt.decls.items()}
    if rt.edges:  # the first `edge` declaration: where a tool that cannot take a graph points (E217)
        decl_spans["edge"] = compiled.spans[rt.edges[0][1]]
    expects = tuple(
        Expectation(compiled.spans[sid], compiled.spans[csid], msg, rank, _expectation_test(fn, compiled, source))
        for sid, csid, msg, fn, rank in env.expects
    )
    return Schedule(
        name=compiled.name,
        params=param_items,
        num_stages=num_stages,
        num_ranks=num_ranks,
        num_microbatches=m,
        kinds=compiled.kinds,
        placement=tuple(placement),
        ranks=tuple(rank_ops),
        costs=costs,
        memory=memory,
        topology=topology,
        spans=compiled.spans,
        source=source,
        decl_spans=decl_spans,
        expects=expects,
        collectives=collectives,
        memops=memops,
        slicing=slicing,
        family=family_of(families + [None] * (num_ranks - len(families)), family_spans) if families else None,
        order=order,
        order_ranks=None if order is None or only is None else tuple(sorted(wanted)),
        graph=graph,
    )


def _default_recomputes(mems: list[tuple], ops: RankOps, recompute_sids: frozenset[int], S: int) -> list[tuple]:
    """A rank's memory ops as `(index in MEMOP_NAMES, mb, stage, before, sid)`, in order: those its block
    placed, and for each forward emitted with `recompute: true` (its statement id is one of
    `recompute_sids`) whose (mb, stage) the block gave no RECOMPUTE of its own, a RECOMPUTE just before
    that forward's B, after any memory op the block placed there (at the end of the rank when it has no such
    B: the checks then report the missing B). Whether they are in order and paired is
    pipec.passes.checks' business, once every op is known to occur once."""
    if not recompute_sids:
        return mems
    rc = MEMOP_NAMES.index("RECOMPUTE")
    wanted = np.flatnonzero((ops.kind == 0) & np.isin(ops.sid, np.fromiter(recompute_sids, np.int64)))
    if not len(wanted):
        return mems
    placed = {(i, s) for k, i, s, _, _ in mems if k == rc}
    bi = np.flatnonzero(ops.kind == 1)
    bkey = ops.mb[bi] * S + ops.stage[bi]
    order = np.argsort(bkey, kind="stable")
    keys = ops.mb[wanted] * S + ops.stage[wanted]
    at = np.minimum(np.searchsorted(bkey[order], keys), max(len(bi) - 1, 0))
    found = (bkey[order][at] == keys) if len(bi) else np.zeros(len(keys), dtype=bool)
    before = np.where(found, bi[order][at] if len(bi) else 0, len(ops))
    extra = [
        (rc, i, s, b, sid)
        for i, s, b, sid in zip(
            ops.mb[wanted].tolist(), ops.stage[wanted].tolist(), before.tolist(), ops.sid[wanted].tolist()
        )
        if (i, s) not in placed
    ]
    if not extra:
        return mems
    # Stable by `before`, the block's own first: sorted() keeps the block's order among equal places.
    return sorted(mems + extra, key=lambda t: t[3])


def _check_collectives(colls: list[tuple], rank: int, owned: list[int], placement: list[int]) -> list[tuple]:
    """A rank's collectives as `(op index, stage, before, sid)`, each on a stage the rank owns: the ops'
    own codes, at the collective's statement (E308 no stage named on a rank of several, E208 no such
    stage, E301 another rank's stage). Whether they pair up (an UNSHARD before each compute, a RESHARD
    after, a REDUCE_GRAD after the last backward) is the validator's proof, on the lowered Program."""
    for k, s, _, sid in colls:
        name = COLLECTIVES[k]
        if s == -1:
            raise _Fail("E308", f"rank {rank} owns stages {owned}: say which, e.g. `{name}(stage: s)`", sid)
        if not 0 <= s < len(placement):
            raise _Fail("E208", f"stage {s} is out of range 0..{len(placement) - 1}", sid)
        if placement[s] != rank:
            raise _Fail(
                "E301",
                f"{name}(stage {s}) placed on rank {rank}, but stage {s} is placed on rank {placement[s]}",
                sid,
                (f"rank {rank} owns stage{'s' if len(owned) != 1 else ''} {', '.join(map(str, owned)) or 'none'}",),
            )
    return colls


def _policy(num_ranks: int, num_stages: int, owned: list[list[int]], decl, sid: int) -> Policy:
    """An `order` block as its `Policy` value; the orders it gives are derived after evaluation
    (`pipec.passes.policy.resolve`, under the schedule's own costs and memory)."""
    prefer, fill, fn = decl
    R, S = num_ranks, num_stages
    inflight, stage_inflight, lag = [], [None] * S, []
    for r in range(R):
        a, stage_fn, g = fn(r)
        inflight.append(math.inf if a is None else _float(a, sid))
        lag.append(0 if g is None else g)
        if stage_fn is not None:
            for s in owned[r]:
                stage_inflight[s] = _float(stage_fn(s), sid)
    bad = [x for x in inflight + [x for x in stage_inflight if x is not None] if x < 1]
    if bad:
        raise _Fail("E213", f"an in-flight limit must be at least 1, got {bad[0]:g}", sid)
    return Policy(
        prefer=prefer,
        inflight=tuple(inflight),
        stage_inflight=None
        if all(x is None for x in stage_inflight)
        else tuple(math.inf if x is None else x for x in stage_inflight),
        w_mode="fit" if fill else "idle",
        w_lag=tuple(lag),
    )


def _expectation_test(fn, compiled: GeneratedCode, source: Source):
    """The deferred condition of an `expect`; errors inside it (division by zero...) become diagnostics."""

    def test(metrics):
        try:
            return fn(metrics)
        except _Fail as f:
            span = compiled.spans[f.sid] if f.sid is not None else compiled.header
            raise error(f.code, f.message, span, source, f.notes) from None
        except OverflowError as e:
            raise error("E212", f"arithmetic overflow: {e}", _generated_span(compiled, e), source) from None

    return test


def _cmp(a, op: str, b) -> tuple[bool, object, object]:
    """An `expect` comparison, keeping both sides. `<=`, `>=` and `==` allow a relative error of 1e-9,
    because simulated times are floats: (p - 1) / (m + p - 1) must hold when it holds exactly."""
    tol = 1e-9 * max(1.0, abs(a), abs(b))
    ok = {
        "<": a < b,
        "<=": a <= b + tol,
        ">": a > b,
        ">=": a >= b - tol,
        "==": abs(a - b) <= tol,
    }[op]
    return bool(ok), a, b


def _pyname(compiled: GeneratedCode, name: str) -> str:
    # Parameters are bound first, in order, so their generated names are v_<name>_<index+1>.
    index = [p.name for p in compiled.params].index(name)
    return f"v_{name}_{index + 1}"


def _empty_rank() -> RankOps:
    z = np.zeros(0, dtype=np.int64)
    return RankOps(z, z, z, z, np.zeros(0, dtype=bool))


def _topology(decl, num_ranks: int) -> Topology | None:
    if decl is None:
        return None
    items, decl_sid = decl
    dcs, links, names = [], [], set()
    replica_dcs: list[Datacenter] = []
    for item in items:
        if item[0] == "replicas":
            # Where data-parallel replicas sit. Their number is a compile option (`--dp N`), unknown here:
            # the ranges must start at replica 0 and leave no gap; the lowering checks they reach N.
            _, name, lo, hi, sid = item
            if any(d.name == name for d in replica_dcs):
                raise _Fail("E112", f'datacenter "{name}" declared twice for replicas', sid)
            if not 0 <= lo < hi <= MAX_SIZE:
                raise _Fail("E112", f'datacenter "{name}" replicas {lo}..{hi}: need 0 <= lo < hi', sid)
            for d in replica_dcs:
                if lo < d.hi and d.lo < hi:
                    raise _Fail("E112", f'datacenter "{name}" replicas overlap those of "{d.name}"', sid)
            names.add(name)
            replica_dcs.append(Datacenter(name, lo, hi))
        elif item[0] == "dc":
            _, name, lo, hi, sid = item
            if any(d.name == name for d in dcs):
                raise _Fail("E112", f'datacenter "{name}" declared twice', sid)
            if not 0 <= lo < hi <= num_ranks:
                raise _Fail("E112", f'datacenter "{name}" ranks {lo}..{hi} are not within 0..{num_ranks}', sid)
            for d in dcs:
                if lo < d.hi and d.lo < hi:
                    raise _Fail("E112", f'datacenter "{name}" overlaps "{d.name}"', sid)
            names.add(name)
            dcs.append(Datacenter(name, lo, hi))
        else:
            _, a, b, lat, bw, sid = item
            for n in (a, b):
                if n is not None and n not in names:
                    raise _Fail("E112", f'link names unknown datacenter "{n}"', sid)
            if bw is not None and not bw > 0:
                raise _Fail("E112", "a link's bandwidth must be positive", sid)
            links.append(Link(a, b, lat, bw))
    # Once one datacenter is declared, every rank belongs to exactly one (so no link is a guess).
    at, gaps = 0, []
    for d in sorted(dcs, key=lambda d: d.lo):
        if d.lo > at:
            gaps.append((at, d.lo))
        at = max(at, d.hi)
    if dcs and at < num_ranks:
        gaps.append((at, num_ranks))
    if gaps:
        lo, hi = gaps[0]
        what = f"rank {lo} is" if hi == lo + 1 else f"ranks {lo}..{hi} are"
        raise _Fail(
            "E112",
            f"{what} in no datacenter",
            decl_sid,
            (f"once a datacenter is declared, each of the {num_ranks} ranks must be in one",),
        )
    at = 0
    for d in sorted(replica_dcs, key=lambda d: d.lo):
        if d.lo > at:
            what = f"replica {at} is" if d.lo == at + 1 else f"replicas {at}..{d.lo} are"
            raise _Fail(
                "E112",
                f"{what} in no datacenter",
                decl_sid,
                ("datacenters for replicas cover 0 .. N - 1 for `--dp N`, without a gap",),
            )
        at = d.hi
    return Topology(tuple(dcs), tuple(links), tuple(sorted(replica_dcs, key=lambda d: d.lo)))


class _Env:
    """The helpers the generated code calls, bound into its namespace."""

    def __init__(self, compiled: GeneratedCode, ns: dict) -> None:
        self.compiled = compiled
        self.ns = ns
        self.left = WORK_FIXED
        self.rank: int | None = None  # the rank block being run, for `expect`s written in it
        self.colls: list[tuple] = []  # the collectives the rank block being run placed (when it places any)
        self.mems: list[tuple] = []  # likewise its memory ops, `(k, mb, stage, before, sid)`
        self.expects: list[tuple] = []
        ns.update(
            _tdiv=self.tdiv,
            _fdiv=self.fdiv,
            _mod=self.mod,
            _zero_div=self.zero_div,
            _zero_mod=self.zero_mod,
            _charge=self.charge,
            _step=self.step,
            _require_failed=self.require_failed,
            _while_check=self.while_check,
            _expect=self.expect,
            _cmp=_cmp,
            _done=self.done_outside_rank,
            _ds=-1,
            _ops=[],
            _emit=None,
            _RC=compiled.recompute_sids,
        )

    @staticmethod
    def tdiv(a, b, sid):
        if b == 0:
            raise _Fail("E201", "division by zero", sid)
        return a / b

    @staticmethod
    def fdiv(a, b, sid):
        if b == 0:
            raise _Fail("E201", "division by zero", sid)
        return a // b

    @staticmethod
    def mod(a, b, sid):
        if b == 0:
            raise _Fail("E201", "modulo by zero", sid)
        return a % b

    # The generated code divides inline, `a // (b or _zero_div(sid))`: evaluated in the same order as
    # `_fdiv(a, b, sid)` (a, then b), with the same error, at a fraction of a call's cost.
    @staticmethod
    def zero_div(sid):
        raise _Fail("E201", "division by zero", sid)

    @staticmethod
    def zero_mod(sid):
        raise _Fail("E201", "modulo by zero", sid)

    @staticmethod
    def step(value, sid):
        if value == 0:
            raise _Fail("E211", "a `for` step must not be zero", sid)
        return value

    def charge(self, n, sid):
        if n > 0:
            self.left -= n
            if self.left < 0:
                raise _Fail(
                    "E207", "evaluation ran too long: loops here iterate far more than the schedule has ops", sid
                )

    def require_failed(self, sid, message):
        values = ", ".join(f"{k}={v}" for k, v in self.ns.get("_params", ()))
        text = f"requirement failed: {message}" if message else "requirement failed"
        raise _Fail("E202", text, sid, (f"with {values}",) if values else ())

    @staticmethod
    def done_outside_rank(kind, stage, sid):
        raise _Fail("E109", "`done(op, stage)` counts the ops a rank has emitted: use it inside the `rank` block", sid)

    def expect(self, sid, cond_sid, message, fn):
        self.expects.append((sid, cond_sid, message, fn, self.rank))

    def while_check(self, before, after, sid):
        if after == before:
            raise _Fail("E207", "`while` loop made no progress: an iteration emitted no ops", sid)
        if after > self.cap:
            raise _Fail("E207", f"`while` loop emitted more ops than this rank can own ({self.cap})", sid)

    def run_rank(self, fn, rank: int, default_stage: int, cap: int) -> RankOps:
        ns = self.ns
        ops: list[tuple] = []
        pairs: list[int] = []
        self.rank = rank
        self.cap = cap
        self.left = WORK_FIXED + WORK_PER_OP * cap
        ns["_ops"] = ops
        ns["_ds"] = default_stage
        ns["_pair"] = lambda: pairs.append(len(ops))
        if self.compiled.collectives:
            colls: list[tuple] = []
            self.colls = colls
            ns["_coll"] = lambda k, s, sid: colls.append((k, s, len(ops), sid))
        if self.compiled.memops or self.compiled.recompute_sids:
            mems: list[tuple] = []
            self.mems = mems
            ns["_mem"] = lambda k, i, s, sid: mems.append((k, i, s, len(ops), sid))
        if self.compiled.counts_ops:
            counts: dict[tuple[int, int], int] = {}
            append = ops.append

            def emit(t):
                append(t)
                key = (t[0], t[2])
                counts[key] = counts.get(key, 0) + 1

            def nxt(k, s, sid):
                key = (k, s)
                i = counts.get(key, 0)
                append((k, i, s, sid))
                counts[key] = i + 1

            ns["_emit"] = emit
            ns["_next"] = nxt
            ns["_done"] = lambda k, s, sid: counts.get((k, s), 0)
        else:
            ns["_emit"] = ops.append
            ns["_next"] = None  # no op without a micro-batch: the generated code never calls it
        if self.compiled.family:
            self.family = FamilyRecorder(ops)
            self.family.bind(ns)
        fn(rank)
        return _to_arrays(ops, pairs)


def _to_arrays(ops: list[tuple], pairs: list[int]) -> RankOps:
    if not ops:
        return _empty_rank()
    try:  # flattened through fromiter: half the time of np.array on a list of tuples, the same errors
        a = np.fromiter(itertools.chain.from_iterable(ops), dtype=np.int64, count=4 * len(ops)).reshape(-1, 4)
    except OverflowError:
        bad = next(t for t in ops if any(abs(x) >= 2**62 for x in t[1:3]))
        raise _Fail("E209", f"micro-batch or stage out of range: {bad[1]}, {bad[2]}", bad[3]) from None
    paired = np.zeros(len(ops), dtype=bool)
    for j in pairs:
        paired[j] = True
    return RankOps(a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy(), a[:, 3].copy(), paired)
