"""Arrays of the SIMD layer that count no references (simd.borrowed_flat, simd.stack_bytes, and the one-call
kernels' int16_array_at): the rows' loops of the GEMV kernels pass them to inlined functions, so they must be
the views and buffers they claim to be."""

import numba
import numpy as np
import pytest
import torch
from numba.core.errors import TypingError

from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu._runtime import aligned_empty, int16_array_at


@numba.njit
def _borrowed_sum_and_fill(arr, value):
    view = simd.borrowed_flat(arr)
    total = 0.0
    for i in range(view.size):
        total += view[i]
        view[i] = value
    return view.size, total


def test_borrowed_flat_is_a_view_of_every_element():
    arr = np.arange(3 * 5 * 7, dtype=np.float32).reshape(3, 5, 7)
    size, total = _borrowed_sum_and_fill(arr, np.float32(-1.0))
    assert size == arr.size
    assert total == np.arange(arr.size).sum()
    assert np.all(arr == -1.0)  # the writes went to arr's memory


def test_borrowed_flat_refuses_a_non_contiguous_array():
    arr = np.zeros((4, 6), dtype=np.float32)
    with pytest.raises(TypingError):
        _borrowed_sum_and_fill(arr[:, ::2], np.float32(1.0))


@numba.njit
def _two_scratch_buffers(first_value, second_value):
    first = simd.stack_bytes(48)
    second = simd.stack_bytes(48)
    for i in range(first.size):
        first[i] = first_value
        second[i] = second_value
    total = 0
    for i in range(first.size):
        total += np.int64(first[i]) - np.int64(second[i])
    return first.size, second.size, total


def test_stack_bytes_gives_buffers_of_their_size_apart():
    first_size, second_size, total = _two_scratch_buffers(np.uint8(200), np.uint8(3))
    assert (first_size, second_size) == (48, 48)
    assert total == 48 * (200 - 3)  # writing the second left the first as it was


@numba.njit
def _scratch_of(count):
    return simd.stack_bytes(count).size


def test_stack_bytes_needs_a_compile_time_size():
    with pytest.raises(TypingError):
        _scratch_of(np.int64(48))


def test_int16_array_at_is_the_memory_at_a_tensors_address():
    """The one-call kernels' view of x and out (_runtime.int16_array_at): a (rows, cols) C-contiguous int16 array
    over the tensor's memory, read and written in place, from the address of a view with an offset too."""
    t = torch.arange(24, dtype=torch.int16).reshape(4, 6)

    @numba.njit
    def total_and_mark(address, rows, cols):
        a = int16_array_at(address, rows, cols)
        total = a.sum()
        a[rows - 1, cols - 1] = -1
        return total, a.shape[0], a.shape[1], a.strides[0]

    before = int(t.sum())
    assert total_and_mark(t.data_ptr(), 4, 6) == (before, 4, 6, 12)
    assert t[3, 5] == -1
    rows = t[1:3].view(torch.bfloat16)  # two rows from an offset, another 16-bit dtype
    before = int(t[1:3].sum())
    assert total_and_mark(rows.data_ptr(), 2, 6) == (before, 2, 6, 12)
    assert t[2, 5] == -1 and t[3, 5] == -1 and t[1, 0] == 6


def test_aligned_empty_starts_on_a_64_byte_boundary():
    """_runtime.aligned_empty: a C-contiguous (rows, cols) array of the dtype on a 64-byte boundary, whatever the
    allocator's offset (arrays allocated between calls move it), zero columns included, from Python and numba."""
    @numba.njit
    def made(rows, cols):
        a = aligned_empty(rows, cols, np.int16)
        a[:] = 7
        return a

    for rows, cols in ((1, 4096), (3, 100), (2, 0), (5, 33)):
        for dtype in (np.float32, np.int16):
            kept = [np.empty(k, dtype=np.uint8) for k in range(1, 9)]  # moves the allocator's next address
            a = aligned_empty(rows, cols, dtype)
            assert a.shape == (rows, cols) and a.dtype == dtype and a.flags.c_contiguous and kept
            assert a.ctypes.data % 64 == 0
        b = made(rows, cols)
        assert b.ctypes.data % 64 == 0 and b.shape == (rows, cols) and (b == 7).all()
