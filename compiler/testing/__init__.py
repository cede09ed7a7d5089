"""batchc's testing helpers, for the tests of an engine author's own passes and scheduler.

Install them with the ``testing`` extra, which brings pytest and hypothesis::

    pip install 'batchc[testing]'

- ``compiler.testing.strategies``: hypothesis strategies of every IR node kind, valid by construction
  (they pass the IR's verifiers and round-trip through its text and wire forms), by kind
  (``extend_batches()``, ``decode_plans()``, ...), in ``NODE_STRATEGIES`` by class name, or
  through ``strategy_for(cls)``; and ``step_sequences()``, valid sequences of scheduler steps.
  Imports no torch.
- ``compiler.testing.runner``: ``run_steps`` runs a step sequence through a ``compiler.steps.Pipeline``
  (executing each plan when given a backend); ``consume_tickets`` drains a ledger without one.
  Imports no torch.
- ``compiler.testing.golden``: ``assert_golden`` / ``assert_golden_ir``, a golden-file assertion
  with an update switch (``BATCHC_UPDATE_GOLDEN=1`` or pytest's ``--batchc-update-golden``).
- ``compiler.testing.fakes``: ``FakeModel`` (a model hook with deterministic logits) and
  ``FakeBackend`` (executors over small pools), so a test can run the plans it lowers. Imports torch.
- ``compiler.testing.models``: ``state_sensitive`` (a hybrid model whose tokens depend on its Mamba
  state, so that a token comparison sees a state bug) and ``greedy_continuation`` (a model's greedy
  tokens, with its state zeroed where a test says). Imports torch.
- ``compiler.testing.pytest_plugin``: the pytest plugin (loaded by the ``pytest11`` entry point of
  an installed batchc): the fixtures ``batchc_ledger``, ``batchc_pipeline``, ``batchc_model_hook``,
  ``batchc_backend``, ``batchc_executor``, the ``batchc`` marker that configures them, and the
  ``--batchc-update-golden`` option.

This package imports none of them (the plugin is imported by every pytest run, before anything
else): import the module you use. The guide is ``docs/guides/testing.md``.
"""

__all__: list[str] = []
