"""Hypothesis settings profiles of the whole-stack fuzzer (``tests/test_fuzz_stack.py``).

- ``batchc-fuzz-ci``: what the fuzzer runs with by default (CI): 3 examples x 30 steps, about 50 s on
  two cores under the suite's run-time type checks (the suite's six-minute budget; the soak run is ``long``).
- ``long``: the soak run, at least 10,000 state-machine steps in total (450 examples x up to 30 steps;
  hypothesis ends some runs early, so the margin keeps the executed total above 10,000).

Registering a profile does not load it: the rest of the suite keeps its own settings. The fuzzer
picks ``long`` when it is the active profile or when ``BATCHC_FUZZ_PROFILE=long`` is set.

``pytest --hypothesis-profile=long`` loads the profile while pytest configures itself, before any
test module is imported, so the profile must be registered by then: either load this module as a
plugin, ``pytest -p tests.hypothesis_profiles --hypothesis-profile=long tests/test_fuzz_stack.py``,
or (no plugin needed) ``BATCHC_FUZZ_PROFILE=long pytest tests/test_fuzz_stack.py``. Importing this
module from ``tests/conftest.py`` would make the bare ``--hypothesis-profile=long`` work too.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

FUZZ_CI = "batchc-fuzz-ci"
FUZZ_LONG = "long"

# the machine builds real models and drivers: a slow example is expected, not a bug
_COMMON = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    print_blob=True,
)

settings.register_profile(FUZZ_CI, _COMMON, max_examples=3, stateful_step_count=30)
settings.register_profile(FUZZ_LONG, _COMMON, max_examples=450, stateful_step_count=30)
