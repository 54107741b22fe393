"""Regressions: the weight is never cached implicitly (explicit PackedWeight instead), the plan's device is
normalized, plan.run raises typed errors, the workspace's alignment is checked, ``lowbit verify`` on empty
files, and ``last_backend`` records every execution path."""

import numpy as np
import pytest
import torch

from helpers import bits, wqbmm_operands

import lowbit.ops.wqbmm as wq
from lowbit import backends
from lowbit.cli.main import main
from lowbit.errors import DeviceError, DtypeError, ShapeError
from lowbit.formats import wqbmm as ref

M, K, N, G = 3, 256, 96, 64


def _operands(dtype=torch.float16, seed=0, n=N):
    return wqbmm_operands(M, K, n, G, dtype, seed)


def _new_values(weight, seed=1):
    return torch.randint(0, 256, weight.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


@pytest.mark.parametrize("template", ["basic", "preload"])
@pytest.mark.parametrize("write", ["data_copy", "numpy", "inference_mode"])
def test_one_shot_sees_weight_changed_in_place(template, write):
    x, weight, scale = _operands()
    call = lambda: wq.weight_quant_batch_matmul(x, weight, scale, group_size=G, template=template, backend="native")
    assert torch.equal(bits(call()), bits(ref.wqbmm_msd(x, weight, scale, None, G)))
    new = _new_values(weight)
    if write == "data_copy":
        weight.data.copy_(new)
    elif write == "numpy":
        weight.numpy()[:] = new.numpy()
    else:
        with torch.inference_mode():
            weight, x, scale = weight.clone(), x.clone(), scale.clone()
            call()  # an inference tensor, used once, then changed in place
            weight.copy_(new)
    assert torch.equal(weight, new)
    with torch.inference_mode(write == "inference_mode"):
        assert torch.equal(bits(call()), bits(ref.wqbmm_msd(x, new, scale, None, G)))


@pytest.mark.parametrize("backend", ["native", "reference"])
@pytest.mark.parametrize("template", ["basic", "preload"])
def test_plan_raw_weight_is_repacked_per_run(backend, template):
    x, weight, scale = _operands()
    plan = wq.plan_weight_quant_batch_matmul(M, K, N, group_size=G, template=template, backend=backend)
    workspace, out = plan.new_workspace(), torch.empty(M, N, dtype=torch.float16)
    plan.run(x, weight, scale, out=out, workspace=workspace)
    weight.data.copy_(_new_values(weight))
    plan.run(x, weight, scale, out=out, workspace=workspace)
    assert torch.equal(bits(out), bits(ref.wqbmm_msd(x, weight, scale, None, G)))


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_packed_weight_is_a_snapshot(backend):
    x, weight, scale = _operands(n=100)
    plan = wq.plan_weight_quant_batch_matmul(M, K, 100, group_size=G, backend=backend, prepacked=True)
    packed = plan.pack_weight(weight)
    assert isinstance(packed, wq.PackedWeight) and packed.shape == (K, 50) and packed.device == torch.device("cpu")
    before = ref.wqbmm_msd(x, weight, scale, None, G)
    weight.data.copy_(_new_values(weight))
    y = plan.run(x, packed, scale)
    assert torch.equal(bits(y), bits(before))  # the snapshot, not the modified weight
    with pytest.raises(ValueError, match="pack_weight"):
        plan.run(x, weight, scale)  # a prepacked plan has no room to repack a raw weight


@pytest.mark.parametrize("template", ["basic", "preload"])
@pytest.mark.parametrize("prepacked", [False, True])
def test_reused_plan_allocates_nothing_with_either_weight(template, prepacked):
    from test_wqbmm_op import _allocated_bytes

    x, weight, scale = _operands(n=100)
    plan = wq.plan_weight_quant_batch_matmul(M, K, 100, group_size=G, template=template, backend="native",
                                             prepacked=prepacked)
    w = plan.pack_weight(weight) if prepacked else weight
    workspace, out = plan.new_workspace(), torch.empty(M, 100, dtype=torch.float16)
    plan.run(x, w, scale, out=out, workspace=workspace)
    assert _allocated_bytes(lambda: plan.run(x, w, scale, out=out, workspace=workspace)) == 0
    assert torch.equal(bits(out), bits(ref.wqbmm_msd(x, weight, scale, None, G)))


def test_raw_weight_workspace_holds_the_tiles():
    plain = wq.plan_weight_quant_batch_matmul(M, K, N, group_size=G, backend="native")
    prepacked = wq.plan_weight_quant_batch_matmul(M, K, N, group_size=G, backend="native", prepacked=True)
    assert plain.workspace_nbytes - prepacked.workspace_nbytes >= K * N // 2


def test_packed_weight_must_match_the_plan():
    x, weight, scale = _operands()
    plan = wq.plan_weight_quant_batch_matmul(M, K, N, group_size=G, backend="native", prepacked=True)
    other_g = wq.plan_weight_quant_batch_matmul(M, K, N, group_size=32, backend="native", prepacked=True)
    with pytest.raises(ValueError, match="group_size"):
        plan.run(x, other_g.pack_weight(weight), scale)
    reference_plan = wq.plan_weight_quant_batch_matmul(M, K, N, group_size=G, backend="reference", prepacked=True)
    with pytest.raises(ValueError, match="reference"):
        plan.run(x, reference_plan.pack_weight(weight), scale)
    with pytest.raises(ShapeError, match=r"\(256, 48\)"):
        plan.pack_weight(weight[:, :40])
    with pytest.raises(DtypeError, match="int8"):
        plan.pack_weight(weight.to(torch.int8))
    with pytest.raises(DeviceError, match="meta"):
        plan.pack_weight(weight.to("meta"))


@pytest.mark.parametrize("device", ["cpu:0", "cpu", torch.device("cpu", 0)])
def test_plan_device_is_normalized(device):
    x, weight, scale = _operands()
    plan = wq.plan_weight_quant_batch_matmul(M, K, N, group_size=G, backend="native", device=device)
    assert plan.device == torch.device("cpu")
    y = plan.run(x, weight, scale, workspace=plan.new_workspace())
    assert torch.equal(bits(y), bits(ref.wqbmm_msd(x, weight, scale, None, G)))


def test_plan_run_error_types():
    x, weight, scale = _operands()
    plan = wq.plan_weight_quant_batch_matmul(M, K, N, group_size=G, backend="reference")
    with pytest.raises(DtypeError, match=r"float16.*bfloat16"):
        plan.run(x.to(torch.bfloat16), weight, scale.to(torch.bfloat16))
    meta = [t.to("meta") for t in (x, weight, scale)]
    with pytest.raises(DeviceError, match=r"cpu.*meta"):
        plan.run(*meta)
    with pytest.raises(ShapeError, match=r"\(3, 256, 96\).*\(2, 256, 96\)"):
        plan.run(x[:2], weight, scale)


def test_misaligned_workspace_is_a_shape_error():
    x, weight, scale = _operands()
    plan = wq.plan_weight_quant_batch_matmul(M, K, N, group_size=G, backend="native")
    buf = torch.empty(plan.workspace_nbytes + 64, dtype=torch.uint8)
    with pytest.raises(ShapeError, match="align"):
        plan.run(x, weight, scale, workspace=buf[1:])
    y = plan.run(x, weight, scale, workspace=buf[64:])  # an aligned slice is fine
    assert torch.equal(bits(y), bits(ref.wqbmm_msd(x, weight, scale, None, G)))


def test_verify_empty_files_is_a_clean_error(tmp_path, capsys):
    empty, golden = tmp_path / "empty.bin", tmp_path / "golden.bin"
    empty.write_bytes(b"")
    (tmp_path / "empty2.bin").write_bytes(b"")
    np.asarray([1.0, 2.0], dtype=np.float16).tofile(golden)
    assert main(["verify", str(empty), str(tmp_path / "empty2.bin")]) == 2  # cannot compare: exit 2 (docs/cli.md)
    assert "empty.bin" in capsys.readouterr().err
    assert main(["verify", str(empty), str(golden)]) == 2
    assert "empty.bin" in capsys.readouterr().err


def test_last_backend_records_every_path():
    x, weight, scale = _operands()
    op = "weight_quant_batch_matmul"
    wq.weight_quant_batch_matmul(x, weight, scale, group_size=G, backend="native")
    assert backends.last_backend(op) == "native"
    wq.weight_quant_batch_matmul(x, weight, scale, group_size=G, algorithm="dequant")
    assert backends.last_backend(op) == "native"
    wq.weight_quant_batch_matmul(x, weight, scale, group_size=G, algorithm="dequant", backend="reference")
    assert backends.last_backend(op) == "reference"
    plan = wq.plan_weight_quant_batch_matmul(M, K, N, group_size=G, backend="native")
    wq.weight_quant_batch_matmul(x, weight, scale, group_size=G, backend="reference")
    assert backends.last_backend(op) == "reference"
    plan.run(x, weight, scale)
    assert backends.last_backend(op) == "native"
