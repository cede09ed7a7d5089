"""The suite's own settings (``tests/conftest.py``): every test runs at ``BATCHC_VERIFY=2`` even when
the developer's shell sets another level, and the run says once that it overrode it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from backend.executor import Executor
from backend.ledger import Ledger
from backend.pool import MambaStatePool
from compiler.manager import PassManager
from ir.ids import TARGET_POOL
from tests.helpers import LAYOUT

ROOT = Path(__file__).resolve().parent.parent


def test_the_suite_runs_at_verify_level_2() -> None:
    assert os.environ["BATCHC_VERIFY"] == "2"
    assert PassManager.from_env().verify_level == 2  # every pass output is verified
    assert Executor(MambaStatePool(TARGET_POOL, LAYOUT, 2), Ledger()).watch  # the mutation detector is on


def test_a_developer_level_is_overridden_and_reported_once() -> None:
    env = {**os.environ, "BATCHC_VERIFY": "0"}
    out = subprocess.run(
        # one xdist worker, as under the suite's own addopts: the notice is printed by the controller, once (the
        # addopts' typeguard is left out: it instruments batchc in the worker and has nothing to do with the notice)
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-n", "1",
         f"{__file__}::test_the_suite_runs_at_verify_level_2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("BATCHC_VERIFY='0' from the environment was overridden") == 1, out.stdout


def test_verify_level_is_parsed_once_into_an_enum() -> None:


    from ir.errors import SettingsError
    from ir.verify import VerifyLevel, parse_verify_level

    assert [parse_verify_level(v) for v in (None, "", "0", "1", "2")] == [
        VerifyLevel.LAST, VerifyLevel.LAST, VerifyLevel.OFF, VerifyLevel.LAST, VerifyLevel.EVERY_PASS
    ]
    assert all(type(parse_verify_level(v)) is VerifyLevel for v in ("0", "1", "2"))
    for bad in (" 1", "yes", "3"):
        with pytest.raises(SettingsError, match="BATCHC_VERIFY must be 0, 1 or 2"):
            parse_verify_level(bad)
    assert PassManager(verify_level=2).verify_level is VerifyLevel.EVERY_PASS
    with pytest.raises(ValueError, match=r"verify_level must be 0, 1 or 2 \(a VerifyLevel\), got True"):
        PassManager(verify_level=True)


def test_typeguard_checks_every_package_with_code_batchc_s_pytest_plugin_included() -> None:
    """batchc's pytest plugin is loaded (by its entry point) before typeguard's import hook, so the
    suite filters typeguard's warning that ``compiler`` was imported already: the modules with code
    that the suite imports later are still instrumented, in all four packages and in the helpers."""
    import typeguard

    import compiler.testing.golden
    from compiler.steps import Pipeline
    from ir.parse import parse
    from passes.lower import lower

    for function in (Pipeline.prefill, compiler.testing.golden.assert_golden, Ledger.register, parse, lower):
        assert "TypeCheckMemo" in function.__code__.co_names, function.__qualname__
    with pytest.raises(typeguard.TypeCheckError):
        compiler.testing.golden.assert_golden(1, Path("unused.txt"))  # type: ignore[arg-type]  # typeguard must refuse it


def test_typeguard_checks_the_public_functions_and_methods_and_leaves_private_helpers_to_mypy() -> None:
    """tests/conftest.py: a public function or method, a dunder method and a function nested in a
    public one are instrumented; a private helper (one leading underscore) is not."""
    import typeguard

    import backend.ledger
    import ir.columns
    from ir.printer import dump

    for function in (backend.ledger.Claim.__init__, Ledger.register, ir.columns.check_int, dump):
        assert "TypeCheckMemo" in function.__code__.co_names, function.__qualname__
    for function in (ir.columns._as_i64, backend.ledger._key):
        assert "TypeCheckMemo" not in function.__code__.co_names, function.__qualname__
    with pytest.raises(typeguard.TypeCheckError):
        ir.columns.check_int(None, 1, 2)  # type: ignore[arg-type]  # typeguard must refuse the int named as a name


def test_typeguard_leaves_out_the_numeric_inner_loop_and_only_it() -> None:
    """pyproject's ``--typeguard-packages-ignore`` names the kernels, the bundled model's layers, its
    config, the state pool (hot, tensor-typed, checked by mypy and by the kernels' own checks) and the
    readback counter (called for every torch call while it counts):
    the suite's import hook leaves those modules unchecked, and checks their neighbours (the
    executor, the ledger, the model hook)."""
    import typeguard

    hooks = [f for f in sys.meta_path if isinstance(f, typeguard.TypeguardFinder)]
    described = [(f.packages, f.ignore_packages) for f in hooks]
    assert hooks, "no typeguard import hook"
    for hook in hooks:
        for module in ("backend.kernels.checks", "backend.kernels.jit.init_ops", "backend.hybrid.model", "backend.hybrid.config",
                       "backend.pool", "backend.readback"):
            assert not hook.should_instrument(module), (module, described)
        for module in ("backend.executor", "backend.ledger", "backend.hybrid.hook", "backend.pooling", "ir.columns", "compiler.engine"):
            assert hook.should_instrument(module), (module, described)


def test_the_suite_caches_compiled_modules_keyed_by_the_instrumentation_policy() -> None:
    """tests/conftest.py: bytecode is written even under ``PYTHONDONTWRITEBYTECODE`` (each worker
    would instrument and compile every module again), and typeguard's cached modules are keyed by the
    policy that chose what to instrument, so a module cached under another policy is never read back."""
    import hashlib
    import inspect

    from typeguard import _importhook

    from tests import conftest

    assert sys.dont_write_bytecode is False
    policy = hashlib.sha256(inspect.getsource(conftest._public_only).encode()).hexdigest()[:8]
    assert _importhook.OPTIMIZATION.endswith(policy) and _importhook.OPTIMIZATION.startswith("typeguard")
    cached = Path(_importhook.optimized_cache_from_source(str(ROOT / "backend" / "ledger.py")))
    assert cached.name.endswith(f"{_importhook.OPTIMIZATION}.pyc") and cached.parent.name == "__pycache__"
