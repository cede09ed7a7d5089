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
  (``tests/forkserver.py``): the same programs, a second instead of several each. In tests marked
  ``real_processes`` (how children live and die) batchc starts its children as fresh interpreters,
  as it does outside the suite (the ``batchc`` under test itself may be forked, with
  ``real_children``), and ``BATCHC_TEST_FORK=0`` turns the template off for a whole run.
- Torch's intra-op thread count is put back after every test: the command line sets it
  (``--threads``), and a test that runs the command line must not change it for the tests after.
- typeguard (pyproject's addopts) checks the arguments, returns and annotated assignments of every
  public function and method of the four packages, dunder methods included (``__init__``,
  ``__call__``, ...), and of the functions nested in them; a private helper (a name with one leading
  underscore) is checked by mypy --strict alone (``_public_only``).
"""

from __future__ import annotations

import hashlib
import inspect
import os
import sys
from collections.abc import Iterator

import pytest
import torch

from tests import hypothesis_profiles  # noqa: F401  # registers the fuzzer's profiles, so --hypothesis-profile=long works

# Compiled modules are cached (``__pycache__``, git-ignored) even where ``PYTHONDONTWRITEBYTECODE`` is
# set, as on the machines this suite is timed on: every xdist worker imports every test module and,
# through typeguard's import hook, every batchc module, and rewriting their asserts and instrumenting
# and compiling them took 20-25 s of CPU per process; with the caches written by the run before,
# 8 s. typeguard's cache is keyed by its version and, below, by the instrumentation policy's code;
# pytest's by its version.
sys.dont_write_bytecode = False


def _public_only() -> None:
    """typeguard instruments the public functions and methods only (see the module): its import hook
    (installed by its pytest plugin at configure, after this conftest is imported) rewrites every
    function of a module, and a private helper is called from within its module, with arguments
    mypy --strict has checked there, many times per public call (the IR's column helpers, the
    printer's and parser's per-value steps, the executor's per-plan steps). Measured on two cores,
    the engine, IR and pass test files it costs most in (test_parse, test_wire, test_pass_promises,
    test_engine_promises, test_penalties, test_serving; one process, two interleaved rounds): 76-77 s
    of CPU with every function checked, 60-61 s with the public ones. typeguard has no public switch
    for it; its transformer's function visitor is wrapped, and a typeguard without that visitor
    fails here, at the suite's start, rather than checking less unnoticed."""
    from typeguard._transformer import TypeguardTransformer

    for name in ("visit_FunctionDef", "visit_AsyncFunctionDef"):
        visit = getattr(TypeguardTransformer, name)
        if getattr(visit, "_public_only", False):
            continue

        def public_only(self: TypeguardTransformer, node: object, _visit: object = visit) -> object:
            fn = getattr(node, "name", "")
            if fn.startswith("_") and not (fn.startswith("__") and fn.endswith("__")):
                return node  # (left as written: mypy --strict checks it)
            return _visit(self, node)  # type: ignore[operator]  # the visitor taken from the class above

        public_only._public_only = True  # type: ignore[attr-defined]  # marks the wrapper: conftest imported twice wraps once
        setattr(TypeguardTransformer, name, public_only)
    # the instrumented modules' bytecode cache is keyed by typeguard's version; this policy changes
    # what it instruments, so its code keys the cache too (an instrumented module cached under another
    # policy is never read back)
    from typeguard import _importhook

    policy = hashlib.sha256(inspect.getsource(_public_only).encode()).hexdigest()[:8]
    if not _importhook.OPTIMIZATION.endswith(policy):
        _importhook.OPTIMIZATION += policy


_public_only()

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


LONGEST_FIRST = (
    "tests/compiler/tools/test_bench_serve.py",
    "tests/compiler/offline/test_hf_serving.py",
    "tests/compiler/online/test_server.py",
    "tests/compiler/engine/test_penalties.py",
    "tests/compiler/engine/test_engine_head.py",
    "tests/test_fuzz_stack.py",
    "tests/compiler/cli/test_cli_hostile.py",
    "tests/backend/tp/test_tp_serve.py",
    "tests/compiler/engine/test_sampling_engine.py",
    "tests/compiler/online/test_parallel.py",
    "tests/testing/test_strategies.py",
    "tests/compiler/offline/test_tp_cli.py",
    "tests/backend/kernels/test_kernel_window.py",
    "tests/ir/test_parse.py",
    "tests/compiler/cli/test_lifetimes.py",
    "tests/test_suite_settings.py",
)
"""The files that took longest in a full run on two cores (20-70 s each), put first in the collection.
pytest-xdist (3.8 here) then hands the files out by their number of tests, most first (its default
``--loadscope-reorder``), so this order decides only among files of as many tests, or under
``--no-loadscope-reorder``. That flag is not in the suite's settings: in five whole runs with it (and
a remeasured list, not kept) three had a test fail that passed when run again alone (the memory
estimate's run in tests/compiler/offline/test_memory_budget.py allocating more than its estimate;
a ``batchc run`` that did not end on SIGINT in tests/compiler/cli/test_signals.py; a third whose name
was not kept), none of seven runs without it did, and it showed no gain (228-261 s a run with it,
225-290 s without). Only the order changes, and only the order's speed depends on this list being
current."""


def _longest_first(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    where = [rank.get(os.path.relpath(str(item.path), _ROOT).replace(os.sep, "/"), len(rank)) for item in items]
    order = sorted(range(len(items)), key=where.__getitem__)  # (stable: within a file, and for the rest, collection order)
    items[:] = [items[i] for i in order]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    _longest_first(items)
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
