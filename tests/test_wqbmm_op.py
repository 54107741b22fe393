"""weight_quant_batch_matmul: routing, validation, custom op (opcheck, compile), the plan API."""

import pytest
import torch

from helpers import bits, wqbmm_operands

import lowbit.ops.wqbmm as wq
from lowbit import backends
from lowbit.errors import DeviceError, DtypeError, ShapeError
from lowbit.formats import wqbmm as ref


def _operands(m=3, k=256, n=96, g=64, dtype=torch.float16, seed=0):
    return wqbmm_operands(m, k, n, g, dtype, seed)


@pytest.mark.parametrize("backend", ["reference", "native", "auto"])
@pytest.mark.parametrize("template", ["basic", "preload"])
def test_backends_agree_with_leading_dims(backend, template):
    x, weight, scale = _operands(m=6)
    x3 = x.reshape(2, 3, -1)
    y = wq.weight_quant_batch_matmul(x3, weight, scale, group_size=64, template=template, backend=backend)
    assert y.shape == (2, 3, 96) and y.dtype == torch.float16
    assert torch.equal(bits(y.reshape(6, 96)), bits(ref.wqbmm_msd(x, weight, scale, None, 64)))
    assert backends.last_backend("weight_quant_batch_matmul") == ("reference" if backend == "reference" else "native")


def test_out_non_contiguous_and_offset():
    x, weight, scale = _operands(dtype=torch.bfloat16)
    offset = torch.randint(-4, 4, scale.shape).to(torch.bfloat16)
    out = torch.empty(96, 3, dtype=torch.bfloat16).t()
    result = wq.weight_quant_batch_matmul(x, weight, scale, antiquant_offset=offset, group_size=64, out=out)
    assert result is out
    assert torch.equal(bits(out), bits(ref.wqbmm_msd(x, weight, scale, offset, 64)))


def test_non_contiguous_x_and_empty_rows():
    x, weight, scale = _operands()
    wide = torch.cat([x, x], dim=1)[:, ::2]  # a strided view equal to x's values
    y = wq.weight_quant_batch_matmul(wide, weight, scale, group_size=64)
    assert torch.equal(bits(y), bits(ref.wqbmm_msd(wide.contiguous(), weight, scale, None, 64)))
    empty = wq.weight_quant_batch_matmul(x[:0], weight, scale, group_size=64)
    assert empty.shape == (0, 96)


def test_dequant_runs_natively_on_a_raw_and_on_a_packed_weight():
    x, weight, scale = _operands()
    y = wq.weight_quant_batch_matmul(x, weight, scale, group_size=64, algorithm="dequant", backend="reference")
    assert torch.equal(bits(y), bits(ref.wqbmm_dequant(x, weight, scale, None, 64)))
    wq.weight_quant_batch_matmul(x, weight, scale, group_size=64, algorithm="dequant", backend="native")
    assert backends.last_backend("weight_quant_batch_matmul") == "native"
    plan = wq.plan_weight_quant_batch_matmul(*x.shape, scale.shape[1], group_size=64, algorithm="dequant",
                                             dtype=x.dtype, prepacked=True, backend="auto")
    assert plan.backend == "native"  # the CPU kernel decodes its own tiles (docs/wqbmm.md)
    lo, hi = ref.dequant_interval(x, weight, scale, None, 64)
    y = plan.run(x, plan.pack_weight(weight), scale)
    assert bool(((y >= lo) & (y <= hi)).all())


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(x=torch.zeros(3, 256)), DtypeError, "float32"),
        (dict(weight=torch.zeros(256, 48, dtype=torch.int8)), DtypeError, "int8"),
        (dict(scale=torch.zeros(4, 96, dtype=torch.bfloat16)), DtypeError, "bfloat16"),
        (dict(scale=torch.zeros(4, 94, dtype=torch.float16)), ShapeError, r"\(4, 94\)"),
        (dict(x=torch.zeros(3, 128, dtype=torch.float16)), ShapeError, "K = 128"),
        (dict(group_size=96), ShapeError, "96"),
        (dict(group_size=48), ShapeError, "48"),
        (dict(weight=torch.zeros(256, 48, dtype=torch.uint8, device="meta")), DeviceError, "meta"),
        (dict(algorithm="fast"), ValueError, "fast"),
        (dict(template="turbo"), ValueError, "turbo"),
    ],
)
def test_clear_errors(change, error, match):
    x, weight, scale = _operands()
    args = dict(x=x, weight=weight, scale=scale, group_size=64, algorithm="msd", template="preload")
    args.update(change)
    with pytest.raises(error, match=match):
        wq.weight_quant_batch_matmul(
            args["x"], args["weight"], args["scale"], group_size=args["group_size"],
            algorithm=args["algorithm"], template=args["template"],
        )


def test_out_errors():
    x, weight, scale = _operands()
    with pytest.raises(ShapeError, match=r"\(3, 96\)"):
        wq.weight_quant_batch_matmul(x, weight, scale, group_size=64, out=torch.empty(3, 95, dtype=torch.float16))
    with pytest.raises(DtypeError, match="bfloat16"):
        wq.weight_quant_batch_matmul(x, weight, scale, group_size=64, out=torch.empty(3, 96, dtype=torch.bfloat16))


def test_opcheck_and_meta():
    x, weight, scale = _operands(m=2, k=128, n=64, g=32)
    offset = torch.ones(4, 64, dtype=torch.float16)
    for args in [
        (x, weight, scale, None, 32, "msd", "preload", None),
        (x, weight, scale, offset, 32, "msd", "basic", "native"),
    ]:
        torch.library.opcheck(torch.ops.lowbit.weight_quant_batch_matmul.default, args)
    out = torch.empty(2, 64, dtype=torch.float16)
    out_op = torch.ops.lowbit.weight_quant_batch_matmul_out.default
    torch.library.opcheck(out_op, (x, weight, scale, None, 32, "msd", "preload", out))
    meta = [t.to("meta") for t in (x, weight, scale)]
    y = torch.ops.lowbit.weight_quant_batch_matmul(*meta, None, 32)
    assert y.device.type == "meta" and y.shape == (2, 64) and y.dtype == torch.float16


def test_torch_compile_matches_eager():
    x, weight, scale = _operands()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(x, weight, scale):
        return wq.weight_quant_batch_matmul(x * 2, weight, scale, group_size=64) + 1

    expected = wq.weight_quant_batch_matmul(x * 2, weight, scale, group_size=64) + 1
    assert torch.equal(bits(f(x, weight, scale)), bits(expected))


@pytest.mark.parametrize("template", ["basic", "preload"])
def test_plan_run_and_reuse(template):
    x, weight, scale = _operands()
    plan = wq.plan_weight_quant_batch_matmul(3, 256, 96, group_size=64, template=template, backend="native")
    assert plan.backend == "native" and plan.workspace_nbytes > 0
    workspace, out = plan.new_workspace(), torch.empty(3, 96, dtype=torch.float16)
    expected = bits(ref.wqbmm_msd(x, weight, scale, None, 64))
    for _ in range(2):
        assert plan.run(x, weight, scale, out=out, workspace=workspace) is out
        assert torch.equal(bits(out), expected)
    assert wq.plan_weight_quant_batch_matmul(3, 256, 96, group_size=64, backend="reference").workspace_nbytes == 0


def _allocated_bytes(fn) -> int:
    """Bytes allocated by CPU tensors while fn runs (torch.profiler memory events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(e.cpu_memory_usage, 0) for e in prof.events())


@pytest.mark.parametrize("template", ["basic", "preload"])
def test_reused_plan_allocates_nothing(template):
    x, weight, scale = _operands(n=100)  # N % 64 != 0: the padded scale copy lives in the workspace too
    plan = wq.plan_weight_quant_batch_matmul(3, 256, 100, group_size=64, template=template, backend="native")
    workspace, out = plan.new_workspace(), torch.empty(3, 100, dtype=torch.float16)
    plan.run(x, weight, scale, out=out, workspace=workspace)  # first call compiles; the weight is repacked each call
    assert _allocated_bytes(lambda: plan.run(x, weight, scale, out=out, workspace=workspace)) == 0
    # without a workspace, the calling thread's scratch buffer, kept between calls (a new workspace on every
    # call cost an int4 layer at M = 256 page faults on 65 MiB: 10 instead of 5.5 ms)
    plan.run(x, weight, scale, out=out)
    assert _allocated_bytes(lambda: plan.run(x, weight, scale, out=out)) == 0
    # the counter does see allocations: without out, run allocates one
    assert _allocated_bytes(lambda: plan.run(x, weight, scale, workspace=workspace)) >= out.numel() * 2


def test_plan_refuses_bad_workspace_and_inputs():
    x, weight, scale = _operands()
    plan = wq.plan_weight_quant_batch_matmul(3, 256, 96, group_size=64, backend="native")
    good = plan.new_workspace()
    with pytest.raises(ShapeError, match="bytes"):
        plan.run(x, weight, scale, workspace=good[:-1])
    with pytest.raises(DtypeError, match="int32"):
        plan.run(x, weight, scale, workspace=torch.empty(plan.workspace_nbytes, dtype=torch.int32))
    with pytest.raises(DeviceError, match="meta"):
        plan.run(x, weight, scale, workspace=torch.empty(plan.workspace_nbytes, dtype=torch.uint8, device="meta"))
    with pytest.raises(ShapeError, match="plan is for"):
        plan.run(x[:2], weight, scale)
    with pytest.raises(DtypeError, match="plan is for"):
        plan.run(x.to(torch.bfloat16), weight, scale.to(torch.bfloat16))


def test_plan_validates_sizes():
    with pytest.raises(ShapeError, match="even"):
        wq.plan_weight_quant_batch_matmul(1, 256, 95)
    with pytest.raises(ShapeError, match="group_size"):
        wq.plan_weight_quant_batch_matmul(1, 200, 96, group_size=128)
    with pytest.raises(DtypeError, match="float32"):
        wq.plan_weight_quant_batch_matmul(1, 256, 96, dtype=torch.float32)


def test_inference_mode_and_smoke_contracts():
    from lowbit.cli.smoke import wqbmm as smoke
    from lowbit.cli.smoke._common import contracts_hold

    x, weight, scale = _operands()
    with torch.inference_mode():
        y = wq.weight_quant_batch_matmul(x, weight, scale, group_size=64, backend="native")
    assert torch.equal(bits(y), bits(ref.wqbmm_msd(x, weight, scale, None, 64)))
    results = smoke.run("native", torch.device("cpu"))
    assert len(results) == 16 and contracts_hold(results)
    assert {r["api"] for r in results} == {"one-shot", "packed plan"}
