"""lowbit: bit-exact low-bit number formats and quantized operators for PyTorch, on every machine.

Operators are also registered as ``torch.ops.lowbit.<name>``. Backends: see :mod:`lowbit.backends`.
"""

import os as _os
import sys as _sys

# numba's parallel loops and torch's ops take turns on one team of OpenMP threads (one libgomp serves both:
# README, "Threads"), so how its idle threads wait between regions decides what a switch costs. Threads that
# spin long after a region (libgomp's default, milliseconds) stalled a switch for as long on a 2-vCPU VM;
# threads that sleep at once must be woken for the next region, and on virtual machines whose kernel packs woken
# threads onto busy vCPUs a region's threads then ran one after the other on one vCPU. So idle threads spin for
# a bounded count (about 0.5 ms) and then sleep (PASSIVE: none at all where the team has more threads than
# CPUs). Read when OpenMP loads: this only takes effect when lowbit is imported before torch (as in the lowbit
# command); a value of either variable set by the user is kept.
_WAIT_POLICY = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "50000"}
if "torch" not in _sys.modules and not any(name in _os.environ for name in _WAIT_POLICY):
    _os.environ.update(_WAIT_POLICY)


def _interrupted_while_loading(signum, frame) -> None:
    """The lowbit command's Ctrl-C before its main() runs (the imports below take about a second): its one
    line and exit code 130, as main() reports an interrupt (docs/cli.md), not a traceback of the imports."""
    _os.write(2, b"lowbit: error: interrupted\n")
    _os._exit(130)


if _os.path.basename(_sys.argv[0] if getattr(_sys, "argv", None) else "") == "lowbit":  # the console script
    import signal
    import threading

    python_handles_it = signal.getsignal(signal.SIGINT) is signal.default_int_handler  # not ignored (nohup, &)
    if threading.current_thread() is threading.main_thread() and python_handles_it:
        signal.signal(signal.SIGINT, _interrupted_while_loading)  # put back by lowbit.cli.main.main

from importlib.metadata import PackageNotFoundError as _PackageNotFoundError, version as _version  # noqa: E402

from lowbit.backends import (  # noqa: E402
    BackendUnavailable,
    get_backend,
    last_backend,
    set_backend,
    use_backend,
)
from lowbit.errors import DeviceError, DtypeError, ShapeError
from lowbit.nn.svd_quant import SVDQuantLinear, svd_quant_decompose
from lowbit.ops.hifloat4 import hifloat4_fake_quant, hifloat4_pack, hifloat4_unpack
from lowbit.ops.hifloat8 import decode_from_hifloat8, encode_to_hifloat8
from lowbit.ops.mxfp4 import dynamic_mx_quant, mxfp4_dequantize, mxfp4_quantize
from lowbit.ops.svd_quant import svd_quant
from lowbit.ops.weight_only import float8_e4m3fn_linear, hifloat4_linear, hifloat8_linear, mxfp4_linear, mxfp8_linear
from lowbit.ops.wqbmm import PackedWeight, WqbmmPlan, plan_weight_quant_batch_matmul, weight_quant_batch_matmul
from lowbit.quantize import (  # noqa: E402
    SCHEMES,
    AlgorithmSpec,
    InputSpec,
    QuantConfig,
    QuantizeReport,
    Scheme,
    WeightSpec,
    convert,
    load_quantized,
    parameters_on_meta,
    quantize,
    quantize_,
    save_quantized,
)

try:
    __version__ = _version("lowbit")
except _PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0+unknown"

__all__ = [
    "SCHEMES",
    "AlgorithmSpec",
    "InputSpec",
    "QuantConfig",
    "QuantizeReport",
    "Scheme",
    "WeightSpec",
    "convert",
    "load_quantized",
    "parameters_on_meta",
    "quantize",
    "quantize_",
    "save_quantized",
    "BackendUnavailable",
    "DeviceError",
    "DtypeError",
    "PackedWeight",
    "SVDQuantLinear",
    "ShapeError",
    "WqbmmPlan",
    "decode_from_hifloat8",
    "dynamic_mx_quant",
    "encode_to_hifloat8",
    "float8_e4m3fn_linear",
    "get_backend",
    "hifloat4_fake_quant",
    "hifloat4_linear",
    "hifloat4_pack",
    "hifloat4_unpack",
    "hifloat8_linear",
    "last_backend",
    "mxfp4_dequantize",
    "mxfp4_linear",
    "mxfp4_quantize",
    "mxfp8_linear",
    "plan_weight_quant_batch_matmul",
    "set_backend",
    "svd_quant",
    "svd_quant_decompose",
    "use_backend",
    "weight_quant_batch_matmul",
]
