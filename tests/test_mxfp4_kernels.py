"""MXFP4 kernels (numba, Triton under the interpreter) and ops: bit-exact with the reference, contracts."""

import numba
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowbit
import lowbit.ops.mxfp4 as ops
from lowbit import backends
from lowbit.errors import DeviceError, DtypeError, ShapeError
from lowbit.formats import mxfp4
from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu import mxfp4 as cpu_kernels
from lowbit.ops.mxfp4 import DEQUANTIZE, QUANTIZE

triton_kernels = pytest.importorskip("lowbit.kernels.triton.mxfp4", reason="triton is not installed")

KERNELS = {"numba": cpu_kernels, "triton-interpreter": triton_kernels}
RULE_ROUNDING = [(r, m) for r in mxfp4.SCALE_RULES for m in mxfp4.ROUNDINGS]


def quantize_with(kernels, x, block_size=32, scale_rule="floor", rounding="ta", axis=-1):
    """Run a kernel module's QUANTIZE directly (contiguous input, fresh contiguous outputs)."""
    x = x.contiguous()
    out = QUANTIZE.new_outputs(x, block_size, scale_rule, rounding, axis)
    kernels.QUANTIZE.run(x, block_size, scale_rule, rounding, axis, out=out)
    return out


def dequantize_with(kernels, codes, scales, dtype=torch.bfloat16, axis=-1):
    """Run a kernel module's DEQUANTIZE directly (contiguous inputs, a fresh contiguous output)."""
    codes, scales = codes.contiguous(), scales.contiguous()
    out = DEQUANTIZE.new_outputs(codes, scales, dtype, axis)
    kernels.DEQUANTIZE.run(codes, scales, dtype, axis, out=out)
    return out


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
    assert_same(quantize_with(KERNELS[kernel], x, 32, rule, rounding), mxfp4.quantize(x, 32, rule, rounding))


@pytest.mark.parametrize("kernel", KERNELS, ids=list(KERNELS))
@pytest.mark.parametrize("dtype", ops.KERNEL_OUTPUT_DTYPES)
def test_dequantize_every_scale_and_code_byte(kernel, dtype):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(256).reshape(256, 256)
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).unsqueeze(1).repeat(1, 16)
    assert_same([dequantize_with(KERNELS[kernel], codes, scales, dtype)], [mxfp4.dequantize(codes, scales, dtype)])


@pytest.mark.parametrize("dtype, pattern", [(torch.bfloat16, 0x7FC0), (torch.float16, 0x7E00)])
@pytest.mark.parametrize("blocks", [1, 16, 17, 33])
def test_a_nan_block_dequantizes_to_the_quiet_nan_wherever_it_sits(dtype, pattern, blocks):
    """torch's float64 -> BF16 conversion writes 0xFFFF in its vector part and 0x7FC0 in its scalar tail: the
    reference's NaN bits depended on the block's position (and on the thread count) until they were fixed."""
    codes = torch.zeros(3, blocks, dtype=torch.uint8)
    scales = torch.full((3, blocks), 0xFF, dtype=torch.uint8)
    for backend in ("reference", "native"):
        y = lowbit.mxfp4_dequantize(codes, scales, dtype, backend=backend)
        assert set(y.view(torch.int16).flatten().tolist()) == {pattern}, backend


@pytest.mark.parametrize("kernel", KERNELS, ids=list(KERNELS))
def test_float64_output_is_the_references_job(kernel):
    codes, scales = torch.zeros(2, 16, dtype=torch.uint8), torch.full((2, 1), 254, dtype=torch.uint8)
    assert "float64" in KERNELS[kernel].DEQUANTIZE.supports(codes, scales, torch.float64, -1)
    with pytest.raises(lowbit.BackendUnavailable, match="float64"):
        ops.mxfp4_dequantize(codes, scales, torch.float64, backend="native")
    y = ops.mxfp4_dequantize(codes | 0x77, scales, torch.float64, backend="auto")
    assert backends.last_backend(DEQUANTIZE.name) == "reference" and y[0, 0].item() == 6.0 * 2.0**127


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
    assert_same(quantize_with(cpu_kernels, x, block_size, rule, rounding), mxfp4.quantize(x, block_size, rule, rounding))
    codes, scales = mxfp4.quantize(x, block_size, rule, rounding)
    assert_same([dequantize_with(cpu_kernels, codes, scales, dtype)], [mxfp4.dequantize(codes, scales, dtype)])


@pytest.mark.parametrize("kernel", KERNELS, ids=list(KERNELS))
def test_odd_shapes_axes_and_views(kernel):
    k = KERNELS[kernel]
    x = torch.randn(96, 3, 7, dtype=torch.bfloat16)
    assert_same(quantize_with(k, x, 32, "even", "rne", axis=0), mxfp4.quantize(x, 32, "even", "rne", axis=0))
    view = torch.randn(5, 128, dtype=torch.float32)[:, ::2]  # non-contiguous (5, 64)
    assert_same(quantize_with(k, view, 16), mxfp4.quantize(view, 16))
    assert_same(quantize_with(k, x[:, :, 1], 48, axis=0), mxfp4.quantize(x[:, :, 1], 48, axis=0))
    codes, scales = mxfp4.quantize(x, 32, axis=0)
    assert_same([dequantize_with(k, codes, scales, torch.float16, axis=0)],
                [mxfp4.dequantize(codes, scales, torch.float16, axis=0)])
    empty = torch.zeros(0, 64)
    assert_same(quantize_with(k, empty), mxfp4.quantize(empty))


def test_numba_thread_counts_agree():
    """One thread runs every block on the calling thread, two the parallel loops: the same quantized and
    dequantized bits."""
    x = torch.randn(1024, 256, dtype=torch.bfloat16) * 100
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            codes, scales = quantize_with(cpu_kernels, x, 32, "ceil", "rne")
            results.append([codes, scales, dequantize_with(cpu_kernels, codes, scales, torch.float32)])
    finally:
        torch.set_num_threads(threads)
    assert_same(results[0], results[1])
    assert_same(results[0][2:], [mxfp4.dequantize(results[0][0], results[0][1], torch.float32)])


# --- ops --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["reference", "native", "auto"])
def test_ops_route_and_agree(backend):
    x = torch.randn(3, 64, dtype=torch.float16) * 50
    codes, scales = ops.mxfp4_quantize(x, 32, "rceil", "rne", backend=backend)
    assert backends.last_backend(QUANTIZE.name) == ("reference" if backend == "reference" else "native")
    assert_same((codes, scales), mxfp4.quantize(x, 32, "rceil", "rne"))
    y = ops.mxfp4_dequantize(mxfp4.as_torch_fp4(codes), mxfp4.as_torch_e8m0(scales), torch.float32, backend=backend)
    assert_same([y], [mxfp4.dequantize(codes, scales, torch.float32)])


def test_auto_self_checks_pass_on_cpu():
    cpu = torch.device("cpu")
    for op in (QUANTIZE, DEQUANTIZE):
        assert op.auto_check_error(cpu) is None
        assert op.resolve(cpu, "auto") == "native"


def test_opcheck_and_meta():
    x = torch.randn(2, 4, 64, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.lowbit.mxfp4_quantize.default, (x.transpose(1, 2), 32, "floor", "ta", 1, "native"))
    codes, scales = ops.mxfp4_quantize(x)
    torch.library.opcheck(torch.ops.lowbit.mxfp4_dequantize.default, (codes, scales, torch.float16, -1, "native"))
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
        got = torch.empty(x.shape, dtype=out_dtype or dtype)
        cpu_kernels.fake_quantize(x, block_size, "even", "rne", out=got)
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
    torch.library.opcheck(torch.ops.lowbit.mxfp4_quantize_out.default, (x, 32, "floor", "ta", -1, codes, scales, backend))
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
        assert_same(quantize_with(cpu_kernels, x, 32, rule, rounding), mxfp4.quantize(x, 32, rule, rounding))
    for rule, rounding in (("floor", "ta"), ("rceil", "rne")):
        assert_same(quantize_with(triton_kernels, x, 32, rule, rounding), mxfp4.quantize(x, 32, rule, rounding))


@numba.njit
def _codes_by_compares(elems, mask, thr, blocks_bytes, codes):
    for b in range(blocks_bytes.size):
        cpu_kernels._store_block_codes16_compares(elems, 32 * b, mask, thr, blocks_bytes[b], codes, 16 * b)


@numba.njit
def _codes_by_search(elems, mask, thr, blocks_bytes, codes):
    for b in range(blocks_bytes.size):
        cpu_kernels._store_block_codes16_search(elems, 32 * b, mask, thr, blocks_bytes[b], codes, 16 * b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rounding", mxfp4.ROUNDINGS)
def test_block_code_search_equals_the_compares(dtype, rounding):
    """The AVX512-BW block codes (a binary search over the thresholds with vpermw) equal the portable ones
    (seven compares) for every 16-bit pattern under every scale byte but 0xFF (which never reaches them),
    whichever of the two this CPU's kernels use."""
    if not simd.HAS_AVX512BW:
        pytest.skip("no AVX512-BW on this CPU")
    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    thr = cpu_kernels._padded_thresholds(dtype, rounding)
    mask = np.uint16(0x7FFF)
    for byte in range(255):
        elems = np.random.default_rng(byte).permutation(patterns)
        blocks_bytes = np.full(elems.size // 32, byte, dtype=np.int64)
        by_compares, by_search = (np.empty(elems.size // 2, dtype=np.uint8) for _ in range(2))
        _codes_by_compares(elems, mask, thr, blocks_bytes, by_compares)
        _codes_by_search(elems, mask, thr, blocks_bytes, by_search)
        assert np.array_equal(by_compares, by_search), byte


@numba.njit
def _values_in_registers(elems, mask, thr, values, blocks_bytes, out):
    for b in range(blocks_bytes.size):
        cpu_kernels._store_block_values16(elems, 32 * b, mask, thr, blocks_bytes[b], values, out, 32 * b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rounding", mxfp4.ROUNDINGS)
def test_block_values_in_registers_are_the_codes_decoded(dtype, rounding):
    """The fake quant's registers (threshold count, vpermw into the scale's row of values, the sign) give, for
    every 16-bit pattern in varying lanes under every scale byte but 0xFF (a NaN block never reaches them), the
    bits that the block codes decoded by the reference's (scale, code byte) table give."""
    if not simd.HAS_AVX512BW:
        pytest.skip("no AVX512-BW on this CPU")
    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    thr, mask = cpu_kernels._padded_thresholds(dtype, rounding), np.uint16(0x7FFF)
    values, pairs = cpu_kernels._block_values(dtype), cpu_kernels._dequant_pair_table(dtype).reshape(256, 256)
    for byte in range(255):
        elems = np.random.default_rng(byte).permutation(patterns)
        blocks_bytes = np.full(elems.size // 32, byte, dtype=np.int64)
        codes, got = np.empty(elems.size // 2, dtype=np.uint8), np.empty(elems.size, dtype=np.uint16)
        _codes_by_search(elems, mask, thr, blocks_bytes, codes)
        _values_in_registers(elems, mask, thr, values, blocks_bytes, got)
        nibbles = np.stack([codes & 15, codes >> 4], 1).reshape(-1)
        want = (pairs[byte, nibbles] & 0xFFFF).astype(np.uint16)
        assert np.array_equal(got, want), byte


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rule, rounding", RULE_ROUNDING)
def test_fake_quantize_in_registers_is_the_reference(dtype, rule, rounding):
    """fake_quantize_into: every 16-bit pattern (NaN and Inf blocks included) and blocks of every magnitude,
    values and scale bytes equal the reference's quantize then dequantize, on numba's threads and on one; so do
    the values of its one-call form given the tensors' addresses (fake_quantize_small)."""
    if not cpu_kernels.fake_quantizes_in_registers(dtype, 32):
        pytest.skip("no AVX512-BW on this CPU")
    g = torch.Generator().manual_seed(len(rule) + len(rounding))
    patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    shuffled = patterns[torch.randperm(65536, generator=g)]
    spread = torch.randn(2048, 32, generator=g) * torch.logspace(-40, 40, 2048).reshape(-1, 1)
    many = torch.cat([patterns, shuffled, spread.to(dtype).reshape(-1)]).reshape(-1, 512)  # numba's threads
    for x in (many, shuffled[:4096].reshape(-1, 64)):
        out, scales = torch.empty_like(x), torch.empty(x.shape[0], x.shape[1] // 32, dtype=torch.uint8)
        cpu_kernels.fake_quantize_into(x, 32, rule, rounding, scales, out)
        codes, want_scales = mxfp4.quantize(x, 32, rule, rounding)
        assert_same([out, scales], [mxfp4.dequantize(codes, want_scales, dtype), want_scales])
    for x in (patterns.reshape(-1, 512), spread.to(dtype)):  # the one-call form, up to its size
        assert x.numel() <= cpu_kernels.ONE_THREAD_ELEMENTS
        assert_same([cpu_kernels.fake_quantize_small(x, rule, rounding)],
                    [mxfp4.dequantize(*mxfp4.quantize(x, 32, rule, rounding), dtype)])


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
    assert_same(quantize_with(triton_kernels, x, block_size, rule, rounding),
                mxfp4.quantize(x, block_size, rule, rounding))
    codes, scales = mxfp4.quantize(x, block_size, rule, rounding)
    assert_same([dequantize_with(triton_kernels, codes, scales, dtype)], [mxfp4.dequantize(codes, scales, dtype)])


@pytest.mark.parametrize("backend", ["reference", "native"])
def test_dynamic_mx_quant_op_matches_reference_layout(backend):
    x = torch.randn(5, 96, dtype=torch.bfloat16) * 7
    for mode in ("round", "rint"):
        assert_same(ops.dynamic_mx_quant(x, 32, mode, backend=backend), mxfp4.dynamic_mx_quant(x, 32, mode))
    with pytest.raises(ValueError, match="round_mode"):
        ops.dynamic_mx_quant(x, round_mode="floor")
    with pytest.raises(ShapeError, match="block_size"):
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
    torch.library.opcheck(torch.ops.lowbit.mxfp4_dequantize_out.default, (codes, scales, torch.float16, -1, out, backend))
    with pytest.raises(DtypeError, match="float32"):
        ops.mxfp4_dequantize(codes, scales, torch.float16, out=torch.empty(3, 64))
    assert ops.mxfp4_dequantize(codes, scales, out=torch.empty(3, 64), backend=backend).dtype == torch.float32
    with pytest.raises(ShapeError, match=r"\(3, 64\)"):
        ops.mxfp4_dequantize(codes, scales, torch.float32, out=torch.empty(3, 63))


# --- out= sharing memory with the inputs -------------------------------------------------------------

@pytest.mark.parametrize("backend", ["native", "reference"])
@given(data=st.data())
def test_quantize_into_the_inputs_memory_equals_the_reference(backend, data):
    """codes or scales written over the bytes of x (from any offset) give the reference's bits."""
    dtype = data.draw(st.sampled_from(mxfp4.INPUT_DTYPES))
    rows, n_blocks = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 3))
    rule, rounding = data.draw(st.sampled_from(RULE_ROUNDING))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    storage = (torch.randn(rows, 32 * n_blocks, generator=gen) * 300).to(dtype)
    x = storage.clone()
    want = mxfp4.quantize(x, 32, rule, rounding)
    raw = storage.view(-1).view(torch.uint8)
    offset = data.draw(st.integers(0, raw.numel() - want[0].numel() - want[1].numel()))
    which = data.draw(st.sampled_from(["codes", "scales", "both"]))
    codes = raw[offset : offset + want[0].numel()].view(want[0].shape) if which != "scales" else torch.empty_like(want[0])
    start = offset + want[0].numel() if which == "both" else offset
    scales = raw[start : start + want[1].numel()].view(want[1].shape) if which != "codes" else torch.empty_like(want[1])
    got = ops.mxfp4_quantize(storage, 32, rule, rounding, out=(codes, scales), backend=backend)
    assert got[0] is codes and got[1] is scales
    assert_same(got, want)


@pytest.mark.parametrize("backend", ["native", "reference"])
@given(data=st.data())
def test_dequantize_over_its_codes_or_scales_equals_the_reference(backend, data):
    """The decoded values written over the memory holding the codes and/or scales give the reference's bits."""
    dtype = data.draw(st.sampled_from(ops.KERNEL_OUTPUT_DTYPES))
    rows, n_blocks = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 3))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    want_codes = torch.randint(0, 256, (rows, 16 * n_blocks), generator=gen, dtype=torch.int32).to(torch.uint8)
    want_scales = torch.randint(100, 160, (rows, n_blocks), generator=gen, dtype=torch.int32).to(torch.uint8)
    want = mxfp4.dequantize(want_codes, want_scales, dtype)
    buffer = torch.zeros(want.numel() * want.element_size() + want_codes.numel() + want_scales.numel(), dtype=torch.uint8)
    out_start = data.draw(st.integers(0, want_codes.numel() + want_scales.numel())) // want.element_size()
    out = buffer[out_start * want.element_size() :][: want.numel() * want.element_size()].view(dtype).view(want.shape)
    codes_start = data.draw(st.integers(0, buffer.numel() - want_codes.numel()))
    codes = buffer[codes_start : codes_start + want_codes.numel()].view(want_codes.shape)
    codes.copy_(want_codes)
    scales = want_scales.clone()
    if data.draw(st.booleans()):  # scales inside the buffer too, unless they would overlap the codes
        scales_start = data.draw(st.integers(0, buffer.numel() - want_scales.numel()))
        if scales_start + want_scales.numel() <= codes_start or scales_start >= codes_start + want_codes.numel():
            scales = buffer[scales_start : scales_start + want_scales.numel()].view(want_scales.shape)
            scales.copy_(want_scales)
    assert ops.mxfp4_dequantize(codes, scales, dtype, out=out, backend=backend) is out
    assert_same([out], [want])


# --- malformed codes and scales never reach a kernel ------------------------------------------------

@given(data=st.data())
def test_malformed_codes_and_scales_are_refused_before_any_kernel(data):
    """Random shapes and dtypes: either a DtypeError / ShapeError, or the reference's bits (no crash)."""
    dims = data.draw(st.integers(1, 3))
    codes_shape = tuple(data.draw(st.lists(st.integers(0, 9), min_size=dims, max_size=dims)))
    scales_shape = tuple(data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
    codes_dtype = data.draw(st.sampled_from([torch.uint8, torch.uint8, torch.int8, torch.int32]))
    scales_dtype = data.draw(st.sampled_from([torch.uint8, torch.uint8, torch.int16, torch.float32]))
    axis = data.draw(st.integers(-3, 2))
    codes = torch.randint(0, 100, codes_shape, dtype=torch.int32).to(codes_dtype)
    scales = torch.randint(100, 150, scales_shape, dtype=torch.int32).to(scales_dtype)
    try:
        got = ops.mxfp4_dequantize(codes, scales, torch.float32, axis, backend="native")
    except (DtypeError, ShapeError) as exc:
        assert any(name in str(exc) for name in ("codes", "scales", "axis")), exc
        return
    assert_same([got], [mxfp4.dequantize(codes, scales, torch.float32, axis)])


def test_empty_codes_with_scales_are_refused():
    with pytest.raises(ShapeError, match="do not fit"):
        ops.mxfp4_dequantize(torch.zeros(4, 0, dtype=torch.uint8), torch.zeros(4, 5, dtype=torch.uint8))
    assert ops.mxfp4_dequantize(torch.zeros(4, 0, dtype=torch.uint8), torch.zeros(4, 0, dtype=torch.uint8)).shape == (4, 0)


# --- argument errors ----------------------------------------------------------------------------------

def test_size_arguments_raise_shape_or_type_errors_naming_them():
    x = torch.zeros(2, 64)
    for bad in (33, 0, -2):
        with pytest.raises(ShapeError, match="block_size"):
            ops.mxfp4_quantize(x, bad)
    for bad in (32.0, True, "32"):
        with pytest.raises(TypeError, match="block_size"):
            ops.mxfp4_quantize(x, bad)
    with pytest.raises(TypeError, match="axis"):
        ops.mxfp4_quantize(x, 32, axis=1.0)
    with pytest.raises(TypeError, match="axis"):
        ops.mxfp4_dequantize(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8), axis=False)
    with pytest.raises(ShapeError, match="block_size"):
        ops.dynamic_mx_quant(x, 64)
    with pytest.raises(TypeError, match="block_size"):
        ops.dynamic_mx_quant(x, 32.0)


def test_unknown_option_names_list_the_allowed_ones():
    x = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="floor, nearest, even, ceil, rceil"):
        ops.mxfp4_quantize(x, scale_rule="stochastic")
    with pytest.raises(ValueError, match="ta, rne"):
        ops.mxfp4_quantize(x, rounding="up")
    with pytest.raises(ValueError, match="round, rint"):
        ops.dynamic_mx_quant(x, round_mode="floor")


def test_out_of_the_wrong_kind_names_out():
    x = torch.zeros(2, 64)
    codes, scales = torch.empty(2, 32, dtype=torch.uint8), torch.empty(2, 2, dtype=torch.uint8)
    with pytest.raises(TypeError, match="out must be a tuple of 2 tensors, got tuple of length 3"):
        ops.mxfp4_quantize(x, out=(codes, scales, scales))
    with pytest.raises(TypeError, match="out"):
        ops.mxfp4_quantize(x, out=codes)
    with pytest.raises(DtypeError, match="dtype"):
        ops.mxfp4_dequantize(codes, scales, "float32")
    with pytest.raises(DtypeError, match=r"codes must be uint8.*int8"):
        ops.mxfp4_dequantize(codes.view(torch.int8), scales)
    with pytest.raises(DeviceError, match="meta"):
        ops.mxfp4_quantize(x, out=(codes, scales.to("meta")))


def test_triton_kernel_refuses_blocks_larger_than_its_tile():
    big = triton_kernels.MAX_BLOCK_SIZE * 2
    x = torch.zeros(1, big)
    assert "block_size" in triton_kernels.QUANTIZE.supports(x, big, "floor", "ta", -1)
    assert triton_kernels.QUANTIZE.supports(x, triton_kernels.MAX_BLOCK_SIZE, "floor", "ta", -1) is None
    codes, scales = torch.zeros(1, big // 2, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.uint8)
    assert "block_size" in triton_kernels.DEQUANTIZE.supports(codes, scales, torch.float32, -1)


def test_one_name_per_concept():
    """The MX block is ``block_size`` / ``BLOCK``; a kernel's work unit is named per program or tile."""
    from lowbit.formats import svd_quant as svd_ref
    from lowbit.kernels.triton import svd_quant as triton_svd

    assert svd_ref.BLOCK == 32 and not hasattr(svd_ref, "BLOCK_SIZE")
    assert triton_kernels.BLOCKS_PER_PROGRAM == 64 and not hasattr(triton_kernels, "BLOCKS")
    assert (triton_svd.TILE_M, triton_svd.TILE_N, triton_svd.TILE_BYTES) == (32, 32, 32)
    assert not hasattr(mxfp4, "E2M1_MAX")
