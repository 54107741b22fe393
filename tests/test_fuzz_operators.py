"""Fuzzing every registered operator with malformed tensors: a clear typed error or the reference's bits.

Each case takes an operator's smallest probe and damages one tensor argument (its shape, dtype, or both),
then calls the operator on every backend. The call must either raise one of lowbit's documented error types
(naming the problem) or, when the damaged arguments are still valid, agree with the reference on the same
arguments. A native kernel reached with a tensor of the wrong size would read out of bounds: the process
would crash or the bits would differ, and this test would fail.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lowbit  # noqa: F401  (registers the operators)
from lowbit import backends
from lowbit.backends import Operator, tensors_of
from lowbit.errors import BackendUnavailable, DeviceError, DtypeError, ShapeError

OPERATORS = {name: op for name, op in sorted(backends.operators().items()) if isinstance(op, Operator)}
DOCUMENTED_ERRORS = (DtypeError, ShapeError, DeviceError, BackendUnavailable, ValueError, TypeError)
DTYPES = (torch.uint8, torch.int8, torch.int32, torch.float16, torch.bfloat16, torch.float32)


def _smallest_probe(op: Operator) -> tuple:
    return min(op.probes(), key=lambda args: sum(t.numel() for t in tensors_of(args)))


def _damaged(t: torch.Tensor, draw) -> torch.Tensor:
    """``t`` with a different shape and/or dtype, filled with random bytes."""
    shape = list(t.shape)
    kind = draw(st.sampled_from(["grow", "shrink", "drop_dim", "add_dim", "dtype"]))
    if kind in ("grow", "shrink") and shape:
        dim = draw(st.integers(0, len(shape) - 1))
        delta = draw(st.integers(1, 70))
        shape[dim] = shape[dim] + delta if kind == "grow" else max(0, shape[dim] - delta)
    elif kind == "drop_dim" and shape:
        shape.pop(draw(st.integers(0, len(shape) - 1)))
    elif kind == "add_dim":
        shape.insert(draw(st.integers(0, len(shape))), draw(st.integers(1, 3)))
    dtype = draw(st.sampled_from(DTYPES)) if kind == "dtype" else t.dtype
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)


def _outcome(op: Operator, args: tuple, backend: str):
    try:
        return op(*args, backend=backend)
    except DOCUMENTED_ERRORS as exc:
        assert str(exc), f"{op.name}: {type(exc).__name__} without a message"
        return exc


@pytest.mark.parametrize("name", OPERATORS)
@given(data=st.data())
def test_malformed_tensors_give_an_error_or_the_reference(name, data):
    op = OPERATORS[name]
    args = list(_smallest_probe(op))
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    index = data.draw(st.sampled_from(positions))
    args[index] = _damaged(args[index], data.draw)
    args = tuple(args)
    want = _outcome(op, args, "reference")
    for backend in ("native", "auto"):
        got = _outcome(op, args, backend)
        if isinstance(want, Exception):
            assert isinstance(got, Exception), f"{op.name}: {backend} accepted what the reference refused: {want}"
        elif isinstance(got, BackendUnavailable):
            continue  # the native kernel declines these arguments and says why
        else:
            assert not isinstance(got, Exception), f"{op.name}: {backend} refused valid arguments: {got}"
            for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
                assert op.agrees(g, w, args), f"{op.name}: {backend} differs from the reference"
