"""HiFloat8 on an Ascend NPU through the vendor's code (unverified until it runs on an NPU).

Prefers an installed ``amct_ops`` (``torch.ops.amct.encode_to_hifloat8`` / ``decode_from_hifloat8``,
the same contract as lowbit's operators), else torch_npu's native HiFloat8 cast
(``torch_npu.npu_dtype_cast`` to ``torch_npu.hifloat8``, codes viewed as uint8). Import failures and a
missing cast raise BackendUnavailable, so ``auto`` falls back to the reference.
"""

from __future__ import annotations

import torch

from lowbit.backends import Kernel
from lowbit.errors import BackendUnavailable


def _amct_ops_loaded() -> bool:
    try:
        import amct_ops  # noqa: F401  (loads the .so that registers torch.ops.amct)
    except (ImportError, OSError):
        return False
    return hasattr(torch.ops.amct, "encode_to_hifloat8")


def _torch_npu():
    try:
        import torch_npu
    except (ImportError, OSError) as exc:
        raise BackendUnavailable(f"torch_npu is not importable: {exc}") from exc
    if not (hasattr(torch_npu, "hifloat8") and hasattr(torch_npu, "npu_dtype_cast")):
        raise BackendUnavailable("torch_npu has no native HiFloat8 cast; install amct_ops")
    return torch_npu


class Encode(Kernel):
    """encode_to_hifloat8 on an NPU with the vendor's cast."""

    def run(self, x: torch.Tensor, *, out: torch.Tensor) -> None:
        if _amct_ops_loaded():
            out.copy_(torch.ops.amct.encode_to_hifloat8(x))
            return
        torch_npu = _torch_npu()
        out.copy_(torch_npu.npu_dtype_cast(x, torch_npu.hifloat8).view(torch.uint8))


class Decode(Kernel):
    """decode_from_hifloat8 on an NPU with the vendor's cast."""

    def run(self, codes: torch.Tensor, dtype: torch.dtype | None, *, out: torch.Tensor) -> None:
        if _amct_ops_loaded():
            out.copy_(torch.ops.amct.decode_from_hifloat8(codes, out.dtype))
            return
        torch_npu = _torch_npu()
        out.copy_(torch_npu.npu_dtype_cast(codes.view(torch_npu.hifloat8), out.dtype))


ENCODE = Encode()
DECODE = Decode()
