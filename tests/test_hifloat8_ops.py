"""HiFloat8 operators: upstream behaviours, every backend == reference bit for bit, contracts, errors."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lowbit
from helpers import HALF_DTYPES, bits
from lowbit.formats import hifloat8
from lowbit.kernels.cpu import hifloat8 as cpu_kernels
from lowbit.ops.hifloat8 import DECODE, ENCODE

triton_kernels = pytest.importorskip("lowbit.kernels.triton.hifloat8", reason="triton is not installed")

DTYPES = HALF_DTYPES
KERNELS = {"numba": cpu_kernels, "triton-interpreter": triton_kernels}


def edge_values(dtype):
    """NaN, +-Inf, +-0, subnormals, dtype max, and values next to every rounding threshold."""
    finfo = torch.finfo(dtype)
    base = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), finfo.max, -finfo.max, finfo.tiny,
            finfo.smallest_normal / 4, 2.0**-24, 2.0**-23, 2.0**-22, 40000.0, 40960.0, 28672.0, 32768.0]
    grid = [abs(hifloat8.code_value(c)) for c in range(0x80) if c not in (0x6F, 0x00)]
    grid = sorted(grid)
    midpoints = [(a + b) / 2 for a, b in zip(grid, grid[1:])]
    x = torch.tensor(base + grid + midpoints, dtype=torch.float64).to(dtype)
    neighbours = [x, torch.nextafter(x, torch.full_like(x, float("inf"))),
                  torch.nextafter(x, torch.full_like(x, float("-inf")))]
    x = torch.cat(neighbours)
    return torch.cat([x, -x])


# --- upstream behaviours (docs/hifloat8.md, "Operator contract") -------------------------------------------------

def test_encode_dtype_and_rejected_inputs():
    for dtype in DTYPES:
        assert lowbit.encode_to_hifloat8(torch.ones(4, dtype=dtype)).dtype == torch.uint8
    for dtype in (torch.float32, torch.int32):
        with pytest.raises(RuntimeError, match=str(dtype)):
            lowbit.encode_to_hifloat8(torch.ones(4, dtype=dtype))
        with pytest.raises(TypeError, match=str(dtype)):
            lowbit.encode_to_hifloat8(torch.ones(4, dtype=dtype))


def test_decode_dtype_default_and_choices():
    codes = torch.tensor([0x08, 0x18], dtype=torch.uint8)
    assert lowbit.decode_from_hifloat8(codes).dtype == torch.bfloat16
    for dtype in DTYPES:
        assert lowbit.decode_from_hifloat8(codes, dtype).dtype == dtype
    with pytest.raises(RuntimeError, match="float32"):
        lowbit.decode_from_hifloat8(torch.ones(2, dtype=torch.float32))
    with pytest.raises(RuntimeError, match="float32"):
        lowbit.decode_from_hifloat8(codes, torch.float32)


def test_exact_round_trip():
    x = torch.tensor([1.0, -1.0, 0.5, 2.0, 0.0], dtype=torch.float16)
    assert torch.equal(lowbit.decode_from_hifloat8(lowbit.encode_to_hifloat8(x), torch.float16), x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_relative_error_below_a_quarter(dtype):
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0)).to(dtype)
    y = lowbit.decode_from_hifloat8(lowbit.encode_to_hifloat8(x), dtype).float()
    big = x.float().abs() > 1e-4
    assert float(((y - x.float()).abs()[big] / x.float().abs()[big]).max()) < 0.25


def test_specials_and_fp16_bf16_agree():
    values = [0.0, -0.0, float("inf"), float("-inf"), float("nan")]
    expected = [0x00, 0x00, 0x6F, 0xEF, 0x80]
    for dtype in DTYPES:
        assert lowbit.encode_to_hifloat8(torch.tensor(values, dtype=dtype)).tolist() == expected


def test_upstream_regressions():
    x = torch.tensor([6.097555e-5], dtype=torch.float16)
    code = lowbit.encode_to_hifloat8(x)
    assert code.item() == 0x7C
    assert abs(lowbit.decode_from_hifloat8(code, torch.float16).float().item() / x.float().item() - 1) < 0.2
    assert lowbit.encode_to_hifloat8(torch.tensor([2.7180e-5], dtype=torch.float16)).item() == 0x7E


def test_decoding_all_codes_yields_one_nan():
    for dtype in DTYPES:
        assert int(lowbit.decode_from_hifloat8(torch.arange(256, dtype=torch.uint8), dtype).isnan().sum()) == 1


# --- kernels == reference, zero tolerance ----------------------------------------------------------

@pytest.mark.parametrize("kernel", KERNELS.values(), ids=KERNELS.keys())
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_encode_every_bit_pattern(kernel, dtype):
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
    out = torch.empty(x.shape, dtype=torch.uint8)
    kernel.ENCODE.run(x, out=out)
    assert torch.equal(out, hifloat8.encode(x))


@pytest.mark.parametrize("kernel", KERNELS.values(), ids=KERNELS.keys())
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_decode_every_code(kernel, dtype):
    codes = torch.arange(256, dtype=torch.uint8).repeat(3)
    out = torch.empty(codes.shape, dtype=dtype)
    kernel.DECODE.run(codes, out.dtype, out=out)
    assert torch.equal(bits(out), bits(hifloat8.decode(codes, dtype)))


@pytest.mark.parametrize("backend", ["native", "auto"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_edge_values_every_backend(backend, dtype):
    x = edge_values(dtype)
    codes = lowbit.encode_to_hifloat8(x, backend=backend)
    assert torch.equal(codes, hifloat8.encode(x))
    assert torch.equal(bits(lowbit.decode_from_hifloat8(codes, dtype, backend=backend)),
                       bits(hifloat8.decode(codes, dtype)))


shapes = st.lists(st.integers(1, 9), min_size=0, max_size=4)


@given(shape=shapes, seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from(DTYPES),
       view=st.sampled_from(["contiguous", "transposed", "strided"]))
def test_native_equals_reference_on_random_bit_patterns(shape, seed, dtype, view):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-32768, 32768, shape, generator=g, dtype=torch.int32).to(torch.int16).view(dtype)
    if view == "transposed" and x.dim() >= 2:
        x = x.transpose(0, -1)
    elif view == "strided" and x.dim() >= 1:
        x = x[..., ::2]
    codes = lowbit.encode_to_hifloat8(x, backend="native")
    assert codes.shape == x.shape and codes.is_contiguous()
    assert torch.equal(codes, hifloat8.encode(x))
    decoded = lowbit.decode_from_hifloat8(codes.mT if codes.dim() >= 2 else codes, dtype, backend="native")
    assert torch.equal(bits(decoded), bits(hifloat8.decode(codes.mT if codes.dim() >= 2 else codes, dtype)))


def test_triton_kernel_on_odd_sizes_and_non_block_multiples():
    g = torch.Generator().manual_seed(1)
    for n in (1, 7, 4095, 4097, 3 * 4096 + 5):
        x = torch.randint(-32768, 32768, (n,), generator=g, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        out = torch.empty(n, dtype=torch.uint8)
        triton_kernels.ENCODE.run(x, out=out)
        assert torch.equal(out, hifloat8.encode(x))


# --- contracts: shapes, out=, empty, errors -------------------------------------------------------

@pytest.mark.parametrize("backend", ["native", "reference"])
def test_empty_and_zero_dim(backend):
    empty = torch.empty(0, 3, dtype=torch.float16)
    assert lowbit.encode_to_hifloat8(empty, backend=backend).shape == (0, 3)
    assert lowbit.decode_from_hifloat8(torch.empty(0, dtype=torch.uint8), backend=backend).shape == (0,)
    scalar = torch.tensor(3.0, dtype=torch.bfloat16)
    assert lowbit.encode_to_hifloat8(scalar, backend=backend).shape == ()
    assert lowbit.encode_to_hifloat8(scalar, backend=backend).item() == 0x14


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_out_argument(backend):
    x = torch.randn(6, 5).to(torch.float16)
    out = torch.empty(6, 5, dtype=torch.uint8)
    assert lowbit.encode_to_hifloat8(x, out=out, backend=backend) is out
    assert torch.equal(out, hifloat8.encode(x))
    out_t = torch.empty(5, 6, dtype=torch.uint8).t()  # non-contiguous out
    lowbit.encode_to_hifloat8(x, out=out_t, backend=backend)
    assert torch.equal(out_t, hifloat8.encode(x))
    decoded = torch.empty(5, 6, dtype=torch.float16).t()
    lowbit.decode_from_hifloat8(out, out=decoded, backend=backend)
    assert torch.equal(bits(decoded), bits(hifloat8.decode(out, torch.float16)))


def test_out_errors():
    x = torch.randn(4).to(torch.float16)
    with pytest.raises(TypeError, match="uint8"):
        lowbit.encode_to_hifloat8(x, out=torch.empty(4, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"\(4,\)"):
        lowbit.encode_to_hifloat8(x, out=torch.empty(5, dtype=torch.uint8))
    with pytest.raises(ValueError, match="meta"):
        lowbit.encode_to_hifloat8(x, out=torch.empty(4, dtype=torch.uint8, device="meta"))
    codes = torch.zeros(4, dtype=torch.uint8)
    with pytest.raises(TypeError, match="float32"):
        lowbit.decode_from_hifloat8(codes, out=torch.empty(4))
    with pytest.raises(TypeError, match="dtype"):
        lowbit.decode_from_hifloat8(codes, torch.float16, out=torch.empty(4, dtype=torch.bfloat16))


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="bogus"):
        lowbit.encode_to_hifloat8(torch.ones(2, dtype=torch.float16), backend="bogus")


def test_native_without_a_kernel_for_the_device_is_unavailable():
    with pytest.raises(lowbit.BackendUnavailable, match="meta"):
        ENCODE.native_kernel(torch.device("meta"))
    assert ENCODE.resolve(torch.device("meta"), "auto") == "reference"


# --- backend routing --------------------------------------------------------------------------------

def test_default_backend_and_last_backend():
    x = torch.ones(3, dtype=torch.float16)
    with lowbit.use_backend("reference"):
        assert lowbit.get_backend() == "reference"
        lowbit.encode_to_hifloat8(x)
        assert lowbit.last_backend("encode_to_hifloat8") == "reference"
    lowbit.encode_to_hifloat8(x, backend="native")
    assert lowbit.last_backend("encode_to_hifloat8") == "native"
    assert ENCODE.resolve("cpu", "auto") == "native" and DECODE.resolve("cpu", "auto") == "native"
    with pytest.raises(ValueError, match="nope"):
        lowbit.set_backend("nope")


def test_environment_variable_sets_the_default(tmp_path):
    import subprocess
    import sys

    code = "import lowbit; print(lowbit.get_backend())"
    env = {"LOWBIT_BACKEND": "reference", "PATH": "", "PYTHONPATH": ":".join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "reference"


# --- torch.library and torch.compile --------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(dtype):
    x = torch.randn(3, 5).to(dtype)
    codes = hifloat8.encode(x)
    torch.library.opcheck(torch.ops.lowbit.encode_to_hifloat8.default, (x,))
    torch.library.opcheck(torch.ops.lowbit.decode_from_hifloat8.default, (codes, dtype))
    torch.library.opcheck(torch.ops.lowbit.encode_to_hifloat8_out.default, (x, torch.empty_like(codes)))
    torch.library.opcheck(torch.ops.lowbit.decode_from_hifloat8_out.default, (codes, dtype, torch.empty_like(x)))


def test_fake_tensors_give_shapes_and_errors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 7, dtype=torch.bfloat16)
        codes = torch.ops.lowbit.encode_to_hifloat8(x)
        assert codes.shape == (2, 7) and codes.dtype == torch.uint8
        assert torch.ops.lowbit.decode_from_hifloat8(codes, torch.float16).dtype == torch.float16
        with pytest.raises(RuntimeError, match="float32"):
            torch.ops.lowbit.encode_to_hifloat8(torch.empty(2, dtype=torch.float32))


def test_torch_compile():
    def round_trip(x):
        return lowbit.decode_from_hifloat8(lowbit.encode_to_hifloat8(x * 2), torch.float16) + 1

    compiled = torch.compile(round_trip, fullgraph=True, backend="eager")
    x = torch.randn(64).to(torch.float16)
    assert torch.equal(bits(compiled(x)), bits(round_trip(x)))


def test_torch_compile_fullgraph_with_out():
    """out= under fullgraph=True: the output checks (negative bit, inference tensor) are not traced."""
    def encode_into(x):
        return lowbit.encode_to_hifloat8(x, out=torch.empty(x.shape, dtype=torch.uint8))

    x = torch.randn(3, 64).to(torch.bfloat16)
    for backend in ("eager", "inductor"):
        assert torch.equal(torch.compile(encode_into, fullgraph=True, backend=backend)(x), encode_into(x))


def test_torch_compile_inductor():
    compiled = torch.compile(lambda x: lowbit.encode_to_hifloat8(x.abs()), fullgraph=True)
    x = torch.randn(33).to(torch.bfloat16)
    assert torch.equal(compiled(x), hifloat8.encode(x.abs()))
