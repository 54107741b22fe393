"""HiFloat4 operators: every backend == reference, out=, non-contiguous inputs, errors, routing, gradient,
opcheck, torch.compile, and the smoke / bench CLI."""

import json

import pytest
import torch

import lowbit
from lowbit.cli.main import main as cli_main
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

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


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
        FAKE_QUANT.select(torch.device("meta"), "native")


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
    assert PACK.resolve("cpu", "auto") == "native" and UNPACK.resolve("cpu", "auto") == "native"
    with pytest.raises(RuntimeError, match="2-D"):
        hifloat4_pack(torch.ones(2, 2, 64))
    numpy_out = hifloat4_unpack(scale.numpy(), value.numpy(), torch.float32)
    assert numpy_out.dtype == torch.float32


def test_auto_self_check_passes_on_cpu():
    assert FAKE_QUANT.resolve("cpu", "auto") == "native"
    assert FAKE_QUANT.auto_check_error(torch.device("cpu")) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(dtype):
    x = torch.randn(3, 128).to(dtype)
    torch.library.opcheck(torch.ops.lowbit.hifloat4_fake_quant.default, (x, -1))
    torch.library.opcheck(torch.ops.lowbit.hifloat4_fake_quant.default, (x.t().contiguous(), 0))
    torch.library.opcheck(torch.ops.lowbit.hifloat4_fake_quant_out.default, (x, torch.empty_like(x), -1))
    if dtype == torch.float32:
        torch.library.opcheck(torch.ops.lowbit.hifloat4_fake_quant.default, (x.requires_grad_(), 1))


def test_fake_tensors_give_shapes_and_errors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(5, 192, dtype=torch.bfloat16)
        y = torch.ops.lowbit.hifloat4_fake_quant(x, -1)
        assert y.shape == (5, 192) and y.dtype == torch.bfloat16
        with pytest.raises(RuntimeError, match="multiple of 64"):
            torch.ops.lowbit.hifloat4_fake_quant(x, 0)


def test_torch_compile():
    def f(x):
        return hifloat4_fake_quant(x * 2, 0) + 1

    x = torch.randn(128, 5)
    assert torch.equal(torch.compile(f, fullgraph=True, backend="eager")(x), f(x))
    assert torch.equal(torch.compile(f, fullgraph=True)(x), f(x))


# --- CLI -------------------------------------------------------------------------------------------------

def test_smoke_hifloat4_native_cpu(capsys):
    code = cli_main(["smoke", "hifloat4", "--backend", "native", "--device", "cpu"])
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
