"""lowbit.ops.library.call runs the Operator itself only where torch.ops.lowbit would do nothing else."""

import numpy as np
import pytest
import torch

import lowbit
from helpers import SeenFunctions, SeenOps
from lowbit.ops import weight_only as ops
from lowbit.ops.library import dispatches_plainly, plain_context

N, K = 48, 64


def _layer(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(3)
    codes, scales = lowbit.mxfp4_quantize(torch.randn(N, K, generator=g))
    return torch.randn(2, K, generator=g).to(dtype), codes, scales, torch.randn(N, generator=g).to(dtype)


class _Subclass(torch.Tensor):
    pass


def test_a_plain_call_runs_directly_with_the_bits_of_the_custom_op():
    x, codes, scales, bias = _layer()
    assert dispatches_plainly("mxfp4_linear", (x, codes, scales, bias), None)
    assert dispatches_plainly("mxfp4_linear", (x, codes, scales, None), "native")
    for b in (bias, None, bias.float()):
        got = ops.mxfp4_linear(x, codes, scales, b)
        want = torch.ops.lowbit.mxfp4_linear(x, codes, scales, b, None)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        assert lowbit.last_backend("mxfp4_linear") == "native"


def test_not_plain_arguments_go_through_the_custom_op():
    x, codes, scales, bias = _layer()
    plain = (x, codes, scales, bias)
    assert not dispatches_plainly("mxfp4_linear", (x.requires_grad_(),) + plain[1:], None)
    x.requires_grad_(False)
    assert not dispatches_plainly("mxfp4_linear", (x, codes, scales, bias._neg_view()), None)
    assert dispatches_plainly("mxfp4_linear", (*plain[:3], torch.nn.Parameter(bias, requires_grad=False)), None)
    assert not dispatches_plainly("mxfp4_linear", (*plain[:3], torch.nn.Parameter(bias.float())), None)
    assert not dispatches_plainly("mxfp4_linear", (x.as_subclass(_Subclass), *plain[1:]), None)
    assert not dispatches_plainly("mxfp4_linear", (x.to("meta"), *plain[1:]), None)
    assert not dispatches_plainly("mxfp4_linear", plain[:3], None)  # fewer arguments than parameters
    assert not dispatches_plainly("mxfp4_linear", (x, codes, scales, [1.0]), None)
    assert not dispatches_plainly("mxfp4_linear", plain, 3)
    assert not dispatches_plainly("mxfp4_quantize", (x,), None)  # fewer arguments than parameters
    with pytest.raises(TypeError, match="bias must be a tensor, got list"):  # named before any dispatch
        ops.mxfp4_linear(x, codes, scales, [1.0])


def test_scalar_arguments_of_their_exact_python_type_are_plain():
    """int / str parameters (and None for an optional one) pass through the dispatcher unchanged, so such a
    call runs directly too, with the custom op's bits; a bool or a numpy integer for an int, which the
    dispatcher converts or rejects, goes through it."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, K, generator=g).to(torch.float16)
    weight = torch.randint(0, 256, (K, N // 2), generator=g, dtype=torch.uint8)
    scale = torch.rand(K // 32, N, generator=g).to(torch.float16)
    args = (x, weight, scale, None, 32, "msd", "preload")
    assert dispatches_plainly("weight_quant_batch_matmul", args, None)
    assert dispatches_plainly("decode_from_hifloat8", (weight, None), None)
    assert dispatches_plainly("decode_from_hifloat8", (weight, 5), None)
    assert not dispatches_plainly("weight_quant_batch_matmul", (*args[:4], True, *args[5:]), None)
    assert not dispatches_plainly("weight_quant_batch_matmul", (*args[:4], np.int64(32), *args[5:]), None)
    assert not dispatches_plainly("weight_quant_batch_matmul", (*args[:5], None, args[6]), None)
    got = lowbit.weight_quant_batch_matmul(x, weight, scale, group_size=32)
    assert torch.equal(got, torch.ops.lowbit.weight_quant_batch_matmul(*args, None))
    assert lowbit.last_backend("weight_quant_batch_matmul") == "native"


def test_inference_tensors_are_plain():
    """Tensors made under torch.inference_mode (how models usually run inference) lack the autograd keys;
    they are called directly too, with the same result."""
    x, codes, scales, bias = _layer()
    want = ops.mxfp4_linear(x, codes, scales, bias)
    with torch.inference_mode():
        args = tuple(t.clone() for t in (x, codes, scales, bias))
        assert torch._C._dispatch_keys(args[0]) != torch._C._dispatch_keys(x)
        assert dispatches_plainly("mxfp4_linear", args, None)
        assert torch.equal(ops.mxfp4_linear(*args), want)


def test_gradients_keep_the_custom_ops_autograd_behaviour():
    x, codes, scales, bias = _layer()
    y = ops.mxfp4_linear(x.requires_grad_(), codes, scales, bias)
    assert y.requires_grad  # the custom op's autograd: its backward is an error (lowbit.ops.library.define)
    with pytest.raises(RuntimeError, match="lowbit::mxfp4_linear has no backward"):
        y.sum().backward()


def _grad_cases():
    """(name, function of (x, bias), x, bias) for paths that run a torch GEMM into an output buffer."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(70, K, generator=g).to(torch.bfloat16)  # more rows than any exact path takes
    bias = torch.randn(N, generator=g).to(torch.bfloat16)
    codes, scales = lowbit.mxfp4_quantize(torch.randn(N, K, generator=g))
    weight = torch.randint(0, 256, (K, N // 2), generator=g, dtype=torch.uint8)
    scale = torch.rand(K // 32, N, generator=g).to(torch.bfloat16)
    w, s, d, u = lowbit.svd_quant_decompose(torch.randn(N, K, generator=g).to(torch.bfloat16), 8)
    return [
        ("mxfp4_linear", lambda x, b: ops.mxfp4_linear(x, codes, scales, b), x, bias),
        ("weight_quant_batch_matmul dequant", lambda x, b: lowbit.weight_quant_batch_matmul(
            x, weight, scale, group_size=32, algorithm="dequant") + b, x, bias),
        ("svd_quant", lambda x, b: lowbit.svd_quant(x, w, s, d, u) + b, x, bias),
    ]


@pytest.mark.parametrize("case", _grad_cases(), ids=lambda c: c[0])
def test_inputs_that_require_grad_give_the_same_values(case):
    """Kernels run without autograd: a GEMM written into an output buffer must not meet a tensor that
    requires grad (torch refuses out= there)."""
    _, fn, x, bias = case
    want = fn(x, bias)
    got = fn(x.clone().requires_grad_(), torch.nn.Parameter(bias.clone()))
    assert got.requires_grad and torch.equal(got.detach(), want)


def test_modes_profiler_and_compile_see_the_custom_op():
    x, codes, scales, bias = _layer()
    for mode in (SeenOps(), SeenFunctions()):
        with mode:
            assert not dispatches_plainly("mxfp4_linear", (x, codes, scales, bias), None)
            ops.mxfp4_linear(x, codes, scales, bias)
        assert any("lowbit" in name and "mxfp4_linear" in name for name in mode.seen), mode.seen
    with torch.profiler.profile() as prof:
        ops.mxfp4_linear(x, codes, scales, bias)
    assert any(event.name == "lowbit::mxfp4_linear" for event in prof.events())
    with torch.inference_mode():
        assert dispatches_plainly("mxfp4_linear", (x, codes, scales, bias), None)
    assert torch.func.vmap(lambda row: ops.mxfp4_linear(row[None], codes, scales, bias)[0])(x).shape == (2, N)
    compiled = torch.compile(lambda *a: ops.mxfp4_linear(*a), fullgraph=True, backend="eager")
    assert torch.equal(compiled(x, codes, scales, bias).view(torch.int16),
                       ops.mxfp4_linear(x, codes, scales, bias).view(torch.int16))


def test_plain_context_sees_torchs_own_modes_and_transforms():
    """Fake tensors, functionalization and functorch's transforms are modes and interpreters of torch's own;
    inside any of them an op's call is not plain, even on tensors made outside."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    assert plain_context()
    for mode in (FakeTensorMode(), FunctionalTensorMode(), SeenOps()):
        with mode:
            assert not plain_context(), type(mode).__name__
    seen = []

    def record(t):
        seen.append(plain_context())
        return t

    x = torch.ones(2, 3)
    torch.func.vmap(record)(x)
    torch.func.functionalize(record)(x)
    torch.func.grad(lambda t: record(t).sum())(x)
    assert seen == [False, False, False]
    assert plain_context()
