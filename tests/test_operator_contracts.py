"""One contract test over every registered operator (lowbit.backends.operators()).

Each operator is driven through its own probe inputs (the self-check's), so a new operator is covered by
registering it: custom-op registration (opcheck) for the functional and the ``_out`` op, fake-tensor
shapes, every kernel available here equal to the reference (numba on the CPU, Triton under its
interpreter), non-contiguous inputs, and ``out=`` that is non-contiguous or overlaps an input.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import lowbit  # noqa: F401  (registers the operators)
from lowbit import backends
from lowbit.backends import Operator, bits_equal, tensors_of

OPERATORS = {name: op for name, op in sorted(backends.operators().items()) if isinstance(op, Operator)}
KERNEL_PACKAGES = ("cpu", "cuda")  # numba, and Triton (interpreted on CPU tensors in the tests)


def _nan_free(out) -> bool:
    return not any(t.is_floating_point() and t.isnan().any() for t in _as_tuple(out))


def _smallest_probe(op: Operator) -> tuple:
    """The operator's smallest probe whose reference result holds no NaN (opcheck compares with
    torch.testing.assert_close, where NaN != NaN)."""
    usable = [args for args in op.probes() if _nan_free(_reference(op, args))]
    assert usable, f"{op.name}: add a probe whose outputs hold no NaN"
    return min(usable, key=lambda args: sum(t.numel() for t in tensors_of(args)))


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _reference(op: Operator, args: tuple):
    return op(*args, backend="reference")


def _agree(op: Operator, got, want, args) -> bool:
    return all(op.agrees(g, w, args) for g, w in zip(_as_tuple(got), _as_tuple(want)))


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous tensor (every other element of a wider buffer)."""
    wide = torch.empty(*t.shape, 2, dtype=t.dtype)
    wide[..., 0] = t
    return wide[..., 0]


@pytest.mark.parametrize("name", OPERATORS)
def test_opcheck_functional_and_out(name):
    op = OPERATORS[name]
    args = _smallest_probe(op)
    torch.library.opcheck(getattr(torch.ops.lowbit, name).default, (*args, None))
    outs = _as_tuple(op.new_outputs(*args))
    torch.library.opcheck(getattr(torch.ops.lowbit, name + "_out").default, (*args, *outs, None))


@pytest.mark.parametrize("name", OPERATORS)
def test_backward_is_an_error_or_no_gradient_never_a_silent_none(name):
    """Floating inputs that require grad: the quantizer without a straight-through estimator gives no gradient;
    every other operator's backward raises (it completed with None gradients and a warning)."""
    op = OPERATORS[name]
    args = tuple(a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in _smallest_probe(op))
    grads = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    results = _as_tuple(getattr(torch.ops.lowbit, name)(*args, None))
    outs = [t for t in results if t.requires_grad]
    if not grads or not any(t.is_floating_point() for t in results):  # codes and scales never require grad
        assert not outs
        return
    assert outs, f"{name}: an output of floating inputs that require grad must require grad"
    total = sum(t.float().sum() for t in outs)
    if name == "hifloat4_fake_quant":
        total.backward()
        assert all(a.grad is None for a in grads)
    else:
        with pytest.raises(RuntimeError, match=f"lowbit::{name} has no backward"):
            total.backward()


def test_a_compiled_graph_that_requires_grad_compiles_and_its_backward_is_the_error():
    """torch.compile traces the backward of a forward run in grad mode: it compiles (it failed at compile
    time), computes what eager computes, and its backward raises when it runs."""
    from lowbit import SVDQuantLinear

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64).bfloat16(), SVDQuantLinear(64, 64, rank=8,
                                                                                   backend="reference"))
    x = torch.randn(2, 64).bfloat16()
    y = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    assert y.requires_grad and torch.equal(y, model(x))
    with pytest.raises(RuntimeError, match="lowbit::svd_quant has no backward"):
        y.float().sum().backward()


@pytest.mark.parametrize("name", OPERATORS)
def test_fake_tensors_give_the_real_shapes_and_dtypes(name):
    op = OPERATORS[name]
    args = _smallest_probe(op)
    real = _as_tuple(_reference(op, args))
    with FakeTensorMode() as mode:
        fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        fake = _as_tuple(getattr(torch.ops.lowbit, name)(*fake_args, None))
    assert [(f.shape, f.dtype) for f in fake] == [(r.shape, r.dtype) for r in real]


@pytest.mark.parametrize("device_type", KERNEL_PACKAGES)
@pytest.mark.parametrize("name", OPERATORS)
def test_every_kernel_here_equals_the_reference_on_every_probe(name, device_type):
    op = OPERATORS[name]
    if device_type not in op.native:
        pytest.skip(f"{name} has no {device_type} kernel")
    kernel = op.native[device_type]()
    ran = 0
    for args in op.probes():
        if kernel.supports(*args) is not None:
            continue
        got = op.new_outputs(*args)
        kernel.run(*args, out=got)
        assert _agree(op, got, _reference(op, args), args), f"{name} {device_type} kernel differs on a probe"
        ran += 1
    assert ran, f"the {device_type} kernel of {name} supports none of its probes"


@pytest.mark.parametrize("backend", ["native", "auto"])
@pytest.mark.parametrize("name", OPERATORS)
def test_non_contiguous_inputs(name, backend):
    op = OPERATORS[name]
    if "cpu" not in op.native:
        pytest.skip(f"{name} has no CPU kernel")
    args = _smallest_probe(op)
    strided = tuple(_strided(a) if isinstance(a, torch.Tensor) and a.numel() > 1 else a for a in args)
    assert not all(t.is_contiguous() for t in tensors_of(strided))
    assert _agree(op, op(*strided, backend=backend), _reference(op, args), args)


@pytest.mark.parametrize("name", OPERATORS)
def test_out_that_is_non_contiguous_is_filled(name):
    op = OPERATORS[name]
    args = _smallest_probe(op)
    outs = tuple(_strided(torch.zeros_like(t)) for t in _as_tuple(op.new_outputs(*args)))
    result = op(*args, out=outs if len(outs) > 1 else outs[0])
    assert all(r is o for r, o in zip(_as_tuple(result), outs))
    assert _agree(op, result, _reference(op, args), args)


@pytest.mark.parametrize("name", OPERATORS)
def test_out_overlapping_an_input_gives_the_reference_result(name):
    """Each output placed over the start of the largest input's memory (the input is cloned first)."""
    op = OPERATORS[name]
    args = _smallest_probe(op)
    want = _reference(op, args)
    biggest = max(tensors_of(args), key=lambda t: t.numel() * t.element_size())
    index = next(i for i, a in enumerate(args) if a is biggest)
    for k, spec in enumerate(op.outputs(*args)):
        nbytes = max(biggest.numel() * biggest.element_size(), torch.Size(spec.shape).numel() * spec.dtype.itemsize)
        storage = torch.zeros(nbytes + 64, dtype=torch.uint8)
        shared = storage[: biggest.numel() * biggest.element_size()].view(biggest.dtype).view(biggest.shape)
        shared.copy_(biggest)
        call_args = args[:index] + (shared,) + args[index + 1:]
        outs = list(_as_tuple(op.new_outputs(*args)))
        outs[k] = storage[: torch.Size(spec.shape).numel() * spec.dtype.itemsize].view(spec.dtype).view(spec.shape)
        result = op(*call_args, out=tuple(outs) if len(outs) > 1 else outs[0], backend="auto")
        assert _agree(op, result, want, args), f"{name}: output {k} over input {index}"


def test_every_operator_is_registered_once_with_both_custom_ops():
    for name in OPERATORS:
        assert hasattr(torch.ops.lowbit, name) and hasattr(torch.ops.lowbit, name + "_out")


def test_bits_equal_compares_bytes():
    nan_a = torch.tensor([float("nan")]).view(torch.int32)
    nan_b = nan_a | 1
    assert not bits_equal(nan_a.view(torch.float32), nan_b.view(torch.float32))
    assert not bits_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert bits_equal(torch.tensor([1.5]), torch.tensor([1.5]))
