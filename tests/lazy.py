"""A module imported on first use: ``openai = lazy("openai")`` at a test module's top costs nothing
until a test touches ``openai.…``. Every xdist worker imports every test module to collect it, and a
client library such as ``openai`` takes about a second to import; the worker that runs the tests
pays it once, the others never (the standard library's ``importlib.util.LazyLoader`` recipe)."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType


def lazy(name: str) -> ModuleType:
    """``name``, imported when one of its attributes is first read (at once if it already is)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    return module
