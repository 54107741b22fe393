"""Find the per-operator modules of a CLI package (smoke checks, benchmarks) without a hand-kept list."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def operator_modules(package: str, path: list[str]) -> dict[str, ModuleType]:
    """Modules of ``package`` (whose ``__path__`` is ``path``) not starting with '_', keyed by their NAME."""
    found = {}
    for info in pkgutil.iter_modules(path):
        if not info.name.startswith("_"):
            module = importlib.import_module(f"{package}.{info.name}")
            found[module.NAME] = module
    return dict(sorted(found.items()))
