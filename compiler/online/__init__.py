"""``batchc serve``: the online, OpenAI-compatible server (the offline runner, ``batchc run``, is
``compiler.offline``). The HTTP process (``server``: Starlette on uvicorn; ``protocol``, ``chat``,
``text``, ``metrics``) never runs a forward; the engine runs in its own process
(``engine_process``), reached through ``engine_client`` with the typed messages of ``messages``."""

__all__: list[str] = []
