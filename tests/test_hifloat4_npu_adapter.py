"""The NPU adapter's logic, run on CPU tensors against a stand-in for AMCT's operator (the real kernel
needs an Ascend NPU and is not verified here)."""

import sys
import types

import pytest
import torch

from lowbit.errors import BackendUnavailable
from lowbit.formats import hifloat4
from lowbit.kernels.npu import hifloat4 as npu


def _kernel_like_amct(input: torch.Tensor, qdim: int = -1) -> torch.Tensor:
    """AMCT's kernel (docs/hifloat4.md, section 'Upstream paths'): the reference, except that an input
    -0.0 keeps its sign."""
    out = hifloat4.fake_quant(input, qdim)
    return torch.where((input == 0) & input.signbit() & (out == 0), -0.0, out).to(input.dtype)


@pytest.fixture
def fake_amct(monkeypatch):
    if not hasattr(torch.ops.amct, "hifloat4_fake_quant"):
        torch.library.custom_op("amct::hifloat4_fake_quant", _kernel_like_amct, mutates_args=())
    monkeypatch.setitem(sys.modules, "amct_ops", types.ModuleType("amct_ops"))


def test_adapter_matches_the_reference_including_negative_zero(fake_amct):
    x = torch.randn(4, 128).to(torch.bfloat16)
    x[0, :5] = -0.0
    x[1, 3] = float("nan")
    x[2, 7] = -1e-9  # rounds to -0.0 in the reference too
    kernel = _kernel_like_amct(x)
    assert not torch.equal(kernel.view(torch.int16), hifloat4.fake_quant(x).view(torch.int16))
    out = torch.empty_like(x)
    npu.FAKE_QUANT.run(x, -1, out=out)
    assert torch.equal(out.view(torch.int16), hifloat4.fake_quant(x).view(torch.int16))


def test_adapter_without_amct_ops_is_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "amct_ops", None)  # import amct_ops raises ImportError
    with pytest.raises(BackendUnavailable, match="amct_ops"):
        npu.FAKE_QUANT.run(torch.ones(64), -1, out=torch.empty(64))
