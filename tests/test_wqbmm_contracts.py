"""weight_quant_batch_matmul's kernel interface: malformed packed weights and workspaces are clear errors
(never a crash or a wrong read), workspace overlap, per-call kernel limits (Triton group sizes) with the
self-check's probes, last_backend only after execution, deterministic reference dequant, finite int4 scales and
argument type errors."""

import dataclasses
import subprocess
import sys
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowbit
import lowbit.ops.wqbmm as wq
from lowbit import backends
from lowbit.errors import BackendUnavailable, DeviceError, DtypeError, ShapeError
from lowbit.formats import wqbmm as ref
from lowbit.formats.int4 import quantize_int4_per_group
from lowbit.kernels.cpu import wqbmm as cpu
from helpers import bits
from test_wqbmm_op import _operands as operands

M, K, N, G = 3, 256, 100, 64  # N % 32 != 0: the CPU tiles are padded
CLEAR_ERRORS = (ShapeError, DtypeError, DeviceError, ValueError, TypeError)


def _operands(m=M, k=K, n=N, g=G, dtype=torch.float16, seed=0):
    return operands(m, k, n, g, dtype, seed)


# ---- 1. packed weights are checked against the kernel that reads them ---------------------------------

CRASH_SCRIPT = """
import torch, lowbit
from lowbit.errors import ShapeError
K, N, G = 4096, 8192, 128
for backend in ("native", "reference"):
    plan = lowbit.plan_weight_quant_batch_matmul(1, K, N, group_size=G, backend=backend, prepacked=True)
    bad = lowbit.PackedWeight(torch.zeros(16, dtype=torch.uint8), (K, N // 2), G, torch.device("cpu"), backend)
    x, scale = torch.ones(1, K, dtype=torch.float16), torch.ones(K // G, N, dtype=torch.float16)
    try:
        plan.run(x, bad, scale)
    except ShapeError as exc:
        print(backend, "ShapeError", exc)
"""


def test_hand_built_packed_weight_is_a_shape_error_not_a_crash():
    """The reported crash (a 16-byte PackedWeight for K, N = 4096, 8192), in a subprocess: a segfault
    there fails this test instead of killing the test run."""
    result = subprocess.run([sys.executable, "-c", CRASH_SCRIPT], capture_output=True, text=True, timeout=600,
                            env={"PYTHONPATH": ":".join(sys.path), "PATH": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert [line.split()[:2] for line in lines] == [["native", "ShapeError"], ["reference", "ShapeError"]]
    assert all("(16,)" in line for line in lines)


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_resized_or_replaced_packed_data_is_refused(backend):
    x, weight, scale = _operands()
    plan = wq.plan_weight_quant_batch_matmul(M, K, N, group_size=G, backend=backend, prepacked=True)
    packed = plan.pack_weight(weight)
    expected = bits(ref.wqbmm_msd(x, weight, scale, None, G))
    assert torch.equal(bits(plan.run(x, packed, scale)), expected)
    good_shape = tuple(packed.data.shape)
    with pytest.raises(ShapeError, match=r"packed weight must have shape"):
        plan.run(x, dataclasses.replace(packed, data=packed.data.reshape(-1)[:-1].clone()), scale)
    with pytest.raises(DtypeError, match="int8"):
        plan.run(x, dataclasses.replace(packed, data=packed.data.view(torch.int8)), scale)
    with pytest.raises(DeviceError, match="meta"):
        plan.run(x, dataclasses.replace(packed, data=packed.data.to("meta")), scale)
    # same bytes, other values: a valid layout, so it runs (no error, no crash)
    zeros = dataclasses.replace(packed, data=torch.zeros(good_shape, dtype=torch.uint8))
    assert plan.run(x, zeros, scale).shape == (M, N)
    packed.data.resize_(16)  # altered in place after packing
    with pytest.raises(ShapeError, match=r"\(16,\)"):
        plan.run(x, packed, scale)


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_a_packed_weight_relabelled_for_another_plan_is_refused(backend):
    """(K, N) = (128, 128) and (256, 64) pack to the same byte count: a PackedWeight of the first relabelled
    with dataclasses.replace ran on a plan of the second and gave another weight's numbers."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randint(0, 256, (128, 64), dtype=torch.uint8, generator=g)
    x, scale = torch.randn(2, 256, generator=g).half(), (torch.randn(8, 64, generator=g) / 8).half()
    first = wq.plan_weight_quant_batch_matmul(2, 128, 128, group_size=32, backend=backend, prepacked=True)
    second = wq.plan_weight_quant_batch_matmul(2, 256, 64, group_size=32, backend=backend, prepacked=True)
    packed = first.pack_weight(weight)
    with pytest.raises(ValueError, match=r"packed for shape \(128, 64\), group_size 32.*not as its fields say"):
        second.run(x, dataclasses.replace(packed, shape=(256, 32)), scale)
    copied = dataclasses.replace(packed, data=packed.data.clone())  # another tensor: taken as its fields say
    assert torch.equal(bits(first.run(x[:, :128], copied, scale[:4].repeat(1, 2))),
                       bits(first.run(x[:, :128], packed, scale[:4].repeat(1, 2))))


def test_kernel_objects_check_the_packed_weight_themselves():
    """No path reaches numba code with a wrong-size weight: the check is in the kernel's run."""
    x, weight, scale = _operands()
    out = torch.empty(M, N, dtype=torch.float16)
    with pytest.raises(ShapeError, match="packed weight"):
        cpu.MATMUL.run(x, weight, scale, None, G, "msd", "preload", None, True, out=out)
    with pytest.raises(ShapeError, match="weight must have shape"):
        cpu.MATMUL.run(x, weight[:, :10].contiguous(), scale, None, G, "msd", "preload", out=out)
    with pytest.raises(ShapeError, match="contiguous"):
        cpu.MATMUL.run(x, weight.t().contiguous().t(), scale, None, G, "msd", "preload", out=out)


@st.composite
def _malformed(draw):
    """A plan backend and a change that breaks the packed weight or the workspace."""
    backend = draw(st.sampled_from(["native", "reference"]))
    kind = draw(st.sampled_from(["numel", "dtype", "dims", "strided", "workspace_small", "workspace_dtype",
                                 "workspace_2d", "workspace_misaligned", "workspace_is_x", "workspace_is_weight"]))
    return backend, kind, draw(st.integers(0, 2**16))


@settings(max_examples=40)
@given(case=_malformed())
def test_malformed_packed_weights_and_workspaces_are_clear_errors(case):
    backend, kind, number = case
    x, weight, scale = _operands()
    plan = wq.plan_weight_quant_batch_matmul(M, K, N, group_size=G, backend=backend, prepacked=True)
    packed = plan.pack_weight(weight)
    data, workspace = packed.data, plan.new_workspace()
    if kind == "numel":
        size = number % (2 * data.numel())
        data = torch.zeros(size if size != data.numel() else size + 1, dtype=torch.uint8)
    elif kind == "dtype":
        data = data.view(torch.int8) if number % 2 else data.to(torch.float16)
    elif kind == "dims":
        data = data.reshape(1, -1) if number % 2 else data.reshape(-1, 2)
    elif kind == "strided":
        data = torch.stack([data, data], dim=-1)[..., 0]
    elif kind == "workspace_small":
        workspace = torch.empty(number % max(plan.workspace_nbytes, 1), dtype=torch.uint8)
        if plan.workspace_nbytes == 0:
            return  # the reference needs no workspace: any size will do
    elif kind == "workspace_dtype":
        workspace = torch.empty(plan.workspace_nbytes + 8, dtype=(torch.int32, torch.float16)[number % 2])
    elif kind == "workspace_2d":
        workspace = torch.empty(2, plan.workspace_nbytes + 1, dtype=torch.uint8)
    elif kind == "workspace_misaligned":
        if plan.workspace_nbytes == 0:
            return
        workspace = torch.empty(plan.workspace_nbytes + 64, dtype=torch.uint8)[1 + number % 63:]
    elif kind == "workspace_is_x":
        workspace = x.view(torch.uint8).reshape(-1)
    else:
        workspace = packed.data.reshape(-1)
    bad = dataclasses.replace(packed, data=data)
    expected = bits(ref.wqbmm_msd(x, weight, scale, None, G))
    try:
        y = plan.run(x, bad, scale, workspace=workspace)
    except CLEAR_ERRORS as exc:
        assert str(exc)
    else:  # accepted only if the change left a valid layout (the reference's strided copy, no workspace use)
        assert torch.equal(bits(y), expected), kind


# ---- 2. the workspace may not overlap the operands ----------------------------------------------------


@pytest.mark.parametrize("operand", ["x", "weight", "antiquant_scale"])
def test_workspace_overlapping_an_operand_is_a_shape_error(operand):
    x, weight, scale = _operands()
    plan = wq.plan_weight_quant_batch_matmul(M, K, N, group_size=G, backend="native")
    workspace = plan.new_workspace()
    operands = {"x": x, "weight": weight, "antiquant_scale": scale}
    source = operands[operand]
    assert source.numel() * source.element_size() < plan.workspace_nbytes
    inside = workspace[: source.numel() * source.element_size()].view(source.dtype).view(source.shape)
    operands[operand] = inside.copy_(source)  # the operand lives in the workspace's first bytes
    with pytest.raises(ShapeError, match=f"shares memory with {operand}"):
        plan.run(operands["x"], operands["weight"], operands["antiquant_scale"], workspace=workspace)


def test_out_overlapping_the_workspace_goes_through_a_temporary():
    x, weight, scale = _operands()
    plan = wq.plan_weight_quant_batch_matmul(M, K, N, group_size=G, backend="native")
    workspace = plan.new_workspace()
    out = workspace[: 2 * M * N].view(torch.float16).view(M, N)
    plan.run(x, weight, scale, out=out, workspace=workspace)
    assert torch.equal(bits(out), bits(ref.wqbmm_msd(x, weight, scale, None, G)))
    with pytest.raises(ShapeError, match="shares memory with out"):  # the kernel itself refuses it
        cpu.MATMUL.run(x, weight, scale, None, G, "msd", "preload", workspace, out=out)


# ---- 3. per-call kernel limits and the self-check's probes ---------------------------------------------

triton_wqbmm = pytest.importorskip("lowbit.kernels.triton.wqbmm", reason="triton is not installed")


def _args(g, m=3, n=70, algorithm="msd"):
    x, weight, scale = _operands(m=m, k=2 * g, n=n, g=g)
    return (x, weight, scale, None, g, algorithm, "preload")


def test_supports_declares_the_kernels_limits():
    for g in (32, 64, 128):
        assert triton_wqbmm.MATMUL.supports(*_args(g)) is None
    for g in (96, 160):
        assert "power-of-two" in triton_wqbmm.MATMUL.supports(*_args(g))
        assert cpu.MATMUL.supports(*_args(g)) is None
    assert "reference" in triton_wqbmm.MATMUL.supports(*_args(64, algorithm="dequant"))
    assert cpu.MATMUL.supports(*_args(96, algorithm="dequant")) is None  # the raw weight
    assert cpu.MATMUL.supports(*_args(64, algorithm="dequant"), prepacked=True) is None  # a PackedWeight
    assert wq.MATMUL.reference.supports(*_args(96, algorithm="dequant")) is None


def test_probes_cover_the_edge_shapes():
    probes = list(wq.MATMUL.probes())
    assert {p[4] for p in probes} == {32, 64, 96, 128, 160}
    assert any(p[0].shape[0] % 2 for p in probes) and any(p[0].shape[0] % 4 == 3 for p in probes)
    assert any(p[2].shape[1] % 32 for p in probes)
    assert {p[6] for p in probes} == set(wq.TEMPLATES)
    assert {p[0].dtype for p in probes} == {torch.float16, torch.bfloat16}
    assert any(p[3] is not None for p in probes) and any(p[3] is None for p in probes)
    assert any(p[0].isnan().any() for p in probes) and any(p[0].isinf().any() for p in probes)


@pytest.mark.parametrize("g", [32, 128])
def test_triton_kernel_object_odd_m_and_padded_n(g):
    x, weight, scale = _operands(m=5, k=2 * g, n=34, g=g, dtype=torch.bfloat16)
    offset = torch.randint(-8, 8, scale.shape).to(torch.bfloat16)
    expected = bits(ref.wqbmm_msd(x, weight, scale, offset, g))
    for template in wq.TEMPLATES:
        out = torch.empty(5, 34, dtype=torch.bfloat16)
        triton_wqbmm.MATMUL.run(x, weight, scale, offset, g, "msd", template, out=out)
        assert torch.equal(bits(out), expected), template


def test_auto_falls_back_per_call_where_the_triton_kernel_declines():
    """An operator whose native kernel is the Triton one (as on CUDA), run on the interpreter: the
    self-check passes on the probes it supports; g = 96 and 160 run on the reference under auto and raise
    BackendUnavailable naming the reason under native."""
    op = dataclasses.replace(wq.MATMUL, native={"cpu": lambda: triton_wqbmm.MATMUL}, _checked={},
                             _lock=threading.Lock())
    assert op.auto_check_error("cpu") is None
    for g in (64, 96, 160):
        args = _args(g)
        expected = bits(ref.wqbmm_msd(*args[:5]))
        assert torch.equal(bits(op(*args, backend="auto")), expected)
        assert backends.last_backend(op.name) == ("native" if g == 64 else "reference")
        if g != 64:
            with pytest.raises(BackendUnavailable, match=f"group_size {g}.*power-of-two"):
                op(*args, backend="native")


# ---- 4. last_backend only after execution ----------------------------------------------------------------


def test_planning_and_failed_runs_do_not_record_a_backend():
    x, weight, scale = _operands()
    wq.weight_quant_batch_matmul(x, weight, scale, group_size=G, backend="reference")
    assert backends.last_backend(wq.MATMUL.name) == "reference"
    plan = wq.plan_weight_quant_batch_matmul(M, K, N, group_size=G, backend="native")
    assert plan.backend == "native" and backends.last_backend(wq.MATMUL.name) == "reference"
    with pytest.raises(ShapeError):
        plan.run(x, weight, scale, workspace=plan.new_workspace()[:-1])
    with pytest.raises(ShapeError):
        wq.weight_quant_batch_matmul(x, weight[:, :4], scale, group_size=G, backend="native")
    assert backends.last_backend(wq.MATMUL.name) == "reference"
    plan.run(x, weight, scale)
    assert backends.last_backend(wq.MATMUL.name) == "native"


# ---- 5. dequant does not depend on the thread count -------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_reference_dequant_bits_do_not_depend_on_threads(dtype):
    x, weight, scale = _operands(m=33, k=256, n=1024, g=64, dtype=dtype, seed=5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = wq.weight_quant_batch_matmul(x, weight, scale, group_size=64, algorithm="dequant", backend="reference")
        torch.set_num_threads(2)
        two = wq.weight_quant_batch_matmul(x, weight, scale, group_size=64, algorithm="dequant", backend="reference")
    finally:
        torch.set_num_threads(before)
    assert torch.equal(bits(one), bits(two))
    # the documented order: float32 products summed in ascending k
    w = ref.dequantize_weight(weight, scale, None, 64).float()
    acc = torch.zeros(33, 1024)
    for k in range(256):
        acc = acc + x[:, k : k + 1].float() * w[k]
    assert torch.equal(bits(one), bits(acc.to(dtype)))


# ---- 6. int4 quantization never returns Inf scales --------------------------------------------------------


def test_overflowing_fp16_scales_are_a_clear_error():
    w = torch.randn(128, 8, generator=torch.Generator().manual_seed(0))
    w[70, 3] = 1e6  # K-group 1, column 3: scale 1e6 / 7 > 65504
    with pytest.raises(ValueError, match=r"K-group 1, column 3.*not finite"):
        quantize_int4_per_group(w, 64)
    with pytest.raises(ValueError, match=r"K-group 0, column 0"):
        quantize_int4_per_group(w * 1e6, 64)
    _, scale, _ = quantize_int4_per_group(w, 64, dtype=torch.bfloat16)  # bfloat16 holds it
    assert torch.isfinite(scale).all()
    w[5, 6] = float("inf")
    with pytest.raises(ValueError, match=r"weight.*K-group 0, column 6"):
        quantize_int4_per_group(w, 64, dtype=torch.bfloat16)


# ---- 7. argument types and group sizes ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["m", "k", "n", "group_size"])
@pytest.mark.parametrize("value", [3.0, True, "3"])
def test_plan_names_a_non_int_argument(name, value):
    sizes = dict(m=1, k=256, n=96, group_size=64)
    sizes[name] = value
    with pytest.raises(TypeError, match=name):
        wq.plan_weight_quant_batch_matmul(sizes.pop("m"), sizes.pop("k"), sizes.pop("n"), **sizes)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_plan_refuses_a_prepacked_that_is_not_a_bool(value):
    with pytest.raises(TypeError, match=f"prepacked must be a bool, got {type(value).__name__}"):
        wq.plan_weight_quant_batch_matmul(1, 256, 96, group_size=64, prepacked=value)


@pytest.mark.parametrize("group_size", [0, -32, 48, 96, 512])
def test_invalid_group_size_is_a_shape_error_everywhere(group_size):
    x, weight, scale = _operands(m=1, k=256, n=96, g=64)
    with pytest.raises(ShapeError, match="group_size"):
        wq.plan_weight_quant_batch_matmul(1, 256, 96, group_size=group_size)
    with pytest.raises(ShapeError, match="group_size"):
        wq.weight_quant_batch_matmul(x, weight, scale, group_size=group_size)
    if group_size <= 0 or 256 % group_size:
        with pytest.raises(ShapeError, match="group_size"):
            quantize_int4_per_group(torch.zeros(256, 8), group_size)
    with pytest.raises(TypeError, match="group_size"):
        wq.weight_quant_batch_matmul(x, weight, scale, group_size=64.0)


def test_public_names():
    assert lowbit.PackedWeight is wq.PackedWeight and lowbit.WqbmmPlan is wq.WqbmmPlan
