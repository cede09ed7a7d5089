"""Suite-wide settings.

- Every pass manager built from the environment verifies after every pass, and every executor runs
  its in-place mutation detector (``BATCHC_VERIFY=2``), whatever the developer's shell says: a
  ``BATCHC_VERIFY`` of another value is overridden, and the run says so once, in its terminal
  summary (the run does not fail for it).
- Without a GPU, Triton's interpreter is on for the whole session, set before anything imports
  Triton so that Triton's own ``@jit`` library functions are interpreted too. CPU code still takes
  the torch references unless a kernel test asks for Triton (``BATCHC_TRITON_ON_CPU``).
- Under pytest-xdist each worker runs torch on one thread, and so do the processes its tests start.
- The processes the tests start that run batchc's own modules (``batchc run`` and ``serve`` through
  ``tests.forkserver.Popen``/``run``, and the ranks, replicas and executor processes batchc starts
  itself) are forked from a template process that imported torch and batchc once
  (``tests/forkserver.py``): the same programs, a second instead of several each. Tests marked
  ``real_processes`` (how children live and die) start fresh interpreters, and ``BATCHC_TEST_FORK=0``
  turns the template off for a whole run.
- Torch's intra-op thread count is put back after every test: the command line sets it
  (``--threads``), and a test that runs the command line must not change it for the tests after.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from tests import hypothesis_profiles  # noqa: F401  # registers the fuzzer's profiles, so --hypothesis-profile=long works

collect_ignore = ["user_project"]
"""An engine author's project kept as test data: ``.ci/check-install`` copies it out of the checkout and
runs its own tests there, against the installed batchc (inside this suite its conftest-free layout
and its deliberate misuse would be collected as batchc's own tests)."""

SUITE_VERIFY = "2"
OVERRIDDEN_VERIFY = os.environ.get("BATCHC_VERIFY")
"""The developer's ``BATCHC_VERIFY`` before the suite set its own (``None`` when unset)."""

os.environ["BATCHC_VERIFY"] = SUITE_VERIFY
if os.environ.get("PYTEST_XDIST_WORKER"):
    # a worker of `pytest -n N` shares the cores with the other workers: one torch thread each (and
    # in the processes its tests start), or N workers of all-core thread pools spin against each other
    # (measured on 2 cores: the suite took 2.5x the CPU time until this)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests import forkserver  # noqa: E402  # (after the settings above: the template starts with them)

FAST_TIER = (
    "tests/ir/",
    "tests/passes/",
    "tests/backend/test_ledger_truth.py",
    "tests/backend/test_backend_core.py",
    "tests/test_regression_stale_init.py",
    "tests/test_typecheck.py",
    "tests/testing/test_plugin.py",
    "tests/test_layering.py",
    "tests/test_lint.py",
)
"""The fast tier, ``pytest -m "not slow"``: the IR, every pass, the ledger and executor core, the
seed bug's regression test, mypy with the linear-use plugin and the type-rejection cases, batchc's
pytest plugin, the import rules and ruff. Every other test is marked ``slow`` at collection (a test
of a fast-tier file may be marked ``slow`` by hand); the full run, ``pytest``, runs both."""

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _in_fast_tier(path: object) -> bool:
    return os.path.relpath(str(path), _ROOT).replace(os.sep, "/").startswith(FAST_TIER)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto`` (the suite's addopts) starts one and a half workers a core: much of the suite waits
    on processes it started (executor processes, ranks, servers, the command line) and on their
    timeouts, which leaves a core idle under one worker a core. Measured on two cores, the whole
    suite: 539 s with two workers (1.4 cores busy on average), 423 s with three.
    ``PYTEST_XDIST_AUTO_NUM_WORKERS`` still overrides it, as in pytest-xdist."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # (pytest-xdist's own hook reads it)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores + cores // 2)


def pytest_ignore_collect(collection_path: object, config: pytest.Config) -> bool | None:
    """Under exactly ``-m "not slow"`` a test file outside the fast tier is not even imported: every
    test in it would be deselected (importing them all is most of a minute's budget)."""
    if config.getoption("markexpr") == "not slow" and str(collection_path).endswith(".py") and not _in_fast_tier(collection_path):
        return True
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    slow = pytest.mark.slow
    no_device = pytest.mark.skip(reason="no CUDA device") if not torch.cuda.is_available() else None
    for item in items:
        if not _in_fast_tier(item.path):
            item.add_marker(slow)
        if no_device is not None and item.get_closest_marker("cuda") is not None:
            item.add_marker(no_device)  # (the device-only tests: one line each in the summary)


def verify_override_notice() -> str | None:
    """The line the run prints when it overrode the developer's ``BATCHC_VERIFY`` (else ``None``)."""
    if OVERRIDDEN_VERIFY is None or OVERRIDDEN_VERIFY == SUITE_VERIFY:
        return None
    return (
        f"batchc: BATCHC_VERIFY={OVERRIDDEN_VERIFY[:40]!r} from the environment was overridden: "
        f"the suite always runs at BATCHC_VERIFY={SUITE_VERIFY}"
    )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    notice = verify_override_notice()
    if notice is not None:
        terminalreporter.write_sep("-", "settings")
        terminalreporter.write_line(notice)


@pytest.fixture(scope="session", autouse=True)
def _forked_children() -> Iterator[None]:
    """batchc's own children fork from the suite's template (``tests/forkserver.py``), from the first
    fixture on (a session fixture: installed after typeguard instruments batchc)."""
    if os.environ.get(forkserver.OFF_ENV) == "0":
        yield
        return
    forkserver.install()
    try:
        yield
    finally:
        forkserver.uninstall()


@pytest.fixture(autouse=True)
def _real_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test marked ``real_processes`` (the tests of how children live and die) starts batchc's
    children as batchc does, fresh interpreters, not forked from the suite's template."""
    if request.node.get_closest_marker("real_processes") is None or os.environ.get(forkserver.OFF_ENV) == "0":
        yield
        return
    forkserver.uninstall()
    try:
        yield
    finally:
        forkserver.install()


@pytest.fixture(autouse=True)
def _torch_threads_restored() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
