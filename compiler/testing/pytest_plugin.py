"""batchc's pytest plugin, registered by the ``pytest11`` entry point ``batchc``: fixtures that give a
test a ledger, a pipeline, a fake model and executors, the ``batchc`` marker that configures them,
and the ``--batchc-update-golden`` option of ``compiler.testing.golden``.

Fixtures (each a fresh one per test):

- ``batchc_config``: the ``BatchcConfig`` the test asked for (the marker, or indirect parametrization);
- ``batchc_ledger``: a ``backend.ledger.Ledger``; at teardown it must be drained (every ticket
  registered with it consumed), else the test errors naming the tickets left, unless the test
  body failed already or the test opts out with ``check_drained=False``;
- ``batchc_pipeline``: a ``compiler.steps.Pipeline`` over that ledger, lowering for the configured
  pools (``passes.lower.LowerContext(pools=...)``);
- ``batchc_model_hook``: a ``compiler.testing.fakes.FakeModel`` (deterministic logits, no model);
- ``batchc_backend``: a ``compiler.testing.fakes.FakeBackend``: one executor per configured pool over a
  small pool, sharing the ledger and the model hook; its ``execute`` runs any plan of the pipeline;
- ``batchc_executor``: the backend's first pool's executor.

Configure them with the marker, keywords only::

    @pytest.mark.batchc(pools=("target", "draft"), capacity=8, vocab=16, check_drained=True)

or, for several configurations, by indirect parametrization of ``batchc_config`` with dicts of the
same keywords (``@pytest.mark.parametrize("batchc_config", [{"capacity": 4}], indirect=True)``;
they override the marker's). An unknown keyword or a bad value fails the test's setup with one line
naming the keyword, the value and the test.

Every pytest run in an environment that has batchc installed imports this module, before
typeguard's import hook (which a project's own suite may use) is installed: so at module level it
imports only pytest and the standard library. batchc, torch and hypothesis are imported inside the
fixtures that need them: the ledger and the pipeline load no torch, the model hook and the
executors do.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Generator, Iterator, Mapping
from typing import TYPE_CHECKING, NoReturn

import pytest

if TYPE_CHECKING:  # annotations only: importing these at module level would defeat the point above
    from backend.executor import Executor
    from backend.ledger import Ledger
    from compiler.steps import Pipeline
    from compiler.testing.fakes import FakeBackend, FakeModel

__all__ = [
    "BatchcConfig",
    "batchc_backend",
    "batchc_config",
    "batchc_executor",
    "batchc_ledger",
    "batchc_model_hook",
    "batchc_pipeline",
    "update_golden_option",
]

MARKER = "batchc"
OPTION = "--batchc-update-golden"
UPDATE_ENV = "BATCHC_UPDATE_GOLDEN"
"""``compiler.testing.golden.UPDATE_ENV``: a value other than unset, empty, 0 or 1 stops the session at its start."""
MAX_CAPACITY = 1 << 20
"""The marker's largest ``capacity``: ``compiler.testing.fakes.MAX_CAPACITY`` (spelled out here, where
batchc is not imported)."""
MAX_VOCAB = 1 << 18
"""The marker's largest ``vocab``: ``compiler.testing.fakes.MAX_VOCAB``."""


@dataclasses.dataclass(frozen=True)
class BatchcConfig:
    """What the ``batchc`` marker configures (the defaults when a test has none)."""

    pools: tuple[str, ...] = ("target",)
    """The pools a prefill's ops are lowered for, one executor each (the first the target's, the last the draft's)."""
    capacity: int = 8
    """Slots ``1..capacity`` of each executor's pool."""
    vocab: int = 16
    """The fake model's vocabulary: its tokens are ``[0, vocab)``."""
    check_drained: bool = True
    """Whether ``batchc_ledger`` must be drained at teardown."""


_NOT_PARAMETRIZED = object()
_KEYWORDS = tuple(f.name for f in dataclasses.fields(BatchcConfig))
_CALL_FAILED = pytest.StashKey[bool]()
_UPDATE_GOLDEN: list[bool] = []
"""The ``--batchc-update-golden`` of each configured session, innermost last (a test run inside a
test, as pytester's, pushes its own)."""


def update_golden_option() -> bool:
    """Whether the running pytest session was given ``--batchc-update-golden``."""
    return bool(_UPDATE_GOLDEN) and _UPDATE_GOLDEN[-1]


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add ``--batchc-update-golden``."""
    group = parser.getgroup("batchc", "batchc's testing helpers")
    group.addoption(
        OPTION, action="store_true", default=False, dest="batchc_update_golden",
        help="write the actual output of every batchc golden assertion (compiler.testing.golden) to its golden file "
        "instead of comparing (as BATCHC_UPDATE_GOLDEN=1 does); review the diff before committing it",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``batchc`` marker (``--strict-markers`` knows it) and read the update switch
    (a ``BATCHC_UPDATE_GOLDEN`` that is not unset, empty, 0 or 1 is a usage error, in one line)."""
    config.addinivalue_line(
        "markers",
        f"{MARKER}(pools=('target',), capacity=8, vocab=16, check_drained=True): configure batchc's fixtures "
        "(batchc_ledger, batchc_pipeline, batchc_model_hook, batchc_backend, batchc_executor)",
    )
    value = os.environ.get(UPDATE_ENV)
    if value not in (None, "", "0", "1"):  # (once, here, rather than in every golden test)
        raise pytest.UsageError(f"{UPDATE_ENV} must be 0 or 1 (or unset), got {value[:40]!r}")
    _UPDATE_GOLDEN.append(bool(config.getoption("batchc_update_golden", default=False)))


def pytest_unconfigure(config: pytest.Config) -> None:
    """Forget this session's update switch."""
    if _UPDATE_GOLDEN:
        _UPDATE_GOLDEN.pop()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Keep whether the test body failed, so the ledger's teardown check does not pile onto it."""
    report = yield
    if call.when == "call":
        item.stash[_CALL_FAILED] = report.failed
    return report


def _bad(test: str, message: str) -> NoReturn:
    pytest.fail(f"@pytest.mark.{MARKER} of {test}: {message}", pytrace=False)


def _checked(values: Mapping[str, object], test: str) -> BatchcConfig:
    """``values`` as a ``BatchcConfig``; a one-line setup failure naming the keyword, value and test."""
    for key in values:
        if key not in _KEYWORDS:
            _bad(test, f"unknown keyword {key!r} (known: {', '.join(_KEYWORDS)})")
    pools = values.get("pools", BatchcConfig.pools)
    if isinstance(pools, str) or not isinstance(pools, (tuple, list)) or not pools:
        _bad(test, f"pools must be a non-empty tuple of pool names, got {pools!r}")
    for p in pools:
        if not isinstance(p, str) or not p:
            _bad(test, f"pools must hold non-empty str pool names, got {p!r} in {pools!r}")
    if len(set(pools)) != len(pools):
        _bad(test, f"pools must be distinct, got {pools!r}")
    ints: dict[str, int] = {}
    defaults = BatchcConfig()
    for key, least, most, default in (("capacity", 1, MAX_CAPACITY, defaults.capacity), ("vocab", 2, MAX_VOCAB, defaults.vocab)):
        v = values.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or not least <= v <= most:
            _bad(test, f"{key} must be an int in [{least}, {most}], got {v!r}")
        ints[key] = v
    drained = values.get("check_drained", True)
    if not isinstance(drained, bool):
        _bad(test, f"check_drained must be True or False, got {drained!r}")
    return BatchcConfig(pools=tuple(pools), capacity=ints["capacity"], vocab=ints["vocab"], check_drained=drained)


@pytest.fixture
def batchc_config(request: pytest.FixtureRequest) -> BatchcConfig:
    """The test's ``BatchcConfig``: its ``batchc`` markers' keywords (the closest marker winning),
    then those of an indirect parametrization of this fixture."""
    test = request.node.nodeid
    values: dict[str, object] = {}
    for mark in reversed(list(request.node.iter_markers(MARKER))):
        if mark.args:
            _bad(test, f"takes keywords only, got positional {mark.args!r}")
        values.update(mark.kwargs)
    try:
        param: object = request.param
    except AttributeError:  # pytest sets it only when the fixture is parametrized (an explicit None is a parameter)
        param = _NOT_PARAMETRIZED
    if param is not _NOT_PARAMETRIZED:
        if not isinstance(param, Mapping):
            _bad(test, f"an indirect parameter of batchc_config must be a dict of its keywords, got {param!r}")
        values.update(param)
    return _checked(values, test)


@pytest.fixture
def batchc_ledger(request: pytest.FixtureRequest, batchc_config: BatchcConfig) -> Iterator[Ledger]:
    """A fresh ledger, drained at teardown (see the module docstring)."""
    from backend.ledger import Ledger
    from ir.errors import ResourceLeakError

    ledger = Ledger()
    yield ledger
    if not batchc_config.check_drained or request.node.stash.get(_CALL_FAILED, False):
        return
    try:
        ledger.assert_drained()
    except ResourceLeakError as e:
        leak = str(e)
    else:
        return
    pytest.fail(  # (outside the except block: one line, no chained traceback)
        f"batchc_ledger of {request.node.nodeid} is not drained at teardown: {leak} (@pytest.mark.{MARKER}(check_drained=False) allows it)",
        pytrace=False,
    )


@pytest.fixture
def batchc_pipeline(batchc_ledger: Ledger, batchc_config: BatchcConfig) -> Pipeline:
    """A pipeline over ``batchc_ledger`` lowering for the configured pools."""
    from compiler.steps import Pipeline
    from passes.lower import LowerContext

    return Pipeline(batchc_ledger, LowerContext(pools=batchc_config.pools))


@pytest.fixture
def batchc_model_hook(batchc_config: BatchcConfig) -> FakeModel:
    """A ``FakeModel`` over the configured vocabulary (loads torch)."""
    from compiler.testing.fakes import FakeModel

    return FakeModel(vocab=batchc_config.vocab)


@pytest.fixture
def batchc_backend(batchc_ledger: Ledger, batchc_model_hook: FakeModel, batchc_config: BatchcConfig) -> FakeBackend:
    """One executor per configured pool, sharing ``batchc_ledger`` and ``batchc_model_hook``."""
    from compiler.testing.fakes import FakeBackend

    return FakeBackend(batchc_ledger, pools=batchc_config.pools, capacity=batchc_config.capacity, model=batchc_model_hook)


@pytest.fixture
def batchc_executor(batchc_backend: FakeBackend) -> Executor[None]:
    """``batchc_backend``'s first pool's executor."""
    return batchc_backend.target
