"""HiFloat4 fake-quant on an Ascend NPU through AMCT's kernel (unverified until it runs on an NPU).

Calls ``torch.ops.amct.hifloat4_fake_quant(input, qdim)`` from an installed ``amct_ops`` (FP16, BF16 and
FP32 accepted; formats.md 2.6). Two documented differences from the reference are handled or noted:

* the kernel keeps the sign of an input -0.0 (section 2.7 (b)); lowbit returns +0.0 there, so zeros of
  the input are written back as +0.0 (a poisoned block stays NaN);
* the kernel body is only compiled for A2/A3 (``__DAV_C220_VEC__``); built for Ascend 950 it returns
  uninitialised memory (gotcha 7.4). ``auto`` runs a self-check against the reference first, so such a
  build falls back to the reference; ``native`` would return its output.

A missing ``amct_ops`` (or one built without the HiF4 op) raises BackendUnavailable.
"""

from __future__ import annotations

import torch

from lowbit.backends import BackendUnavailable


def _amct_fake_quant():
    try:
        import amct_ops  # noqa: F401  (loads the .so files that register torch.ops.amct)
    except (ImportError, OSError) as exc:
        raise BackendUnavailable(f"amct_ops is not importable: {exc}") from exc
    if not hasattr(torch.ops.amct, "hifloat4_fake_quant"):
        raise BackendUnavailable("amct_ops has no hifloat4_fake_quant operator")
    return torch.ops.amct.hifloat4_fake_quant


def fake_quant_into(x: torch.Tensor, qdim: int, out: torch.Tensor) -> None:
    """HiF4 fake-quant of NPU ``x`` along ``qdim`` into ``out`` (same shape, dtype and device)."""
    result = _amct_fake_quant()(x, qdim)
    out.copy_(result.masked_fill((x == 0) & (result == 0), 0.0))
