"""The CPU kernel of weight_quant_batch_matmul's "dequant" algorithm (lowbit.kernels.cpu.wqbmm_dequant): its
tiles are the reference's dequantized weight bit for bit, and its products lie in the summation interval
around the reference (docs/wqbmm.md, 'Dequant numerics'), for random and edge inputs, tiles of any width,
FP16 / BF16, with and without offsets, on 1 and 2 threads; the same on a PackedWeight's tiles, decoded in the
(N, K) orientation for the weight-only kernels' GEMM path (docs/wqbmm.md, 'Dequant on a PackedWeight')."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowbit
from helpers import bits, wqbmm_spread_operands
from lowbit.formats import wqbmm as ref
from lowbit.kernels.cpu import weight_only
from lowbit.kernels.cpu import wqbmm as cpu_wqbmm
from lowbit.kernels.cpu import wqbmm_dequant as dequant
from lowbit.kernels.cpu._runtime import as_numpy
from lowbit.ops import wqbmm as wq
from lowbit.quantize import modules


def _operands(seed, m, k, n, g, dtype, with_offset, specials):
    x, weight, scale, offset = wqbmm_spread_operands(torch.Generator().manual_seed(seed), m, k, n, g, dtype,
                                                     with_offset)
    if specials:
        info = torch.finfo(dtype)
        scale[0, n - 1] = info.max  # W * max overflows to Inf unless W is 0 or +-1
        scale[-1, 0] = info.tiny / 4  # subnormal weights
        scale[0, 0] = float("nan")
        scale[-1, n // 2] = -float("inf")
        x[m - 1, :g] = 0
        x[0, k - 1] = info.max
        if m > 1:
            x[1, 0] = float("nan")
    return x, weight, scale, offset


def _decoded(weight, scale, offset, g, dtype, c0, width, bf16_tile, serial):
    """The kernel's tile of columns c0 .. c0 + width, as values of ``dtype`` (BF16 x: a BF16 tile, or, without
    ``bf16_tile``, the float32 tile of CPUs without BF16 hardware), by its serial or its parallel form."""
    k, n = weight.shape[0], 2 * weight.shape[1]
    np_ = dequant.padded_columns(n)
    scale32 = torch.zeros(k // g, np_)
    scale32[:, :n] = scale.float()
    offset32 = torch.zeros(k // g, np_)
    if offset is not None:
        offset32[:, :n] = offset.float()
    args = (as_numpy(weight), scale32.numpy(), offset32.numpy(), offset is not None, g, c0)
    if dtype == torch.bfloat16 and bf16_tile:
        tile = torch.full((k, width), -1, dtype=torch.int16)
        dequant._decode_tile_bf16(*args, tile.numpy(), serial=serial)
        return tile.view(torch.bfloat16)
    tile = torch.full((k, width), -1.0)
    decode = dequant._decode_tile_bf16_as_f32 if dtype == torch.bfloat16 else dequant._decode_tile_f16
    decode(*args, tile.numpy(), serial=serial)
    return tile


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), g=st.sampled_from([32, 64, 96, 128]), groups=st.integers(1, 3),
       n=st.sampled_from([2, 34, 64, 130, 200]), first_step=st.integers(0, 6), bf16=st.booleans(),
       with_offset=st.booleans(), specials=st.booleans(), bf16_tile=st.booleans(), serial=st.booleans())
def test_tiles_are_the_reference_dequantized_weight(seed, g, groups, n, first_step, bf16, with_offset, specials,
                                                     bf16_tile, serial):
    """Any tile (starting at any decode step, a short last step included; BF16 or float32 for BF16 x) holds
    round_D((W + offset) * scale) exactly; NaN where the reference has NaN."""
    dtype = torch.bfloat16 if bf16 else torch.float16
    k = g * groups
    _, weight, scale, offset = _operands(seed, 2, k, n, g, dtype, with_offset, specials)
    c0 = min(first_step * 32, dequant.padded_columns(n) - 32)
    width = n - c0
    tile = _decoded(weight, scale, offset, g, dtype, c0, width, bf16_tile, serial)
    want = ref.dequantize_weight(weight, scale, offset, g)[:, c0:].to(tile.dtype)
    assert torch.equal(tile.isnan(), want.isnan())
    keep = ~want.isnan()
    assert torch.equal(bits(tile[keep]), bits(want[keep]))


def _within_interval(y, x, weight, scale, offset, g):
    """Every element of y inside ref.dequant_interval, or NaN where the reference is NaN, or anything where the
    absolute products sum beyond float32's range (the order decides whether an intermediate overflows)."""
    lo, hi = (t.float() for t in ref.dequant_interval(x, weight, scale, offset, g))
    want = ref.wqbmm_dequant(x, weight, scale, offset, g).float()
    w64 = ref.dequantize_weight(weight, scale, offset, g).double()
    s = x.double().abs() @ w64.abs()
    unbounded = ~torch.isfinite(s) | (s > torch.finfo(torch.float32).max)
    y32 = y.float()
    inside = (y32 >= lo) & (y32 <= hi)
    both_nan = y32.isnan() & want.isnan()
    return bool((inside | both_nan | unbounded).all())


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), m=st.sampled_from([1, 5, 49, 70]), g=st.sampled_from([32, 64, 96, 128]),
       groups=st.integers(1, 3), n=st.sampled_from([2, 34, 64, 130, 200]), bf16=st.booleans(),
       with_offset=st.booleans(), specials=st.booleans(), threads=st.sampled_from([1, 2]),
       tile_columns=st.sampled_from([32, 64, None]), bf16_gemm=st.booleans())
def test_products_lie_in_the_summation_interval(seed, m, g, groups, n, bf16, with_offset, specials, threads,
                                                 tile_columns, bf16_gemm):
    """The native product, one tile or several (a tile budget of 32 or 64 columns), BF16 x through torch's
    BF16 or float32 GEMM (BF16_GEMM), against the interval around the reference's ascending-k sum; NaN
    outputs are canonical."""
    dtype = torch.bfloat16 if bf16 else torch.float16
    k = g * groups
    x, weight, scale, offset = _operands(seed, m, k, n, g, dtype, with_offset, specials)
    before = torch.get_num_threads(), dequant.TILE_BYTES, dequant.BF16_GEMM
    torch.set_num_threads(threads)
    dequant.BF16_GEMM = bf16_gemm
    if tile_columns is not None:  # room for exactly this many float32 columns
        dequant.TILE_BYTES = k * tile_columns * 4
    try:
        y = wq.weight_quant_batch_matmul(x, weight, scale, antiquant_offset=offset, group_size=g,
                                         algorithm="dequant", backend="native")
    finally:
        torch.set_num_threads(before[0])
        dequant.TILE_BYTES, dequant.BF16_GEMM = before[1:]
    assert y.dtype == dtype and y.shape == (m, n)
    assert _within_interval(y, x, weight, scale, offset, g)
    nan_bits = 0x7FC0 if bf16 else 0x7E00
    assert (bits(y)[y.isnan()] == nan_bits).all()


def test_tile_widths_follow_the_budget():
    assert dequant.tile_columns(4096, 4096, 2) == 4096  # 32 MiB of BF16: the whole weight
    assert dequant.tile_columns(4096, 12288, 2) == 8192  # 64 MiB
    assert dequant.tile_columns(4096, 12288, 4) == 4096
    assert dequant.tile_columns(64, 100, 2) == 100  # all of N
    assert dequant.tile_columns(1 << 22, 4096, 4) == 32  # at least one decode step
    sizes = dequant.workspace_sizes(8, 4096, 12288, 128)
    assert sizes["tile"] == 64 << 20 and sizes["y32"] == 4 * 8 * 4096


def test_a_reused_workspace_and_out_give_the_same_result():
    x, weight, scale, offset = _operands(3, 70, 256, 130, 64, torch.bfloat16, True, False)
    plan = wq.plan_weight_quant_batch_matmul(70, 256, 130, group_size=64, algorithm="dequant",
                                             dtype=torch.bfloat16, backend="native")
    assert plan.workspace_nbytes >= sum(dequant.workspace_sizes(70, 256, 130, 64).values())
    workspace, out = plan.new_workspace(), torch.empty(70, 130, dtype=torch.bfloat16)
    first = plan.run(x, weight, scale, offset, workspace=workspace, out=out).clone()
    workspace.fill_(0xFF)
    second = plan.run(x, weight, scale, offset, workspace=workspace, out=out)
    assert second.data_ptr() == out.data_ptr() and torch.equal(bits(first), bits(second))
    one_shot = wq.weight_quant_batch_matmul(x, weight, scale, antiquant_offset=offset, group_size=64,
                                            algorithm="dequant", backend="native")
    assert torch.equal(bits(first), bits(one_shot))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_identity_rows_give_the_dequantized_weight(dtype):
    """x = I (K rows): every output is one product plus zeros, exact in any order: y is the weight itself
    (up to the sign of a zero)."""
    k, n, g = 128, 96, 32
    _, weight, scale, offset = _operands(11, 1, k, n, g, dtype, True, False)
    y = wq.weight_quant_batch_matmul(torch.eye(k, dtype=dtype), weight, scale, antiquant_offset=offset,
                                     group_size=g, algorithm="dequant", backend="native")
    assert torch.equal(y, ref.dequantize_weight(weight, scale, offset, g))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), g=st.sampled_from([32, 64, 96, 128]), groups=st.integers(1, 3),
       n=st.sampled_from([2, 30, 64, 130, 200]), first=st.integers(0, 70), count=st.integers(1, 80),
       bf16=st.booleans(), with_offset=st.booleans(), specials=st.booleans(), words=st.booleans(),
       serial=st.booleans())
def test_packed_tiles_are_the_reference_dequantized_weight(seed, g, groups, n, first, count, bf16, with_offset,
                                                            specials, words, serial):
    """Rows r0 .. r0 + count of the (N, K) tile decoded from a PackedWeight (any first row, so the 16-column
    steps and the single columns around them both run; on the calling thread or in parallel) hold the
    reference's round_D((W + offset) * scale) of those columns: BF16 bits for BF16 x (``words``), else float32
    values; NaN where the reference has NaN. The elements past K are not written."""
    dtype = torch.bfloat16 if bf16 else torch.float16
    words = words and bf16
    k = g * groups
    r0 = min(first, n - 1)
    count = min(count, n - r0)
    _, weight, scale, offset = _operands(seed, 2, k, n, g, dtype, with_offset, specials)
    scale32, offset32 = torch.zeros(k // g, n), torch.full((k // g, n), float("nan"))
    scale32.copy_(scale)
    if offset is not None:
        offset32.copy_(offset)
    tiles = cpu_wqbmm.MATMUL.pack_weight(weight, g)
    tile = torch.full((count, k + 64), -1, dtype=torch.int16 if words else torch.int32)
    out = tile if words else tile.view(torch.float32)
    args = (as_numpy(tiles), scale32.numpy(), offset32.numpy(), offset is not None, g, bf16, r0)
    if serial:
        dequant._packed_tile_rows(*args, 0, count, out.numpy())
    else:
        dequant._packed_tile(*args, out.numpy())
    got = tile[:, :k].view(torch.bfloat16) if words else out[:, :k]
    want = ref.dequantize_weight(weight, scale, offset, g)[:, r0 : r0 + count].t().to(got.dtype)
    assert torch.equal(got.isnan(), want.isnan())
    keep = ~want.isnan()
    assert torch.equal(bits(got[keep]), bits(want[keep]))
    assert (tile[:, k:] == -1).all()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), m=st.sampled_from([1, 5, 49, 70]), g=st.sampled_from([32, 64, 96, 128]),
       groups=st.integers(1, 3), n=st.sampled_from([2, 34, 64, 130, 200]), bf16=st.booleans(),
       with_offset=st.booleans(), specials=st.booleans(), threads=st.sampled_from([1, 2]),
       tile_rows=st.sampled_from([16, 40, None]), path=st.sampled_from(["float32", "bf16", "transposed"]))
def test_products_on_a_packed_weight_lie_in_the_summation_interval(seed, m, g, groups, n, bf16, with_offset,
                                                                   specials, threads, tile_rows, path):
    """A prepacked dequant plan's product, through each of the GEMM path's ways (float32 GEMM, torch's BF16
    GEMM, the transposed BF16 GEMM of AMX CPUs; forced here on any CPU), in one tile or several, against the
    interval around the reference's ascending-k sum; NaN outputs canonical; a reused, scribbled-over workspace
    gives the same bits."""
    dtype = torch.bfloat16 if bf16 else torch.float16
    k = g * groups
    x, weight, scale, offset = _operands(seed, m, k, n, g, dtype, with_offset, specials)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(weight_only, "BF16_GEMM", path != "float32")
        patch.setattr(weight_only, "TRANSPOSED_GEMM", path == "transposed")
        patch.setattr(weight_only, "TRANSPOSED_MIN_SIDE", 0)
        if tile_rows is not None:
            patch.setattr(weight_only, "GEMM_TILE_BYTES", tile_rows * weight_only._tile_width(k) * 2)
        plan = wq.plan_weight_quant_batch_matmul(m, k, n, group_size=g, algorithm="dequant", dtype=dtype,
                                                 backend="native", prepacked=True)
        packed, workspace = plan.pack_weight(weight), plan.new_workspace()
        y = plan.run(x, packed, scale, offset, workspace=workspace)
        workspace.fill_(0xFF)
        again = plan.run(x, packed, scale, offset, workspace=workspace)
    torch.set_num_threads(before)
    assert y.dtype == dtype and y.shape == (m, n)
    assert _within_interval(y, x, weight, scale, offset, g)
    assert torch.equal(bits(y), bits(again))
    nan_bits = 0x7FC0 if bf16 else 0x7E00
    assert (bits(y)[y.isnan()] == nan_bits).all()


@pytest.mark.parametrize("faster", [True, False])
def test_the_int4_layer_prefill_reads_the_packed_weight_where_that_is_faster(monkeypatch, faster):
    """Int4Linear above INT4_MSD_MAX_ROWS rows: the dequant product on its PackedWeight where
    packed_is_faster (bound to the layer: BoundDequant), else on the raw weight; either way the operator's bits
    plus the bias."""
    calls = []
    for name in ("dequant_packed_into", "dequant_into"):
        kernel = getattr(dequant, name)
        monkeypatch.setattr(dequant, name, lambda *args, _kernel=kernel, _name=name: (calls.append(_name),
                                                                                       _kernel(*args)))
    bound = dequant.BoundDequant.__call__
    monkeypatch.setattr(dequant.BoundDequant, "__call__", lambda self, *args: calls.append("BoundDequant")
                        or bound(self, *args))
    monkeypatch.setattr(dequant, "packed_is_faster", lambda dtype: faster)
    model = torch.nn.Sequential(torch.nn.Linear(256, 64)).bfloat16()
    lowbit.quantize_(model, "int4-a16w4")
    layer = model[0]
    x = torch.randn(modules.INT4_MSD_MAX_ROWS + 1, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    y = layer(x)
    assert calls == ["BoundDequant" if faster else "dequant_into"]
    plan = wq.plan_weight_quant_batch_matmul(*x.shape, 64, algorithm="dequant", dtype=x.dtype, prepacked=faster)
    weight = plan.pack_weight(layer.weight) if faster else layer.weight
    assert torch.equal(bits(y), bits(plan.run(x, weight, layer.antiquant_scale) + layer.bias))


@pytest.mark.parametrize("algorithm", ["msd", "dequant"])
def test_a_plan_for_the_raw_weight_runs_a_packed_one_in_its_own_workspace(algorithm):
    """A plan made without ``prepacked`` runs the raw weight and its own PackedWeight, each in a workspace of
    exactly ``workspace_nbytes`` (dequant lays out other buffers for a PackedWeight than for the raw weight)."""
    x, weight, scale, offset = _operands(5, 3, 256, 64, 128, torch.bfloat16, True, False)
    plan = wq.plan_weight_quant_batch_matmul(3, 256, 64, group_size=128, algorithm=algorithm, dtype=torch.bfloat16,
                                             backend="native")
    raw = plan.run(x, weight, scale, offset, workspace=plan.new_workspace())
    packed = plan.run(x, plan.pack_weight(weight), scale, offset, workspace=plan.new_workspace())
    if algorithm == "msd":
        assert torch.equal(bits(raw), bits(packed))
    else:
        assert _within_interval(raw, x, weight, scale, offset, 128)
        assert _within_interval(packed, x, weight, scale, offset, 128)


def test_gemm_tiles_start_on_whole_steps():
    """The GEMM path's tiles: the budget counts rows without their padding (4096^2: two BF16 tiles of 2048 rows
    for the transposed GEMM) and, where a tile is not all of N, holds a multiple of 128 rows, so that every tile
    starts on a 16-column step of the int4 decoder."""
    assert weight_only._tile_layout(4096, 4096, torch.bfloat16, True)[0] == 2048
    for n, k in ((4096, 4096), (12288, 8192), (11008, 4096), (4096, 11008), (300, 1 << 16)):
        for dtype, transposed in ((torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, False)):
            rows, nbytes = weight_only._tile_layout(n, k, dtype, transposed)
            assert rows == n or rows % 128 == 0 or rows < 128
            assert nbytes >= rows * weight_only._tile_width(k) * dtype.itemsize
