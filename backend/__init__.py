"""The backend: what runs the plans the compiler lowers, on the state they describe.

Pools and allocators (``backend.pool``, ``backend.allocator``), the ledger of one-shot tickets
(``backend.ledger``), the executor that consumes plans on the pool it owns (``backend.executor``)
and the model hook it calls (``backend.model``), the boundary an engine talks to and the
transports behind it (``backend.boundary``, ``backend.transports``: in process, executor processes,
tensor parallelism), the sampler (``backend.sampling``, ``backend.plan_sampling``), the Triton
kernels and their torch references (``backend.kernels``, ``backend.reference``), the hybrid model
and its checkpoints (``backend.hybrid``, ``backend.hf``) and tensor parallelism (``backend.tp``).

The package itself re-exports nothing: import each name from its module. ``backend`` imports
``ir`` and never ``passes`` or ``compiler``.
"""

__all__: list[str] = []
