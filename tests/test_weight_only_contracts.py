"""Weight-only linear operators: the prepared call of a fixed weight, the contract, and typed errors for
bad arguments."""

import pytest
import torch

import lowbit
from lowbit.errors import DeviceError, DtypeError, ShapeError
from lowbit.formats import weight_only as reference
from lowbit.kernels.cpu import weight_only as cpu
from lowbit.ops import weight_only as ops
from lowbit.ops import library
from lowbit.ops.library import PreparedCall

from weight_only_cases import OPS, WEIGHTS, assert_bits, gen, hif4_weight, hif8_weight, mxfp4_weight


# --- the prepared call of a fixed weight ----------------------------------------------------------------------

@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", WEIGHTS)
def test_prepared_call_equals_the_operator(fmt, threads, monkeypatch):
    """PreparedCall(op, (*weight, bias))(x) is op(x, *weight, bias), bit for bit, on every path (GEMV: its one
    numba call against the operator's three, on the calling thread and on two; batched, GEMM), both x dtypes
    and every bias kind, with the kernel's operands made once per x dtype."""
    monkeypatch.setattr(cpu, "GEMV_ONE_THREAD_WEIGHTS", 0)  # a small weight on numba's threads where threads = 2
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_prepared_call_equals_the_operator(fmt)
    finally:
        torch.set_num_threads(previous)


def _check_prepared_call_equals_the_operator(fmt):
    g = gen(11)
    weight = WEIGHTS[fmt](40, 128, g)
    for bias_dtype in (None, torch.bfloat16, torch.float16, torch.float32):
        bias = None if bias_dtype is None else torch.randn(40, generator=g).to(bias_dtype)
        prepared = PreparedCall(OPS[fmt], (*weight, bias))
        for dtype in (torch.bfloat16, torch.float16):
            if bias is not None and bias.dtype not in (dtype, torch.float32):
                continue
            for m in (1, 3, 9, 40):
                x = torch.randn(2, m, 128, generator=g).to(dtype)
                got = prepared(x)
                assert_bits(got, OPS[fmt](x, *weight, bias))
                assert not got.requires_grad  # grad mode is on: nothing of a plain call records a graph
                with torch.inference_mode():
                    x_inference = x.clone()
                assert_bits(prepared(x_inference), got)
        assert len(prepared._prepared) == (2 if bias_dtype in (None, torch.float32) else 1)


def test_prepared_call_takes_the_operator_path_where_the_call_is_not_plain():
    """x requiring grad, a non-contiguous x, a bad dtype or shape, the reference backend, an empty x: the
    operator's results and errors."""
    g = gen(12)
    weight = hif4_weight(24, 128, g)
    prepared = PreparedCall(ops.HIFLOAT4_LINEAR, (*weight, None))
    x = torch.randn(3, 256, generator=g).bfloat16()[:, ::2]
    want = ops.HIFLOAT4_LINEAR(x, *weight, None)
    assert_bits(prepared(x), want)
    assert_bits(prepared(x.clone().requires_grad_()), want)
    with lowbit.use_backend("reference"):
        assert_bits(prepared(x), want)
        assert lowbit.last_backend("hifloat4_linear") == "reference"
    assert_bits(prepared(x), want) and lowbit.last_backend("hifloat4_linear") == "native"
    assert prepared(x[:0]).shape == (0, 24)
    with pytest.raises(DtypeError, match="float16 or bfloat16"):
        prepared(x.float())
    with pytest.raises(ShapeError, match="K = 128"):
        prepared(x[:, :64])
    with pytest.raises(ShapeError, match="bias"):
        PreparedCall(ops.HIFLOAT4_LINEAR, (*weight, torch.zeros(5, dtype=torch.bfloat16)))(x)


def test_prepared_call_keeps_a_bounded_plan_per_kind_of_x():
    """One plan (checks, kernel choice) per x dtype, shape and backend, reused; many shapes (prefill lengths)
    do not grow them past library._MAX_PLANS; every call still gives the operator's bits."""
    g = gen(14)
    weight = hif4_weight(24, 128, g)
    prepared = PreparedCall(ops.HIFLOAT4_LINEAR, (*weight, None))
    x = torch.randn(2, 128, generator=g).bfloat16()
    prepared(x)
    prepared(x.clone())
    assert len(prepared._plans) == 1
    for m in range(1, library._MAX_PLANS + 8):
        x = torch.randn(m, 128, generator=g).bfloat16()
        assert_bits(prepared(x), ops.HIFLOAT4_LINEAR(x, *weight, None))
        assert len(prepared._plans) <= library._MAX_PLANS


def test_prepared_call_copies_a_non_contiguous_weight():
    g = gen(13)
    scale, value = hif4_weight(24, 128, g)
    wide = torch.zeros(24, 128, dtype=torch.uint8)
    wide[:, ::2] = value  # a strided view of the same values
    prepared = PreparedCall(ops.HIFLOAT4_LINEAR, (scale, wide[:, ::2], None))
    assert prepared.fixed[1].is_contiguous()
    x = torch.randn(1, 128, generator=g).bfloat16()
    assert_bits(prepared(x), ops.HIFLOAT4_LINEAR(x, scale, value, None))


# --- contracts and errors -------------------------------------------------------------------------------------

def test_public_functions_shapes_out_and_backend():
    g = gen(10)
    codes, scales = mxfp4_weight(24, 64, g)
    x = torch.randn(2, 3, 64, generator=g).bfloat16()
    y = lowbit.mxfp4_linear(x, codes, scales)
    assert y.shape == (2, 3, 24) and y.dtype == torch.bfloat16
    assert lowbit.last_backend("mxfp4_linear") in ("native", "reference")
    out = torch.empty(2, 3, 24, dtype=torch.bfloat16)
    assert lowbit.mxfp4_linear(x, codes, scales, out=out, backend="native") is out
    assert_bits(out, lowbit.mxfp4_linear(x, codes, scales, backend="reference"))
    assert lowbit.last_backend("mxfp4_linear") == "reference"


def test_reference_is_the_documented_sum():
    """A hand-computed case: 64 lanes, lane j sums k = j, j + 64; then the pairwise fold."""
    k = 128
    x = torch.zeros(1, k, dtype=torch.bfloat16)
    x[0, 0], x[0, 64], x[0, 32] = 2.0**24, 1.0, 1.0  # lane 0: 2^24 + 1 -> 2^24 (ties to even); lane 32: 1
    codes = torch.full((1, k), 0x08, dtype=torch.uint8)  # 1.0
    y32 = reference.lane_sums(x.float(), reference.hifloat8_weight(codes, torch.ones(1), torch.bfloat16))
    assert y32.item() == 2.0**24  # then 2^24 + 1 (lane 32 folded into lane 0) -> 2^24
    assert_bits(lowbit.hifloat8_linear(x, codes, torch.ones(1), backend="native"),
                torch.tensor([[2.0**24]], dtype=torch.bfloat16))


@pytest.mark.parametrize("call, error, match", [
    (lambda x, c, s: lowbit.hifloat8_linear(x.float(), c, s), DtypeError, "x must be float16 or bfloat16"),
    (lambda x, c, s: lowbit.hifloat8_linear(x, c.to(torch.int8), s), DtypeError, "codes must be uint8"),
    (lambda x, c, s: lowbit.hifloat8_linear(x, c, s.half()), DtypeError, "scale must be a float32"),
    (lambda x, c, s: lowbit.hifloat8_linear(x, c, s[:3]), ShapeError, "scale must have shape"),
    (lambda x, c, s: lowbit.hifloat8_linear(x[:, :10], c, s), ShapeError, "K = 64"),
    (lambda x, c, s: lowbit.hifloat8_linear(x, c[0], s), ShapeError, "codes must be"),
    (lambda x, c, s: lowbit.hifloat8_linear(x, c, s, torch.zeros(5)), ShapeError, "bias must have shape"),
    (lambda x, c, s: lowbit.hifloat8_linear(x, c, s, torch.zeros(8, dtype=torch.float64)), DtypeError, "bias"),
    (lambda x, c, s: lowbit.hifloat8_linear(x.to("meta"), c, s), DeviceError, "one device"),
    (lambda x, c, s: lowbit.mxfp4_linear(x[:, :48], c[:, :24], c[:, :1]), ShapeError, "multiple of 32"),
    (lambda x, c, s: lowbit.mxfp4_linear(x, c[:, :32], c[:, :3]), ShapeError, "scales"),
    (lambda x, c, s: lowbit.hifloat4_linear(x, c.reshape(8, 16, 4), c[:, :32]), ShapeError, "K/64"),
    (lambda x, c, s: lowbit.hifloat4_linear(x, c.reshape(8, 1, 64), c[:, :32]), ShapeError, "K/64, 4"),
    (lambda x, c, s: lowbit.hifloat4_linear(x, c.view(torch.int8).reshape(8, 1, 64)[..., :4], c[:, :32]),
     DtypeError, "scale must be uint8"),
])
def test_bad_arguments_raise_typed_errors(call, error, match):
    g = gen(11)
    x = torch.randn(2, 64, generator=g).bfloat16()
    codes, scale = hif8_weight(8, 64, g)
    with pytest.raises(error, match=match):
        call(x, codes, scale)


def test_the_contract_is_exact_for_few_rows_and_the_interval_above():
    g = torch.Generator().manual_seed(5)
    w32 = torch.randn(8, 128, generator=g)
    for rows, exact_only in ((reference.EXACT_ROWS, True), (reference.EXACT_ROWS + 1, False)):
        x = torch.randn(rows, 128, generator=g).bfloat16()
        want = reference.linear(x, w32)
        lo, hi = reference.gemm_interval(x, w32)
        assert reference.meets_contract(want, want, x, w32)
        nudged = torch.where(want == hi, lo, hi)  # another value inside the interval, where it has two
        assert reference.meets_contract(nudged, want, x, w32) is (not exact_only or bool(torch.equal(nudged, want)))
        outside = (hi.float() * 2 + 1).bfloat16()
        assert not reference.meets_contract(outside, want, x, w32)
