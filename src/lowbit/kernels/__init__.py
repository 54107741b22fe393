"""Fast kernels, one sub-package per device type: cpu (numba), triton (CUDA), npu (vendor adapters).

The kernels of the operators in ``lowbit/ops/<family>.py`` for a device type live in
``lowbit/kernels/<package>/<family>.py``, as module-level :class:`lowbit.backends.Kernel` objects named like
the operator objects in the ops module (``ENCODE``, ``DECODE``, ...). :func:`native` is how an operator
declares them without importing numba, triton or torch_npu before a kernel is used.
"""

from __future__ import annotations

import importlib
from typing import Callable

# Device type -> the sub-package holding its kernels.
PACKAGES = {"cpu": "cpu", "cuda": "triton", "npu": "npu"}


def native(family: str, kernel: str, device_types: tuple[str, ...]) -> dict[str, Callable]:
    """``{device type: loader}`` for an Operator's ``native``: each loader imports
    ``lowbit.kernels.<package>.<family>`` on first use and returns its attribute ``kernel``."""

    def loader(device_type: str) -> Callable:
        def load():
            module = importlib.import_module(f"lowbit.kernels.{PACKAGES[device_type]}.{family}")
            return getattr(module, kernel)
        return load

    return {device_type: loader(device_type) for device_type in device_types}
