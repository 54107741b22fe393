"""A caller's tensors keep their properties through a CPU kernel: every operator's native call on its
self-check probes leaves each input and ``out`` tensor's storage resizable, as it was. (torch marks a storage
that ``Tensor.numpy()`` exported as not resizable for good, and a failed ``resize_`` of such a tensor leaves its
new sizes over its old memory, so a later read crashes; the kernels view tensors without that mark:
lowbit.kernels.cpu._runtime.as_numpy.)"""

import pytest
import torch

from lowbit.backends import operators
from lowbit.kernels.cpu._runtime import as_numpy

OPERATORS = sorted(operators())


def _tensors(args):
    return [a for a in args if isinstance(a, torch.Tensor)]


@pytest.mark.parametrize("name", OPERATORS)
def test_a_native_call_leaves_its_tensors_resizable(name):
    op = operators()[name]
    if op.auto_check_error("cpu") is not None:
        pytest.skip(f"no native CPU kernel for {name} here")
    ran = 0
    for args in op.probes():
        if op.native_kernel("cpu").supports(*args) is not None:
            continue
        args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)  # storages of their own
        out = op.new_outputs(*args)
        op(*args, out=out, backend="native")
        for t in _tensors(args) + _tensors(out if isinstance(out, tuple) else (out,)):
            assert t.untyped_storage().resizable(), (name, tuple(t.shape), t.dtype)
        ran += 1
        if ran == 3:
            break
    assert ran


def test_a_tensor_viewed_for_a_kernel_can_grow_afterwards():
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    view = as_numpy(x.t())
    assert view.tolist() == x.t().tolist() and view.strides == (4, 16)
    x.resize_(5, 4)  # raised, and left x broken, after x.numpy()
    assert x.shape == (5, 4) and x[:3].flatten().tolist() == list(range(12))
