"""Exception types that satisfy both Python conventions and the upstream (Ascend) contracts.

Upstream operators raise ``RuntimeError`` for a wrong dtype or shape; Python code expects ``TypeError`` /
``ValueError``. These classes are both, so either ``except`` clause catches them.
"""


class DtypeError(TypeError, RuntimeError):
    """An input has a dtype the operator does not accept; the message names it."""


class ShapeError(ValueError, RuntimeError):
    """An input has a shape (or a dimension length) the operator does not accept; the message names it."""


class DeviceError(ValueError, RuntimeError):
    """Inputs are on a device the operator cannot use, or on different devices; the message names them."""
