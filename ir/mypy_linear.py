"""A mypy plugin that checks linear use of one-shot values: ``plugins = ["ir.mypy_linear"]``.

The ledger refuses a replayed ticket at run time; this plugin refuses, at type-check time, the two
shapes of code that lead there (batchc's guide "The linearity checker in your mypy CI"):

- ``linear-reuse``: within one function body, a linear value bound to a name (or read from a field
  of one: ``result.hidden``, the same field path of the same binding) flows to two consuming
  calls on the same executor along one path (flow-sensitive over ``if``/``else``, ``try``/``except``,
  ``return``, ``break``/``continue``, loops and comprehensions), or to one consuming call in a loop
  that does not rebind the name. Rebinding the name starts a new value. The executor of a call is its
  receiver (``@consumes``) or the argument its ``@consumes_on`` parameter names, compared as source
  text: ``self.target`` and ``self.draft`` are two executors, two names for one executor are two.
  A value passed to a ``@retires`` method (a plan withdrawn before it ran) counts as consumed on
  every executor: any consuming call after it, or before it on a path to it, is a ``linear-reuse``.
- ``linear-escape``: a linear value stored where it outlives the step: an attribute of a class that
  is not declared ``@linear`` (a field, ``self.x = plan``, ``obj.x = plan``), or a container that is
  not a local of the function (``self.queue.append(plan)``, ``PENDING.append(plan)``,
  ``self.d[k] = plan``). ``ir.linear.stash(value)`` and ``@keeps_linear`` are the explicit hatches.
- ``linear-mark``: a marker the plugin cannot honour (``@consumes`` on a module-level function, a
  ``@consumes_on`` parameter the method does not have).

Why a per-call analysis: mypy gives a plugin no hook at the end of a function, so every check runs
from a hook that fires at the offending expression (the consuming call, the attribute store, the
container method), against a control-flow graph of the enclosing body built once from its syntax.
Only the calls already checked are known at a hook, so a second use is reported at the later call of
the two (textually); a loop's back edge is part of the graph, so the order does not hide one.

Which types are linear is read from the ``@linear`` marker, which a class-decorator hook records in
the class's metadata (kept in mypy's cache). Consumers are read from their decorators when mypy has
the source's tree, and from the metadata of their class otherwise, written when the decorator is
applied. This module imports only mypy: the library never imports it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Final

from mypy.checker import TypeChecker
from mypy.errorcodes import ErrorCode
from mypy.messages import format_type_bare
from mypy.nodes import (
    ARG_POS,
    LDEF,
    AssertStmt,
    AssertTypeExpr,
    AssignmentExpr,
    AssignmentStmt,
    AwaitExpr,
    Block,
    BreakStmt,
    CallExpr,
    CastExpr,
    ClassDef,
    ComparisonExpr,
    ConditionalExpr,
    Context,
    ContinueStmt,
    Decorator,
    DelStmt,
    DictExpr,
    DictionaryComprehension,
    Expression,
    ExpressionStmt,
    FakeInfo,
    ForStmt,
    FuncDef,
    GeneratorExpr,
    IfStmt,
    IndexExpr,
    IntExpr,
    ListComprehension,
    ListExpr,
    MatchStmt,
    MemberExpr,
    NameExpr,
    Node,
    OperatorAssignmentStmt,
    OpExpr,
    OverloadedFuncDef,
    RaiseStmt,
    RefExpr,
    ReturnStmt,
    RevealExpr,
    SetComprehension,
    SetExpr,
    SliceExpr,
    StarExpr,
    Statement,
    StrExpr,
    TempNode,
    TryStmt,
    TupleExpr,
    TypeApplication,
    TypeInfo,
    UnaryExpr,
    Var,
    WhileStmt,
    WithStmt,
    YieldExpr,
    YieldFromExpr,
)
from mypy.options import Options
from mypy.patterns import AsPattern, ClassPattern, MappingPattern, OrPattern, SequencePattern, StarredPattern
from mypy.plugin import AttributeContext, ClassDefContext, FunctionContext, MethodContext, Plugin
from mypy.plugins.default import DefaultPlugin
from mypy.types import Instance, TupleType, Type, UnionType, get_proper_type

GUIDE: Final = "The linearity checker in your mypy CI"
"""The title of the plugin's guide in batchc's documentation (docs/guides/linearity-checker.md)."""
DOCS: Final = f'the batchc guide "{GUIDE}", or: python -m pydoc ir.mypy_linear'
"""Where every message of the plugin points: by names that mean something wherever batchc is installed
(the guide's title, and this module's docstring, which ships with the package), not a path of batchc's repository."""
LINEAR_REUSE: Final = ErrorCode("linear-reuse", "A one-shot value consumed twice on one executor", "batchc")
LINEAR_ESCAPE: Final = ErrorCode("linear-escape", "A one-shot value stored where it outlives the step", "batchc")
LINEAR_MARK: Final = ErrorCode("linear-mark", "A linear-use marker the check cannot honour", "batchc")

_MARKERS: Final = "ir.linear"
LINEAR: Final = f"{_MARKERS}.linear"
KEEPS: Final = f"{_MARKERS}.keeps_linear"
CONSUMES: Final = f"{_MARKERS}.consumes"
CONSUMES_ON: Final = f"{_MARKERS}.consumes_on"
RETIRES: Final = f"{_MARKERS}.retires"
_EVERY: Final = "*"
"""The executor of a ``@retires`` call: it conflicts with every executor."""
CONSUMES_ON_CALL: Final = f"{_MARKERS}.ConsumesOn.__call__"
STASH: Final = f"{_MARKERS}.stash"
_META: Final = "batchc_linear"
"""Key of this plugin's entry in ``TypeInfo.metadata`` (serialized in mypy's cache)."""

MUTATORS: Final = frozenset(
    {"append", "appendleft", "extend", "extendleft", "insert", "add", "update", "setdefault", "put", "put_nowait", "__setitem__"}
)
"""Container methods that store their argument: storing a linear value through one of them into a
container that is not a local of the function is an escape."""

_EXIT: Final = -1


def _meta(info: TypeInfo) -> dict[str, object]:
    return info.metadata.setdefault(_META, {})


def _marked(info: TypeInfo, flag: str) -> bool:
    return any(base.metadata.get(_META, {}).get(flag) is True for base in info.mro)


def linear_in(t: Type, depth: int = 0) -> str | None:
    """The name of a linear type ``t`` is, may be (a union member) or holds (a type argument, a tuple
    item), or ``None``. ``Any`` is not linear: that is one of the check's limits."""
    if depth > 8:
        return None
    p = get_proper_type(t)
    if isinstance(p, Instance):
        if _marked(p.type, "linear"):
            return p.type.name
        for arg in p.args:
            if (found := linear_in(arg, depth + 1)) is not None:
                return found
        return None
    if isinstance(p, (UnionType, TupleType)):
        for item in p.items:
            if (found := linear_in(item, depth + 1)) is not None:
                return found
        return None
    return None  # Any, callables, type objects, literals: not linear


def _text(e: Expression) -> str:
    """An expression as the receiver rule compares it: source text for names, attributes and
    constant subscripts; a call is a different executor at each call site."""
    if isinstance(e, NameExpr):
        return e.name
    if isinstance(e, MemberExpr):
        return f"{_text(e.expr)}.{e.name}"
    if isinstance(e, IndexExpr):
        return f"{_text(e.base)}[{_text(e.index)}]"
    if isinstance(e, IntExpr):
        return str(e.value)
    if isinstance(e, StrExpr):
        return repr(e.value)
    return f"<expression at {e.line}:{e.column}>"


def _root_var(e: Expression) -> Var | None:
    """The variable an executor expression starts from (``self`` of ``self.target``)."""
    while isinstance(e, (MemberExpr, IndexExpr)):
        e = e.expr if isinstance(e, MemberExpr) else e.base
    return e.node if isinstance(e, NameExpr) and isinstance(e.node, Var) else None


def _type_text(t: Type, what: str, checker: TypeChecker) -> str:
    """A type as messages show it; a long union (``Plan``) by the linear type it may hold."""
    text = format_type_bare(t, checker.options)
    return text if len(text) <= 60 else f"a type that may hold {what}"


def _value(e: Expression, typ: str) -> str:
    """How a message names a stored value: by its name when it has one."""
    if isinstance(e, (NameExpr, MemberExpr)):
        return f'"{_text(e)}" ({typ})'
    return f'A value of type "{typ}"'


def _tracked(e: Expression) -> tuple[Var, str] | None:
    """The variable a consumed argument is read from, and the argument as text: a name (``plan``),
    or a field path from one (``result.hidden``: a linear field of a value bound to a name, which
    rebinding the name replaces); anything else (a call's result) is not tracked."""
    base = e
    while isinstance(base, MemberExpr):
        base = base.expr
    if isinstance(base, NameExpr) and isinstance(base.node, Var):
        return base.node, _text(e)
    return None


def _is_stash(e: Expression | None) -> bool:
    return isinstance(e, CallExpr) and isinstance(e.callee, RefExpr) and e.callee.fullname == STASH


def _is_none(e: Expression | None) -> bool:
    return isinstance(e, NameExpr) and e.fullname == "builtins.None"


def _bound_names(e: Expression | None) -> Iterator[Var]:
    """The variables an assignment target (re)binds."""
    if isinstance(e, NameExpr) and isinstance(e.node, Var):
        yield e.node
    elif isinstance(e, TupleExpr):
        for item in e.items:
            yield from _bound_names(item)
    elif isinstance(e, ListExpr):
        for item in e.items:
            yield from _bound_names(item)
    elif isinstance(e, StarExpr):
        yield from _bound_names(e.expr)


class _Collector:
    """The calls, walrus targets and comprehension scopes of one statement (or one compound
    statement's header), not descending into lambdas: those are bodies of their own. (A plain
    walker: compiled mypy lets no interpreted class derive from its visitors.)"""

    def __init__(self) -> None:
        self.calls: list[CallExpr] = []
        self.kills: set[Var] = set()
        self.repeated: dict[int, frozenset[Var]] = {}
        """Per call inside a comprehension's repeated part: the variables the comprehensions bind."""
        self._scopes: list[frozenset[Var]] = []

    def statement(self, s: Statement) -> None:
        if isinstance(s, AssignmentStmt):
            self.exprs([s.rvalue, *s.lvalues])
        elif isinstance(s, OperatorAssignmentStmt):
            self.exprs([s.rvalue, s.lvalue])
        elif isinstance(s, ExpressionStmt):
            self.expr(s.expr)
        elif isinstance(s, AssertStmt):
            self.exprs([s.expr, s.msg])
        elif isinstance(s, DelStmt):
            self.expr(s.expr)

    def exprs(self, es: Iterable[Expression | None]) -> None:
        for e in es:
            if e is not None:
                self.expr(e)

    def expr(self, e: Expression) -> None:
        if isinstance(e, CallExpr):
            self.calls.append(e)
            if self._scopes:
                self.repeated[id(e)] = frozenset().union(*self._scopes)
            self.exprs([e.callee, *e.args])
        elif isinstance(e, AssignmentExpr):
            self.kills.update(_bound_names(e.target))
            self.expr(e.value)
        elif isinstance(e, (MemberExpr, StarExpr, UnaryExpr, CastExpr, AssertTypeExpr, AwaitExpr, YieldFromExpr, TypeApplication)):
            self.expr(e.expr)
        elif isinstance(e, (YieldExpr, RevealExpr)):
            self.exprs([e.expr])
        elif isinstance(e, IndexExpr):
            self.exprs([e.base, e.index])
        elif isinstance(e, (TupleExpr, ListExpr, SetExpr)):
            self.exprs(e.items)
        elif isinstance(e, DictExpr):
            self.exprs(x for kv in e.items for x in kv)
        elif isinstance(e, OpExpr):
            self.exprs([e.left, e.right])
        elif isinstance(e, ComparisonExpr):
            self.exprs(e.operands)
        elif isinstance(e, ConditionalExpr):
            self.exprs([e.cond, e.if_expr, e.else_expr])
        elif isinstance(e, SliceExpr):
            self.exprs([e.begin_index, e.end_index, e.stride])
        elif isinstance(e, (ListComprehension, SetComprehension)):
            self.expr(e.generator)
        elif isinstance(e, GeneratorExpr):
            self._comprehension(e.sequences, e.indices, [e.left_expr, *(c for cl in e.condlists for c in cl)])
        elif isinstance(e, DictionaryComprehension):
            self._comprehension(e.sequences, e.indices, [e.key, e.value, *(c for cl in e.condlists for c in cl)])

    def _comprehension(self, sequences: list[Expression], indices: list[Expression], repeated: list[Expression | None]) -> None:
        self.expr(sequences[0])  # evaluated once
        self._scopes.append(frozenset(v for i in indices for v in _bound_names(i)))
        self.exprs([*sequences[1:], *repeated])
        self._scopes.pop()


class Flow:
    """The control-flow graph of one body (a function's, a class's or a module's), at statement
    granularity, with what each statement rebinds, the calls it evaluates, and the value stored by
    each attribute or name assignment target."""

    def __init__(self, body: list[Statement]) -> None:
        self.succ: list[list[int]] = []
        self.kills: list[frozenset[Var]] = []
        self.call_node: dict[int, int] = {}
        self.repeated: dict[int, frozenset[Var]] = {}
        self.stores: dict[int, Expression | None] = {}
        self.declared: set[int] = set()
        """Targets of annotated assignments: they declare the attribute's type, whatever this value's."""
        """id of an assignment target (a ``MemberExpr`` or ``NameExpr``) -> the value stored (``None``
        for a declaration without one)."""
        self.events: list[tuple[CallExpr, Var, str, str, Var | None]] = []
        """Consumptions seen so far: (call, variable, the value as text (the variable, or a field path
        from it), executor as text, the executor's root variable)."""
        self.entry = self._block(body, _EXIT, (_EXIT, _EXIT, ()))

    # -- building

    def _node(self, exprs: list[Expression | None], kills: set[Var], exc: tuple[int, ...], whole: Statement | None = None) -> int:
        n = len(self.succ)
        c = _Collector()
        if whole is not None:
            c.statement(whole)
        c.exprs(exprs)
        for call in c.calls:
            self.call_node.setdefault(id(call), n)
        self.repeated.update(c.repeated)
        self.succ.append(list(exc))
        self.kills.append(frozenset(kills | c.kills))
        return n

    def _block(self, stmts: list[Statement], nxt: int, env: tuple[int, int, tuple[int, ...]]) -> int:
        for s in reversed(stmts):
            nxt = self._stmt(s, nxt, env)
        return nxt

    def _stmt(self, s: Statement, nxt: int, env: tuple[int, int, tuple[int, ...]]) -> int:
        brk, cont, exc = env
        if isinstance(s, Block):
            return self._block(s.body, nxt, env)
        if isinstance(s, IfStmt):
            n = self._node(list(s.expr), set(), exc)
            branches = [self._block(b.body, nxt, env) for b in s.body]
            self.succ[n] += [*branches, self._block(s.else_body.body, nxt, env) if s.else_body else nxt]
            return n
        if isinstance(s, (WhileStmt, ForStmt)):
            if isinstance(s, ForStmt):
                n = self._node([s.expr], set(_bound_names(s.index)), exc)
            else:
                n = self._node([s.expr], set(), exc)
            body = self._block(s.body.body, n, (nxt, n, exc))
            self.succ[n] += [body, self._block(s.else_body.body, nxt, env) if s.else_body else nxt]
            return n
        if isinstance(s, TryStmt):
            fin = self._block(s.finally_body.body, nxt, env) if s.finally_body else nxt
            handlers = []
            for typ, var, handler in zip(s.types, s.vars, s.handlers, strict=True):
                h = self._node([typ], set(_bound_names(var)), exc)
                self.succ[h].append(self._block(handler.body, fin, env))
                handlers.append(h)
            els = self._block(s.else_body.body, fin, env) if s.else_body else fin
            inner = (*handlers, *((fin,) if s.finally_body else ()), *exc)
            return self._block(s.body.body, els, (brk, cont, inner))
        if isinstance(s, WithStmt):
            n = self._node(list(s.expr), {v for t in s.target for v in _bound_names(t)}, exc)
            self.succ[n].append(self._block(s.body.body, nxt, env))
            return n
        if isinstance(s, MatchStmt):
            n = self._node([s.subject], set(), exc)
            for pattern, guard, case_body in zip(s.patterns, s.guards, s.bodies, strict=True):
                binds = {v for name in _pattern_names(pattern) for v in _bound_names(name)}
                case = self._node([guard], binds, exc)
                self.succ[case].append(self._block(case_body.body, nxt, env))
                self.succ[n].append(case)
            self.succ[n].append(nxt)
            return n
        if isinstance(s, ReturnStmt):
            n = self._node([s.expr], set(), exc)  # (its expression may raise)
            self.succ[n].append(_EXIT)
            return n
        if isinstance(s, RaiseStmt):
            n = self._node([s.expr, s.from_expr], set(), exc)
            if not exc:
                self.succ[n].append(_EXIT)
            return n
        if isinstance(s, BreakStmt):
            n = self._node([], set(), ())
            self.succ[n].append(brk)
            return n
        if isinstance(s, ContinueStmt):
            n = self._node([], set(), ())
            self.succ[n].append(cont)
            return n
        if isinstance(s, (FuncDef, OverloadedFuncDef, ClassDef)):
            n = self._node([], set(), exc)
            self.succ[n].append(nxt)
            return n
        if isinstance(s, Decorator):
            n = self._node(list(s.decorators), {s.var}, exc)
            self.succ[n].append(nxt)
            return n
        if isinstance(s, AssignmentStmt):
            kills = {v for lv in s.lvalues for v in _bound_names(lv)}
            for lv in s.lvalues:
                self._record_stores(lv, None if isinstance(s.rvalue, TempNode) and s.rvalue.no_rhs else s.rvalue)
                if s.type is not None:
                    self.declared.add(id(lv))
            n = self._node([], kills, exc, whole=s)
            self.succ[n].append(nxt)
            return n
        if isinstance(s, OperatorAssignmentStmt):
            self._record_stores(s.lvalue, s.rvalue)
            n = self._node([], set(_bound_names(s.lvalue)), exc, whole=s)
            self.succ[n].append(nxt)
            return n
        if isinstance(s, DelStmt):
            n = self._node([], set(_bound_names(s.expr)), exc, whole=s)
            self.succ[n].append(nxt)
            return n
        if isinstance(s, AssertStmt):
            n = self._node([], set(), exc, whole=s)
            self.succ[n].append(nxt)
            return n
        n = self._node([], set(), exc, whole=s)
        self.succ[n].append(nxt)
        return n

    def _record_stores(self, target: Expression, value: Expression | None) -> None:
        if isinstance(target, (MemberExpr, NameExpr)):
            self.stores[id(target)] = value
        elif isinstance(target, TupleExpr):
            values = value.items if isinstance(value, TupleExpr) and len(value.items) == len(target.items) else None
            for i, item in enumerate(target.items):
                self._record_stores(item, values[i] if values is not None else value)

    # -- queries

    def reaches(self, a: CallExpr, b: CallExpr, var: Var, executor: Var | None = None) -> bool:
        """Whether some path runs call ``a`` and then call ``b`` without rebinding ``var`` between,
        nor the variable ``executor`` the executor expression starts from (``for ex in executors``:
        each iteration consumes on another executor)."""
        na, nb = self.call_node.get(id(a)), self.call_node.get(id(b))
        if na is None or nb is None:
            return False
        if a is b and id(a) in self.repeated:
            return not self.repeated[id(a)] & {var, executor}  # a comprehension evaluates it once per item
        if na == nb and a is not b and (a.line, a.column) < (b.line, b.column):
            return True
        if self.kills[na] & {var, executor}:
            return False  # ``plan = ex.execute(plan)``: what follows sees the new value
        seen: set[int] = set()
        todo = list(self.succ[na])
        while todo:
            n = todo.pop()
            if n == _EXIT or n in seen:
                continue
            if n == nb:
                return True
            seen.add(n)
            if not self.kills[n] & {var, executor}:
                todo.extend(self.succ[n])
        return False


def _pattern_names(p: object) -> Iterator[NameExpr]:
    """The names a ``case`` pattern captures (``case ExtendPlan() as plan``)."""
    if isinstance(p, AsPattern):
        if p.name is not None:
            yield p.name
        if p.pattern is not None:
            yield from _pattern_names(p.pattern)
    elif isinstance(p, StarredPattern):
        if p.capture is not None:
            yield p.capture
    elif isinstance(p, OrPattern):
        for q in p.patterns:
            yield from _pattern_names(q)
    elif isinstance(p, SequencePattern):
        for q in p.patterns:
            yield from _pattern_names(q)
    elif isinstance(p, MappingPattern):
        for q in p.values:
            yield from _pattern_names(q)
        if p.rest is not None:
            yield p.rest
    elif isinstance(p, ClassPattern):
        for q in [*p.positionals, *p.keyword_values]:
            yield from _pattern_names(q)


class LinearPlugin(Plugin):
    def __init__(self, options: Options) -> None:
        super().__init__(options)
        self._default = DefaultPlugin(options)
        """Hooks this plugin returns for container methods wrap the default plugin's (mypy asks the
        first plugin that answers)."""
        self._consumers: dict[str, str | None] = {}
        self._flows: dict[int, tuple[Node, Flow]] = {}

    # -- markers

    def get_class_decorator_hook(self, fullname: str) -> Callable[[ClassDefContext], None] | None:
        if fullname == LINEAR:
            return _mark_linear
        if fullname == KEEPS:
            return _mark_keeps
        return None

    def get_function_hook(self, fullname: str) -> Callable[[FunctionContext], Type] | None:
        if fullname in (CONSUMES, RETIRES):
            return _record_consumer
        return None

    def get_method_hook(self, fullname: str) -> Callable[[MethodContext], Type] | None:
        if fullname == CONSUMES_ON_CALL:
            return _record_consumer
        executor = self._consumer(fullname)
        if executor is not None:
            return lambda ctx: self._consume(ctx, executor)
        if fullname.rpartition(".")[2] in MUTATORS:
            inner = self._default.get_method_hook(fullname)
            return lambda ctx: self._container_store(ctx, inner)
        return None

    def get_attribute_hook(self, fullname: str) -> Callable[[AttributeContext], Type] | None:
        owner, _, name = fullname.rpartition(".")
        info = self._info(owner)
        if info is None or _marked(info, "linear") or _marked(info, "keeps"):
            return None
        sym = info.names.get(name)
        if sym is None or not isinstance(sym.node, Var):
            return None
        if sym.node.type is not None and linear_in(sym.node.type) is None:
            return None
        return lambda ctx: self._attribute_store(ctx, info, name)

    def _info(self, fullname: str) -> TypeInfo | None:
        sym = self.lookup_fully_qualified(fullname) if "." in fullname else None
        return sym.node if sym is not None and isinstance(sym.node, TypeInfo) else None

    def _consumer(self, fullname: str) -> str | None:
        """For a method marked ``@consumes``, ``""`` (its receiver is the executor); for one marked
        ``@consumes_on(p)``, ``p``; for one marked ``@retires``, ``"*"`` (every executor); otherwise
        ``None``. Inherited through the class's MRO."""
        if fullname in self._consumers:
            return self._consumers[fullname]
        owner, _, name = fullname.rpartition(".")
        info = self._info(owner)
        found: str | None = None
        for base in info.mro if info is not None else []:
            sym = base.names.get(name)
            if sym is None:
                continue
            found = _decorator_mark(sym.node)
            if found is None:
                consumers = base.metadata.get(_META, {}).get("consumers")
                if isinstance(consumers, dict) and isinstance(consumers.get(name), str):
                    found = consumers[name]
            if found is not None:
                break
        self._consumers[fullname] = found
        return found

    # -- the checks

    def _flow(self, checker: TypeChecker) -> Flow:
        """The graph of the body the checker is in: a function, a class body or the module."""
        scope = checker.scope
        func = scope.current_function()
        owner: Node
        body: list[Statement]
        if func is not None:
            owner, body = func, func.body.body
        elif (cls := scope.active_class()) is not None:
            owner, body = cls.defn, cls.defn.defs.body
        else:
            owner, body = checker.tree, checker.tree.defs
        cached = self._flows.get(id(owner))
        if cached is not None and cached[0] is owner:
            return cached[1]
        flow = Flow(body)
        self._flows[id(owner)] = (owner, flow)
        return flow

    def _consume(self, ctx: MethodContext, executor_param: str) -> Type:
        call, checker = ctx.context, ctx.api
        if not isinstance(call, CallExpr) or not isinstance(checker, TypeChecker):
            return ctx.default_return_type
        skip = -1
        executor_expr: Expression | None = None
        if executor_param == _EVERY:
            pass
        elif executor_param:
            if executor_param not in ctx.callee_arg_names:
                return ctx.default_return_type
            skip = ctx.callee_arg_names.index(executor_param)
            if not ctx.args[skip]:
                return ctx.default_return_type
            executor_expr = ctx.args[skip][0]
        elif isinstance(call.callee, MemberExpr):
            executor_expr = call.callee.expr
        else:
            return ctx.default_return_type
        executor, root = (_EVERY, None) if executor_expr is None else (_text(executor_expr), _root_var(executor_expr))
        flow = self._flow(checker)
        for i, (exprs, types) in enumerate(zip(ctx.args, ctx.arg_types, strict=True)):
            for e, t in zip(exprs, types, strict=True):
                tracked = _tracked(e)
                if i == skip or tracked is None:
                    continue
                what = linear_in(t)
                if what is None:
                    continue
                self._check_reuse(checker, flow, call, tracked, _type_text(t, what, checker), executor, root)
        return ctx.default_return_type

    def _check_reuse(
        self, checker: TypeChecker, flow: Flow, call: CallExpr, tracked: tuple[Var, str], typ: str, executor: str, root: Var | None
    ) -> None:
        var, name = tracked
        for first, v, text, ex, _ in flow.events:
            same = ex == executor or _EVERY in (ex, executor)
            if v is var and text == name and same and first is not call and (first.line, first.column) < (call.line, call.column):
                if flow.reaches(first, call, var, root if ex == executor else None):
                    line = first.line
                    if ex == _EVERY:
                        msg = (f'"{name}" ({typ}) is used after line {line} retired it on a path to here (a withdrawn plan '
                               f"never runs: use the plan the withdrawal returned; see {DOCS})")
                    elif executor == _EVERY:
                        msg = (f'"{name}" ({typ}) is retired after "{ex}" consumed it on line {line} (a plan that ran on an '
                               f"executor cannot be withdrawn; see {DOCS})")
                    else:
                        msg = (f'"{name}" ({typ}) is consumed again by "{executor}": line {line} consumed it on a path to here; '
                               f"one-shot tickets run once per executor (rebind it to a new plan; see {DOCS})")
                    checker.fail(msg, call, code=LINEAR_REUSE)
                    break
        if flow.reaches(call, call, var, root):
            checker.fail(
                f'"{name}" ({typ}) is consumed by "{executor}" in a loop without being rebound: line {call.line} '
                f"consumes the same tickets on every iteration (rebind it in the loop; see {DOCS})",
                call,
                code=LINEAR_REUSE,
            )
        if not any(c is call and v is var and text == name and ex == executor for c, v, text, ex, _ in flow.events):
            flow.events.append((call, var, name, executor, root))

    def _attribute_store(self, ctx: AttributeContext, owner: TypeInfo, name: str) -> Type:
        checker, target = ctx.api, ctx.context
        what = linear_in(ctx.default_attr_type)
        if what is None or not isinstance(checker, TypeChecker) or not isinstance(target, (MemberExpr, NameExpr)):
            return ctx.default_attr_type
        flow = self._flow(checker)
        if id(target) not in flow.stores:
            return ctx.default_attr_type  # a read
        value = flow.stores[id(target)]
        if _is_stash(value) or _is_none(value):
            return ctx.default_attr_type
        shown, shown_what = ctx.default_attr_type, what  # (the attribute's type: ``ExtendPlan | None``)
        if value is not None and id(target) not in flow.declared:
            value_type = checker.lookup_type_or_none(value)
            if value_type is None:  # (mypy checks the target before the value: infer it now, its errors left to mypy's own pass)
                with checker.msg.filter_errors():
                    value_type = checker.expr_checker.accept(value)
            value_what = linear_in(value_type)
            if value_what is None:
                return ctx.default_attr_type
            shown, shown_what = value_type, value_what  # the stored value's own type (``ExtendPlan``)
        typ = _type_text(shown, shown_what, checker)
        if value is None or isinstance(target, NameExpr):
            msg = (
                f'Field "{name}" of "{owner.name}" holds {typ}, a linear value, but "{owner.name}" is not declared '
                f"@linear: an object holding one-shot tickets outlives the step (see {DOCS})"
            )
        else:
            msg = (
                f'{_value(value, typ)} is stored in attribute "{_text(target)}" of "{owner.name}", which outlives the step; '
                f"pass it on, declare the class @linear, or wrap a deliberate store in ir.linear.stash() (see {DOCS})"
            )
        _fail_unfiltered(checker, msg, target, LINEAR_ESCAPE)
        return ctx.default_attr_type

    def _container_store(self, ctx: MethodContext, inner: Callable[[MethodContext], Type] | None) -> Type:
        result = inner(ctx) if inner is not None else ctx.default_return_type
        checker, call = ctx.api, ctx.context
        if not isinstance(checker, TypeChecker):
            return result
        for exprs, types in zip(ctx.args, ctx.arg_types, strict=True):
            for e, t in zip(exprs, types, strict=True):
                if _is_stash(e) or linear_in(t) is None:
                    continue
                receiver = _receiver(call, ctx)
                if receiver is None or not _escapes(receiver, checker):
                    return result
                checker.fail(
                    f'{_value(e, _type_text(t, linear_in(t) or "", checker))} is stored in "{_text(receiver)}", a container that '
                    f"outlives this function; hand it on, or wrap a deliberate store in ir.linear.stash() (see {DOCS})",
                    call,
                    code=LINEAR_ESCAPE,
                )
                return result
        return result


def _fail_unfiltered(checker: TypeChecker, msg: str, context: Context, code: ErrorCode) -> None:
    """Report past mypy's error filters. mypy looks up an attribute's first assignment
    (``self.x = plan``) and a class-body field only inside a filter (its speculative check against
    base classes), and no unfiltered hook sees those stores; the escape is not speculative."""
    errors = checker.msg.errors
    watchers, errors._watchers = errors._watchers, []
    try:
        checker.fail(msg, context, code=code)
    finally:
        errors._watchers = watchers


def _receiver(call: object, ctx: MethodContext) -> Expression | None:
    """The container a mutator call stores into: ``x`` of ``x.append(v)`` or of ``x[k] = v``."""
    if isinstance(call, CallExpr) and isinstance(call.callee, MemberExpr):
        return call.callee.expr
    if isinstance(call, IndexExpr):
        return call.base
    if isinstance(call, AssignmentStmt) and ctx.args and ctx.args[0]:
        index = ctx.args[0][0]
        for lv in call.lvalues:
            if isinstance(lv, IndexExpr) and lv.index is index:
                return lv.base
    return None


def _escapes(container: Expression, checker: TypeChecker) -> bool:
    """Whether a container outlives the function: anything but a local variable of it (a parameter
    is the caller's), except the own attributes of a ``@linear`` or ``@keeps_linear`` class's self."""
    func = checker.scope.current_function()
    if isinstance(container, NameExpr):
        if not isinstance(container.node, Var) or container.kind != LDEF or func is None:
            return True
        return any(arg.variable is container.node for arg in func.arguments)
    root: Expression = container
    while isinstance(root, (MemberExpr, IndexExpr)):
        root = root.expr if isinstance(root, MemberExpr) else root.base
    if not isinstance(root, NameExpr):
        return False  # a temporary (a call's result): not a store the check can follow
    if isinstance(root.node, Var) and root.node.is_self and func is not None:
        info = checker.scope.enclosing_class(func) if func in checker.scope.stack else None
        if info is not None and (_marked(info, "linear") or _marked(info, "keeps")):
            return False
    return True


def _decorator_mark(node: object) -> str | None:
    """The consumer mark of a decorated method, read from its decorators (present when mypy has the
    module's tree, absent when it comes from the cache)."""
    if not isinstance(node, Decorator):
        return None
    for d in node.original_decorators or node.decorators:
        if isinstance(d, RefExpr) and d.fullname == CONSUMES:
            return ""
        if isinstance(d, RefExpr) and d.fullname == RETIRES:
            return _EVERY
        if isinstance(d, CallExpr) and isinstance(d.callee, RefExpr) and d.callee.fullname == CONSUMES_ON:
            if d.args and isinstance(d.args[0], StrExpr) and d.arg_kinds[0] == ARG_POS:
                return d.args[0].value
    return None


def _mark_linear(ctx: ClassDefContext) -> None:
    _meta(ctx.cls.info)["linear"] = True


def _mark_keeps(ctx: ClassDefContext) -> None:
    _meta(ctx.cls.info)["keeps"] = True


def _record_consumer(ctx: FunctionContext | MethodContext) -> Type:
    """Where ``@consumes`` / ``@consumes_on(p)`` is applied: keep the mark in the class's metadata,
    which mypy's cache keeps (a decorator list is not kept)."""
    e = ctx.context
    if not isinstance(e, Decorator):
        return ctx.default_return_type
    mark = _decorator_mark(e)
    info = e.func.info
    if mark is None:
        ctx.api.fail(f"consumes_on takes the executor's parameter name as a literal string (see {DOCS})", e, code=LINEAR_MARK)
    elif isinstance(info, FakeInfo) or not isinstance(info, TypeInfo):
        ctx.api.fail(
            f'"{e.func.name}" is marked as consuming, but only methods can be (mypy\'s cache keeps no decorators of a '
            f"module-level function; see {DOCS})",
            e,
            code=LINEAR_MARK,
        )
    elif mark and mark != _EVERY and mark not in e.func.arg_names:
        ctx.api.fail(f'"{e.func.name}" has no parameter "{mark}" to consume on (see {DOCS})', e, code=LINEAR_MARK)
    else:
        consumers = _meta(info).setdefault("consumers", {})
        if isinstance(consumers, dict):
            consumers[e.func.name] = mark
    return ctx.default_return_type


def plugin(version: str) -> type[Plugin]:
    """mypy's entry point."""
    return LinearPlugin


__all__ = ["DOCS", "GUIDE", "LINEAR_ESCAPE", "LINEAR_MARK", "LINEAR_REUSE", "Flow", "LinearPlugin", "linear_in", "plugin"]
