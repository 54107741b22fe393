"""Backend selection: ``reference``, ``native`` and ``auto``, per operator and device.

* ``reference`` runs the readable torch code in :mod:`lowbit.formats` on any device.
* ``native`` runs the fastest kernel for the tensor's device: numba on CPU, Triton on CUDA, the vendor
  path (torch_npu / amct_ops) on an NPU. If there is none, :class:`BackendUnavailable` is raised.
* ``auto`` runs native when it is available *and* passed a one-time self-check against the reference on
  this device (cached per operator and device for the life of the process), else reference.

The process default is ``auto``; change it with :func:`set_backend` or the environment variable
``LOWBIT_BACKEND``, or for one thread / asyncio context with the context manager :func:`use_backend`. The backend that actually ran last
for an operator is returned by :func:`last_backend`.

Each operator builds one :class:`Dispatcher` with its reference function, a table of native loaders
per device type and a self-check; ops call :meth:`Dispatcher.select` and then the returned function.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

BACKENDS = ("native", "reference", "auto")
_ENV_VAR = "LOWBIT_BACKEND"


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here (no kernel for the device, missing import, failed check)."""


def _check_name(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; expected one of {', '.join(BACKENDS)}")
    return name


_process_default = _check_name(os.environ.get(_ENV_VAR, "auto") or "auto")
_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("lowbit_backend", default=None)
_last_ran: dict[str, str] = {}
_lock = threading.Lock()


def set_backend(name: str) -> None:
    """Set the process-wide default backend ("native", "reference" or "auto")."""
    global _process_default
    _process_default = _check_name(name)


def get_backend() -> str:
    """The default backend here: a :func:`use_backend` override of this thread/context, else the process's."""
    return _override.get() or _process_default


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Change the default backend inside a ``with`` block, for this thread (or asyncio context) only."""
    token = _override.set(_check_name(name))
    try:
        yield
    finally:
        _override.reset(token)


def last_backend(op: str) -> str | None:
    """Name of the backend that last ran ``op`` in this process ("native" or "reference"), or None."""
    return _last_ran.get(op)


def canonical_device(device: torch.device | str) -> torch.device:
    """The device as tensors on it report it: 'cpu:0' -> cpu, 'cuda' -> cuda:<current index>."""
    device = torch.device(device)
    if device.type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, device.type, None)
    if device.index is None and module is not None and hasattr(module, "current_device") and module.is_available():
        return torch.device(device.type, module.current_device())
    return device


def _load(target: str) -> Callable:
    """Import 'package.module:function'; turn import failures into BackendUnavailable."""
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, attr)
    except (ImportError, OSError, AttributeError) as exc:
        raise BackendUnavailable(f"cannot load {target}: {exc}") from exc


@dataclass
class Dispatcher:
    """Routes one operator to a backend.

    ``reference``: the formats/ function. ``native``: device type -> 'module:function' of the kernel
    (loaded lazily, so importing lowbit never imports numba, triton or torch_npu). ``self_check``:
    ``check(fn, device) -> None`` that runs ``fn`` on a probe input on ``device`` and raises if it
    differs from the reference; used once per device by ``auto``.
    """

    op: str
    reference: Callable
    native: dict[str, str]
    self_check: Callable[[Callable, torch.device], None]
    _checked: dict[str, bool] = field(default_factory=dict, repr=False)
    _check_errors: dict[str, str] = field(default_factory=dict, repr=False)

    def native_fn(self, device: torch.device) -> Callable:
        """The native kernel for ``device``; BackendUnavailable if there is none."""
        target = self.native.get(device.type)
        if target is None:
            raise BackendUnavailable(f"{self.op}: no native kernel for device type {device.type!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailable(f"{self.op}: CUDA is not available")
        return _load(target)

    def auto_uses_native(self, device: torch.device) -> bool:
        """Whether ``auto`` picks native on ``device`` (runs the self-check the first time)."""
        key = str(device)
        with _lock:
            if key not in self._checked:
                try:
                    self.self_check(self.native_fn(device), device)
                    self._checked[key] = True
                except Exception as exc:  # any failure of the probe means: do not trust native here
                    self._checked[key] = False
                    self._check_errors[key] = f"{type(exc).__name__}: {exc}"
            return self._checked[key]

    def auto_check_error(self, device: torch.device) -> str | None:
        """Why ``auto`` fell back to reference on ``device`` (None if it did not, or never checked)."""
        return self._check_errors.get(str(device))

    def resolve(self, device: torch.device | str, backend: str | None = None) -> str:
        """The backend ('native' or 'reference') that ``backend`` (default: process default) means here."""
        device = torch.device(device)
        name = _check_name(backend or get_backend())
        if name == "auto":
            return "native" if self.auto_uses_native(device) else "reference"
        if name == "native":
            self.native_fn(device)
        return name

    def record(self, name: str) -> None:
        """Note that backend ``name`` ran this operator (for callers that resolve once and run many times)."""
        _last_ran[self.op] = name

    def select(self, device: torch.device | str, backend: str | None = None) -> Callable:
        """The function to run for ``device`` and ``backend``; records it for :func:`last_backend`."""
        device = torch.device(device)
        name = self.resolve(device, backend)
        self.record(name)
        return self.native_fn(device) if name == "native" else self.reference


_DISPATCHERS: dict[str, Dispatcher] = {}


def register(dispatcher: Dispatcher) -> Dispatcher:
    """Make a dispatcher visible to :func:`dispatchers` (used by ``lowbit info``)."""
    _DISPATCHERS[dispatcher.op] = dispatcher
    return dispatcher


def dispatchers() -> dict[str, Dispatcher]:
    """All registered operator dispatchers, by operator name."""
    return dict(_DISPATCHERS)
