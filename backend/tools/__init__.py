"""Development tools, never imported by the runtime.

``train`` trains the bundled byte-level target and draft models (``python -m backend.tools.train``);
``bench_kernels`` benchmarks the state-pool kernels (``batchc bench kernels``, or
``python -m backend.tools.bench_kernels``). Only the command line (inside the function that runs a
benchmark), these tools and the tests import this package; ``tests/test_layering.py`` enforces it.
"""
