"""A pass of one's own, declared where it is defined (``passes.registry.declare_pass``), runs through
the pass manager with everything a built-in pass gets: its name in timings, dumps and errors, its
output verified at the manager's level (at level 1 too when it ends a step), and a pipeline of one's
own composes it with batchc's passes. The declaration's own input is checked, one line each."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from typeguard import suppress_type_checks

from backend.ledger import Ledger
from compiler.manager import PassError, PassManager
from compiler.steps import Pipeline
from ir.batch import DecodeBatch
from ir.columns import build_unchecked
from ir.errors import IRVerificationError, PreconditionError
from ir.ids import MambaSlot, RequestId
from ir.plan import DecodePlan
from ir.request import AdmittedRequest, Clear
from passes import DecodeContext, filter_batch, lower
from passes.lower import LowerContext
from passes.registry import Pass, PassSpec, declare_pass, spec_of


def _batch(n: int = 3) -> DecodeBatch:
    return DecodeBatch(rids=list(range(1, n + 1)), slots=list(range(1, n + 1)), seq_lens=[4] * n, input_ids=[7] * n, kv_locs=list(range(10, 10 + n)))


@declare_pass
def keep_first(batch: DecodeBatch, limit: int) -> DecodeBatch:
    """The first ``limit`` rows of ``batch``."""
    return filter_batch(batch, [RequestId(int(r)) for r in np.asarray(batch.rids)[limit:]])


@declare_pass(name="keep_and_report")
def keep_first_and_report(batch: DecodeBatch, limit: int) -> tuple[DecodeBatch, list[RequestId]]:
    dropped = [RequestId(int(r)) for r in np.asarray(batch.rids)[limit:]]
    return filter_batch(batch, dropped), dropped


def _twin_slots(batch: DecodeBatch) -> DecodeBatch:
    """A batch whose two rows share a slot: built without checks, so only ``verify`` sees it."""
    return build_unchecked(DecodeBatch, rids=batch.rids, slots=np.ones_like(batch.slots), seq_lens=batch.seq_lens,
                           input_ids=batch.input_ids, kv_locs=batch.kv_locs, sampling=None)


@declare_pass
def corrupt(batch: DecodeBatch) -> DecodeBatch:
    return _twin_slots(batch)


@declare_pass(name="corrupt_plan", ends_step=True)
def corrupt_ending(batch: DecodeBatch) -> DecodePlan:
    return lower(_twin_slots(batch), LowerContext())


def test_a_declared_pass_is_its_function_and_carries_its_declaration() -> None:
    assert isinstance(keep_first, Pass)
    assert keep_first(_batch(), 2).num_requests == 2  # called directly, as the function
    assert keep_first.__name__ == "keep_first" and keep_first.__doc__ == "The first ``limit`` rows of ``batch``."
    assert keep_first.__wrapped__ is keep_first.spec.fn
    assert spec_of(keep_first).name == "keep_first" and not spec_of(keep_first).ends_step
    assert spec_of(corrupt_ending).name == "corrupt_plan" and spec_of(corrupt_ending).ends_step
    assert "keep_first" in repr(keep_first) and __name__ in repr(keep_first)
    with pytest.raises(AttributeError, match="pass 'keep_first' is immutable"):
        keep_first._spec = spec_of(corrupt)


def test_the_manager_runs_it_like_a_built_in_pass(tmp_path: Path) -> None:
    pm = PassManager(verify_level=2, dump_dir=tmp_path, record=True)
    out = pm.run(keep_first, _batch(), 2)
    plan = pm.run(lower, out, LowerContext())
    assert out.num_requests == 2 and plan.num_requests == 2
    assert list(pm.timings()) == ["keep_first", "lower"] and pm.timings()["keep_first"].calls == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00001-keep_first.txt", "00002-lower.txt"]
    assert pm.trace is not None and [name for name, _ in pm.trace] == ["keep_first", "lower"]
    assert (tmp_path / "00001-keep_first.txt").read_text() == pm.trace[0][1]


def test_the_ir_in_a_tuple_it_returns_is_verified_and_dumped(tmp_path: Path) -> None:
    pm = PassManager(verify_level=2, dump_dir=tmp_path)
    batch, dropped = pm.run(keep_first_and_report, _batch(), 1)
    assert batch.num_requests == 1 and dropped == [2, 3]
    assert [p.name for p in tmp_path.iterdir()] == ["00001-keep_and_report.txt"]
    assert list(pm.timings()) == ["keep_and_report"]


def test_its_output_is_verified_at_the_managers_level_and_errors_name_it() -> None:
    assert PassManager(verify_level=1).run(corrupt, _batch()).num_requests == 3  # level 1: step ends only
    pm = PassManager(verify_level=2)
    pm.run(keep_first, _batch(), 3)
    with pytest.raises(PassError, match=r"^pass 'corrupt' failed: IRVerificationError: DecodeBatch\.slots\[1\]: slot 1 already used at index 0\n") as info:
        pm.run(corrupt, _batch())
    assert info.value.pass_name == "corrupt" and info.value.before == ("keep_first",)
    assert isinstance(info.value.error, IRVerificationError)
    with pytest.raises(PassError, match=r"^pass 'corrupt_plan' failed"):
        PassManager(verify_level=1).run(corrupt_ending, _batch())  # ends a step: verified at level 1 too
    assert PassManager(verify_level=0).run(corrupt_ending, _batch()).num_requests == 3


def test_a_pass_that_raises_is_named_with_its_input() -> None:
    pm = PassManager()
    with pytest.raises(PassError, match=r"^pass 'keep_first' failed: TypeError: .*\n  passes before it: \(none\)\n  input IR \(excerpt\):\n    DecodeBatch requests=3\n"):
        pm.run(keep_first, _batch(), "2")  # type: ignore[arg-type]  # the wrong type is the test
    assert pm.timings()["keep_first"].calls == 1


def test_two_passes_under_one_name_are_refused_by_one_manager() -> None:
    other = declare_pass(lambda batch: batch, name="keep_first")
    pm = PassManager()
    pm.run(keep_first, _batch(), 1)
    pm.run(keep_first, _batch(), 1)  # the same pass again is fine
    with pytest.raises(PreconditionError, match=r"^PassManager\.run: two passes are named 'keep_first': .*<lambda> and .*keep_first \(give one another name in declare_pass\)$"):
        pm.run(other, _batch())
    assert pm.timings()["keep_first"].calls == 2
    assert PassManager().run(other, _batch()).num_requests == 3  # another manager: its own names


def test_a_pipeline_of_ones_own_composes_own_and_built_in_passes() -> None:
    """A method of one's own on ``Pipeline``: the pass, then batchc's decode step; the lowered plan is
    verified and registered as every step's is."""

    class CappedPipeline(Pipeline):
        def capped_decode(self, batch: DecodeBatch, ctx: DecodeContext, limit: int) -> tuple[DecodeBatch, list[RequestId]]:
            kept, dropped = self.pm.run(keep_first_and_report, batch, limit)
            out, _plan = self.decode(kept, ctx)
            return out, dropped

    ledger = Ledger()
    pipe = CappedPipeline(ledger, pm=PassManager(verify_level=2))
    batch, plan = pipe.prefill([AdmittedRequest(rid=RequestId(i), slot=MambaSlot(i), input_ids=[1, 2, 3], kv_locs=[10 * i, 10 * i + 1, 10 * i + 2], intent=Clear()) for i in (1, 2, 3)])
    assert {t.serial for t in ledger.outstanding()} == {t.serial for t in plan.tickets}
    out, dropped = pipe.capped_decode(pipe.decode(batch, DecodeContext(next_tokens=[5, 5, 5], kv_locs=[40, 41, 42]))[0],
                                      DecodeContext(next_tokens=[6, 6], kv_locs=[50, 51]), 2)
    assert dropped == [3] and [int(r) for r in out.rids] == [1, 2]
    assert list(pipe.pm.timings()) == ["prepare_for_extend", "lower", "prepare_for_decode", "keep_and_report"]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: declare_pass(lambda b: b), r"^declare_pass: <function .*<lambda>.*> has no identifier for a name; declare it with name=\.\.\.$"),
        (lambda: declare_pass(name="two words"), r"^declare_pass: name must be a Python identifier \(it names dump files\), got 'two words'$"),
        (lambda: declare_pass(name="../x"), r"^declare_pass: name must be a Python identifier \(it names dump files\), got '\.\./x'$"),
        (lambda: declare_pass(name=7), r"^declare_pass: name must be a Python identifier \(it names dump files\), got 7$"),  # type: ignore[call-overload]  # the ill-typed call is the test
        (lambda: declare_pass(name="lower"), r"^declare_pass: name 'lower' is a built-in pass's; give yours another name$"),
        (lambda: declare_pass(name="x", ends_step=1), r"^declare_pass: ends_step must be a bool, got 1$"),  # type: ignore[call-overload]  # the ill-typed call is the test
        (lambda: declare_pass(lower), r"^declare_pass: 'lower' is one of batchc's own passes, declared already$"),
        (lambda: declare_pass(keep_first), r"^declare_pass: <pass 'keep_first' .*> is declared already \(a pass is declared once\)$"),
        (lambda: declare_pass(3), r"^declare_pass: a pass must be a function, got 3$"),  # type: ignore[call-overload]  # the ill-typed call is the test
        (lambda: declare_pass(lambda b: b, name="filter_batch"), r"^declare_pass: name 'filter_batch' is a built-in pass's"),
        (lambda: declare_pass("my_pass"), r"^declare_pass: a pass must be a function, got 'my_pass' \(to name one: @declare_pass\(name='my_pass'\)\)$"),  # type: ignore[call-overload]  # the ill-typed call is the test
        (lambda: declare_pass(name="class"), r"^declare_pass: name 'class' is a Python keyword; give your pass another name$"),
    ],
    ids=["lambda", "spaces", "path", "int-name", "built-in-name", "int-flag", "built-in", "twice", "not-callable", "built-in-name-2",
         "a-name-for-the-function", "keyword"],
)
def test_a_bad_declaration_is_refused_in_one_line(call: object, message: str) -> None:
    """As an untyped caller makes it (the suite's run-time type checks off: they would refuse the
    ill-typed ones first)."""
    assert callable(call)
    with suppress_type_checks(), pytest.raises(PreconditionError, match=message):
        call()


def test_the_manager_refuses_what_is_not_declared() -> None:
    def undeclared(batch: DecodeBatch) -> DecodeBatch:
        return batch

    with pytest.raises(PreconditionError, match=r"^PassManager\.run: <function .*undeclared.*> is not a declared pass"):
        PassManager().run(undeclared, _batch())


def test_the_verify_level_setter_checks_and_converts_as_the_constructor_does() -> None:
    pm = PassManager(verify_level=0)
    with suppress_type_checks():  # as an untyped caller sets it: a plain int
        pm.verify_level = 2  # type: ignore[assignment]  # the plain int is the test
    with pytest.raises(PassError, match=r"^pass 'corrupt' failed"):
        pm.run(corrupt, _batch())
    with suppress_type_checks():
        pm.verify_level = 0  # type: ignore[assignment]  # likewise
    assert pm.run(corrupt_ending, _batch()).num_requests == 3
    with suppress_type_checks(), pytest.raises(ValueError, match=r"^verify_level must be 0, 1 or 2 \(a VerifyLevel\), got 7$"):
        pm.verify_level = 7  # type: ignore[assignment]  # the bad value is the test


class _Out(NamedTuple):
    batch: DecodeBatch
    n: int


@declare_pass
def corrupt_named(batch: DecodeBatch) -> _Out:
    return _Out(_twin_slots(batch), 1)


def test_the_ir_in_a_named_tuple_is_verified_too() -> None:
    with pytest.raises(PassError, match=r"^pass 'corrupt_named' failed: IRVerificationError"):
        PassManager(verify_level=2).run(corrupt_named, _batch())


def test_a_pass_built_directly_is_checked_as_a_declared_one() -> None:
    def mine(batch: DecodeBatch) -> DecodeBatch:
        return batch

    with pytest.raises(PreconditionError, match=r"^declare_pass: name 'lower' is a built-in pass's"):
        Pass(mine, PassSpec(fn=mine, name="lower"))
    with pytest.raises(PreconditionError, match=r"^declare_pass: name must be a Python identifier .*got 'a b/c'$"):
        Pass(mine, PassSpec(fn=mine, name="a b/c"))
    with pytest.raises(PreconditionError, match=r"^Pass: spec must be a PassSpec of the function itself"):
        Pass(mine, PassSpec(fn=_batch, name="other"))


@declare_pass
def returns_a_count(batch: DecodeBatch) -> int:
    return batch.num_requests


@declare_pass
def returns_nothing(batch: DecodeBatch) -> None:
    return None


@declare_pass
def splits(batch: DecodeBatch) -> list[DecodeBatch]:
    return [keep_first(batch, 1), _twin_slots(batch)]


@declare_pass
def splits_into_nothing(batch: DecodeBatch) -> list[DecodeBatch]:
    return []


@declare_pass(name="ends_without_a_plan", ends_step=True)
def ends_with_a_batch(batch: DecodeBatch) -> DecodeBatch:
    return batch


@pytest.mark.parametrize("level", [0, 1, 2])
def test_a_pass_of_ones_own_returns_ir_the_manager_can_verify(level: int) -> None:
    """What a pass of one's own returns is IR (a node, or a tuple or list holding nodes), at every
    verify level: a count or None was accepted and never verified or dumped."""
    for fn, got in ((returns_a_count, "3 \\(int\\)"), (returns_nothing, "None \\(NoneType\\)")):
        with pytest.raises(PassError, match=rf"^pass '{fn.spec.name}' failed: PreconditionError: {fn.spec.name}: returned {got}, not IR: a pass of "
                           "one's own returns a batch or a plan, or a tuple or list holding them"):
            PassManager(verify_level=level).run(fn, _batch())
    with pytest.raises(PassError, match=r"^pass 'ends_without_a_plan' failed: PreconditionError: ends_without_a_plan: is declared ends_step=True "
                       r"but returned no plan \(got DecodeBatch\)"):
        PassManager(verify_level=level).run(ends_with_a_batch, _batch())
    assert PassManager(verify_level=level).run(splits_into_nothing, _batch()) == []  # (an empty split: nothing to verify)
    if level == 2:  # the batches of a list are verified, each
        with pytest.raises(PassError, match=r"^pass 'splits' failed: IRVerificationError: DecodeBatch\.slots\[1\]: slot 1 already used"):
            PassManager(verify_level=level).run(splits, _batch())
    else:
        assert [b.num_requests for b in PassManager(verify_level=level).run(splits, _batch())] == [1, 3]
