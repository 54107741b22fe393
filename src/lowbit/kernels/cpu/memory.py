"""CPU memory for the kernels: tensors advised for transparent huge pages, for weights that the decode
kernels stream and for large outputs, and a per-thread scratch buffer kept between calls, for temporaries too
large to allocate afresh on every call.

A GEMV reads every byte of its weight once per call; with 4 KiB pages that is a TLB miss every 4 KiB per
stream. Backed by 2 MiB pages the same read is faster (benchmarks/results_weight_only.md, 'Huge pages').
A large output is fresh memory on every call, and its first writes fault its pages in: 2 MiB ones cost
fewer faults (:func:`output_empty`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import mmap
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Optional

import torch

HUGE_PAGE = 2 << 20  # bytes: the x86-64 transparent huge page


def huge_page_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of the CPU tensor ``t`` (same shape, dtype and values) in an anonymous mapping that
    starts on a 2 MiB boundary and is advised for huge pages (Linux ``madvise(MADV_HUGEPAGE)``), so that
    the OS backs it with 2 MiB pages where it has them (transparent huge pages in mode ``always`` or
    ``madvise``). The mapping lives as long as the returned tensor (or a view of it).

    Returns ``t`` itself where this does not apply: a tensor that is not on the CPU, is smaller than one
    huge page, a platform without ``MADV_HUGEPAGE``, or a mapping the OS refuses (out of memory). The copy
    never requires grad."""
    if t.device.type != "cpu":
        return t
    copy = _huge_page_tensor(t.shape, t.dtype)
    if copy is None:
        return t
    with torch.no_grad():
        copy.copy_(t)
    return copy


def huge_page_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A new contiguous CPU tensor of ``shape`` and ``dtype``, contents undefined: in huge pages as
    huge_page_copy makes them where that applies (at least one huge page of bytes, Linux), else torch.empty."""
    empty = _huge_page_tensor(shape, dtype)
    return torch.empty(shape, dtype=dtype) if empty is None else empty


def _huge_page_tensor(shape: Sequence[int], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """An uninitialized contiguous CPU tensor in a 2 MiB-aligned anonymous mapping advised for huge pages, or
    None where that does not apply (fewer bytes than a huge page, no ``MADV_HUGEPAGE``, a refused mapping)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:  # private: a shared anonymous mapping is shmem, which has no transparent huge pages by default
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # no address space or memory for a second copy now
        return None
    offset = -torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE  # a multiple of 4 KiB
    try:
        region.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
    except OSError:  # a kernel without transparent huge pages: ordinary pages
        pass
    # storage of exactly nbytes (torch.save and deepcopy copy whole storages), holding a reference to region
    return torch.frombuffer(region, dtype=torch.uint8, offset=offset, count=nbytes).view(dtype).view(tuple(shape))


# glibc's malloc gives every allocation above its mmap threshold (which grows up to 32 MiB on 64-bit Linux)
# a mapping of its own and unmaps it when freed: a tensor of at least this many bytes is fresh memory on every
# call, its 4 KiB pages faulted in by the first writes. Smaller ones reuse memory malloc keeps, already
# faulted in (advising those would cost more than it saves: benchmarks/RESULTS.md, 'Allocating calls in
# huge pages').
FRESH_OUTPUT_BYTES = 32 << 20


def output_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on the CPU, for an output that a kernel writes in full. Where it has
    at least FRESH_OUTPUT_BYTES, the 2 MiB pages inside it are advised for transparent huge pages (Linux
    ``madvise(MADV_HUGEPAGE)``) before anything writes to it, so the kernel's first writes fault in 2 MiB
    pages instead of 4 KiB ones (an allocating call of 64M elements: 0.5-0.8x the time on an Intel Xeon Ice
    Lake). The memory is torch's own, as torch.empty allocates it (unlike huge_page_empty's mapping); without
    transparent huge pages nothing changes."""
    out = torch.empty(tuple(shape), dtype=dtype, device="cpu")
    if type(out) is not torch.Tensor:  # a fake tensor (torch.compile's tracing): no memory, maybe symbolic sizes
        return out
    nbytes = out.numel() * out.element_size()
    advise = _madvise()
    if nbytes >= FRESH_OUTPUT_BYTES and advise is not None:
        start = -(-out.data_ptr() // HUGE_PAGE) * HUGE_PAGE  # the whole huge pages inside the tensor's memory
        end = (out.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
        if end > start:
            advise(start, end - start, mmap.MADV_HUGEPAGE)  # a failure (no huge pages) leaves ordinary pages
    return out


@functools.cache
def _madvise() -> Optional[Callable[[int, int, int], int]]:
    """libc's ``madvise`` (Linux with MADV_HUGEPAGE), or None."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        advise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    advise.argtypes, advise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return advise


class _ThreadScratch(threading.local):
    buffer: torch.Tensor | None = None  # per thread: a 1-D uint8 CPU tensor, grown on demand
    in_use: bool = False  # lent out by thread_scratch


_SCRATCH = _ThreadScratch()


@contextlib.contextmanager
def thread_scratch(nbytes: int):
    """``with thread_scratch(nbytes) as buffer``: a 1-D uint8 CPU tensor of ``nbytes`` bytes, contents
    undefined, for the duration of the block: the calling thread's scratch buffer.

    The buffer is kept between calls and only grown (to exactly what a call asks for), so a kernel that
    decodes into a large temporary on every call does not pay the page faults of a fresh allocation each
    time: glibc maps every allocation of 32 MiB or more anew, and a page fault costs about 1 us per 4 KiB
    on a virtual machine (8 ms for 32 MiB; benchmarks/results_weight_only.md, 'Intel Xeon'). The memory
    stays with the thread until it ends. A call nested inside another's block (a kernel run from inside
    another, say through a torch function mode around the first one's GEMM) gets a new tensor instead, so
    that it cannot overwrite what the outer one holds. ValueError for a negative ``nbytes``."""
    if nbytes < 0:
        raise ValueError(f"thread_scratch: nbytes must be >= 0, got {nbytes}")
    if _SCRATCH.in_use:
        yield torch.empty(nbytes, dtype=torch.uint8)
        return
    buffer = _SCRATCH.buffer
    if buffer is None or buffer.numel() < nbytes:
        _SCRATCH.buffer = None  # the old buffer is freed before the larger one is allocated
        buffer = _SCRATCH.buffer = torch.empty(nbytes, dtype=torch.uint8)
    _SCRATCH.in_use = True
    try:
        yield buffer[:nbytes]
    finally:
        _SCRATCH.in_use = False


def scratch_or_thread(scratch: Optional[torch.Tensor], nbytes: int):
    """``with scratch_or_thread(scratch, nbytes) as buffer``: the first ``nbytes`` of ``scratch`` (a 1-D uint8 CPU
    tensor of at least that many bytes, a caller's workspace) where given, else :func:`thread_scratch`.
    ValueError for a ``scratch`` that is not such a tensor (a kernel would write past it)."""
    if scratch is None:
        return thread_scratch(nbytes)
    if scratch.dtype != torch.uint8 or scratch.dim() != 1 or scratch.numel() < nbytes or not scratch.is_contiguous():
        raise ValueError(f"scratch: {nbytes} bytes needed in a contiguous 1-D uint8 tensor, got {tuple(scratch.shape)} "
                         f"{scratch.dtype}")
    return contextlib.nullcontext(scratch[:nbytes])
