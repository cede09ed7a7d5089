"""Passes are declared once (``passes.registry``): the pass manager takes the pass function and
reads its name and whether it ends a step from the declaration."""

from __future__ import annotations

import inspect

import pytest

import passes
from compiler.manager import PassManager
from ir.batch import DecodeBatch
from ir.errors import PreconditionError
from passes.filter_batch import filter_batch
from passes.lower import LowerContext, lower
from passes.registry import PASSES, REGISTRY, spec_of


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
    with pytest.raises(PreconditionError, match=r"PassManager\.run: <bound method DecodeBatch\.empty .*> is not a registered pass \(passes\.registry\.PASSES\)"):
        pm.run(DecodeBatch.empty)
    assert pm.timings() == {}
