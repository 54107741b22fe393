"""HiFloat8 operators: ``encode_to_hifloat8`` and ``decode_from_hifloat8`` (docs/hifloat8.md).

Registered as ``torch.ops.lowbit.encode_to_hifloat8`` / ``decode_from_hifloat8`` and their ``*_out``
variants (see lowbit.ops.library), with fake implementations, so they work under torch.compile.

Contracts (upstream, with one documented extension):

* encode: input FP16 or BF16, any shape and strides, on any device; output uint8 of the same shape,
  contiguous, same device. Other dtypes raise :class:`lowbit.errors.DtypeError` (a TypeError and a
  RuntimeError). Empty tensors give empty outputs (upstream raises; an elementwise op has an obvious
  answer, so lowbit returns it).
* decode: input uint8; ``dtype`` None means BF16; only FP16 and BF16 outputs (FP32 is available from the
  reference, ``lowbit.formats.hifloat8.decode``).
* ``out=``: a tensor of the output dtype and shape on the input's device; any strides, and it may share
  memory with the input (computed through a temporary then).
* ``backend=``: "native", "reference" or "auto" (default: the process default); see lowbit.backends.
"""

from __future__ import annotations

from typing import Optional

import torch

from lowbit import kernels
from lowbit.backends import Kernel, TensorSpec
from lowbit.errors import DtypeError
from lowbit.formats import hifloat8
from lowbit.ops.library import call, define

ENCODE_INPUT_DTYPES = (torch.float16, torch.bfloat16)
DECODE_OUTPUT_DTYPES = (torch.float16, torch.bfloat16)


def _encode_outputs(x: torch.Tensor) -> tuple[TensorSpec]:
    if x.dtype not in ENCODE_INPUT_DTYPES:
        raise DtypeError(f"encode_to_hifloat8 expects a float16 or bfloat16 input, got {x.dtype}")
    return (TensorSpec(tuple(x.shape), torch.uint8),)


def _decode_outputs(codes: torch.Tensor, dtype: Optional[torch.dtype]) -> tuple[TensorSpec]:
    if codes.dtype != torch.uint8:
        raise DtypeError(f"decode_from_hifloat8 expects a uint8 input, got {codes.dtype}")
    dtype = torch.bfloat16 if dtype is None else dtype
    if dtype not in DECODE_OUTPUT_DTYPES:
        raise DtypeError(f"decode_from_hifloat8 outputs float16 or bfloat16, got dtype={dtype}")
    return (TensorSpec(tuple(codes.shape), dtype),)


class _ReferenceEncode(Kernel):
    def run(self, x: torch.Tensor, *, out: torch.Tensor) -> None:
        out.copy_(hifloat8.encode(x))


class _ReferenceDecode(Kernel):
    def run(self, codes: torch.Tensor, dtype: Optional[torch.dtype], *, out: torch.Tensor) -> None:
        out.copy_(hifloat8.decode(codes, out.dtype))


def _encode_probes():
    """Every FP16 and every BF16 bit pattern."""
    patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    return [(patterns.view(dtype),) for dtype in ENCODE_INPUT_DTYPES]


def _decode_probes():
    """All 256 codes, to FP16 and to BF16; and every code but NaN (an example with a NaN-free result)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return [(codes, dtype) for dtype in DECODE_OUTPUT_DTYPES] + [(codes[codes != hifloat8.NAN_CODE], None)]


_DEVICES = ("cpu", "cuda", "npu")
ENCODE = define("encode_to_hifloat8", "Tensor input", _encode_outputs, _ReferenceEncode(), _encode_probes,
                kernels.native("hifloat8", "ENCODE", _DEVICES))
DECODE = define("decode_from_hifloat8", "Tensor input, ScalarType? dtype=None", _decode_outputs, _ReferenceDecode(),
                _decode_probes, kernels.native("hifloat8", "DECODE", _DEVICES))


def encode_to_hifloat8(
    input: torch.Tensor, *, out: Optional[torch.Tensor] = None, backend: Optional[str] = None
) -> torch.Tensor:
    """Encode an FP16/BF16 tensor to HiFloat8 codes (uint8, same shape and device).

    AMCT semantics: ties away from zero, finite |x| >= 2^15 saturate to +-32768, +-Inf -> 0x6F/0xEF,
    NaN -> 0x80, -0 -> 0x00. ``out``: uint8 tensor of the input's shape and device. ``backend``:
    "native", "reference" or "auto". Raises DtypeError (TypeError and RuntimeError) for other dtypes.
    """
    return call(ENCODE, (input,), out, backend)


def decode_from_hifloat8(
    input: torch.Tensor,
    dtype: Optional[torch.dtype] = None,
    *,
    out: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Decode uint8 HiFloat8 codes to FP16 or BF16 (``dtype`` None: BF16, or ``out``'s dtype), exactly.

    NaN (0x80) decodes to 0x7FFF; FP16 outputs below 2^-14 are exact subnormals. ``out``: tensor of the
    output dtype (they must agree when ``dtype`` is given) and the input's shape.
    """
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"decode_from_hifloat8: dtype must be a torch.dtype or None, got {type(dtype).__name__} "
                        f"{dtype!r}")
    if out is not None and dtype is None and isinstance(out, torch.Tensor):
        dtype = out.dtype
    return call(DECODE, (input, dtype), out, backend)
