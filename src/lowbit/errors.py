"""Exception types that satisfy both Python conventions and the upstream (Ascend) contracts.

Upstream operators raise ``RuntimeError`` for a wrong dtype or shape; Python code expects ``TypeError`` /
``ValueError``. These classes are both, so either ``except`` clause catches them. Every public operator
raises the same class for the same kind of mistake:

* a tensor of a dtype the operator does not take -> :class:`DtypeError`;
* a wrong shape, size, dimension length or a size-like argument out of range -> :class:`ShapeError`;
* a tensor on a device the operator cannot use, or tensors on different devices -> :class:`DeviceError`;
* a backend that cannot run here -> :class:`BackendUnavailable`;
* an unknown option value (an unknown backend, algorithm, rounding name) -> plain ``ValueError``; an argument
  of the wrong Python type (a float where an int is needed) -> plain ``TypeError``.
"""


class DtypeError(TypeError, RuntimeError):
    """An input has a dtype the operator does not accept; the message names it."""


class ShapeError(ValueError, RuntimeError):
    """An input has a shape (or a dimension length) the operator does not accept; the message names it."""


class DeviceError(ValueError, RuntimeError):
    """Inputs are on a device the operator cannot use, or on different devices; the message names them."""


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here (no kernel for the device, missing import, arguments the
    kernel does not support, failed self-check); the message says which and why."""


def check_int(name: str, value, *, minimum: int | None = None) -> int:
    """``value`` as an int (bools and floats refused with TypeError); ShapeError if below ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ShapeError(f"{name} must be >= {minimum}, got {value}")
    return value


def with_context(where: str, exc: Exception) -> Exception:
    """An exception of ``exc``'s class whose message is ``"<where>: <exc's message>"`` (a RuntimeError where
    that class cannot be made from a message; ``exc`` itself where its message starts with ``where``); raise
    it ``from exc``."""
    if str(exc).startswith(where):
        return exc
    try:
        return type(exc)(f"{where}: {exc}")
    except Exception:  # a class whose constructor takes other arguments
        return RuntimeError(f"{where}: {exc}")
