"""The IR: frozen, typed nodes for scheduler batches and the forward plans lowered from them.

Nothing is offered at the package level; import from the modules:

- nodes: ``ir.batch`` (prefill, decode, mixed and idle batches), ``ir.plan`` (their plans),
  ``ir.spec`` (the speculative phases), ``ir.head`` (a draft head's phases), ``ir.nodes`` (the closed
  unions ``Batch`` and ``Plan``), ``ir.request`` (admitted requests and their init intents),
  ``ir.results`` (what a forward hands back), ``ir.hidden`` (kept hidden states), ``ir.sampling``
  (sampling parameters);
- one-shot ops and ids: ``ir.init`` (init and snapshot ops, tickets, serials), ``ir.ids`` and
  ``ir.mint`` (the id types and their minting), ``ir.linear`` (the linear-use markers);
- checks and forms: ``ir.errors``, ``ir.verify``, ``ir.columns`` (column declarations and int
  checks), ``ir.printer`` and ``ir.parse`` (the text form), ``ir.wire`` (the message form).

The IR imports nothing of batchc and no torch. The mypy plugin ``ir.mypy_linear`` is used by its
configuration name, not imported.
"""

__all__: list[str] = []
