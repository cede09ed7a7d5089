"""batchc's pytest plugin (``compiler.testing.pytest_plugin``), run as a user's suite runs it: small
test files in a temporary folder, run by pytester.

- The fixtures give a ledger, a pipeline over it, a fake model, executors over small pools, configured
  by the ``batchc`` marker (known to ``--strict-markers``) or by indirect parametrization; the ledger
  must be drained at teardown unless the test opts out (and a failing test body is not piled on).
- An unknown marker keyword or a bad value fails the test's setup in one line naming it and the test.
- ``--batchc-update-golden`` turns on the golden assertion's update switch; a golden mismatch fails
  with its diff.
- At module level the plugin imports only pytest and the standard library, and the ledger and the
  pipeline load no torch.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

# What the test files below import, imported here first: pytester drops the modules an in-process
# run imported when it ends, and a second copy of an IR module would hold a second class of each node.
import compiler.steps  # noqa: F401
import compiler.testing.fakes  # noqa: F401
import compiler.testing.golden  # noqa: F401
import compiler.testing.pytest_plugin as plugin
import compiler.testing.runner  # noqa: F401
import compiler.testing.strategies  # noqa: F401
import passes.lower  # noqa: F401
import passes.prepare_for_decode  # noqa: F401

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent.parent

HEADER = '''
import pytest
from compiler.testing.pytest_plugin import BatchcConfig
from ir.batch import DecodeBatch
from ir.ids import MambaSlot, RequestId
from ir.request import AdmittedRequest, Clear
from passes.prepare_for_decode import DecodeContext

REQ = [AdmittedRequest(rid=RequestId(1), slot=MambaSlot(1), input_ids=[3, 4], kv_locs=[0, 1], intent=Clear())]
'''

FIXTURES = HEADER + '''

@pytest.mark.batchc(pools=("target", "draft"), capacity=4, vocab=32)
def test_prefill_and_decode_on_two_pools(batchc_pipeline, batchc_backend, batchc_ledger, batchc_config, batchc_model_hook, batchc_executor):
    assert batchc_config == BatchcConfig(pools=("target", "draft"), capacity=4, vocab=32)
    assert batchc_pipeline.ledger is batchc_ledger and batchc_backend.ledger is batchc_ledger
    assert batchc_executor is batchc_backend.target and batchc_executor.pool.capacity == 4
    assert list(batchc_backend.executors) == ["target", "draft"] and batchc_model_hook.vocab == 32
    batch, plan = batchc_pipeline.prefill(REQ)
    assert len(batchc_ledger.outstanding()) == 2  # the clear, once per pool
    sampled = batchc_backend.execute(plan)
    assert sampled.tokens.tolist() == [batchc_model_hook.next_token(4)]
    _, dplan = batchc_pipeline.decode(batchc_pipeline.merge(DecodeBatch.empty(), batch), DecodeContext(next_tokens=[5], kv_locs=[2]))
    assert batchc_backend.execute(dplan).tokens.tolist() == [batchc_model_hook.next_token(5)]


def test_defaults(batchc_config, batchc_backend, batchc_model_hook):
    assert batchc_config == BatchcConfig() and batchc_config.pools == ("target",) and batchc_config.check_drained
    assert list(batchc_backend.executors) == ["target"] and batchc_backend.target.pool.capacity == 8
    assert batchc_model_hook.vocab == 16


@pytest.mark.batchc(check_drained=False)
def test_left_outstanding_on_purpose(batchc_pipeline):
    batchc_pipeline.prefill(REQ)


def test_left_outstanding(batchc_pipeline):
    batchc_pipeline.prefill(REQ)


def test_a_failing_body_is_not_piled_on(batchc_pipeline):
    batchc_pipeline.prefill(REQ)
    assert False, "the body's own failure"


@pytest.mark.parametrize("batchc_config", [{"capacity": 3}, {"pools": ("a", "b"), "vocab": 5}], indirect=True)
def test_indirect(batchc_config, batchc_backend):
    assert batchc_backend.target.pool.capacity == batchc_config.capacity
    assert list(batchc_backend.executors) == list(batchc_config.pools)


@pytest.mark.batchc(capacity=8)
@pytest.mark.parametrize("batchc_config", [{"capacity": 2}], indirect=True)
def test_a_parameter_overrides_the_marker(batchc_config):
    assert batchc_config.capacity == 2


@pytest.mark.batchc(capcity=4)
def test_unknown_keyword(batchc_ledger):
    pass


@pytest.mark.batchc(pools="target")
def test_pools_not_a_tuple(batchc_pipeline):
    pass


@pytest.mark.batchc(pools=("target", 3))
def test_a_pool_not_a_str(batchc_pipeline):
    pass


@pytest.mark.batchc(capacity=0)
def test_capacity_zero(batchc_backend):
    pass


@pytest.mark.batchc(vocab=True)
def test_vocab_bool(batchc_model_hook):
    pass


@pytest.mark.batchc(capacity=2**40)
def test_capacity_past_a_pool(batchc_executor):
    pass


@pytest.mark.batchc(vocab=2**31)
def test_vocab_past_a_model(batchc_model_hook):
    pass


@pytest.mark.batchc(check_drained="no")
def test_check_drained_a_str(batchc_ledger):
    pass


@pytest.mark.batchc("target")
def test_positional(batchc_ledger):
    pass


@pytest.mark.parametrize("batchc_config", [None], indirect=True)
def test_a_none_parameter(batchc_config):
    pass
'''


def _run(pytester: pytest.Pytester, config: pytest.Config, *args: str, subprocess: bool = False) -> pytest.RunResult:
    """Run pytest on pytester's folder with batchc's plugin: autoloaded by its entry point, as in
    this session, or named (where this session did not autoload it)."""
    named = [] if config.pluginmanager.has_plugin("batchc") else ["-p", "compiler.testing.pytest_plugin"]
    run = pytester.runpytest_subprocess if subprocess else pytester.runpytest_inprocess
    return run("-p", "no:cacheprovider", "--strict-markers", *named, *args)


def test_the_fixtures_the_marker_and_its_refusals(pytester: pytest.Pytester, pytestconfig: pytest.Config) -> None:
    pytester.makepyfile(test_fixtures=FIXTURES)
    result = _run(pytester, pytestconfig, "-rA")
    result.assert_outcomes(passed=7, failed=1, errors=11)  # (test_left_outstanding passes, then errors at teardown)
    where = "test_fixtures.py::"
    result.stdout.fnmatch_lines([
        f"*@pytest.mark.batchc of {where}test_unknown_keyword: unknown keyword 'capcity' (known: pools, capacity, vocab, check_drained)",
        f"*@pytest.mark.batchc of {where}test_pools_not_a_tuple: pools must be a non-empty tuple of pool names, got 'target'",
        f"*@pytest.mark.batchc of {where}test_a_pool_not_a_str: pools must hold non-empty str pool names, got 3 in ('target', 3)",
        f"*@pytest.mark.batchc of {where}test_capacity_zero: capacity must be an int in [[]1, 1048576], got 0",
        f"*@pytest.mark.batchc of {where}test_vocab_bool: vocab must be an int in [[]2, 262144], got True",
        f"*@pytest.mark.batchc of {where}test_capacity_past_a_pool: capacity must be an int in [[]1, 1048576], got 1099511627776",
        f"*@pytest.mark.batchc of {where}test_vocab_past_a_model: vocab must be an int in [[]2, 262144], got 2147483648",
        f"*@pytest.mark.batchc of {where}test_check_drained_a_str: check_drained must be True or False, got 'no'",
        f"*@pytest.mark.batchc of {where}test_positional: takes keywords only, got positional ('target',)",
        f"*@pytest.mark.batchc of {where}test_a_none_parameter[[]None]: an indirect parameter of batchc_config must be a dict of its keywords, got None",
    ], consecutive=False)
    result.stdout.re_match_lines([
        re.escape(f"batchc_ledger of {where}test_left_outstanding is not drained at teardown: 1 ticket(s) never consumed: ticket #")
        + r"\d+" + re.escape(" for pool 'target' (ops clear [1], cow []) (@pytest.mark.batchc(check_drained=False) allows it)") + "$",
    ])
    result.stdout.no_fnmatch_line("*During handling of the above exception*")
    result.stdout.fnmatch_lines(["ERROR test_fixtures.py::test_left_outstanding - Failed: batchc_ledger of *"])
    result.stdout.no_fnmatch_line("*test_a_failing_body_is_not_piled_on is not drained*")
    result.stdout.no_fnmatch_line("*test_left_outstanding_on_purpose is not drained*")
    result.stdout.fnmatch_lines(["E *AssertionError: the body's own failure", "FAILED test_fixtures.py::test_a_failing_body_is_not_piled_on - AssertionError*"])


def test_the_marker_and_the_option_are_registered(pytester: pytest.Pytester, pytestconfig: pytest.Config) -> None:
    markers = _run(pytester, pytestconfig, "--markers")
    markers.stdout.fnmatch_lines(["@pytest.mark.batchc(pools=('target',), capacity=8, vocab=16, check_drained=True): configure batchc's fixtures*"])
    helped = _run(pytester, pytestconfig, "--help")
    helped.stdout.fnmatch_lines(["*--batchc-update-golden*"])


GOLDEN_TEST = '''
from pathlib import Path
from compiler.testing.golden import assert_golden

def test_golden():
    assert_golden("line 1\\nline two\\n", Path(__file__).parent / "golden" / "out.txt")
'''


def test_a_golden_mismatch_fails_with_its_diff_and_the_option_updates_it(pytester: pytest.Pytester, pytestconfig: pytest.Config) -> None:
    pytester.makepyfile(test_golden_file=GOLDEN_TEST)
    golden = pytester.path / "golden" / "out.txt"
    golden.parent.mkdir()
    golden.write_text("line 1\nline 2\n")
    failed = _run(pytester, pytestconfig)
    failed.assert_outcomes(failed=1)
    failed.stdout.fnmatch_lines([
        f"*{golden}: the output differs from the golden file (1 line(s)); to accept the new output, rerun with "
        "--batchc-update-golden (or BATCHC_UPDATE_GOLDEN=1) and review the diff",
        "*-line 2", "*+line two",
    ])
    failed.stdout.no_fnmatch_line("*compiler/testing/golden.py*")  # the test's own line and the message, not the helper's frames
    assert golden.read_text() == "line 1\nline 2\n"
    assert not plugin.update_golden_option()  # (the run inside this one does not leak its switch)
    _run(pytester, pytestconfig, "--batchc-update-golden").assert_outcomes(passed=1)
    assert golden.read_text() == "line 1\nline two\n"
    assert not plugin.update_golden_option()
    _run(pytester, pytestconfig).assert_outcomes(passed=1)
    golden.unlink()
    missing = _run(pytester, pytestconfig)
    missing.assert_outcomes(failed=1)
    missing.stdout.fnmatch_lines([f"*golden file {golden} is missing: run with --batchc-update-golden (or BATCHC_UPDATE_GOLDEN=1) to write it"])
    missing.stdout.no_fnmatch_line("*compiler/testing/golden.py*")


@pytest.mark.parametrize("value", ["yes", "true", " 1", "2"])
def test_a_bad_update_switch_in_the_environment_stops_the_session_once(pytester: pytest.Pytester, pytestconfig: pytest.Config,
                                                                      monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    pytester.makepyfile(test_golden_file=GOLDEN_TEST, test_other="def test_a(): pass\ndef test_b(): pass\n")
    monkeypatch.setenv("BATCHC_UPDATE_GOLDEN", value)
    result = _run(pytester, pytestconfig)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert [line for line in result.stderr.lines if line.strip()] == [f"ERROR: BATCHC_UPDATE_GOLDEN must be 0 or 1 (or unset), got {value!r}"]
    assert not (pytester.path / "golden").exists()
    monkeypatch.setenv("BATCHC_UPDATE_GOLDEN", "0")
    _run(pytester, pytestconfig).assert_outcomes(passed=2, failed=1)  # (0: compare; the golden is missing)


NO_TORCH = HEADER + '''
import sys
from compiler.testing.runner import consume_tickets


def test_the_ledger_and_the_pipeline_load_no_torch(batchc_pipeline, batchc_ledger):
    _, plan = batchc_pipeline.prefill(REQ)
    assert consume_tickets(batchc_ledger, [plan]) == 1
    assert "torch" not in sys.modules
'''


def test_the_ledger_and_pipeline_fixtures_load_no_torch(pytester: pytest.Pytester, pytestconfig: pytest.Config) -> None:
    pytester.makepyfile(test_no_torch=NO_TORCH)
    _run(pytester, pytestconfig, subprocess=True).assert_outcomes(passed=1)


def test_the_plugin_imports_only_pytest_and_the_standard_library_at_module_level() -> None:
    tree = ast.parse(Path(plugin.__file__).read_text())
    top: set[str] = set()
    for node in tree.body:  # module level (an ``if TYPE_CHECKING:`` block runs for mypy only)
        if isinstance(node, ast.Import):
            top.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.module is not None and node.level == 0
            top.add(node.module.split(".")[0])
        elif isinstance(node, ast.If):
            assert isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING", ast.unparse(node.test)
    assert top - {"pytest"} <= sys.stdlib_module_names | {"__future__"}, top
    code = (
        "import sys, compiler.testing.pytest_plugin; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ir', 'passes', 'backend', 'compiler', 'torch', 'hypothesis', 'numpy')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['compiler', 'compiler.testing', 'compiler.testing.pytest_plugin']"


def test_the_entry_point_names_the_plugin() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["pytest11"] == {"batchc": "compiler.testing.pytest_plugin"}
    assert set(project["project"]["optional-dependencies"]["testing"]) >= {"pytest>=8", "hypothesis>=6.100"}
