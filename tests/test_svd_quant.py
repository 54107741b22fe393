"""svd_quant: the upstream golden procedure (scaled down), backends, contracts, errors, op hygiene."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import lowbit.ops.svd_quant as op
from lowbit import backends
from lowbit.errors import DeviceError, DtypeError, ShapeError
from lowbit.formats import mxfp4
from lowbit.formats import svd_quant as ref
from lowbit.kernels.cpu import svd_quant as cpu_backend
from lowbit.ops.svd_quant import SVD_QUANT
from mxfp4_oracle import fbgemm_fake_quant

triton_backend = pytest.importorskip("lowbit.kernels.triton.svd_quant", reason="triton is not installed")

NK = [(64, 64), (96, 128), (128, 96), (40, 256)]  # includes non-square and K % 64 == 32


def upstream_data(b, s_len, n, k, r):
    """As the upstream test: np.random.seed(0), U(-10, 10), cast to BF16 (docs/svd_quant.md, section 'Tests')."""
    np.random.seed(0)

    def uniform(*shape):
        return torch.from_numpy(np.random.uniform(-10, 10, shape).astype(np.float32)).to(torch.bfloat16)

    return uniform(b, s_len, k), uniform(n, k), uniform(k, r), uniform(r, n)


def golden(x, weight, d, u):
    """Upstream golden in BF16: Linear(x; d^T) -> Linear(.; u^T), plus Linear(x_deq; w_deq), added in BF16."""
    low = F.linear(F.linear(x, d.T), u.T)
    x_deq = fbgemm_fake_quant(x).to(torch.bfloat16)
    w_deq = fbgemm_fake_quant(weight).to(torch.bfloat16)
    return low + F.linear(x_deq, w_deq)


@pytest.mark.parametrize("backend", ["reference", "native"])
@pytest.mark.parametrize("b", [1, 4])
@pytest.mark.parametrize("s_len", [1, 32, 257])
@pytest.mark.parametrize("r", [32, 64, 128])
@pytest.mark.parametrize("n, k", NK)
def test_upstream_golden(backend, b, s_len, r, n, k):
    x, weight, d, u = upstream_data(b, s_len, n, k, r)
    w, s = mxfp4.dynamic_mx_quant(weight, block_size=32, round_mode="round")
    out = op.svd_quant(x, w, s, d, u, backend=backend)
    assert out.shape == (b, s_len, n) and out.dtype == torch.bfloat16
    assert backends.last_backend(SVD_QUANT.name) == backend
    assert torch.allclose(out.float(), golden(x, weight, d, u).float(), atol=1e-2, rtol=1e-2)  # upstream criterion


def test_golden_fake_quant_matches_library_quantizer():
    """The FBGEMM-procedure fake quant of the golden equals dequantize(quantize(.)) (floor, TA)."""
    x, weight, _, _ = upstream_data(2, 33, 64, 128, 32)
    for t in (x, weight):
        codes, scales = mxfp4.quantize(t, 32, "floor", "ta")
        assert torch.equal(fbgemm_fake_quant(t), mxfp4.dequantize(codes, scales, torch.float32))


@pytest.mark.parametrize("m, n, k, r", [(1, 40, 96, 32), (33, 64, 128, 64), (5, 96, 64, 128)])
def test_triton_interpreter_matches_reference(m, n, k, r):
    x, w, s, d, u = op.probe_inputs(m, n, k, r)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    triton_backend.SVD_QUANT.run(x, w, s, d, u, out=out)
    want = ref.svd_quant(x, w, s, d, u)
    assert torch.allclose(out.float(), want.float(), atol=1e-2, rtol=1e-2)
    assert (out == want).float().mean() > 0.95  # same roundings; only P's FP32 summation order differs


def test_backends_quantize_the_activation_identically():
    """The CPU backend's activation quantizer is the numba kernel; it is bit-exact with the reference."""
    from lowbit.kernels.cpu import mxfp4 as cpu_mxfp4
    from lowbit.kernels.triton import mxfp4 as triton_mxfp4

    x, *_ = op.probe_inputs(65, 8, 256, 32)
    want = ref.quantize_activation(x)
    for kernels in (cpu_mxfp4, triton_mxfp4):
        got = (torch.empty_like(want[0]), torch.empty_like(want[1]))
        kernels.QUANTIZE.run(x, ref.BLOCK, "floor", "ta", -1, out=got)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_cpu_backend_is_the_documented_math():
    """CPU backend = bf16(L + bf16(P)) with L = (x @ d) @ u in BF16 and P exact: equal up to the one
    rounding of P (its FP32 accumulation may land on the other side of a BF16 rounding boundary)."""
    x, w, s, d, u = op.probe_inputs(17, 96, 128, 32)
    out = torch.empty(17, 96, dtype=torch.bfloat16)
    cpu_backend.SVD_QUANT.run(x, w, s, d, u, out=out)
    out = out.double()
    x_deq = mxfp4.dequantize(*ref.quantize_activation(x), torch.float64)
    w_deq = mxfp4.dequantize(w, ref.weight_scales(s, 128), torch.float64)
    product = x_deq @ w_deq.T  # exact: few significant bits per term
    want = (((x @ d) @ u).double() + product.to(torch.bfloat16).double()).to(torch.bfloat16).double()
    assert ((out - want).abs() <= 2.0**-8 * (product.abs() + want.abs())).all()
    assert (out == want).float().mean() > 0.95


def test_decode_equals_rows_of_prefill():
    x, w, s, d, u = op.probe_inputs(6, 64, 128, 32)
    full = op.svd_quant(x.reshape(2, 3, 128), w, s, d, u)
    for i in range(2):
        for j in range(3):
            row = op.svd_quant(x.reshape(2, 3, 128)[i, j : j + 1].unsqueeze(0), w, s, d, u)
            assert torch.equal(row[0, 0], full[i, j])


def test_nonfinite_activation_block_gives_nan_rows():
    x, w, s, d, u = op.probe_inputs(3, 64, 64, 32)
    x[1, 5] = float("inf")
    out = op.svd_quant(x, w, s, d, u)
    assert out[1].isnan().all() and out[[0, 2]].isfinite().all()


def test_fp4_and_e8m0_views_are_accepted():
    x, w, s, d, u = op.probe_inputs(4, 64, 64, 32)
    out = op.svd_quant(x, mxfp4.as_torch_fp4(w), mxfp4.as_torch_e8m0(s), d, u)
    assert torch.equal(out, op.svd_quant(x, w, s, d, u))


def test_empty_batch_and_out_argument():
    _, w, s, d, u = op.probe_inputs(1, 64, 64, 32)
    assert op.svd_quant(torch.zeros(0, 3, 64, dtype=torch.bfloat16), w, s, d, u).shape == (0, 3, 64)
    x = op.probe_inputs(4, 64, 64, 32)[0]
    out = torch.empty(4, 64, dtype=torch.bfloat16)
    assert op.svd_quant(x, w, s, d, u, out=out) is out
    assert torch.equal(out, op.svd_quant(x, w, s, d, u))
    with pytest.raises(ShapeError, match=r"\(4, 64\)"):
        op.svd_quant(x, w, s, d, u, out=torch.empty(4, 63, dtype=torch.bfloat16))
    with pytest.raises(DtypeError, match="float32"):
        op.svd_quant(x, w, s, d, u, out=torch.empty(4, 64))


def test_upstream_errors():
    x, w, s, d, u = op.probe_inputs(4, 64, 128, 32)
    with pytest.raises(DtypeError, match="Data Type is wrong.*float16"):
        op.svd_quant(x.half(), w, s, d, u)
    with pytest.raises(RuntimeError, match="Data Type is wrong.*int8"):
        op.svd_quant(x, w.view(torch.int8), s, d, u)
    with pytest.raises(TypeError, match="Data Type is wrong.*float32"):
        op.svd_quant(x, w, s, d.float(), u)
    with pytest.raises(ShapeError, match="invalid input shapes"):
        op.svd_quant(x[0], w, s, d, u)
    with pytest.raises(RuntimeError, match="invalid input shapes"):
        op.svd_quant(x, w, s.reshape(64, 4), d, u)
    x48 = torch.zeros(4, 48, dtype=torch.bfloat16)
    with pytest.raises(ShapeError, match="K dimension should be a multiple of 32.*got K=48"):
        op.svd_quant(x48, w[:, :24], s[:, :1], d[:48], u)
    with pytest.raises(ShapeError, match="K dimension should be a multiple of 32.*got K=0"):  # fake == real
        op.svd_quant(torch.zeros(4, 0, dtype=torch.bfloat16), w[:, :0], s[:, :0], d[:0], u)
    with pytest.raises(ShapeError, match="Input shapes are incompatible"):
        op.svd_quant(x, w[:32], s, d, u)
    with pytest.raises(ValueError, match="Input shapes are incompatible"):
        op.svd_quant(x, w, s, d, u[:16])
    with pytest.raises(ShapeError, match="Input shapes are incompatible"):
        op.svd_quant(x, w, s[:, :1], d, u)
    with pytest.raises(DeviceError, match="meta"):
        op.svd_quant(x, w, s, d.to("meta"), u)


def test_auto_self_check_passes_on_cpu():
    cpu = torch.device("cpu")
    assert SVD_QUANT.auto_check_error(cpu) is None
    assert SVD_QUANT.resolve(cpu, "auto") == "native"


def test_opcheck_meta_and_compile():
    x, w, s, d, u = op.probe_inputs(6, 64, 96, 32)
    x3 = x.reshape(2, 3, 96)
    for backend in ("reference", "native"):
        torch.library.opcheck(torch.ops.lowbit.svd_quant.default, (x3, w, s, d, u, backend))
        out = torch.empty(2, 3, 64, dtype=torch.bfloat16)
        torch.library.opcheck(torch.ops.lowbit.svd_quant_out.default, (x3, w, s, d, u, out, backend))
    meta = op.svd_quant(*(t.to("meta") for t in (x3, w, s, d, u)))
    assert meta.shape == (2, 3, 64) and meta.dtype == torch.bfloat16
    compiled = torch.compile(op.svd_quant, fullgraph=True)
    assert torch.equal(compiled(x3, w, s, d, u), op.svd_quant(x3, w, s, d, u))


def test_non_contiguous_inputs():
    x, w, s, d, u = op.probe_inputs(6, 64, 128, 32)
    want = op.svd_quant(x, w, s, d, u)
    x_strided = torch.stack([x, x], dim=-1)[..., 0]
    d_strided = d.T.contiguous().T
    u_strided = u.T.contiguous().T
    assert not (x_strided.is_contiguous() or d_strided.is_contiguous() or u_strided.is_contiguous())
    assert torch.equal(op.svd_quant(x_strided, w, s, d_strided, u_strided), want)


def test_agreement_is_the_upstream_tolerance():
    """Backends agree within rtol = atol = 1e-2 (not bit for bit), NaN only where the reference has NaN."""
    want = torch.tensor([1000.0, 1.0, float("nan")], dtype=torch.bfloat16)
    assert op.RTOL == op.ATOL == 1e-2 and SVD_QUANT.agrees is op.agrees
    assert op.agrees(torch.tensor([1008.0, 1.0, float("nan")], dtype=torch.bfloat16), want)
    assert not op.agrees(torch.tensor([1024.0, 1.0, float("nan")], dtype=torch.bfloat16), want)
    assert not op.agrees(torch.tensor([1000.0, 1.0, 0.0], dtype=torch.bfloat16), want)
    assert not op.agrees(want.float(), want)


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_out_written_directly_or_over_an_input(backend):
    """A contiguous out= is written by the kernel; one over the activation's memory gives the same result."""
    x, w, s, d, u = op.probe_inputs(4, 64, 64, 32)
    want = op.svd_quant(x, w, s, d, u, backend=backend)
    x_in_place = x.clone()
    assert op.svd_quant(x_in_place, w, s, d, u, out=x_in_place, backend=backend) is x_in_place
    assert torch.equal(x_in_place, want)
    strided = torch.empty(64, 4, dtype=torch.bfloat16).T
    op.svd_quant(x, w, s, d, u, out=strided, backend=backend)
    assert torch.equal(strided, want)


def test_zero_k_is_refused_everywhere():
    _, w, s, d, u = op.probe_inputs(1, 64, 64, 32)
    x0, w0, s0, d0 = torch.zeros(4, 0, dtype=torch.bfloat16), w[:, :0], s[:, :0], d[:0]
    for backend in ("native", "reference"):
        with pytest.raises(ShapeError, match="got K=0"):
            op.svd_quant(x0, w0, s0, d0, u, backend=backend)
    with pytest.raises(ShapeError, match="got K=0"):
        op.svd_quant(x0.to("meta"), w0.to("meta"), s0.to("meta"), d0.to("meta"), u.to("meta"))
    with pytest.raises(ShapeError, match="got K=0"):
        op.svd_quant(x0, w0, s0, d0, u, out=torch.empty(4, 64, dtype=torch.bfloat16))
