"""Operators, kernels and backend selection: the one seam between ``lowbit.ops`` and ``lowbit.kernels``.

Every operator is one :class:`Operator`: its contract (``outputs``: validates the arguments and gives the
output shapes and dtypes), its reference :class:`Kernel` (the readable torch code of ``lowbit.formats``), a
loader per device type for its native kernel, and probe inputs for the self-check. ``Operator.__call__``
is the only way to a kernel: it validates every tensor (dtype, shape, device; see ``outputs``), makes the
inputs contiguous, and hands the kernel contiguous outputs that overlap no input (an ``out=`` that is not
contiguous, or shares memory with an input, is computed through a temporary and copied in). docs/architecture.md
follows one call through this module.

Backends:

* ``reference`` runs the reference kernel on any device.
* ``native`` runs the device's kernel (numba on CPU, Triton on CUDA, the vendor's path on an NPU);
  :class:`BackendUnavailable` if there is none, or if the kernel does not support these arguments (its
  ``supports`` gives the reason).
* ``auto`` runs native when the device has a kernel that passed a one-time self-check against the reference
  on this device and supports these arguments; otherwise the reference, for that call. The self-check
  runs the probes with the call's dtypes (see :func:`dtype_signature`; all probes when none has them), so
  a first call compiles only the kernel specializations it needs; results are cached per operator, device
  and dtype signature for the life of the process.

The process default is ``auto``; change it with :func:`set_backend` or the environment variable
``LOWBIT_BACKEND`` (read once, when the default is first needed), or for one thread / asyncio context with
:func:`use_backend`. :func:`last_backend`
names the backend that last *ran* an operator.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

import torch
from torch._subclasses.fake_tensor import is_fake

from lowbit.collector import fewer_collections
from lowbit.errors import BackendUnavailable, DeviceError, DtypeError, ShapeError
from lowbit.kernels.cpu.memory import output_empty

BACKENDS = ("native", "reference", "auto")
ENV_VAR = "LOWBIT_BACKEND"


def check_backend_name(name: str) -> str:
    """``name`` if it is one of BACKENDS; ValueError (listing them) otherwise, also for "" and non-strings."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; expected one of {', '.join(BACKENDS)}")
    return name


_process_default: Optional[str] = None  # set_backend's; None: LOWBIT_BACKEND's
_environment_value: Optional[str] = None  # LOWBIT_BACKEND as first read ("auto" if unset); None: not read yet
_override: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("lowbit_backend", default=None)
_last_ran: dict[str, str] = {}


def set_backend(name: str) -> None:
    """Set the process-wide default backend ("native", "reference" or "auto")."""
    global _process_default
    _process_default = check_backend_name(name)


def get_backend() -> str:
    """The default backend here: a :func:`use_backend` override of this thread/context, else the
    process's (:func:`set_backend`'s, else ``LOWBIT_BACKEND`` if set, else "auto"). ValueError naming the
    variable if it is invalid. The variable is read once, the first time it is needed: every operator call
    asks for the default, and an ``os.environ`` look-up cost 10-30 us of a layer's call after other work had
    evicted the caches (docs/weight_only.md, 'One call'); change the default at run time with set_backend
    (or read the variable again: read_environment)."""
    global _environment_value
    override = _override.get()
    if override is not None:
        return override
    if _process_default is not None:
        return _process_default
    value = _environment_value
    if value is None:
        value = _environment_value = os.environ.get(ENV_VAR, "auto")
    if value not in BACKENDS:
        raise ValueError(f"environment variable {ENV_VAR}={value!r} is not a backend; expected one of "
                         f"{', '.join(BACKENDS)}")
    return value


def read_environment() -> None:
    """Read ``LOWBIT_BACKEND`` again the next time the default is needed (get_backend reads it once): for a
    process that changes the variable on purpose, such as the command line's commands run in one process."""
    global _environment_value
    _environment_value = None


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Change the default backend inside a ``with`` block, for this thread (or asyncio context) only."""
    token = _override.set(check_backend_name(name))
    try:
        yield
    finally:
        _override.reset(token)


def last_backend(op: str) -> Optional[str]:
    """Name of the backend that last ran ``op`` in this process ("native" or "reference"), or None."""
    return _last_ran.get(op)


def canonical_device(device: torch.device | str) -> torch.device:
    """The device as tensors on it report it: 'cpu:0' -> cpu, 'cuda' -> cuda:<current index>. DeviceError for
    a string torch does not know as a device, TypeError for another type."""
    if not isinstance(device, (torch.device, str)):
        raise TypeError(f"device must be a torch.device or a str, got {type(device).__name__}")
    try:
        device = torch.device(device)
    except RuntimeError as exc:
        raise DeviceError(f"unknown device {device!r} ({exc})") from None
    if device.type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, device.type, None)
    if device.index is None and module is not None and hasattr(module, "current_device") and module.is_available():
        return torch.device(device.type, module.current_device())
    return device


class Kernel:
    """One implementation of one operator on one device type (the reference is one too).

    ``run(*args, out=...)`` writes the result into ``out`` (a tensor, or a tuple of tensors for operators
    with several outputs) and returns None. ``args`` are the operator's arguments in its order. The
    operator calls it only after validating them: every tensor is contiguous and on one device, has the
    dtype and shape of the contract, and ``out`` is contiguous and overlaps no input.

    ``supports(*args)`` returns None when this kernel computes these (already validated) arguments, else a
    short reason ("group_size 96: this kernel takes 32, 64 or 128"); ``auto`` then runs the reference for
    that call and ``native`` raises BackendUnavailable with the reason. Operators may declare extra
    methods for their kernels (the matmul's workspace size and weight prepacking; ``prepare`` and
    ``run_prepared`` for lowbit.ops.library.PreparedCall).
    """

    def supports(self, *args: Any) -> Optional[str]:
        return None

    def run(self, *args: Any, out: Any) -> None:
        raise NotImplementedError


def tensors_of(values: Iterable[Any]) -> list[torch.Tensor]:
    """The tensors among ``values`` (tuples and lists are searched one level deep)."""
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (tuple, list)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def _memory_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte addresses that ``t`` may touch."""
    if t.numel() == 0:
        return (0, 0)
    start = t.data_ptr()
    extent = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride())) + 1
    return (start, start + extent * t.element_size())


def _touches(span: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    """Whether the non-empty byte range ``span`` intersects any of ``spans``."""
    return span[0] < span[1] and any(span[0] < end and start < span[1] for start, end in spans)


def _elements_apart(t: torch.Tensor) -> bool:
    """Whether no two elements of ``t`` can share memory: with its dimensions of size > 1 in ascending |stride|,
    each stride exceeds the span of the smaller ones (conservative: a few exotic layouts whose elements are
    apart fail it too)."""
    if t.is_contiguous():  # dense: every element at its own offset
        return True
    reach = 0  # the largest offset, in elements, that the dimensions so far reach
    for stride, size in sorted((abs(st), sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride <= reach:
            return False
        reach += (size - 1) * stride
    return True


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory ``a`` and ``b`` may touch intersects (conservative: compares address ranges)."""
    return a.device == b.device and _touches(_memory_span(a), [_memory_span(b)])


def share_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have a byte of memory in common (exact: interleaved views of one buffer, such
    as a row's even and odd columns, share none). Rows of contiguous elements (codes and scales side by side in
    one buffer's rows) are compared by arithmetic on their row strides; other strided layouts whose spans meet
    by marking bytes, which costs memory and time in their elements (for outputs, which are written anyway)."""
    if not overlaps(a, b):
        return False
    if a.is_contiguous() and b.is_contiguous():  # each covers its whole span
        return True
    rows = _rows(a), _rows(b)
    if None not in rows:
        return _rows_meet(*rows)
    return _marked_share(a, b)


def _marked_share(a: torch.Tensor, b: torch.Tensor) -> bool:
    """share_bytes by marking ``a``'s bytes over the span both may touch (memory and time in their elements)."""
    (a0, a1), (b0, b1) = _memory_span(a), _memory_span(b)
    base = min(a0, b0)
    marked = torch.zeros(max(a1, b1) - base, dtype=torch.bool, device=a.device)
    marked[_byte_offsets(a, base)] = True
    return bool(marked[_byte_offsets(b, base)].any())


def _rows(t: torch.Tensor) -> Optional[tuple[int, int, int, int]]:
    """(first byte, rows, row stride, row length) in bytes where ``t`` is rows of contiguous elements a
    single stride apart (any layout a ``view(-1, t.shape[-1])`` takes), else None."""
    if t.dim() == 0:
        return None
    try:
        rows = t.view(-1, t.shape[-1])
    except RuntimeError:  # leading dimensions that do not collapse into one stride
        return None
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        return None
    size = t.element_size()
    return t.data_ptr(), rows.shape[0], rows.stride(0) * size, rows.shape[1] * size


def _rows_meet(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> bool:
    """Whether row ``i`` of ``a`` and row ``j`` of ``b`` (_rows) share a byte for some i, j: with one row stride
    S, row j - i = k of b starts d + kS after a row of a (d = b's first byte - a's), and they meet where
    -len_b < d + kS < len_a, k in [-(rows_a - 1), rows_b - 1]."""
    (a0, rows_a, stride_a, len_a), (b0, rows_b, stride_b, len_b) = a, b
    d = b0 - a0
    if rows_a == 1 and rows_b == 1:
        return -len_b < d < len_a
    if rows_a > 1 and rows_b > 1 and stride_a != stride_b:
        return _meet_by_rows(a, b)
    stride = stride_a if rows_a > 1 else stride_b  # > 0: outputs' elements are apart (_elements_apart)
    low = max(-(rows_a - 1), (-len_b - d) // stride + 1)  # the smallest k with d + kS > -len_b
    high = min(rows_b - 1, -((d - len_a) // stride) - 1)  # the largest k with d + kS < len_a
    return low <= high


def _meet_by_rows(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> bool:
    """_rows_meet for row strides that differ: each row of the one with fewer rows against the other's rows."""
    if a[1] > b[1]:
        a, b = b, a
    a0, rows_a, stride_a, len_a = a
    return any(_rows_meet((a0 + i * stride_a, 1, stride_a, len_a), b) for i in range(rows_a))


def _byte_offsets(t: torch.Tensor, base: int) -> torch.Tensor:
    """The offsets from address ``base`` of every byte of every element of ``t`` (int64, flat)."""
    size = t.element_size()
    offsets = torch.full((1,) * t.dim(), t.data_ptr() - base, dtype=torch.int64, device=t.device)
    for axis, (count, stride) in enumerate(zip(t.shape, t.stride())):
        shape = [1] * t.dim()
        shape[axis] = count
        offsets = offsets + (torch.arange(count, device=t.device) * (stride * size)).view(shape)
    return (offsets.reshape(-1, 1) + torch.arange(size, device=t.device)).reshape(-1)


_NO_CONTEXT = contextlib.nullcontext()


def dtype_signature(args: Sequence) -> Optional[tuple[torch.dtype, ...]]:
    """The dtypes of the tensors and the torch.dtype values among ``args``, in order (None for no args):
    what selects a kernel specialization, and the probes of the self-check for a call."""
    if not args:
        return None
    return tuple(a.dtype if isinstance(a, torch.Tensor) else a for a in args
                 if isinstance(a, (torch.Tensor, torch.dtype)))


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (NaN payloads and signed zeros included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.detach().cpu().contiguous().reshape(-1), b.detach().cpu().contiguous().reshape(-1)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.numel() else True


def same_bits(got: torch.Tensor, want: torch.Tensor, args: Sequence = ()) -> bool:
    """The default contract of a kernel: the reference's bits exactly (``args`` unused)."""
    return bits_equal(got, want)


_ALIGNMENT = 16  # bytes: kernels view their tensors as wider words (two BF16 as one int32, float32 pairs, ...)


def _aligned(t: torch.Tensor) -> bool:
    """Whether ``t``'s first element lies at a multiple of ALIGNMENT bytes in memory."""
    return t.data_ptr() % _ALIGNMENT == 0


def is_dense_aligned(t: torch.Tensor) -> bool:
    """Whether a kernel can read or write ``t``'s memory as its values, as :func:`dense_aligned` and
    :func:`values_resolved` would leave it: contiguous, aligned, without a negative or conjugate bit."""
    return t.is_contiguous() and _aligned(t) and not (t.is_neg() or t.is_conj())


def dense_aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and aligned (a copy where it is not: a view at an odd offset of a larger buffer)."""
    t = t.contiguous()
    return t if _aligned(t) else t.clone()


def values_resolved(t: Any) -> Any:
    """``t`` with a negative or conjugate bit applied to its values (torch._neg_view, .conj() of a real view:
    lazy views whose memory holds the other values; a kernel reads memory), else ``t`` itself."""
    if isinstance(t, torch.Tensor) and (t.is_neg() or t.is_conj()):
        return t.resolve_neg().resolve_conj()
    return t


def check_writable(op_name: str, label: str, t: torch.Tensor) -> None:
    """ValueError naming output ``label`` of ``op_name`` where a kernel cannot write tensor ``t`` as given: the
    negative or conjugate bit set (its memory holds other values than it shows); RuntimeError for an inference
    tensor outside torch.inference_mode, which torch's own ops refuse to write too. Nothing under
    torch.compile, which cannot trace these reads (fullgraph=True failed on them): its graph writes out as it is."""
    if torch.compiler.is_compiling():
        return
    if t.is_neg() or t.is_conj():
        raise ValueError(f"{op_name}: {label} has the negative or conjugate bit set (a view such as "
                         "torch._neg_view or .conj()); pass a tensor holding its own values")
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise RuntimeError(f"{op_name}: {label} is an inference tensor, which cannot be written outside "
                           "torch.inference_mode()")


def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one output of an operator."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(eq=False)
class Operator:
    """One operator: its contract, its kernels, and how ``auto`` checks them.

    * ``name``: the name under ``torch.ops.lowbit`` and for :func:`last_backend`.
    * ``outputs(*args) -> tuple[TensorSpec, ...]``: validates the arguments (raising DtypeError,
      ShapeError, DeviceError, ValueError, TypeError) and returns the outputs' shapes and dtypes; works on
      meta and fake tensors (it is the fake implementation too).
    * ``reference``: the Kernel that runs on any device.
    * ``native``: device type -> a function that imports and returns that device's Kernel (imported on
      first use, so ``import lowbit`` imports no numba, triton or torch_npu); an ImportError / OSError
      there makes the backend unavailable.
    * ``probes() -> iterable of args``: CPU inputs for the self-check, covering the kernels' edge shapes
      and special values; every probe a kernel supports must give the reference's bits (or satisfy
      ``agrees``, for an operator whose kernels may sum in another order).
    * ``agrees(got, want, args) -> bool``: whether a kernel's output ``got`` meets the contract given the
      reference's ``want`` for the arguments ``args`` (default :func:`same_bits`: bit equality).
    * ``scratch``: positions of arguments handed to the kernels as they are, not made contiguous or copied
      (workspaces, which the kernels check themselves).
    """

    name: str
    outputs: Callable[..., tuple[TensorSpec, ...]]
    reference: Kernel
    native: Mapping[str, Callable[[], Kernel]]
    probes: Callable[[], Iterable[tuple]]
    agrees: Callable[[torch.Tensor, torch.Tensor, Sequence], bool] = same_bits
    scratch: tuple[int, ...] = ()
    # (device, dtype signature or None for every probe) -> None or error
    _checked: dict[tuple, Optional[str]] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # (device, backend name, dtype signature) -> the kernel that name means there before ``supports``: what
    # the self-check decided and the loaded native kernel, looked up once (not copied by dataclasses.replace)
    _candidates: dict[tuple, tuple[str, Kernel]] = field(default_factory=dict, init=False, repr=False)

    # ---- kernels and backends ----------------------------------------------------------------------

    def native_kernel(self, device: torch.device | str) -> Kernel:
        """The native kernel for ``device``; BackendUnavailable if there is none or it cannot load."""
        device = torch.device(device)
        loader = self.native.get(device.type)
        if loader is None:
            raise BackendUnavailable(f"{self.name}: no native kernel for device type {device.type!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailable(f"{self.name}: CUDA is not available")
        try:
            return loader()
        except (ImportError, OSError) as exc:
            raise BackendUnavailable(f"{self.name}: cannot load the {device.type} kernel: {exc}") from exc

    def auto_check_error(self, device: torch.device | str, args: Sequence = ()) -> Optional[str]:
        """Why ``auto`` does not run native on ``device`` for arguments of the dtypes of ``args`` (None: it
        does; no ``args``: for any). The self-check runs the probes of that dtype signature that the kernel
        supports (every probe when there are none), once per device and signature; a passed check of every
        probe answers for all signatures."""
        device = canonical_device(device)
        place = str(device)
        every, key = (place, None), (place, dtype_signature(args))
        with self._lock:
            if every in self._checked and self._checked[every] is None:
                return None
            if key in self._checked:
                return self._checked[key]
        try:  # no lock held while kernels run; the first runs compile them
            with fewer_collections():
                kernel = self.native_kernel(device)
                probes = list(self.probes())
                matching = [p for p in probes if dtype_signature(p) == key[1] and kernel.supports(
                    *(a.to(device) if isinstance(a, torch.Tensor) else a for a in p)) is None]
                error = self._self_check(kernel, device, matching or probes)
            checked_every = not matching
        except Exception as exc:  # any failure of the probe means: do not trust native here
            error, checked_every = f"{type(exc).__name__}: {exc}", True
        with self._lock:
            if checked_every:
                error = self._checked.setdefault(every, error)
            return self._checked.setdefault(key, error)

    def adopt_passed_check(self, device: torch.device | str) -> None:
        """Record that the self-check of every probe passed on ``device``, as another process on this machine
        found with the same compiled kernels (a warm-up worker, lowbit.kernels.cpu.warm), so that this
        process does not run the probes again."""
        with self._lock:
            self._checked.setdefault((str(canonical_device(device)), None), None)

    def _self_check(self, kernel: Kernel, device: torch.device, probes: Optional[list] = None) -> Optional[str]:
        """None if ``kernel`` agrees with the reference on every probe (default: ``self.probes()``) it
        supports, else the first failure."""
        ran = 0
        for args in self.probes() if probes is None else probes:
            want = self._allocate(args, torch.device("cpu"))
            self.reference.run(*args, out=want)
            on_device = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
            if kernel.supports(*on_device) is not None:
                continue
            got = self._allocate(on_device, device)
            kernel.run(*on_device, out=got)
            ran += 1
            for g, w in zip(_as_tuple(got), _as_tuple(want)):
                if not self.agrees(g.cpu(), w, args):
                    shapes = [tuple(t.shape) for t in tensors_of(args)]
                    return f"native {self.name} differs from the reference on {device} (probe shapes {shapes})"
        return None if ran else f"native {self.name} supports none of the self-check probes"

    def resolve(self, device: torch.device | str, backend: Optional[str] = None, args: Sequence = ()) -> str:
        """The backend ('native' or 'reference') that ``backend`` (default: the default backend) means
        for ``args`` on ``device``. BackendUnavailable when ``native`` cannot run them."""
        return self.kernel(device, backend, args)[0]

    def kernel(self, device: torch.device | str, backend: Optional[str] = None, args: Sequence = ()) -> tuple[str, Kernel]:
        """(backend name, Kernel) that runs ``args`` on ``device``: see the module docstring."""
        name = check_backend_name(backend if backend is not None else get_backend())
        key = (device, name, dtype_signature(args))
        candidate = self._candidates.get(key)
        if candidate is None:
            if name == "reference" or (name == "auto" and self.auto_check_error(device, args) is not None):
                candidate = ("reference", self.reference)
            else:
                candidate = ("native", self.native_kernel(device))
            self._candidates[key] = candidate
        if candidate[0] == "reference":
            return candidate
        kernel = candidate[1]
        reason = kernel.supports(*args) if args else None
        if reason is None:
            return "native", kernel
        if name == "auto":
            return "reference", self.reference
        raise BackendUnavailable(f"{self.name}: the native {torch.device(device).type} kernel cannot run "
                                 f"these arguments: {reason}")

    def record(self, backend: str) -> None:
        """Note that ``backend`` ran this operator (for :func:`last_backend`)."""
        _last_ran[self.name] = backend

    # ---- calling -----------------------------------------------------------------------------------

    def device_of(self, args: Sequence) -> torch.device:
        """The one device of the tensors in ``args``; DeviceError if they are on several."""
        devices = {t.device for t in tensors_of(args)}
        if len(devices) != 1:
            raise DeviceError(f"{self.name}: the inputs must be on one device, got "
                              f"{sorted(str(d) for d in devices) or 'no tensor'}")
        return devices.pop()

    def _allocate(self, args: Sequence, device: torch.device) -> Any:
        outs = tuple(output_empty(s.shape, s.dtype) if device.type == "cpu" else
                     torch.empty(s.shape, dtype=s.dtype, device=device) for s in self.outputs(*args))
        return outs if len(outs) > 1 else outs[0]

    def new_outputs(self, *args: Any) -> Any:
        """Fresh output tensor(s) for ``args`` on their device (validates ``args``)."""
        return self._allocate(args, self.device_of(args))

    def check_out(self, args: Sequence, out: Any, specs: Optional[Sequence[TensorSpec]] = None) -> None:
        """Validate a caller's ``out``: a tensor (a tuple of them for several outputs) of the output
        dtypes and shapes on the inputs' device (``specs``: ``self.outputs(*args)`` where the caller has them).
        DtypeError / ShapeError / DeviceError / TypeError."""
        specs = self.outputs(*args) if specs is None else specs
        device = self.device_of(args)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if len(outs) != len(specs) or not all(isinstance(t, torch.Tensor) for t in outs):
            want = "a tensor" if len(specs) == 1 else f"a tuple of {len(specs)} tensors"
            raise TypeError(f"{self.name}: out must be {want}, got {type(out).__name__}"
                            + (f" of length {len(outs)}" if isinstance(out, (tuple, list)) else ""))
        for i, (t, spec) in enumerate(zip(outs, specs)):
            label = "out" if len(specs) == 1 else f"out[{i}]"
            if t.dtype != spec.dtype:
                raise DtypeError(f"{self.name}: {label} must have dtype {spec.dtype}, got {t.dtype}")
            if tuple(t.shape) != tuple(spec.shape):
                raise ShapeError(f"{self.name}: {label} must have shape {tuple(spec.shape)}, got {tuple(t.shape)}")
            if t.device != device:
                raise DeviceError(f"{self.name}: {label} is on {t.device} but the inputs are on {device}")
            check_writable(self.name, label, t)
            if not _elements_apart(t):
                raise ShapeError(f"{self.name}: {label} has elements that may share memory (strides {t.stride()} "
                                 f"for shape {tuple(t.shape)}, e.g. from expand or as_strided); pass a tensor with "
                                 "its own memory per element")
        # Outputs sharing memory: the later one's copy-in (run_into) would overwrite the earlier's. Strided ones
        # that only interleave, such as a row's codes and scales in one buffer, share none and are allowed.
        if len(outs) == 1:  # (is_fake alone costs some 30 us after other work)
            return
        real = [i for i, t in enumerate(outs) if not (is_fake(t) or t.device.type == "meta")]
        for i, j in itertools.combinations(real, 2):
            if share_bytes(outs[i], outs[j]):
                raise ShapeError(f"{self.name}: out[{i}] and out[{j}] share memory; pass separate tensors")

    def run_into(self, args: Sequence, out: Any, backend: Optional[str] = None, fresh: bool = False) -> None:
        """Compute ``args`` into the validated ``out`` with the selected backend, then record it.

        Inputs are made contiguous and aligned (see dense_aligned); an output that is not contiguous or aligned or
        may overlap an input is computed into a temporary and copied in, so every backend gives the same
        result for any ``out``. ``fresh``: ``out`` was just allocated here (contiguous, sharing memory with
        nothing), so it is not checked.
        Kernels run under ``torch.no_grad()`` where a tensor requires grad (entering it costs about 10 us after other
        work, and without such a tensor no torch op inside a kernel records anything)."""
        if any(t.numel() == 0 for t in _as_tuple(out)):
            return
        dense = tuple(dense_aligned(values_resolved(a)) if isinstance(a, torch.Tensor) and i not in self.scratch
                      else a for i, a in enumerate(args))
        name, kernel = self.kernel(_as_tuple(out)[0].device, backend, dense)  # out is on the inputs' device
        if fresh:
            targets = _as_tuple(out)
        else:
            spans = [_memory_span(t) for t in tensors_of(args) if t.numel()]
            targets = tuple(
                t if t.is_contiguous() and _aligned(t) and not _touches(_memory_span(t), spans) else torch.empty_like(
                    t, memory_format=torch.contiguous_format)
                for t in _as_tuple(out)
            )
        # kernels compute values only: torch ops inside them (a GEMM into ``out``) must not see tensors that require
        # grad (torch refuses out= there); the custom op's own autograd stays
        grad = any(t.requires_grad for t in (*tensors_of(dense), *targets))
        with torch.no_grad() if grad else _NO_CONTEXT:
            kernel.run(*dense, out=targets if isinstance(out, tuple) else targets[0])
            for target, t in zip(targets, _as_tuple(out)):
                if target is not t:
                    t.copy_(target)
        self.record(name)

    def __call__(self, *args: Any, out: Any = None, backend: Optional[str] = None) -> Any:
        """Validate ``args``, allocate or check ``out``, run; returns the output(s)."""
        fresh = out is None
        if fresh:
            out = self.new_outputs(*args)
        else:
            self.check_out(args, out)
            out = tuple(out) if isinstance(out, list) else out
        self.run_into(args, out, backend, fresh=fresh)
        return out


_OPERATORS: dict[str, Operator] = {}


def register(op: Operator) -> Operator:
    """Make an operator visible to :func:`operators` (``lowbit info``, the contract tests)."""
    _OPERATORS[op.name] = op
    return op


def operators() -> dict[str, Operator]:
    """All registered operators, by name."""
    return dict(_OPERATORS)
