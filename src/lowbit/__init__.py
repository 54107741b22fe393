"""lowbit: bit-exact low-bit number formats and quantized operators for PyTorch, on every machine.

Operators are also registered as ``torch.ops.lowbit.<name>``. Backends: see :mod:`lowbit.backends`.
"""

from importlib.metadata import PackageNotFoundError, version

from lowbit.backends import (
    BackendUnavailable,
    get_backend,
    last_backend,
    set_backend,
    use_backend,
)
from lowbit.errors import DeviceError, DtypeError, ShapeError
from lowbit.ops.hifloat4 import hifloat4_fake_quant, hifloat4_pack, hifloat4_unpack
from lowbit.ops.hifloat8 import decode_from_hifloat8, encode_to_hifloat8

try:
    __version__ = version("lowbit")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0+unknown"

__all__ = [
    "BackendUnavailable",
    "DeviceError",
    "DtypeError",
    "ShapeError",
    "decode_from_hifloat8",
    "encode_to_hifloat8",
    "get_backend",
    "hifloat4_fake_quant",
    "hifloat4_pack",
    "hifloat4_unpack",
    "last_backend",
    "set_backend",
    "use_backend",
]
