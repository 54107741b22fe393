"""The ``--device`` option of ``lowbit smoke`` and ``lowbit bench``: a device that exists here."""

from __future__ import annotations

import torch

from lowbit.backends import BackendUnavailable, canonical_device


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda:0, else npu:0, else cpu; otherwise the named device (canonical spelling).

    Raises BackendUnavailable naming the device when it is not a device torch knows, not a type lowbit
    runs on (cpu, cuda, npu: so never 'meta', which cannot be run or timed), or not present here.
    """
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda:0")
        if hasattr(torch, "npu") and torch.npu.is_available():  # type: ignore[attr-defined]
            return torch.device("npu:0")
        return torch.device("cpu")
    if name.split(":")[0] == "npu":  # torch only knows the device type once torch_npu is imported
        try:
            import torch_npu  # noqa: F401
        except ImportError as exc:
            raise BackendUnavailable(f"device {name}: torch_npu is not importable ({exc})") from exc
    try:
        device = canonical_device(name)
    except RuntimeError as exc:
        raise BackendUnavailable(f"device {name!r} is not a device torch knows: {exc}") from exc
    if device.type not in ("cpu", "cuda", "npu"):
        raise BackendUnavailable(f"device {name}: unsupported device type {device.type!r} (cpu, cuda:N or npu:N)")
    if device.type != "cpu":
        module = getattr(torch, device.type)
        if not module.is_available():
            raise BackendUnavailable(f"device {name}: {device.type.upper()} is not available")
        if (device.index or 0) >= module.device_count():
            raise BackendUnavailable(f"device {name}: only {module.device_count()} {device.type.upper()} device(s)")
    return device
