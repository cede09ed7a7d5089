"""Composition: the typed steps over the passes (``compiler.steps``), the pass manager
(``compiler.manager``), the prefix cache (``compiler.prefix_cache``), the serving engine
(``compiler.engine``), ``batchc run`` (``compiler.offline``), ``batchc serve``
(``compiler.online``), the workloads' limits and records (``compiler.workload``), and the command
line (``compiler.cli``).

The package itself re-exports nothing: import each name from its module."""

__all__: list[str] = []
