"""Fast kernels, one sub-package per device type: cpu (numba), triton (CUDA), npu (vendor adapters).

The kernels of the operators in ``lowbit/ops/<family>.py`` for a device type live in
``lowbit/kernels/<package>/<family>.py``, as module-level :class:`lowbit.backends.Kernel` objects named like
the operator objects in the ops module (``ENCODE``, ``DECODE``, ...). :func:`native` is how an operator
declares them without importing numba, triton or torch_npu before a kernel is used.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

# Device type -> the sub-package holding its kernels.
PACKAGES = {"cpu": "cpu", "cuda": "triton", "npu": "npu"}


@dataclass(frozen=True)
class NativeLoader:
    """Imports ``module`` on first call and returns its attribute ``kernel`` (a Kernel)."""

    module: str  # e.g. "lowbit.kernels.cpu.hifloat8"
    kernel: str  # e.g. "ENCODE"

    def __call__(self):
        return getattr(importlib.import_module(self.module), self.kernel)


def native(family: str, kernel: str, device_types: tuple[str, ...]) -> dict[str, NativeLoader]:
    """``{device type: loader}`` for an Operator's ``native``: each loader imports
    ``lowbit.kernels.<package>.<family>`` on first use and returns its attribute ``kernel``."""
    return {device_type: NativeLoader(f"lowbit.kernels.{PACKAGES[device_type]}.{family}", kernel)
            for device_type in device_types}
