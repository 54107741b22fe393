"""MXFP4 kernels (numba, Triton under the interpreter) and ops: bit-exact with the reference, contracts."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowbit.ops.mxfp4 as ops
from lowbit import backends
from lowbit.errors import DeviceError, DtypeError, ShapeError
from lowbit.formats import mxfp4
from lowbit.kernels.cpu import mxfp4 as cpu_kernels

triton_kernels = pytest.importorskip("lowbit.kernels.triton.mxfp4", reason="triton is not installed")

KERNELS = {"numba": cpu_kernels, "triton-interpreter": triton_kernels}
RULE_ROUNDING = [(r, m) for r in mxfp4.SCALE_RULES for m in mxfp4.ROUNDINGS]


def edge_rows(dtype: torch.dtype) -> torch.Tensor:
    """Rows of 64 with ties at several scales, NaN/Inf/zero blocks, subnormals, dtype max and min."""
    finfo = torch.finfo(dtype)
    ties = torch.tensor(mxfp4.E2M1_MIDPOINTS * 10, dtype=torch.float64)[:63]
    rows = []
    for e in (-3, 0, 9):
        rows.append(torch.cat([torch.tensor([4.0 * 2.0**e]), ties * 2.0**e]))
    special = torch.zeros(64, dtype=torch.float64)
    special[1], special[33], special[40] = -0.0, float("nan"), float("-inf")
    rows.append(special)
    extremes = torch.tensor([finfo.max, -finfo.max, finfo.tiny, finfo.smallest_normal / 8] * 16, dtype=torch.float64)
    rows.append(extremes)
    rows.append(torch.full((64,), finfo.tiny / 4, dtype=torch.float64))  # all-subnormal blocks
    x = torch.stack(rows).to(dtype)
    up = torch.nextafter(x, torch.full_like(x, float("inf")))
    down = torch.nextafter(x, torch.full_like(x, float("-inf")))
    return torch.cat([x, up, down, -x])


def assert_same(got, want):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g.cpu().view(torch.uint8), w.view(torch.uint8))


@pytest.mark.parametrize("kernel", KERNELS, ids=list(KERNELS))
@pytest.mark.parametrize("dtype", mxfp4.INPUT_DTYPES)
@pytest.mark.parametrize("rule, rounding", RULE_ROUNDING)
def test_quantize_edges_bit_exact(kernel, dtype, rule, rounding):
    x = edge_rows(dtype)
    assert_same(KERNELS[kernel].quantize(x, 32, rule, rounding), mxfp4.quantize(x, 32, rule, rounding))


@pytest.mark.parametrize("kernel", KERNELS, ids=list(KERNELS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_dequantize_every_scale_and_code_byte(kernel, dtype):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(256).reshape(256, 256)
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).unsqueeze(1).repeat(1, 16)
    assert_same([KERNELS[kernel].dequantize(codes, scales, dtype)], [mxfp4.dequantize(codes, scales, dtype)])


@pytest.mark.parametrize("dtype", mxfp4.INPUT_DTYPES)
@given(data=st.data())
def test_numba_random_inputs_bit_exact(dtype, data):
    rule = data.draw(st.sampled_from(mxfp4.SCALE_RULES))
    rounding = data.draw(st.sampled_from(mxfp4.ROUNDINGS))
    block_size = data.draw(st.sampled_from([2, 6, 32, 64]))
    rows = data.draw(st.integers(1, 5))
    k = block_size * data.draw(st.integers(1, 4))
    seed = data.draw(st.integers(0, 2**31))
    spread = data.draw(st.integers(0, 60))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * torch.exp2(torch.randint(-spread, spread + 1, (rows, k), generator=gen).float())
    x = x.to(dtype)
    assert_same(cpu_kernels.quantize(x, block_size, rule, rounding), mxfp4.quantize(x, block_size, rule, rounding))
    codes, scales = mxfp4.quantize(x, block_size, rule, rounding)
    assert_same([cpu_kernels.dequantize(codes, scales, dtype)], [mxfp4.dequantize(codes, scales, dtype)])


@pytest.mark.parametrize("kernel", KERNELS, ids=list(KERNELS))
def test_odd_shapes_axes_and_views(kernel):
    k = KERNELS[kernel]
    x = torch.randn(96, 3, 7, dtype=torch.bfloat16)
    assert_same(k.quantize(x, 32, "even", "rne", axis=0), mxfp4.quantize(x, 32, "even", "rne", axis=0))
    view = torch.randn(5, 128, dtype=torch.float32)[:, ::2]  # non-contiguous (5, 64)
    assert_same(k.quantize(view, 16), mxfp4.quantize(view, 16))
    assert_same(k.quantize(x[:, :, 1], 48, axis=0), mxfp4.quantize(x[:, :, 1], 48, axis=0))
    codes, scales = mxfp4.quantize(x, 32, axis=0)
    assert_same([k.dequantize(codes, scales, torch.float16, axis=0)], [mxfp4.dequantize(codes, scales, torch.float16, axis=0)])
    empty = torch.zeros(0, 64)
    assert_same(k.quantize(empty), mxfp4.quantize(empty))


def test_numba_out_arguments():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    codes, scales = torch.empty(4, 32, dtype=torch.uint8), torch.empty(4, 2, dtype=torch.uint8)
    got = cpu_kernels.quantize(x, out=(codes, scales))
    assert got[0] is codes and got[1] is scales
    assert_same(got, mxfp4.quantize(x))
    with pytest.raises(ValueError, match="out codes"):
        cpu_kernels.quantize(x, out=(torch.empty(4, 31, dtype=torch.uint8), scales))


def test_numba_thread_counts_agree():
    x = torch.randn(1024, 256, dtype=torch.bfloat16) * 100
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(cpu_kernels.quantize(x, 32, "ceil", "rne"))
    finally:
        torch.set_num_threads(threads)
    assert_same(results[0], results[1])


# --- ops --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["reference", "native", "auto"])
def test_ops_route_and_agree(backend):
    x = torch.randn(3, 64, dtype=torch.float16) * 50
    codes, scales = ops.mxfp4_quantize(x, 32, "rceil", "rne", backend=backend)
    assert backends.last_backend(ops.QUANTIZE) == ("reference" if backend == "reference" else "native")
    assert_same((codes, scales), mxfp4.quantize(x, 32, "rceil", "rne"))
    y = ops.mxfp4_dequantize(mxfp4.as_torch_fp4(codes), mxfp4.as_torch_e8m0(scales), torch.float32, backend=backend)
    assert_same([y], [mxfp4.dequantize(codes, scales, torch.float32)])


def test_auto_self_checks_pass_on_cpu():
    cpu = torch.device("cpu")
    for dispatcher in (ops.QUANTIZE_DISPATCH, ops.DEQUANTIZE_DISPATCH):
        assert dispatcher.resolve(cpu, "auto") == "native", dispatcher.auto_check_error(cpu)


def test_opcheck_and_meta():
    x = torch.randn(2, 4, 64, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.lowbit.mxfp4_quantize, (x.transpose(1, 2), 32, "floor", "ta", 1, "native"))
    codes, scales = ops.mxfp4_quantize(x)
    torch.library.opcheck(torch.ops.lowbit.mxfp4_dequantize, (codes, scales, torch.float16, -1, "native"))
    meta_codes, meta_scales = ops.mxfp4_quantize(x.transpose(1, 2).to("meta"), 16, axis=1)
    assert meta_codes.shape == (2, 32, 4) and meta_scales.shape == (2, 4, 4)
    assert ops.mxfp4_dequantize(codes.to("meta"), scales.to("meta"), torch.float32).shape == (2, 4, 64)


def test_compile_fullgraph_matches_eager():
    x = torch.randn(8, 64, dtype=torch.bfloat16)

    def fake_quant(t):
        return ops.mxfp4_dequantize(*ops.mxfp4_quantize(t, 32, "even", "rne"), torch.bfloat16)

    compiled = torch.compile(fake_quant, fullgraph=True)
    assert_same([compiled(x)], [fake_quant(x)])


def test_op_errors():
    with pytest.raises(DtypeError, match="int32"):
        ops.mxfp4_quantize(torch.zeros(32, dtype=torch.int32))
    with pytest.raises(ShapeError, match="block_size 32"):
        ops.mxfp4_quantize(torch.zeros(40))
    with pytest.raises(DeviceError, match="meta"):
        ops.mxfp4_dequantize(torch.zeros(16, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8, device="meta"))
    with pytest.raises(ValueError, match="backend"):
        ops.mxfp4_quantize(torch.zeros(32), backend="fast")


@pytest.mark.parametrize("dtype", mxfp4.INPUT_DTYPES)
@pytest.mark.parametrize("out_dtype", [None, torch.float32, torch.bfloat16])
def test_numba_fake_quantize_is_quantize_then_dequantize(dtype, out_dtype):
    x = edge_rows(dtype)
    for block_size in (32, 16):
        got = cpu_kernels.fake_quantize(x, block_size, "even", "rne", out_dtype)
        want = mxfp4.dequantize(*mxfp4.quantize(x, block_size, "even", "rne"), out_dtype or dtype)
        assert_same([got], [want])


@pytest.mark.parametrize("backend", ["reference", "native"])
def test_quantize_op_out_argument(backend):
    x = torch.randn(3, 64, dtype=torch.bfloat16) * 10
    codes, scales = torch.empty(3, 32, dtype=torch.uint8), torch.empty(3, 2, dtype=torch.uint8)
    got = ops.mxfp4_quantize(x, 32, "ceil", "ta", out=(codes, scales), backend=backend)
    assert got[0] is codes and got[1] is scales
    assert_same(got, mxfp4.quantize(x, 32, "ceil", "ta"))
    strided = torch.empty(3, 64, dtype=torch.uint8)[:, ::2]  # non-contiguous out
    ops.mxfp4_quantize(x, out=(strided, scales), backend=backend)
    assert torch.equal(strided, mxfp4.quantize(x)[0])
    torch.library.opcheck(torch.ops.lowbit.mxfp4_quantize_out, (x, codes, scales, 32, "floor", "ta", -1, backend))
    with pytest.raises(ShapeError, match=r"\(3, 32\)"):
        ops.mxfp4_quantize(x, out=(torch.empty(3, 31, dtype=torch.uint8), scales))
    with pytest.raises(DtypeError, match="int8"):
        ops.mxfp4_quantize(x, out=(codes, scales.view(torch.int8)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_16bit_pattern_bit_exact(dtype):
    """All 65536 patterns (NaN payloads, subnormals, +-0, Inf), sorted and shuffled into blocks of 32."""
    patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    shuffled = patterns[torch.randperm(65536, generator=torch.Generator().manual_seed(0))]
    x = torch.stack([patterns, shuffled]).reshape(-1, 1024)
    for rule, rounding in RULE_ROUNDING:
        assert_same(cpu_kernels.quantize(x, 32, rule, rounding), mxfp4.quantize(x, 32, rule, rounding))
    for rule, rounding in (("floor", "ta"), ("rceil", "rne")):
        assert_same(triton_kernels.quantize(x, 32, rule, rounding), mxfp4.quantize(x, 32, rule, rounding))


@settings(max_examples=10)
@given(data=st.data())
def test_triton_random_inputs_bit_exact(data):
    dtype = data.draw(st.sampled_from(mxfp4.INPUT_DTYPES))
    rule = data.draw(st.sampled_from(mxfp4.SCALE_RULES))
    rounding = data.draw(st.sampled_from(mxfp4.ROUNDINGS))
    block_size = data.draw(st.sampled_from([2, 6, 32, 64]))
    seed = data.draw(st.integers(0, 2**31))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 2 * block_size, generator=gen) * torch.exp2(torch.randint(-40, 41, (3, 1), generator=gen).float())
    x = x.to(dtype)
    assert_same(triton_kernels.quantize(x, block_size, rule, rounding), mxfp4.quantize(x, block_size, rule, rounding))
    codes, scales = mxfp4.quantize(x, block_size, rule, rounding)
    assert_same([triton_kernels.dequantize(codes, scales, dtype)], [mxfp4.dequantize(codes, scales, dtype)])


@pytest.mark.parametrize("backend", ["reference", "native"])
def test_dynamic_mx_quant_op_matches_reference_layout(backend):
    x = torch.randn(5, 96, dtype=torch.bfloat16) * 7
    for mode in ("round", "rint"):
        assert_same(ops.dynamic_mx_quant(x, 32, mode, backend=backend), mxfp4.dynamic_mx_quant(x, 32, mode))
    with pytest.raises(ValueError, match="round_mode"):
        ops.dynamic_mx_quant(x, round_mode="floor")
    with pytest.raises(ValueError, match="block_size"):
        ops.dynamic_mx_quant(x, block_size=16)


@pytest.mark.parametrize("backend", ["reference", "native"])
def test_dequantize_op_out_argument(backend):
    codes, scales = mxfp4.quantize(torch.randn(3, 64) * 10)
    out = torch.empty(3, 64, dtype=torch.float16)
    assert ops.mxfp4_dequantize(codes, scales, torch.float16, out=out, backend=backend) is out
    assert_same([out], [mxfp4.dequantize(codes, scales, torch.float16)])
    strided = torch.empty(3, 128, dtype=torch.bfloat16)[:, ::2]
    ops.mxfp4_dequantize(codes, scales, out=strided, backend=backend)
    assert_same([strided.contiguous()], [mxfp4.dequantize(codes, scales)])
    torch.library.opcheck(torch.ops.lowbit.mxfp4_dequantize_out, (codes, scales, out, -1, backend))
    with pytest.raises(DtypeError, match="float32"):
        ops.mxfp4_dequantize(codes, scales, torch.float16, out=torch.empty(3, 64))
    with pytest.raises(ShapeError, match=r"\(3, 64\)"):
        ops.mxfp4_dequantize(codes, scales, torch.float32, out=torch.empty(3, 63))
