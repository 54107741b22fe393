"""Shared plumbing for the numba kernels: thread count, zero-copy numpy views of CPU tensors, the one-line
notice on stderr while a kernel family compiles, and fewer garbage collections while it does."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
import threading
import types
from typing import Optional

import numba
import numpy as np
import torch
from llvmlite import ir
from numba.core import cgutils, types as numba_types
from numba.core import event as numba_event
from numba.extending import intrinsic

import lowbit.kernels.cpu as cpu_package
from lowbit.collector import fewer_collections

# Options every CPU kernel is compiled with: one place to change them.
NJIT_OPTIONS = dict(nogil=True, cache=True, boundscheck=False)
PARALLEL_NJIT_OPTIONS = dict(NJIT_OPTIONS, parallel=True)


@numba.njit(nogil=True, boundscheck=False, inline="always")  # inlined into its callers: nothing of its own to cache
def copy_elements(dst, at, src, start, count):
    """dst[at : at + count] = src[start : start + count] for 1-D arrays, element by element: a slice
    assignment makes numba compile its shape-mismatch error formatting, seconds per process (the caller
    keeps both ranges in bounds)."""
    for i in range(count):
        dst[at + i] = src[start + i]


def run_tasks(kernels: tuple, args: tuple, count: int, out: np.ndarray, serial: bool) -> None:
    """Items 0 .. count - 1 (rows, blocks, column tiles: the kernel's unit) of a kernel written as a pair
    (serial, parallel) of numba functions: ``serial(*args, first, end, out)`` computes items first .. end - 1
    on the calling thread, ``parallel(*args, out)`` all of them in numba's parallel loop (a thin loop over
    ``serial``, a task of one or more items per iteration). ``serial``: the calling thread computes them all,
    without the parallel loop's launch; a process that only ever does that never compiles the parallel
    function (numba compiles a function on its first call)."""
    serial_kernel, parallel_kernel = kernels
    if serial:
        serial_kernel(*args, 0, count, out)
    else:
        parallel_kernel(*args, out)


class SerialOrParallel:
    """A numba kernel whose loops are ``numba.prange``, as two dispatchers of the one Python function:
    ``parallel`` (compiled with parallel=True: numba's parallel loops) and ``serial`` (without: the same loops
    as plain ranges on the calling thread). numba compiles each on its first call, so a process that only
    runs inputs too small to be worth waking threads for never compiles the parallel loops. ``serial`` has a
    name of its own (the function's + "_serial") and so its own entry in numba's on-disk cache. Called from
    Python only: ``kernel(*args, serial=...)``. ``SerialOrParallel(template, name, **bound)``: the pair of a
    copy of ``template`` named ``name`` whose global names ``bound`` are replaced by the given values (numba
    functions, constants; as :func:`bound_njit`): one template for several kernels, each compiled only when
    called and cached under its own name. ``serial_bound``: globals bound in ``serial`` only, over ``bound``
    (say a thread's slot that only the parallel loop may ask numba's threading layer for)."""

    def __init__(self, py_func, name: str | None = None, serial_bound: Optional[dict] = None, **bound):
        if name is not None:
            py_func = _renamed_copy(py_func, name, bound)
        elif bound or serial_bound:
            raise ValueError("SerialOrParallel: bound globals need a name of their own")
        self.serial = numba.njit(**NJIT_OPTIONS)(_renamed_copy(py_func, py_func.__name__ + "_serial", serial_bound))
        self.parallel = numba.njit(**PARALLEL_NJIT_OPTIONS)(py_func)
        self.__doc__ = py_func.__doc__

    def __call__(self, *args, serial: bool):
        return (self.serial if serial else self.parallel)(*args)


def _renamed_copy(py_func, name: str, bound: Optional[dict] = None):
    """A copy of the Python function ``py_func`` named ``name`` (its own entry in numba's on-disk cache) whose
    global names ``bound`` are replaced by the given values."""
    globals_ = {**py_func.__globals__, **bound} if bound else py_func.__globals__
    twin = types.FunctionType(py_func.__code__, globals_, name, py_func.__defaults__, py_func.__closure__)
    twin.__qualname__, twin.__doc__, twin.__module__ = name, py_func.__doc__, py_func.__module__
    return twin


_BOUND: dict[str, tuple] = {}  # name -> (numba dispatcher of bound_njit, its bindings)


def bound_njit(template, name: str, **bound):
    """The numba dispatcher (NJIT_OPTIONS) of a copy of the Python function ``template`` named ``name``, whose
    global names ``bound`` (numba dispatchers, constants) are replaced by the given values: one template for
    several kernels (say a driver calling a serial or a parallel kernel), each with its own entry in numba's
    on-disk cache. Made once per name; ValueError if a name comes back with other bindings (each combination
    needs a name of its own)."""
    if name not in _BOUND:
        _BOUND[name] = (numba.njit(**NJIT_OPTIONS)(_renamed_copy(template, name, bound)), bound)
    dispatcher, made_with = _BOUND[name]
    if made_with.keys() != bound.keys() or any(made_with[key] is not value for key, value in bound.items()):
        raise ValueError(f"bound_njit: {name!r} was made with other bindings")
    return dispatcher


KERNEL_PACKAGE = __name__.rpartition(".")[0]  # "lowbit.kernels.cpu"


@functools.lru_cache(maxsize=None)
def family_module(module: str) -> str:
    """The kernel family (the full name of its public module) of a module of KERNEL_PACKAGE: the module itself,
    or for a private helper module named ``_<family>_<part>`` (``_weight_only_gemv8``) the public module
    ``<family>`` where one exists (the longest such name); any other module is its own family."""
    package, _, name = module.rpartition(".")
    if package != KERNEL_PACKAGE or not name.startswith("_"):
        return module
    parts = name[1:].split("_")
    for end in range(len(parts) - 1, 0, -1):
        candidate = f"{KERNEL_PACKAGE}.{'_'.join(parts[:end])}"
        if importlib.util.find_spec(candidate) is not None:
            return candidate
    return module


class CompileNotice(numba_event.Listener):
    """Prints "lowbit: compiling CPU kernels for <family> (first run only; cached in <dir>)" on stderr the
    first time, in this process, that numba compiles (rather than loads from its on-disk cache) a kernel of
    ``lowbit/kernels/cpu/<family>.py`` or of its private helper modules (family_module); silent when the cache
    is warm. A ``quiet`` notice prints nothing (the warm-up's worker processes: their parent prints)."""

    def __init__(self) -> None:
        self.announced: set[str] = set()
        self.quiet = False
        self._lock = threading.Lock()

    def on_start(self, event) -> None:
        dispatcher = event.data["dispatcher"]
        module = getattr(dispatcher.py_func, "__module__", "")
        if module.rpartition(".")[0] == KERNEL_PACKAGE:
            self.announce(family_module(module), dispatcher)

    def announce(self, module: str, dispatcher) -> None:
        """Print the line for kernel module ``module`` (its family: the module's last name) unless this
        process printed it before; the cache folder is numba dispatcher ``dispatcher``'s."""
        family = module.rpartition(".")[2]
        with self._lock:
            if family in self.announced or self.quiet:
                return
            self.announced.add(family)
        cache_dir = getattr(getattr(dispatcher, "_cache", None), "_cache_path", None) or "numba's cache"
        print(f"lowbit: compiling CPU kernels for {family} (first run only; cached in {cache_dir})",
              file=sys.stderr, flush=True)

    def on_end(self, event) -> None:
        pass


COMPILE_NOTICE = CompileNotice()
numba_event.register("numba:compile", COMPILE_NOTICE)


class FewerCollectionsWhileCompiling(numba_event.Listener):
    """Runs every numba compile of a function of lowbit's modules, from its start to its end, in
    lowbit.collector.fewer_collections (docs/cli.md, 'First run'): a kernel's first call compiles with fewer
    garbage collections wherever it happens, not only in a self-check or the warm-up. A compile nested in
    another (a callee) or of another package's function changes nothing of its own."""

    def __init__(self) -> None:
        self._open = threading.local()  # .contexts: a stack per thread, one entry (a context or None) per compile

    def on_start(self, event) -> None:
        stack = self._open.__dict__.setdefault("contexts", [])
        module = getattr(event.data["dispatcher"].py_func, "__module__", "") or ""
        context = fewer_collections() if module.split(".")[0] == "lowbit" else None
        if context is not None:
            context.__enter__()
        stack.append(context)

    def on_end(self, event) -> None:
        context = self._open.contexts.pop()
        if context is not None:
            context.__exit__(None, None, None)


numba_event.register("numba:compile", FewerCollectionsWhileCompiling())


def parallel_loops_allowed() -> bool:
    """Whether the kernels may run numba's parallel loops here: not in a child forked after lowbit's import
    (lowbit.kernels.cpu.parallel_loops), where each runs its serial form whatever the thread count."""
    return cpu_package.parallel_loops


_threads_started = False  # whether _followed_threads started numba's threading layer


def _followed_threads() -> int:
    """torch.get_num_threads() capped by numba's pool: the numba thread count that follows torch's; 1 where
    parallel loops may not run (:func:`parallel_loops_allowed`).

    Starting numba's OpenMP threading layer (on the first call) resets the process's OpenMP thread
    count, which is torch's too; torch's setting is read first and put back.
    """
    global _threads_started
    if not cpu_package.parallel_loops:
        return 1
    wanted = torch.get_num_threads()
    if not _threads_started:
        numba.get_num_threads()  # launches numba's threading layer if it is not running yet
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)
        _threads_started = True
    return max(1, min(wanted, numba.config.NUMBA_NUM_THREADS))


_synced = threading.local()  # .threads: the count sync_threads last gave numba in this thread (numba's is per thread)


def sync_threads() -> int:
    """Set numba's thread count to torch.get_num_threads() (capped by numba's pool); return it. numba's own
    count is read only when that target changed since this thread last synced it: numba.get_num_threads
    takes a lock and costs tens of microseconds after other work has evicted the caches (docs/weight_only.md,
    'One call'); a count set with numba.set_num_threads directly in between is not seen."""
    n = _followed_threads()
    if getattr(_synced, "threads", 0) != n:
        if numba.get_num_threads() != n:
            numba.set_num_threads(n)
        _synced.threads = n
    return n


def runs_serially(work: int, one_thread_below: int) -> bool:
    """Whether a kernel call of ``work`` (the kernel's own measure of its size) runs its serial form on the
    calling thread: below ``one_thread_below``, or when torch has one thread; otherwise numba's thread count
    is synced to torch's (:func:`sync_threads`) for the parallel loop."""
    return work < one_thread_below or sync_threads() == 1


@contextlib.contextmanager
def kernel_threads(work: int, one_thread_below: int, chunksize: Optional[int] = None):
    """:func:`sync_threads` for a kernel call, run on one numba thread when ``work`` (the kernel's own
    measure of its size) is below ``one_thread_below``: waking numba's threads after a torch op costs tens
    of microseconds, more than they save on small inputs. ``chunksize``: numba's parallel chunk size for
    the call when it runs on several threads (None: unchanged). Both are put back afterwards (the thread
    count to the synced one)."""
    if work < one_thread_below:
        threads = _followed_threads()
        numba.set_num_threads(1)
        try:
            yield
        finally:
            numba.set_num_threads(threads)
        return
    sync_threads()
    previous_chunksize = None if chunksize is None else numba.set_parallel_chunksize(chunksize)
    try:
        yield
    finally:
        if previous_chunksize is not None:
            numba.set_parallel_chunksize(previous_chunksize)


@intrinsic
def swap_parallel_chunksize(typingctx, chunksize):
    """In compiled code: set this thread's chunk size of numba's parallel loops to ``chunksize`` (uintp) and
    return the previous one. The threading layer's own functions, declared by name as numba's parallel loops
    declare them, so a caller stays cacheable (``numba.set_parallel_chunksize`` in compiled code calls them
    through a ctypes pointer, which numba does not cache) and spares Python's two calls of call_in_chunks.
    Only in functions that run a parallel loop: loading one starts the threading layer, which defines them."""
    if chunksize != numba_types.uintp:
        return None

    def codegen(context, builder, sig, args):
        word = ir.IntType(numba_types.uintp.bitwidth)
        get = cgutils.get_or_insert_function(builder.module, ir.FunctionType(word, []), "get_parallel_chunksize")
        put = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [word]),
                                             "set_parallel_chunksize")
        previous = builder.call(get, [])
        builder.call(put, [args[0]])
        return previous

    return numba_types.uintp(chunksize), codegen


def call_in_chunks(chunksize: int, kernel, *args):
    """``kernel(*args)`` with numba's parallel loops handing out ``chunksize`` iterations at a time (this
    thread's setting, put back after): two calls into numba where ``with numba.parallel_chunksize(...)``
    makes three and a generator's frames, each tens of microseconds after other work has evicted the caches
    (docs/weight_only.md, 'One call')."""
    previous = numba.set_parallel_chunksize(chunksize)
    try:
        return kernel(*args)
    finally:
        numba.set_parallel_chunksize(previous)


_BITS_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16}  # dtypes numpy lacks


@intrinsic
def _int16_pointer(typingctx, address):
    """The int16 pointer at the integer ``address``."""
    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

    return numba_types.CPointer(numba_types.int16)(numba_types.intp), codegen


@numba.njit(nogil=True, boundscheck=False, inline="always")
def int16_array_at(address, rows, cols):
    """The C-contiguous (rows, cols) int16 array over the memory at ``address`` (a CPU tensor's data_ptr()),
    owning nothing: the caller keeps the tensor alive and has checked its size, dtype (2 bytes an element) and
    layout. From Python an address and two ints cost a compiled call less than a tensor's numpy view (about 8
    us after other work has evicted the caches: docs/weight_only.md, 'One call')."""
    return numba.carray(_int16_pointer(address), (rows, cols))


@numba.njit(nogil=True, boundscheck=False, inline="always")
def aligned_empty(rows, cols, dtype):
    """An uninitialised C-contiguous (rows, cols) array of ``dtype`` (a numpy scalar type) whose data starts on a
    64-byte boundary: a view into a flat array 64 elements longer, which it keeps alive. numba's and numpy's own
    arrays start where the allocator puts them (a multiple of 16 bytes), and off a 64-byte boundary every
    64-byte vector load of a row straddles two cache lines: the MXFP4 GEMV of three rows of x, which loads x for
    each row of W, took 1.6x the time with its x so placed (docs/weight_only.md, 'Kernels')."""
    flat = np.empty(rows * cols + 64, dtype=dtype)
    skip = (64 - flat.ctypes.data % 64) % 64 // flat.itemsize
    return flat[skip:skip + rows * cols].reshape(rows, cols)


# numpy's type strings of the dtypes kernels view (FP16 / BF16 as their int16 bit patterns: _BITS_VIEW)
_TYPESTRS = {torch.bool: "|b1", torch.uint8: "|u1", torch.int8: "|i1", torch.int16: "<i2", torch.int32: "<i4",
             torch.int64: "<i8", torch.uint16: "<u2", torch.uint32: "<u4", torch.uint64: "<u8", torch.float32: "<f4",
             torch.float64: "<f8"}


class _TensorMemory:
    """A tensor's memory described to numpy (``__array_interface__``); the array made from it keeps this object,
    and so the tensor, alive."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, t: torch.Tensor, typestr: str) -> None:
        self.tensor = t
        strides = None if t.is_contiguous() else tuple(stride * t.element_size() for stride in t.stride())
        self.__array_interface__ = {"data": (t.data_ptr(), False), "shape": tuple(t.shape), "typestr": typestr,
                                    "strides": strides, "version": 3}


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view sharing memory with a CPU tensor; FP16/BF16 are viewed as int16 bit patterns. Unlike
    ``t.numpy()``, it leaves the tensor's storage resizable: torch marks a storage that ``numpy()`` exported as
    not resizable for good, and a failed ``resize_`` then leaves the tensor's new sizes over its old memory (a
    later read crashes), so a caller's tensor passed to a kernel would change under the caller. RuntimeError,
    as ``numpy()`` raises it, for a tensor that requires grad or has the negative or conjugate bit."""
    if not t.is_cpu:
        raise ValueError(f"numba kernels need CPU tensors, got device {t.device}")
    view = t if (view_dtype := _BITS_VIEW.get(t.dtype)) is None else t.view(view_dtype)
    typestr = _TYPESTRS.get(view.dtype)
    if typestr is None or view.requires_grad or view.is_neg() or view.is_conj() or not view.numel():
        return view.numpy()  # (its errors; an empty tensor has no memory to share)
    return np.asarray(_TensorMemory(view, typestr))
