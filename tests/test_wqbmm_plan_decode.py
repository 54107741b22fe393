"""A prepacked plan's run of few rows through the CPU kernel's one-call decode (WqbmmPlan._decoded): the same bits
as the operator and the reference, the operator's checks, and the cases where the operator's own path runs."""

import random

import pytest
import torch

from helpers import bits, wqbmm_spread_operands

import lowbit.ops.wqbmm as wq
from lowbit import backends
from lowbit.errors import DtypeError, ShapeError
from lowbit.formats import wqbmm as ref
from lowbit.kernels.cpu import wqbmm as cpu

K, G = 256, 64


@pytest.fixture
def decodes(monkeypatch):
    """The results of every decode_into call (True: the plan's run went through it)."""
    results = []
    decode_into = cpu.WeightQuantBatchMatmul.decode_into

    def recorded(*args):
        results.append(decode_into(*args))
        return results[-1]

    monkeypatch.setattr(cpu.WeightQuantBatchMatmul, "decode_into", staticmethod(recorded))
    return results


def _plan_and_operands(m, n, dtype, with_offset, seed=0, prepacked=True):
    x, weight, scale, offset = wqbmm_spread_operands(torch.Generator().manual_seed(seed), m, K, n, G, dtype, with_offset)
    plan = wq.plan_weight_quant_batch_matmul(m, K, n, group_size=G, dtype=dtype, backend="native", prepacked=prepacked)
    return plan, x, plan.pack_weight(weight), weight, scale, offset


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_offset", [False, True])
@pytest.mark.parametrize("m", [1, 3, cpu.decode_rows(K)])
def test_decode_equals_the_reference(decodes, dtype, with_offset, m):
    plan, x, packed, weight, scale, offset = _plan_and_operands(m, 96, dtype, with_offset, seed=m)
    expected = bits(ref.wqbmm_msd(x, weight, scale, offset, G))
    workspace, out = plan.new_workspace(), torch.empty(m, 96, dtype=dtype)
    for kwargs in ({}, {"workspace": workspace}, {"out": out}, {"out": out, "workspace": workspace}):
        wq.weight_quant_batch_matmul(x, weight, scale, antiquant_offset=offset, group_size=G, backend="reference")
        y = plan.run(x, packed, scale, offset, **kwargs)
        assert torch.equal(bits(y), expected)
        assert y is out if "out" in kwargs else y.shape == (m, 96)
        assert backends.last_backend("weight_quant_batch_matmul") == "native"
    assert decodes == [True] * 4


def test_leading_dims_and_a_plan_for_the_raw_weight(decodes):
    plan, x, packed, weight, scale, _ = _plan_and_operands(4, 64, torch.float16, False, prepacked=False)
    y = plan.run(x.reshape(2, 2, K), packed, scale, workspace=plan.new_workspace())  # the plan's larger workspace
    assert y.shape == (2, 2, 64)
    assert torch.equal(bits(y.reshape(4, 64)), bits(ref.wqbmm_msd(x, weight, scale, None, G)))
    assert decodes == [True]


def test_more_rows_or_padded_columns_take_the_operator(decodes):
    for m, n in ((cpu.decode_rows(K) + 1, 64), (2, 100)):
        plan, x, packed, weight, scale, _ = _plan_and_operands(m, n, torch.float16, False)
        assert torch.equal(bits(plan.run(x, packed, scale)), bits(ref.wqbmm_msd(x, weight, scale, None, G)))
    assert decodes == [False, False]


def test_a_nan_in_the_result_is_computed_by_the_operator(decodes):
    plan, x, packed, weight, scale, _ = _plan_and_operands(2, 64, torch.bfloat16, False)
    scale[1, 5] = float("nan")  # a NaN's bits depend on torch's code path
    y = plan.run(x, packed, scale)
    operator = wq.weight_quant_batch_matmul(x, weight, scale, group_size=G, backend="native")
    assert torch.isnan(y).any()
    assert torch.equal(bits(y), bits(operator))
    assert decodes == [False]


def test_operands_the_operator_would_copy_take_its_path(decodes):
    plan, x, packed, weight, scale, _ = _plan_and_operands(2, 64, torch.float16, False)
    expected = bits(ref.wqbmm_msd(x, weight, scale, None, G))
    wide = torch.zeros(2, 128, dtype=torch.float16)
    assert torch.equal(bits(plan.run(x, packed, scale, out=wide[:, ::2])), expected)  # out not contiguous
    assert torch.equal(bits(wide[:, ::2]), expected)
    negated = torch._neg_view(-x)  # memory holds -x
    assert torch.equal(bits(plan.run(negated, packed, scale)), expected)
    shared = torch.zeros(2 * K + 2 * 64, dtype=torch.float16)
    x_in, out_in = shared[:2 * K].view(2, K), shared[2 * K - 64:2 * K + 64].view(2, 64)  # out overlaps x
    x_in.copy_(x)
    assert plan.run(x_in, packed, scale, out=out_in) is out_in
    assert torch.equal(bits(out_in), expected)
    assert decodes == []


def test_checks_are_the_operators(decodes):
    plan, x, packed, _, scale, _ = _plan_and_operands(2, 64, torch.float16, False)
    workspace = plan.new_workspace()
    with pytest.raises(DtypeError, match="out"):
        plan.run(x, packed, scale, out=torch.empty(2, 64))
    with pytest.raises(ShapeError, match="out"):
        plan.run(x, packed, scale, out=torch.empty(2, 65, dtype=torch.float16))
    with pytest.raises(ShapeError, match="bytes"):
        plan.run(x, packed, scale, workspace=workspace[:-1])
    out = workspace[:256].view(torch.float16).view(2, 64)
    with pytest.raises(ShapeError, match="shares memory with out"):
        plan.run(x, packed, scale, out=out, workspace=workspace)
    with pytest.raises(ShapeError, match="packed weight"):
        plan.run(x, wq.PackedWeight(packed.data[:-1], packed.shape, G, packed.device, packed.backend), scale)
    assert decodes == []


def test_the_decode_stays_inside_the_plans_workspace(decodes):
    for m, n in ((1, 64), (3, 96), (cpu.decode_rows(K), 32)):
        plan, x, packed, weight, scale, _ = _plan_and_operands(m, n, torch.float16, False)
        assert cpu._decode_parts(m, K, n, G)[-1] <= plan.workspace_nbytes
        padded = torch.full((plan.workspace_nbytes + 4096,), 0xA5, dtype=torch.uint8)
        y = plan.run(x, packed, scale, workspace=padded[:plan.workspace_nbytes])
        assert torch.equal(bits(y), bits(ref.wqbmm_msd(x, weight, scale, None, G)))
        assert padded[plan.workspace_nbytes:].eq(0xA5).all()
    assert decodes == [True] * 3


def test_a_reused_plan_allocates_no_tensor(decodes):
    from test_wqbmm_op import _allocated_bytes

    plan, x, packed, _, scale, _ = _plan_and_operands(2, 64, torch.float16, False)
    workspace, out = plan.new_workspace(), torch.empty(2, 64, dtype=torch.float16)
    plan.run(x, packed, scale, out=out)
    assert _allocated_bytes(lambda: plan.run(x, packed, scale, out=out, workspace=workspace)) == 0
    assert _allocated_bytes(lambda: plan.run(x, packed, scale, out=out)) == 0  # the thread's scratch buffer
    assert all(decodes) and len(decodes) == 3


def test_the_warm_up_compiles_the_decode_after_the_self_check(decodes, monkeypatch):
    """The warm-up task of the operator runs its native kernel's compile_more, which runs the one-call decode
    (so that a warm-up worker compiles it, not the smoke's main process)."""
    from lowbit.kernels.cpu import warm

    calls = []
    compile_more = cpu.WeightQuantBatchMatmul.compile_more
    monkeypatch.setattr(cpu.WeightQuantBatchMatmul, "compile_more", lambda self: calls.append(compile_more(self)))
    assert warm._warm_operator(wq.MATMUL.name) is None
    assert len(calls) == 1 and decodes == [True]



def _odd_view(t: torch.Tensor, rng: random.Random, bad: bool = False) -> torch.Tensor:
    """``t``'s values in a random layout: as is, rows strided, at an odd offset or column-major; where ``bad``,
    another dtype or one column short instead (an error to expect)."""
    if bad:
        return t.to(torch.float32) if rng.random() < 0.5 else t[:, :-1]
    kind = rng.choice(["as is", "strided", "odd offset", "column-major"])
    if kind == "strided":
        return torch.stack([t, torch.zeros_like(t)], dim=1).flatten(0, 1)[::2]
    if kind == "odd offset":
        flat = torch.empty(t.numel() + 1, dtype=t.dtype)
        flat[1:] = t.reshape(-1)
        return flat[1:].view(t.shape)
    return t.t().contiguous().t() if kind == "column-major" else t


@pytest.mark.parametrize("seed", range(8))
def test_random_layouts_of_every_operand_give_the_reference_or_an_error(seed):
    """One operand of each run in a random layout (x, scale, offset or out: see _odd_view; out also overlapping
    x), fresh or reused workspaces, packed or raw weights, and in a quarter of the runs one operand wrong
    (dtype, shape, a short or strided workspace): each run gives the reference's bits, or, exactly where an
    operand is wrong, a ValueError, TypeError or RuntimeError; never a crash or other bits."""
    rng = random.Random(seed)
    for _ in range(24):
        m, n, dtype = rng.choice([1, 2, 3, cpu.decode_rows(K)]), rng.choice([32, 64, 96]), rng.choice([torch.float16,
                                                                                                      torch.bfloat16])
        plan, x, packed, weight, scale, offset = _plan_and_operands(m, n, dtype, rng.random() < 0.3, rng.randrange(99),
                                                                    prepacked=rng.random() < 0.5)
        want = ref.wqbmm_msd(x, weight, scale, offset, G)
        names = ["x", "scale", "out"] + ([] if offset is None else ["offset"])
        odd = rng.choice(names)
        bad = rng.choice(names + ["workspace"]) if rng.random() < 0.25 else None
        x, scale = _odd_view(x, rng, bad == "x") if "x" in (odd, bad) else x, (
            _odd_view(scale, rng, bad == "scale") if "scale" in (odd, bad) else scale)
        if offset is not None and "offset" in (odd, bad):
            offset = _odd_view(offset, rng, bad == "offset")
        out = rng.choice([None, torch.empty(m, n, dtype=dtype)])
        if "out" in (odd, bad):
            overlapping = x.reshape(-1)[:m * n].view(m, n) if x.is_contiguous() and x.numel() >= m * n else None
            out = _odd_view(torch.empty(m, n, dtype=dtype), rng, bad == "out") if bad == "out" or overlapping is None \
                or rng.random() < 0.7 else overlapping
        workspace = rng.choice([None, plan.new_workspace()])
        if bad == "workspace":
            workspace = rng.choice([plan.new_workspace()[:16],
                                    torch.empty(2 * plan.workspace_nbytes + 2, dtype=torch.uint8)[1::2]])
        run = lambda: plan.run(x, packed if plan.prepacked else rng.choice([packed, weight]), scale, offset,  # noqa
                               out=out, workspace=workspace)
        if bad:
            with pytest.raises((ValueError, TypeError, RuntimeError), match=bad if bad not in ("x", "scale") else None):
                run()
            continue
        got = run()
        assert got is out or out is None
        assert torch.equal(bits(got), bits(want))
