"""HiFloat4 fake-quant on an Ascend NPU through AMCT's kernel (unverified until it runs on an NPU).

Calls ``torch.ops.amct.hifloat4_fake_quant(input, qdim)`` from an installed ``amct_ops`` (FP16, BF16 and
FP32 accepted). Two differences from the reference (docs/hifloat4.md, section 'Upstream paths') are
handled or noted:

* the kernel keeps the sign of an input -0.0; lowbit returns +0.0 there, so zeros of the input are written
  back as +0.0 (a poisoned block stays NaN);
* the kernel body is only compiled for A2/A3; built for Ascend 950 it returns uninitialised memory.
  ``auto`` runs a self-check against the reference first, so such a build falls back to the reference;
  ``native`` would return its output.

A missing ``amct_ops`` (or one built without the HiF4 op) raises BackendUnavailable.
"""

from __future__ import annotations

import torch

from lowbit.backends import Kernel
from lowbit.kernels.npu import amct_operator


class FakeQuant(Kernel):
    """hifloat4_fake_quant on an NPU: ``x`` along ``qdim`` into ``out`` (same shape, dtype and device)."""

    def run(self, x: torch.Tensor, qdim: int, *, out: torch.Tensor) -> None:
        result = amct_operator("amct_ops", "hifloat4_fake_quant")(x, qdim)
        out.copy_(result.masked_fill((x == 0) & (result == 0), 0.0))


FAKE_QUANT = FakeQuant()
