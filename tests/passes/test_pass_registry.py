"""Passes are declared once (``passes.registry``): the pass manager takes the pass function and
reads its name and whether it ends a step from the declaration. The declaration holds nothing
else: the node types a pass takes and returns are its signature's, read by mypy."""

from __future__ import annotations

import ast
import inspect
import types
import typing
from collections.abc import Sequence
from pathlib import Path

import attrs
import pytest

import passes
from compiler.manager import PassManager
from ir.batch import DecodeBatch
from ir.errors import PreconditionError
from ir.nodes import NODE_TYPES
from ir.request import AdmittedRequest
from ir.spec import AcceptResult
from passes.filter_batch import filter_batch
from passes.lower import LowerContext, lower
from passes.registry import PASSES, REGISTRY, PassSpec, spec_of

MANAGER = Path(__file__).resolve().parents[2] / "compiler" / "manager.py"


def test_every_pass_is_declared_once_under_its_own_name() -> None:
    exported = {name: obj for name, obj in vars(passes).items() if name in passes.__all__ and inspect.isfunction(obj)}
    assert set(REGISTRY) == set(exported.values())
    assert [p.name for p in PASSES] == [p.fn.__name__ for p in PASSES]
    assert len({p.name for p in PASSES}) == len(PASSES)
    assert [p.name for p in PASSES if p.ends_step] == ["lower"]


def test_the_manager_names_a_run_after_the_declaration() -> None:
    pm = PassManager(verify_level=1)
    batch = pm.run(filter_batch, DecodeBatch.empty(), [])
    pm.run(lower, batch, LowerContext())
    assert list(pm.timings()) == ["filter_batch", "lower"]
    assert spec_of(lower).ends_step and not spec_of(filter_batch).ends_step


def test_an_undeclared_function_is_refused() -> None:
    pm = PassManager()
    with pytest.raises(PreconditionError, match=r"^PassManager\.run: <bound method DecodeBatch\.empty .*> is not a declared pass \(batchc's own, or one made with passes\.registry\.declare_pass\)$"):
        pm.run(DecodeBatch.empty)
    assert pm.timings() == {}


def test_the_declaration_holds_only_what_the_manager_reads() -> None:
    """A field nothing reads drifts from the code unnoticed: every field but ``fn`` (the registry's
    key) is read by the pass manager, off the declaration ``spec_of`` returns."""
    tree = ast.parse(MANAGER.read_text())
    read = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "spec"}
    fields = {a.name for a in attrs.fields(PassSpec)}
    assert fields - {"fn"} <= read, f"PassSpec fields the pass manager never reads: {sorted(fields - {'fn'} - read)}"
    assert "fn" in fields and set(REGISTRY) == {p.fn for p in PASSES}


def _members(annotation: object) -> set[object]:
    """The classes an annotation admits: a union's members, a type variable's constraints, a
    sequence's entries."""
    if isinstance(annotation, typing.TypeVar):
        return {m for c in annotation.__constraints__ for m in _members(c)}
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return {m for a in typing.get_args(annotation) for m in _members(a)}
    if origin is Sequence:
        return {m for a in typing.get_args(annotation) for m in _members(a)}
    return {annotation}


@pytest.mark.parametrize("spec", PASSES, ids=lambda p: p.name)
def test_a_pass_signature_maps_ir_to_ir(spec: PassSpec) -> None:
    """What the declaration no longer repeats is in the signature: the first argument and the
    result are IR values (requests in, nodes out), each a class the IR declares."""
    hints = typing.get_type_hints(spec.fn)
    first = next(iter(inspect.signature(spec.fn).parameters))
    ir = {*NODE_TYPES, AcceptResult}
    assert _members(hints[first]) <= ir | {AdmittedRequest}, f"{spec.name} takes {hints[first]}"
    assert _members(hints["return"]) <= ir, f"{spec.name} returns {hints['return']}"
    if spec.ends_step:  # a plan for the backend: every batch lowers to its plan
        assert _members(hints["return"]) == {t for t in NODE_TYPES if t.__name__.endswith("Plan")}
