"""Import an optional dependency or fail with one clear line naming the extra that provides it."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """``importlib.import_module(module)``; ImportError "<purpose> needs <module>: pip install 'lowbit[<extra>]'"."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{purpose} needs the '{module}' package: pip install 'lowbit[{extra}]' ({exc})") from None
