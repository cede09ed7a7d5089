"""Suite-wide settings.

- Every pass manager built from the environment verifies after every pass, and every executor runs
  its in-place mutation detector (``BATCHC_VERIFY=2``), whatever the developer's shell says: a
  ``BATCHC_VERIFY`` of another value is overridden, and the run says so once, in its terminal
  summary (the run does not fail for it).
- Without a GPU, Triton's interpreter is on for the whole session, set before anything imports
  Triton so that Triton's own ``@jit`` library functions are interpreted too. CPU code still takes
  the torch references unless a kernel test asks for Triton (``BATCHC_TRITON_ON_CPU``).
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
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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


@pytest.fixture(autouse=True)
def _torch_threads_restored() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
