"""svd_quant_decompose and SVDQuantLinear."""

import pytest
import torch

from lowbit.formats import mxfp4
from lowbit.formats import svd_quant as ref
from lowbit.errors import DtypeError, ShapeError
from lowbit.nn.svd_quant import SVDQuantLinear, low_rank_factors, svd_quant_decompose


def sqnr_db(signal: torch.Tensor, approx: torch.Tensor) -> float:
    signal, approx = signal.detach().double(), approx.detach().double()
    return float(10 * torch.log10(signal.pow(2).sum() / (signal - approx).pow(2).sum()))


def lowrank_weight(n=192, k=256, true_rank=8, noise=0.01, seed=0):
    gen = torch.Generator().manual_seed(seed)
    low = torch.randn(n, true_rank, generator=gen) @ torch.randn(true_rank, k, generator=gen)
    return low * 0.2 + noise * torch.randn(n, k, generator=gen)


def test_decompose_shapes_and_reconstruction():
    weight = lowrank_weight()
    w, s, d, u = svd_quant_decompose(weight, rank=32)
    assert w.shape == (192, 128) and w.dtype == torch.uint8
    assert s.shape == (192, 4, 2) and s.dtype == torch.uint8
    assert d.shape == (256, 32) and u.shape == (32, 192) and d.dtype == u.dtype == torch.bfloat16
    assert all(t.is_contiguous() for t in (w, s, d, u))  # the operator would copy the factors on every call
    residual = mxfp4.dequantize(w, ref.weight_scales(s, 256), torch.float64)
    rebuilt = (d.double() @ u.double()).T + residual
    plain = mxfp4.dequantize(*mxfp4.quantize(weight), torch.float64)
    assert sqnr_db(weight, rebuilt) > sqnr_db(weight, plain) + 15  # the low-rank branch carries the signal


def test_linear_matches_dense_layer_better_than_plain_mxfp4():
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 192)
    with torch.no_grad():
        linear.weight.copy_(lowrank_weight())
    module = SVDQuantLinear.from_linear(linear, rank=32)
    x = torch.randn(3, 7, 256)
    out = module(x)
    assert out.shape == (3, 7, 192) and out.dtype == torch.bfloat16
    want = linear(x)
    w, s = mxfp4.dynamic_mx_quant(linear.weight.detach())
    plain = x.to(torch.bfloat16).float() @ mxfp4.dequantize(w, ref.weight_scales(s, 256), torch.float32).T + linear.bias
    assert sqnr_db(want, out) > sqnr_db(want, plain) + 10
    assert module(x[0, 0]).shape == (192,)  # 1-D input


def test_state_dict_round_trip_and_no_bias():
    linear = torch.nn.Linear(64, 32, bias=False)
    module = SVDQuantLinear.from_linear(linear, rank=8, backend="reference")
    clone = SVDQuantLinear(64, 32, rank=8, bias=False, backend="reference")
    clone.load_state_dict(module.state_dict())
    x = torch.randn(5, 64)
    assert torch.equal(clone(x), module(x))
    assert "rank=8" in repr(module)


def test_decompose_errors():
    with pytest.raises(ShapeError, match="multiple of 32"):
        svd_quant_decompose(torch.randn(8, 40), rank=4)
    with pytest.raises(ShapeError, match="K = 0"):
        svd_quant_decompose(torch.randn(8, 0), rank=1)
    with pytest.raises(ShapeError, match="rank"):
        svd_quant_decompose(torch.randn(8, 64), rank=9)
    with pytest.raises(TypeError, match="rank"):
        svd_quant_decompose(torch.randn(8, 64), rank=8.5)
    with pytest.raises(TypeError, match="rank"):
        svd_quant_decompose(torch.randn(8, 64), rank=True)
    with pytest.raises(ShapeError, match="2-D"):
        svd_quant_decompose(torch.randn(64), rank=1)
    with pytest.raises(DtypeError, match="int32"):
        svd_quant_decompose(torch.ones(8, 64, dtype=torch.int32), rank=1)
    with pytest.raises(ShapeError, match="multiple of 32"):
        SVDQuantLinear(40, 8)
    with pytest.raises(TypeError, match="rank"):
        SVDQuantLinear(64, 8, rank=2.0)
    with pytest.raises(ShapeError, match="out_features"):
        SVDQuantLinear(64, 0)


@pytest.mark.parametrize("bad, count", [(float("inf"), 1), (float("nan"), 1), (float("-inf"), 3)])
def test_decompose_refuses_non_finite_weights(capfd, bad, count):
    """Inf used to give NaN factors and NaN a LinAlgError with oneMKL noise on stderr: now one clear error."""
    weight = lowrank_weight(16, 64)
    weight.view(-1)[torch.arange(count) * 7] = bad
    with pytest.raises(ValueError, match=f"holds {count} non-finite"):
        svd_quant_decompose(weight, rank=4)
    assert capfd.readouterr().err == ""


def _truncated_svd(w64, rank):
    """d, u of the rank-``rank`` truncated SVD by LAPACK's full SVD, signs as low_rank_factors sets them."""
    left, singular, right_t = torch.linalg.svd(w64.T, full_matrices=False)
    root = singular[:rank].sqrt()
    d, u = left[:, :rank] * root, root[:, None] * right_t[:rank]
    sign = torch.where(u.gather(1, u.abs().argmax(dim=1, keepdim=True)) < 0, -1.0, 1.0).to(torch.float64)
    return d * sign.T, u * sign


@pytest.mark.parametrize("n, k, rank", [(96, 160, 32), (160, 96, 32), (64, 64, 64), (40, 256, 1), (192, 256, 32)])
def test_low_rank_factors_are_the_truncated_svd(n, k, rank):
    """The Gram-matrix eigendecomposition gives the full SVD's factors to float64 rounding, and the same BF16
    factors; the largest entry of each row of u is positive."""
    gen = torch.Generator().manual_seed(n + k + rank)
    weight = lowrank_weight(n, k, seed=rank) if (n, k) == (192, 256) else torch.randn(n, k, generator=gen) * 0.02
    w64 = weight.to(torch.bfloat16).to(torch.float64)
    d, u = low_rank_factors(w64, rank)
    want_d, want_u = _truncated_svd(w64, rank)
    assert d.shape == (k, rank) and u.shape == (rank, n) and d.dtype == u.dtype == torch.float64
    assert torch.allclose(d, want_d, rtol=0, atol=1e-11) and torch.allclose(u, want_u, rtol=0, atol=1e-11)
    assert torch.equal(d.to(torch.bfloat16), want_d.to(torch.bfloat16))
    assert torch.equal(u.to(torch.bfloat16), want_u.to(torch.bfloat16))
    assert (u.gather(1, u.abs().argmax(dim=1, keepdim=True)) > 0).all()


def test_low_rank_factors_of_a_weight_of_lower_rank_are_zero_beyond_it():
    """Components whose singular value is zero (here rank 2 of 8 asked for, exact in float64; and a zero
    weight) are zero in d and u, never NaN, and the product is the weight."""
    gen = torch.Generator().manual_seed(5)
    w64 = (torch.randint(-3, 4, (48, 2), generator=gen) @ torch.randint(-3, 4, (2, 64), generator=gen)).double()
    d, u = low_rank_factors(w64, 8)
    assert not (d.isnan().any() or u.isnan().any())
    assert d[:, 2:].eq(0).all() and u[2:].eq(0).all()
    assert torch.allclose((d @ u).T, w64, rtol=0, atol=1e-12)
    d, u = low_rank_factors(torch.zeros(32, 64, dtype=torch.float64), 4)
    assert d.eq(0).all() and u.eq(0).all()
    w, s, d16, u16 = svd_quant_decompose(torch.zeros(32, 64), rank=4)
    assert d16.eq(0).all() and u16.eq(0).all() and w.eq(0).all()
