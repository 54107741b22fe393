"""HiFloat4 operators: every backend == reference, out= (overlapping the input too), non-contiguous inputs,
malformed packed bytes, errors, routing, gradient, opcheck, torch.compile, and the smoke / bench CLI."""

import json

import numpy as np
import pytest
import torch

from helpers import FLOAT_DTYPES
from hypothesis import given
from hypothesis import strategies as st

import lowbit
from lowbit.cli.main import main as cli_main
from lowbit.dtypes import bit_view as bits
from lowbit.errors import DeviceError, DtypeError, ShapeError
from lowbit.formats import hifloat4
from lowbit.ops.hifloat4 import (
    FAKE_QUANT,
    PACK,
    UNPACK,
    hifloat4_fake_quant,
    hifloat4_pack,
    hifloat4_unpack,
    probe_input,
)

DTYPES = FLOAT_DTYPES


@pytest.mark.parametrize("backend", ["native", "reference", "auto"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_backend_equals_reference(backend, dtype):
    x = probe_input(dtype)
    for qdim, xq in ((-1, x), (0, x.t().contiguous()), (1, x)):
        out = hifloat4_fake_quant(xq, qdim, backend=backend)
        assert out.shape == xq.shape and out.dtype == dtype and out.is_contiguous()
        assert torch.equal(bits(out), bits(hifloat4.fake_quant(xq, qdim)))
    assert lowbit.last_backend("hifloat4_fake_quant") == ("reference" if backend == "reference" else "native")


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_non_contiguous_input_and_out(backend):
    x = probe_input(torch.bfloat16)
    view = x.t()  # (128, 16), quant dim 0 is strided
    expected = hifloat4.fake_quant(view.contiguous(), 0)
    assert torch.equal(bits(hifloat4_fake_quant(view, 0, backend=backend)), bits(expected))
    out = torch.empty(16, 128, dtype=torch.bfloat16).t()
    assert hifloat4_fake_quant(view, 0, out=out, backend=backend) is out
    assert torch.equal(bits(out.contiguous()), bits(expected))
    strided = torch.randn(4, 256).to(torch.float16)[:, ::2]
    assert torch.equal(bits(hifloat4_fake_quant(strided, backend=backend)),
                       bits(hifloat4.fake_quant(strided.contiguous())))


def test_out_errors():
    x = torch.randn(2, 64)
    with pytest.raises(TypeError, match="float16"):
        hifloat4_fake_quant(x, out=torch.empty(2, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"\(2, 64\)"):
        hifloat4_fake_quant(x, out=torch.empty(2, 128))
    with pytest.raises(ValueError, match="meta"):
        hifloat4_fake_quant(x, out=torch.empty(2, 64, device="meta"))


def test_operator_errors():
    with pytest.raises(RuntimeError, match="multiple of 64, got 100"):
        hifloat4_fake_quant(torch.ones(3, 100))
    with pytest.raises(RuntimeError, match="out of range"):
        hifloat4_fake_quant(torch.ones(64), 1)
    with pytest.raises(RuntimeError, match="0-d"):
        hifloat4_fake_quant(torch.tensor(2.0))
    with pytest.raises(TypeError, match="float64"):
        hifloat4_fake_quant(torch.ones(64, dtype=torch.float64))
    with pytest.raises(ValueError, match="bogus"):
        hifloat4_fake_quant(torch.ones(64), backend="bogus")
    with pytest.raises(lowbit.BackendUnavailable, match="meta"):
        FAKE_QUANT.native_kernel(torch.device("meta"))
    for op in (PACK, UNPACK):
        with pytest.raises(lowbit.BackendUnavailable, match="cuda"):
            op.native_kernel(torch.device("cuda"))


def test_qdim_must_be_an_int_not_a_bool():
    """True used to be taken as qdim 1; every entry point now refuses it, naming qdim."""
    x = torch.ones(64, 64)
    for qdim in (True, False, 1.0, "0"):
        with pytest.raises(TypeError, match="qdim"):
            hifloat4_fake_quant(x, qdim)
        with pytest.raises(TypeError, match="qdim"):
            hifloat4_fake_quant(x, qdim, out=torch.empty_like(x))
        with pytest.raises(TypeError, match="qdim"):
            FAKE_QUANT(x, qdim)
    assert torch.equal(hifloat4_fake_quant(x, np.int64(0)), hifloat4.fake_quant(x, 0))


def test_empty_tensor():
    for backend in ("native", "reference"):
        assert hifloat4_fake_quant(torch.ones(0, 128), backend=backend).shape == (0, 128)


def test_gradient_is_cut():
    x = torch.randn(64, 3, requires_grad=True)
    y = hifloat4_fake_quant(x, 0)
    (y.sum() + x.sum()).backward()
    assert torch.equal(x.grad, torch.ones_like(x))  # only the direct x.sum() path contributes


def test_pack_unpack_operators():
    for backend in ("native", "reference", "auto"):
        for dtype in DTYPES:
            x = probe_input(dtype)
            scale, value = hifloat4_pack(x, backend=backend)
            expected = hifloat4.pack(x)
            assert torch.equal(scale, expected[0]) and torch.equal(value, expected[1])
            out = hifloat4_unpack(scale, value, dtype, backend=backend)
            assert torch.equal(bits(out), bits(hifloat4_fake_quant(x)))
            assert lowbit.last_backend("hifloat4_unpack") == ("reference" if backend == "reference" else "native")
    assert PACK.resolve("cpu", "auto") == "native" and UNPACK.resolve("cpu", "auto") == "native"
    with pytest.raises(ShapeError, match="2-D"):
        hifloat4_pack(torch.ones(2, 2, 64))
    numpy_out = hifloat4_unpack(scale.numpy(), value.numpy())
    assert numpy_out.dtype == torch.float32
    assert torch.equal(bits(numpy_out), bits(hifloat4_fake_quant(x.float())))
    strided_value = torch.stack([value, torch.zeros_like(value)], dim=-1)[..., 0]
    assert not strided_value.is_contiguous()
    assert torch.equal(bits(hifloat4_unpack(scale, strided_value, backend="native")), bits(numpy_out))
    assert torch.equal(bits(hifloat4_unpack(scale.numpy(), strided_value.numpy(), backend="native")), bits(numpy_out))


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_pack_and_unpack_out(backend):
    x = probe_input(torch.bfloat16)
    expected = hifloat4.pack(x)
    scale = torch.empty(4, 2, 16, dtype=torch.uint8).permute(2, 1, 0)  # not contiguous
    value = torch.empty(16, 64, dtype=torch.uint8)
    result = hifloat4_pack(x, out=(scale, value), backend=backend)
    assert result[0] is scale and result[1] is value
    assert torch.equal(scale, expected[0]) and torch.equal(value, expected[1])
    out = torch.empty(128, 16, dtype=torch.float16).t()
    assert hifloat4_unpack(scale, value, out=out, backend=backend) is out  # dtype from out
    assert torch.equal(bits(out.contiguous()), bits(hifloat4.unpack(*expected, torch.float16)))
    with pytest.raises(TypeError, match="tuple of 2"):
        hifloat4_pack(x, out=value, backend=backend)
    with pytest.raises(ShapeError, match="out\\[1\\]"):
        hifloat4_pack(x, out=(scale, value[:, :32]), backend=backend)
    with pytest.raises(DtypeError, match="float16"):
        hifloat4_unpack(scale, value, torch.float32, out=out, backend=backend)
    with pytest.raises(TypeError, match="dtype"):
        hifloat4_unpack(scale, value, "float32", backend=backend)


def test_unpack_errors():
    scale, value = hifloat4_pack(torch.ones(2, 128))
    with pytest.raises(DtypeError, match="int8"):
        hifloat4_unpack(scale.to(torch.int8), value)
    with pytest.raises(DtypeError, match="value"):
        hifloat4_unpack(scale, value.float())
    with pytest.raises(DtypeError, match="float64"):
        hifloat4_unpack(scale, value, torch.float64)
    with pytest.raises(DeviceError):
        hifloat4_unpack(scale, value.to("meta"))
    with pytest.raises(ShapeError, match=r"\(2, 2, 4\)"):
        hifloat4_unpack(scale, value[:, :32], backend="native")


@st.composite
def packed_shapes(draw):
    """(scale shape, value shape): a valid pair (rows, n_blocks, 4) / (rows, n_blocks * 32), then usually
    broken: one dim changed, a dim added or one dropped, in either tensor."""
    rows, n_blocks = draw(st.integers(0, 4)), draw(st.integers(0, 4))
    shapes = [[rows, n_blocks, 4], [rows, n_blocks * 32]]
    for _ in range(draw(st.integers(0, 2))):
        shape = shapes[draw(st.integers(0, 1))]
        change = draw(st.sampled_from(["resize", "add", "drop"]))
        if change == "resize" and shape:
            i = draw(st.integers(0, len(shape) - 1))
            shape[i] = max(0, shape[i] + draw(st.sampled_from([-33, -32, -4, -1, 1, 3, 32, 64])))
        elif change == "add" and len(shape) < 4:
            shape.insert(draw(st.integers(0, len(shape))), draw(st.integers(0, 5)))
        elif change == "drop" and shape:
            shape.pop(draw(st.integers(0, len(shape) - 1)))
    return tuple(shapes[0]), tuple(shapes[1])


@given(shapes=packed_shapes(), seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from(DTYPES))
def test_unpack_of_malformed_bytes_is_a_shape_error_never_a_crash(shapes, seed, dtype):
    """Random scale/value shapes: a ShapeError unless they match, then the reference's bits; through
    the Python API and the registered op, with the native kernel (numba indexes without bounds checks)."""
    g = torch.Generator().manual_seed(seed)
    scale, value = (torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8)
                    for shape in shapes)
    valid = len(shapes[0]) == 3 and shapes[0][2] == 4 and shapes[1] == (shapes[0][0], shapes[0][1] * 32)
    calls = [lambda: hifloat4_unpack(scale, value, dtype, backend="native"),
             lambda: torch.ops.lowbit.hifloat4_unpack(scale, value, dtype, "native")]
    for run in calls:
        if valid:
            assert torch.equal(bits(run()), bits(hifloat4.unpack(scale, value, dtype)))
        else:
            with pytest.raises(ShapeError):
                run()
    if not valid:
        with pytest.raises(ShapeError):
            hifloat4_unpack(scale, value, out=torch.empty(shapes[1][:1] + (64,) if shapes[1] else (64,)))


@st.composite
def overlapping_buffers(draw):
    """(buffer, x offset, out offset, rows, qdim, dtype): x and out are windows of one buffer, out shifted
    by a drawn number of elements (0: in place; +-128: one row), quantized along the last dim or dim 0."""
    dtype = draw(st.sampled_from(DTYPES))
    qdim = draw(st.sampled_from([-1, 0]))
    rows = draw(st.integers(1, 3)) * (64 if qdim == 0 else 1)
    shift = draw(st.one_of(st.just(0), st.sampled_from([-128, 128, -64, 64]), st.integers(-400, 400)))
    return dtype, qdim, rows, shift, draw(st.integers(0, 2**31 - 1))


@pytest.mark.parametrize("backend", ["native", "auto", "reference"])
@given(drawn=overlapping_buffers())
def test_fake_quant_into_memory_overlapping_the_input(backend, drawn):
    """out= sharing memory with the input, shifted by any offset (in place included), gives the
    reference's bits of the input as it was before the call."""
    dtype, qdim, rows, shift, seed = drawn
    g = torch.Generator().manual_seed(seed)
    n = rows * 128
    buffer = (torch.randn(n + abs(shift), generator=g) * torch.exp2(torch.randn(1, generator=g) * 8)).to(dtype)
    buffer[int(torch.randint(n, (1,), generator=g))] = float("nan")
    x = buffer[max(0, -shift):][:n].view(rows, 128)
    out = buffer[max(0, shift):][:n].view(rows, 128)
    expected = hifloat4.fake_quant(x.clone(), qdim)
    assert hifloat4_fake_quant(x, qdim, out=out, backend=backend) is out
    assert torch.equal(bits(out), bits(expected))


@given(shift=st.integers(-300, 300), seed=st.integers(0, 2**31 - 1))
def test_pack_and_unpack_into_memory_overlapping_their_inputs(shift, seed):
    """The outputs of pack / unpack may share bytes with the inputs (views of one byte buffer)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 128, generator=g)
    scale, value = hifloat4.pack(x)
    expected = hifloat4.unpack(scale, value)
    n_bytes = x.numel() * 4
    buffer = torch.zeros(n_bytes + 1024, dtype=torch.uint8)
    base = 512
    x_in = buffer[base:base + n_bytes].view(torch.float32).view(2, 128)
    x_in.copy_(x)
    start = base + shift
    packed = (buffer[start:start + 16].view(2, 2, 4), buffer[start + 16:start + 144].view(2, 64))
    hifloat4_pack(x_in, out=packed, backend="native")
    assert torch.equal(packed[0], scale) and torch.equal(packed[1], value)
    start4 = base + shift // 4 * 4  # float32 outputs start on a 4-byte boundary
    unpacked = buffer[start4:start4 + n_bytes].view(torch.float32).view(2, 128)
    hifloat4_unpack(*packed, out=unpacked, backend="native")
    assert torch.equal(bits(unpacked), bits(expected))


def test_auto_self_check_passes_on_cpu():
    for op in (FAKE_QUANT, PACK, UNPACK):
        assert op.resolve("cpu", "auto") == "native"
        assert op.auto_check_error(torch.device("cpu")) is None


@pytest.mark.parametrize("op", [FAKE_QUANT, PACK, UNPACK], ids=lambda op: op.name)
def test_self_check_catches_a_kernel_wrong_in_one_element(op):
    """The probes reach every output: a kernel that is the reference except for the last byte of its
    last output fails the self-check."""

    class OffByOne(lowbit.backends.Kernel):
        def run(self, *args, out):
            op.reference.run(*args, out=out)
            last = (out if isinstance(out, torch.Tensor) else out[-1]).view(-1).view(torch.uint8)
            last[-1] ^= 1

    assert op._self_check(OffByOne(), torch.device("cpu")) is not None


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(dtype):
    x = torch.randn(3, 128).to(dtype)
    torch.library.opcheck(torch.ops.lowbit.hifloat4_fake_quant.default, (x, -1))
    torch.library.opcheck(torch.ops.lowbit.hifloat4_fake_quant.default, (x.t().contiguous(), 0))
    torch.library.opcheck(torch.ops.lowbit.hifloat4_fake_quant_out.default, (x, -1, torch.empty_like(x)))
    if dtype == torch.float32:
        torch.library.opcheck(torch.ops.lowbit.hifloat4_fake_quant.default, (x.requires_grad_(), 1))
    scale, value = hifloat4.pack(x.detach())
    torch.library.opcheck(torch.ops.lowbit.hifloat4_pack.default, (x.detach(),))
    torch.library.opcheck(torch.ops.lowbit.hifloat4_pack_out.default,
                          (x.detach(), torch.empty_like(scale), torch.empty_like(value)))
    torch.library.opcheck(torch.ops.lowbit.hifloat4_unpack.default, (scale, value, dtype))
    torch.library.opcheck(torch.ops.lowbit.hifloat4_unpack_out.default, (scale, value, dtype, torch.empty_like(x)))


def test_fake_tensors_give_shapes_and_errors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(5, 192, dtype=torch.bfloat16)
        y = torch.ops.lowbit.hifloat4_fake_quant(x, -1)
        assert y.shape == (5, 192) and y.dtype == torch.bfloat16
        with pytest.raises(RuntimeError, match="multiple of 64"):
            torch.ops.lowbit.hifloat4_fake_quant(x, 0)
        scale, value = torch.ops.lowbit.hifloat4_pack(x)
        assert scale.shape == (5, 3, 4) and value.shape == (5, 96) and value.dtype == torch.uint8
        assert torch.ops.lowbit.hifloat4_unpack(scale, value, torch.float16).shape == (5, 192)
        with pytest.raises(ShapeError):
            torch.ops.lowbit.hifloat4_unpack(scale, value[:, 1:], None)


def test_torch_compile():
    def f(x):
        return hifloat4_fake_quant(x * 2, 0) + 1

    def round_trip(x):
        return hifloat4_unpack(*hifloat4_pack(x * 2), torch.bfloat16)

    x = torch.randn(128, 5)
    assert torch.equal(torch.compile(f, fullgraph=True, backend="eager")(x), f(x))
    assert torch.equal(torch.compile(f, fullgraph=True)(x), f(x))
    assert torch.equal(torch.compile(round_trip, fullgraph=True, backend="eager")(x.t()), round_trip(x.t()))


# --- CLI -------------------------------------------------------------------------------------------------

def test_smoke_hifloat4_native_cpu(capsys):
    code = cli_main(["smoke", "hifloat4", "--backend", "native", "--device", "cpu", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["hardware_path_verified"] is True
    assert len(report["results"]) == 6
    assert all(r["matches_reference"] and r["poisoned_blocks_all_nan_others_not"] for r in report["results"])


def test_smoke_hifloat4_broken_kernel_exits_1(capsys, monkeypatch):
    from lowbit.cli.smoke import hifloat4 as smoke

    real = smoke.hifloat4_fake_quant
    monkeypatch.setattr(smoke, "hifloat4_fake_quant", lambda *a, **k: real(*a, **k) * 2)
    assert cli_main(["smoke", "hifloat4", "--device", "cpu"]) == 1
    capsys.readouterr()


def test_bench_hifloat4_runs_small(capsys):
    code = cli_main(["bench", "hifloat4", "--sizes", "262144", "--reference-size", "262144", "--repeats", "1",
                     "--qdims=-1,0", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [r["what"] for r in rows][:2] == ["memcpy (prealloc)", "fake-quant qdim=-1 out="]
    assert rows[-2]["x reference"] > 0
