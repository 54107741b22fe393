"""The SIMD building blocks of the weight-only CPU kernels, in both lowerings where there are two."""

import numba
import numpy as np
import pytest
import torch

from lowbit.formats import weight_only as reference
from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu import _weight_only_batched as wo_batched
from lowbit.kernels.cpu import _weight_only_decode8 as wo_decode8
from lowbit.kernels.cpu import _weight_only_layout as wo_layout
from lowbit.kernels.cpu import _weight_only_steps as wo_steps
from lowbit.kernels.cpu import weight_only as cpu

from helpers import simd_binary
from weight_only_cases import FINITE_E4M3, FINITE_HIF8, OPS, gen, hif8_weight, native_equals_reference


# --- SIMD building blocks, both lowerings -------------------------------------------------------------------

@numba.njit
def _decode_row(magnitudes, scale, bf16, nan_code, table, codes, out):
    wo_decode8._fill_row_table(magnitudes, scale, bf16, nan_code, table)
    for start in range(0, codes.size, 64):
        w0, w1 = wo_decode8.code8_decode(codes, start, table, nan_code)
        simd.f32v_store(out, start, w0)
        simd.f32v_store(out, start + 32, w1)


def skip_without_the_instructions_of(kind, dtype):
    if kind == "bytes" and not simd.BYTE_TABLES:
        pytest.skip("neither AVX512-VBMI nor AVX2 on this CPU")
    if kind == "words" and not simd.HAS_AVX512BW:
        pytest.skip("no AVX512-BW on this CPU")


CODE8 = {"hifloat8": (cpu._hifloat8_operands, reference.hifloat8_weight),
         "float8": (cpu._float8_operands, reference.float8_e4m3fn_weight)}


@pytest.mark.parametrize("fmt", CODE8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["bytes", "words", "values"])
@pytest.mark.parametrize("scale", [1.0, -0.3, 3e-39, 1e-6, 7e4, 1e30, 0.0, -0.0, float("inf"), float("nan")])
def test_row_table_decodes_every_8bit_code(fmt, dtype, kind, scale):
    skip_without_the_instructions_of(kind, dtype)
    operands, weight = CODE8[fmt]
    codes = torch.arange(256, dtype=torch.uint8).reshape(1, 256)
    _, scale_x, bf16, magnitudes, nan_code, table_like, *_ = operands(codes, torch.tensor([scale]), 256, dtype, kind)
    out = np.empty(256, dtype=np.float32)
    _decode_row(magnitudes, scale_x[0], bf16, nan_code, np.empty_like(table_like), codes.numpy().reshape(-1), out)
    order = np.array(wo_layout.CODE8_ORDER)
    logical = np.empty_like(out)
    for start in range(0, 256, 64):
        logical[start + order] = out[start : start + 64]
    want = weight(codes, torch.tensor([scale]), dtype)[0].numpy()
    assert np.array_equal(np.isnan(logical), np.isnan(want))
    finite = ~np.isnan(want)
    assert np.array_equal(logical[finite].view(np.int32), want[finite].view(np.int32))  # signed zeros too


@pytest.mark.parametrize("fmt", CODE8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["words", "values"])
@pytest.mark.parametrize("k", [189, 192])
def test_8bit_gemv_with_other_tables_equals_the_reference(fmt, dtype, kind, k):
    """The table kinds of CPUs without AVX512-VBMI (or BW), on this one: codes, M up to 4, a K tail (rows
    one by one) or none (blocks of wo_steps.ROW_BLOCK rows, 23 rows: a short last block)."""
    skip_without_the_instructions_of(kind, dtype)
    g = gen(13)
    operands, weight = CODE8[fmt]
    codes, scale = hif8_weight(23, k, g, FINITE_HIF8 if fmt == "hifloat8" else FINITE_E4M3)
    x = torch.randn(3, k, generator=g).to(dtype)
    x_reg = torch.zeros(3, 192)
    x_reg[:, :k] = x.float()
    y32 = torch.empty(3, 23)
    x_reg = wo_layout._reorder(x_reg, *cpu.CODE8_SPLIT).numpy()
    weight_operands = operands(codes, scale, k, dtype, kind)
    kernel = cpu.HIFLOAT8_LINEAR
    cpu._code8_gemv(x_reg, *weight_operands, *kernel.x_operands(x_reg, weight_operands, kernel.x_consts), y32.numpy())
    want = reference.lane_sums(x.float(), weight(codes, scale, dtype))
    assert torch.equal(y32.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["bytes", "words", "values"])
def test_mxfp8_every_code_under_every_scale_byte(dtype, kind):
    skip_without_the_instructions_of(kind, torch.bfloat16)  # FP16 x uses the BF16 tables of E4M3 values
    g = gen(14)
    codes = torch.arange(256, dtype=torch.uint8).repeat(32, 3)[:, :736].contiguous()  # K = 736: a one-block last step
    scales = torch.arange(256, dtype=torch.uint8).repeat(3)[torch.randperm(768, generator=g)][: 32 * 23].reshape(32, 23)
    x = torch.randn(2, 736, generator=g).to(dtype)
    x_reg = torch.zeros(2, 768)
    x_reg[:, :736] = x.float()
    y32 = torch.empty(2, 32)
    x_reg = wo_layout._reorder(x_reg, *cpu.CODE8_SPLIT).numpy()
    operands = cpu._mxfp8_operands(codes, scales, 736, dtype, kind)
    cpu._mxfp8_gemv(x_reg, *operands, *cpu._x_bounds_operands(x_reg, operands, ()), y32.numpy())
    want = reference.lane_sums(x.float(), reference.mxfp8_weight(codes, scales, dtype))
    assert torch.equal(y32.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(y32[finite].view(torch.int32), want[finite].view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mxfp8_rows_at_the_edges_of_the_exact_scale_range(dtype):
    """Rows whose scale bytes all lie in the range where the weights need no rounding to x's dtype (the
    kernel skips the rounding there), at both ends of it and one byte past each end, every finite code in each.
    Rows 0-3 are a block of exact rows (summed together), rows 4-7 a block of rows past the range (one by one,
    rounded), row 8 a last row on its own."""
    low, high = wo_steps._MXFP8_EXACT_BYTES_BF16 if dtype == torch.bfloat16 else wo_steps._MXFP8_EXACT_BYTES_F16
    row_scales = [(low, high), (low, low), (high, high), (high, low), (low - 1, high), (low, high + 1),
                  (low - 1, low - 1), (high + 1, high + 1), (low, high)]
    codes = torch.tensor(FINITE_E4M3 + [0, 0], dtype=torch.uint8).repeat(len(row_scales), 1)  # K = 256, no NaN
    scales = torch.tensor([[a, b] * 4 for a, b in row_scales], dtype=torch.uint8)
    x = (torch.rand(3, 256, generator=gen(15)) * 2.0**-12).to(dtype)  # small: a rounding to Inf would show
    for m in (1, 3):
        native_equals_reference(OPS["mxfp8"], x[:m], codes, scales, None)
        for order in ([4, 0, 1, 2, 3, 5, 6, 7, 8], [0, 1, 2, 5, 3, 4, 6, 7, 8]):  # a past-range row first or
            native_equals_reference(OPS["mxfp8"], x[:m], codes[order], scales[order], None)  # last in a block


def _every_lookup16_index(lookup, table, form=None):
    """Run ``lookup`` (a lookup16 intrinsic) on 32-lane ``table`` (or on ``form``, the table as the lookup
    reads it) with every index in every lane, high bits set or not, against table[16 * piece + (index & 15)]."""
    run = simd_binary(lookup, simd.f32v_load, simd.i32v_load, simd.f32v_store)
    form = table if form is None else form
    piece = np.arange(32) // 16
    for shift in range(16):  # each lane takes every index once
        for high_bits in (0, 0x30, 0xFFFFFF00):  # bits above the low 4 are ignored
            index = ((np.arange(32) * 7 + shift) % 16 | high_bits).astype(np.uint32).view(np.int32)
            out = np.empty(32, dtype=np.float32)
            run(form, index, out)
            assert np.array_equal(out.view(np.uint32), table[16 * piece + (index & 15)].view(np.uint32))


@pytest.mark.parametrize("lowering", ["portable", "avx512"])
def test_lookup16_every_index_in_every_lane(lowering):
    if lowering == "avx512" and not simd.HAS_AVX512F:
        pytest.skip("no AVX-512 on this CPU")
    _every_lookup16_index(simd.lookup16_avx512 if lowering == "avx512" else simd.lookup16_portable,
                          np.arange(32, dtype=np.float32) * 0.5 - 3)


@pytest.mark.parametrize("lowering", ["chosen", "avx2"])
def test_lookup16_signed_every_index_in_every_lane(lowering):
    """lookup16_signed (and its AVX2 form) on tables whose entries 8-15 are 0-7 with the sign bit set."""
    if lowering == "avx2" and not simd.HAS_AVX2:
        pytest.skip("no AVX2 on this CPU")
    entries = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 2.0**-130, 6.0e30, 0.0, 7.0, 0.25, 1e-3, 3.0, 5.0, 9.0, 2.0**100],
                       dtype=np.float32).reshape(2, 8)
    table = np.concatenate([entries, -entries], axis=1).reshape(-1)  # -0.0 at 8 and 24
    assert wo_layout._sign_symmetric(table)
    if lowering == "avx2":
        _every_lookup16_index(simd.lookup16_signed_avx2, table, simd.signed_tables_avx2(table))
    else:
        _every_lookup16_index(simd.lookup16_signed, table, simd.signed_tables(table))


_TEST_TABLE = np.arange(48, dtype=np.float32) - 7.5  # three rows of 16
_test_table_halves = simd.aligned_table_halves("lowbit.test.table", _TEST_TABLE)


def _load_halves(first, second):
    out = np.empty(simd.LANES, dtype=np.float32)
    simd.f32v_store(out, 0, _test_table_halves(first, second))
    return out


def test_aligned_table_halves_reads_the_rows_from_a_64_byte_aligned_constant():
    """Each half is the table's 16 floats at its offset, and the table is a module constant aligned to 64 bytes
    (numba's own array constants are aligned to 4: a row then straddles two cache lines)."""
    load = numba.njit(_load_halves)  # not cached: its LLVM IR can be inspected
    for first, second in ((0, 0), (16, 32), (32, 0), (8, 24)):
        assert np.array_equal(load(first, second), np.concatenate([_TEST_TABLE[first:first + 16],
                                                                   _TEST_TABLE[second:second + 16]]))
    (module,) = load.inspect_llvm().values()
    (definition,) = [line for line in module.splitlines() if line.startswith("@lowbit.test.table")]
    assert definition.endswith("align 64")
    with pytest.raises(TypeError, match="float32"):
        simd.aligned_table_halves("lowbit.test.ints", np.arange(16, dtype=np.int32))


@pytest.mark.parametrize("steps", ["mxfp4", "hifloat4"])
def test_the_4bit_steps_read_their_tables_aligned(steps):
    """The float32 tables of the MXFP4 and HiFloat4 steps (and HiFloat4's level multipliers) are loaded through
    aligned_table_halves, as the same values as the tables."""
    from lowbit.kernels.cpu import _weight_only_decode4 as wo_decode4

    pairs = {"mxfp4": [(wo_steps._mxfp4_table_halves, wo_layout._MXFP4_LOOKUP)],
             "hifloat4": [(wo_steps._hifloat4_table_halves, wo_layout._HIFLOAT4_LOOKUP),
                          (wo_decode4._e3_multiplier_halves, wo_decode4._E3_HALF_MULTIPLIERS),
                          (wo_decode4._e2_multiplier_halves, wo_decode4._E2_HALF_MULTIPLIERS)]}[steps]
    for loader, table in pairs:
        @numba.njit
        def read(first, second):
            out = np.empty(simd.LANES, dtype=np.float32)
            simd.f32v_store(out, 0, loader(first, second))
            return out

        rows = table.size // 16
        for first, second in ((0, 16 * (rows - 1)), (16 * (rows // 2), 16 * (rows // 3))):
            assert np.array_equal(read(first, second).view(np.uint32),
                                  np.concatenate([table[first:first + 16], table[second:second + 16]]).view(np.uint32))


@numba.njit
def _batch_buffer_of(kp, rows):
    return wo_batched._batch_buffer(kp, rows)


@pytest.mark.parametrize("kp", [64, 4096, 8192])
def test_the_batched_kernels_row_buffer_starts_on_a_64_byte_boundary(kp):
    """numba aligns its arrays to 32 bytes (a 64 KiB one landed 32 bytes off a 64-byte boundary every time), and
    the batched products then split every 64-byte load of W across two cache lines (1.55x their time)."""
    for rows in (1, 3, wo_steps.ROW_BLOCK):
        for _ in range(4):
            w = _batch_buffer_of(kp, rows)
            assert w.ctypes.data % 64 == 0
            assert w.size == wo_steps.ROW_BLOCK * kp and w.dtype == wo_batched._BATCH_WEIGHT
            assert not w[rows * kp :].any()


@numba.njit
def _telescope_in_place(table):
    simd.telescope_byte_tables(table)


def test_telescoped_byte_tables_undo_by_prefix_xor():
    """Both telescoped forms (numpy, and in place in registers) are chunk i XOR chunk i - 1 per 128-byte
    table, so XOR-ing chunks 0..i gives chunk i back."""
    table = np.random.default_rng(3).integers(0, 256, 256, dtype=np.uint8)
    in_place = table.copy()
    _telescope_in_place(in_place)
    assert np.array_equal(in_place, simd.telescoped(table))
    chunks = in_place.reshape(2, 8, 16)
    assert np.array_equal(np.bitwise_xor.accumulate(chunks, axis=1).reshape(-1), table)
    assert not np.array_equal(in_place, table)


def test_flat_is_a_view_of_every_element_in_order():
    @numba.njit
    def through_flat(a, i, value):
        view = simd.flat(a)
        view[i] = value
        return view.size, view.sum()

    for shape in ((3, 4), (2, 3, 5), (7,)):
        a = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
        size, total = through_flat(a, a.size - 1, -1.0)
        assert size == a.size and a.reshape(-1)[-1] == -1.0 and total == a.sum()

    @numba.njit
    def flat_size(a):
        return simd.flat(a).size

    assert flat_size(np.zeros((4, 0), dtype=np.float32)) == 0


def test_double_where_doubles_the_lanes_of_the_set_bits():
    @numba.njit
    def run(values, mask, out):
        simd.f32v_store(out, 0, simd.f32v_double_where(simd.f32v_load(values, 0), mask))

    values = (np.arange(32, dtype=np.float32) - 7) * 0.75
    values[3], values[4] = np.inf, np.nan
    for mask in (0, 1, 0x80000000, 0xA5A55A5A, 0xFFFFFFFF):
        out = np.empty(32, dtype=np.float32)
        run(values, np.uint32(mask), out)
        chosen = np.array([(mask >> i) & 1 for i in range(32)], dtype=bool)
        assert np.array_equal(out, np.where(chosen, values * 2, values), equal_nan=True)


def test_sum_tree_folds_in_the_reference_order():
    @numba.njit
    def tree(values):
        return simd.f32v_sum_tree(simd.f32v_load(values, 0))

    g = gen(9)
    for _ in range(20):
        values = (torch.randn(32, generator=g) * torch.exp2(torch.randint(-20, 20, (32,), generator=g))).numpy()
        acc = torch.from_numpy(values)
        while acc.numel() > 1:
            acc = acc[: acc.numel() // 2] + acc[acc.numel() // 2 :]
        assert np.float32(tree(values)).view(np.int32) == acc.numpy().view(np.int32)[0]


@pytest.mark.parametrize("split", [wo_layout.CODE8_BLOCK_SPLIT, wo_layout.CODE8_HALVES_SPLIT, wo_layout.NIBBLE_SPLIT,
                                   wo_layout.BYTE_SHUFFLE_SPLIT, wo_layout.HIFLOAT4_SHUFFLE_SPLIT])
def test_every_register_order_folds_as_the_reference(split):
    """A row's 64 lanes kept in a register order fold, level by level where they lie, to the bits of the
    reference's fold of the logical lanes (lane i + lane i + 32, then halves)."""
    order = cpu._order(*split)
    fold = wo_layout._make_fold(order)

    @numba.njit
    def run(lanes):
        return fold(simd.f32v_load(lanes, 0), simd.f32v_load(lanes, 32))

    g = gen(10)
    for _ in range(20):
        logical = torch.randn(64, generator=g) * torch.exp2(torch.randint(-24, 24, (64,), generator=g).float())
        acc = logical
        while acc.numel() > 1:
            acc = acc[: acc.numel() // 2] + acc[acc.numel() // 2 :]
        kept = logical[order].numpy()  # register lane l holds element order[l]
        assert np.float32(run(kept)).view(np.int32) == acc.numpy().view(np.int32)[0]
