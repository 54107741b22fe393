"""The svd_quant NPU adapter's logic, run on CPU tensors against a stand-in for AMCT's operator (the real
kernel needs an Ascend 950 and is not verified here)."""

import sys
import types

import pytest
import torch

from lowbit.backends import BackendUnavailable
from lowbit.formats import svd_quant as ref
from lowbit.kernels.npu import svd_quant as npu
from lowbit.ops.svd_quant import probe_inputs

CALLS = []


def _kernel_like_amct(
    activation: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor, down: torch.Tensor, up: torch.Tensor
) -> torch.Tensor:
    """The documented math, for K % 64 == 0 only (where the Ascend kernel's scale indexing is sound)."""
    CALLS.append(tuple(activation.shape))
    assert activation.shape[-1] % 64 == 0, "the adapter must not send K % 64 == 32 to the kernel"
    return ref.svd_quant(activation, weights, scales, down, up)


@pytest.fixture
def fake_amct(monkeypatch):
    if not hasattr(torch.ops.amct, "svd_quant"):
        torch.library.custom_op("amct::svd_quant", _kernel_like_amct, mutates_args=())
    monkeypatch.setitem(sys.modules, "amct_ops", types.ModuleType("amct_ops"))
    monkeypatch.setitem(sys.modules, "amct_ops.svd_quant", types.ModuleType("amct_ops.svd_quant"))
    CALLS.clear()


@pytest.mark.parametrize("k", [128, 96, 160])
def test_adapter_pads_odd_multiples_of_32(fake_amct, k):
    x, w, s, d, u = probe_inputs(7, 40, k, 32)
    s[:, -1, 1] = 0xFF if k % 64 else s[:, -1, 1]  # a NaN in the unused pad slot must not leak
    out = torch.empty(7, 40, dtype=torch.bfloat16)
    npu.SVD_QUANT.run(x, w, s, d, u, out=out)
    assert CALLS == [(7, k + k % 64)]
    assert torch.equal(out, ref.svd_quant(x, w, s, d, u))


def test_adapter_without_amct_ops_is_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "amct_ops", None)  # import amct_ops raises ImportError
    with pytest.raises(BackendUnavailable, match="amct_ops"):
        npu.SVD_QUANT.run(*probe_inputs(1, 8, 64, 32), out=torch.empty(1, 8, dtype=torch.bfloat16))
