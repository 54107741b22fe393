"""HiFloat8 operators: ``encode_to_hifloat8`` and ``decode_from_hifloat8`` (formats.md section 1.6).

Registered as ``torch.ops.lowbit.encode_to_hifloat8`` / ``decode_from_hifloat8`` (and ``*_out``
variants that write into a given tensor), with fake implementations, so they work under torch.compile.

Contracts (upstream, with one documented extension):

* encode: input FP16 or BF16, any shape and strides, on any device; output uint8 of the same shape,
  contiguous, same device. Other dtypes raise :class:`lowbit.errors.DtypeError` (a TypeError and a
  RuntimeError). Empty tensors give empty outputs (upstream raises; an elementwise op has an obvious
  answer, so lowbit returns it).
* decode: input uint8; ``dtype`` None means BF16; only FP16 and BF16 outputs (FP32 is available from the
  reference, ``lowbit.formats.hifloat8.decode``).
* ``out=``: a tensor of the output dtype and shape on the input's device; it may be non-contiguous.
* ``backend=``: "native", "reference" or "auto" (default: the process default); see lowbit.backends.
"""

from __future__ import annotations

from typing import Optional

import torch

from lowbit import backends
from lowbit.errors import DeviceError, DtypeError, ShapeError
from lowbit.formats import hifloat8

ENCODE_INPUT_DTYPES = (torch.float16, torch.bfloat16)
DECODE_OUTPUT_DTYPES = (torch.float16, torch.bfloat16)


def _reference_encode_into(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(hifloat8.encode(x))


def _reference_decode_into(codes: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(hifloat8.decode(codes, out.dtype))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t


def _check_encode(encode_into, device: torch.device) -> None:
    """Self-check: every FP16 and BF16 bit pattern encodes exactly as the reference does."""
    for dtype in ENCODE_INPUT_DTYPES:
        x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype).to(device)
        out = torch.empty(x.shape, dtype=torch.uint8, device=device)
        encode_into(x, out)
        if not torch.equal(out.cpu(), hifloat8.encode(x.cpu())):
            raise RuntimeError(f"native HiFloat8 encode differs from the reference for {dtype} on {device}")


def _check_decode(decode_into, device: torch.device) -> None:
    """Self-check: all 256 codes decode exactly as the reference does, to FP16 and BF16."""
    codes = torch.arange(256, dtype=torch.uint8)
    for dtype in DECODE_OUTPUT_DTYPES:
        out = torch.empty(256, dtype=dtype, device=device)
        decode_into(codes.to(device), out)
        if not torch.equal(_bits(out.cpu()), _bits(hifloat8.decode(codes, dtype))):
            raise RuntimeError(f"native HiFloat8 decode differs from the reference for {dtype} on {device}")


ENCODE = backends.register(
    backends.Dispatcher(
        op="encode_to_hifloat8",
        reference=_reference_encode_into,
        native={
            "cpu": "lowbit.kernels.cpu.hifloat8:encode_into",
            "cuda": "lowbit.kernels.triton.hifloat8:encode_into",
            "npu": "lowbit.kernels.npu.hifloat8:encode_into",
        },
        self_check=_check_encode,
    )
)
DECODE = backends.register(
    backends.Dispatcher(
        op="decode_from_hifloat8",
        reference=_reference_decode_into,
        native={
            "cpu": "lowbit.kernels.cpu.hifloat8:decode_into",
            "cuda": "lowbit.kernels.triton.hifloat8:decode_into",
            "npu": "lowbit.kernels.npu.hifloat8:decode_into",
        },
        self_check=_check_decode,
    )
)


def _validate_encode_input(x: torch.Tensor) -> None:
    if x.dtype not in ENCODE_INPUT_DTYPES:
        raise DtypeError(f"encode_to_hifloat8 expects a float16 or bfloat16 input, got {x.dtype}")


def _validate_decode_args(codes: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.dtype:
    if codes.dtype != torch.uint8:
        raise DtypeError(f"decode_from_hifloat8 expects a uint8 input, got {codes.dtype}")
    dtype = torch.bfloat16 if dtype is None else dtype
    if dtype not in DECODE_OUTPUT_DTYPES:
        raise DtypeError(f"decode_from_hifloat8 outputs float16 or bfloat16, got dtype={dtype}")
    return dtype


def _validate_out(out: torch.Tensor, like: torch.Tensor, dtype: torch.dtype, op: str) -> None:
    if out.dtype != dtype:
        raise DtypeError(f"{op}: out must have dtype {dtype}, got {out.dtype}")
    if out.shape != like.shape:
        raise ShapeError(f"{op}: out must have shape {tuple(like.shape)}, got {tuple(out.shape)}")
    if out.device != like.device:
        raise DeviceError(f"{op}: out is on {out.device} but the input is on {like.device}")


def _run_into(dispatcher: backends.Dispatcher, src: torch.Tensor, out: torch.Tensor, backend) -> None:
    """Run the selected backend on contiguous data and write the result into ``out``."""
    fn = dispatcher.select(src.device, backend)
    if src.numel() == 0:
        return
    src = src.contiguous()
    if out.is_contiguous():
        fn(src, out)
    else:
        tmp = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        fn(src, tmp)
        out.copy_(tmp)


@torch.library.custom_op("lowbit::encode_to_hifloat8", mutates_args=())
def _encode_op(input: torch.Tensor, backend: Optional[str] = None) -> torch.Tensor:
    _validate_encode_input(input)
    out = torch.empty(input.shape, dtype=torch.uint8, device=input.device)
    _run_into(ENCODE, input, out, backend)
    return out


@_encode_op.register_fake
def _(input: torch.Tensor, backend: Optional[str] = None) -> torch.Tensor:
    _validate_encode_input(input)
    return torch.empty(input.shape, dtype=torch.uint8, device=input.device)


@torch.library.custom_op("lowbit::encode_to_hifloat8_out", mutates_args=("out",))
def _encode_out_op(input: torch.Tensor, out: torch.Tensor, backend: Optional[str] = None) -> None:
    _validate_encode_input(input)
    _validate_out(out, input, torch.uint8, "encode_to_hifloat8")
    _run_into(ENCODE, input, out, backend)


@_encode_out_op.register_fake
def _(input: torch.Tensor, out: torch.Tensor, backend: Optional[str] = None) -> None:
    _validate_encode_input(input)
    _validate_out(out, input, torch.uint8, "encode_to_hifloat8")


@torch.library.custom_op("lowbit::decode_from_hifloat8", mutates_args=())
def _decode_op(
    input: torch.Tensor, dtype: Optional[torch.dtype] = None, backend: Optional[str] = None
) -> torch.Tensor:
    dtype = _validate_decode_args(input, dtype)
    out = torch.empty(input.shape, dtype=dtype, device=input.device)
    _run_into(DECODE, input, out, backend)
    return out


@_decode_op.register_fake
def _(input: torch.Tensor, dtype: Optional[torch.dtype] = None, backend: Optional[str] = None):
    dtype = _validate_decode_args(input, dtype)
    return torch.empty(input.shape, dtype=dtype, device=input.device)


@torch.library.custom_op("lowbit::decode_from_hifloat8_out", mutates_args=("out",))
def _decode_out_op(input: torch.Tensor, out: torch.Tensor, backend: Optional[str] = None) -> None:
    dtype = _validate_decode_args(input, out.dtype)
    _validate_out(out, input, dtype, "decode_from_hifloat8")
    _run_into(DECODE, input, out, backend)


@_decode_out_op.register_fake
def _(input: torch.Tensor, out: torch.Tensor, backend: Optional[str] = None) -> None:
    dtype = _validate_decode_args(input, out.dtype)
    _validate_out(out, input, dtype, "decode_from_hifloat8")


def encode_to_hifloat8(
    input: torch.Tensor, *, out: Optional[torch.Tensor] = None, backend: Optional[str] = None
) -> torch.Tensor:
    """Encode an FP16/BF16 tensor to HiFloat8 codes (uint8, same shape and device).

    AMCT semantics: ties away from zero, finite |x| >= 2^15 saturate to +-32768, +-Inf -> 0x6F/0xEF,
    NaN -> 0x80, -0 -> 0x00. ``out``: uint8 tensor of the input's shape and device. ``backend``:
    "native", "reference" or "auto". Raises DtypeError (TypeError and RuntimeError) for other dtypes.
    """
    if out is None:
        return torch.ops.lowbit.encode_to_hifloat8(input, backend)
    torch.ops.lowbit.encode_to_hifloat8_out(input, out, backend)
    return out


def decode_from_hifloat8(
    input: torch.Tensor,
    dtype: Optional[torch.dtype] = None,
    *,
    out: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Decode uint8 HiFloat8 codes to FP16 or BF16 (``dtype`` None: BF16), exactly.

    NaN (0x80) decodes to 0x7FFF; FP16 outputs below 2^-14 are exact subnormals. ``out``: tensor of the
    output dtype (its dtype wins when ``dtype`` is None; they must agree otherwise) and the input's shape.
    """
    if out is None:
        return torch.ops.lowbit.decode_from_hifloat8(input, dtype, backend)
    if dtype is not None and dtype != out.dtype:
        raise DtypeError(f"decode_from_hifloat8: dtype={dtype} but out has dtype {out.dtype}")
    torch.ops.lowbit.decode_from_hifloat8_out(input, out, backend)
    return out
