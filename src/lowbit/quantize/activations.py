"""Activation fake quantization at run time (docs/quantize.md, "Activations").

Kinds: ``none``; ``hif8_cast`` (scaleless HiF8 round trip, Cast); ``hif8_static`` / ``fp8_static`` (one
calibrated per-tensor scale: ``Q(x / s) * s``); ``hif8_token`` (dynamic per token: ``s = max|x| / 15`` over
the last axis); ``hif8_position`` (AMCT's static "token" fake quant in compat mode: one calibrated scale per
sequence position, shape (S, 1)); ``mxfp8`` / ``mxfp4`` (dynamic MX blocks of 32 along the last axis). The
result has x's dtype; divisions by the scale are in float32.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from lowbit.backends import dense_aligned, get_backend
from lowbit.errors import ShapeError
from lowbit.formats import mxfp4, mxfp8
from lowbit.ops.library import direct_cpu_kernel, plain_context, plain_tensor
from lowbit.ops.mxfp4 import DEQUANTIZE, QUANTIZE, mxfp4_dequantize, mxfp4_quantize
from lowbit.quantize.algorithms import dynamic_token_scale
from lowbit.quantize.elements import e4m3_codes, e4m3_values, hif8_round_trip

ACT_KINDS = ("none", "hif8_cast", "hif8_static", "hif8_token", "hif8_position", "fp8_static", "mxfp8", "mxfp4")
STATIC_KINDS = ("hif8_static", "fp8_static")
SCALELESS_KINDS = ("hif8_cast", "mxfp8", "mxfp4")  # fake quant of x alone: fake_quant_input_call's kinds
# MXFP4 activations: OCP floor shared exponent, ties-away elements (the svd_quant operator's in-kernel rule).
MXFP4_ACT_RULE = ("floor", "ta")


def act_kind(act_type: Optional[str], strategy: str, dynamic: Optional[bool], algorithm: str) -> str:
    """The run-time kind for a resolved inputs spec (type None: not quantized)."""
    if act_type is None:
        return "none"
    if act_type == "mxfp8_e4m3fn":
        return "mxfp8"
    if act_type == "mxfp4_e2m1":
        return "mxfp4"
    if act_type == "hifloat8":
        if algorithm == "cast":
            return "hif8_cast"
        return "hif8_token" if strategy == "token" and algorithm != "ofmr" else "hif8_static"
    if act_type == "float8_e4m3fn":
        return "fp8_static"
    raise ValueError(f"lowbit does not implement {act_type} activation quantization")


def _scaled_hif8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # AMCT: HiF8RT(x / s) (x / s in float32) cast to x's dtype, times s cast to x's dtype.
    return hif8_round_trip(x.to(torch.float32) / scale).to(x.dtype) * scale.to(x.dtype)


def deploy_static_input(x: torch.Tensor, kind: str, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """AMCT's deploy path for a static scale: ``Q(x * rd(1 / s))`` with ``rd`` the rounding to ``out_dtype``
    (``npu_quantize`` multiply form), dequantized by the float32 ``s``; result in ``out_dtype``."""
    reciprocal = (1 / scale).to(out_dtype).to(torch.float32)
    v = x.to(torch.float32) * reciprocal
    q = hif8_round_trip(v) if kind == "hif8_static" else e4m3_values(e4m3_codes(v))
    return (q * scale).to(out_dtype)


def _mxfp8_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """MXFP8 quantize-dequantize of x in its dtype: the numba kernel (the reference's bits in one pass;
    imported on first use) for a plain CPU tensor in a plain context (lowbit.ops.library), else, or under the
    "reference" backend, the reference."""
    if x.dtype in mxfp8.FLOAT_DTYPES and plain_tensor(x) and plain_context() and get_backend() != "reference":
        from lowbit.kernels.cpu.mxfp8 import fake_quantize

        return fake_quantize(x)
    return mxfp8.dequantize(*mxfp8.quantize(x), x.dtype)


_NO_BYTES = torch.zeros(0, dtype=torch.uint8)  # stands for MXFP4 codes and scales in a dtype signature


def _mxfp4_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """MXFP4 quantize-dequantize of x in its dtype (blocks of 32 along the last axis, MXFP4_ACT_RULE): where
    both operators may leave the call to their CPU kernels (lowbit.ops.library.direct_cpu_kernel), the MXFP4
    kernel's one-pass form (their bits without their dispatches; imported on first use), else the operators."""
    args = (x, 32, *MXFP4_ACT_RULE, -1)
    if (x.dtype in mxfp4.INPUT_DTYPES and direct_cpu_kernel(QUANTIZE, args) is not None
            and direct_cpu_kernel(DEQUANTIZE, (_NO_BYTES, _NO_BYTES, x.dtype, -1)) is not None):
        from lowbit.kernels.cpu.mxfp4 import fake_quantize

        x = dense_aligned(x)
        out = torch.empty_like(x)
        fake_quantize(x, *args[1:4], out=out)
        QUANTIZE.record("native")
        DEQUANTIZE.record("native")
        return out
    return mxfp4_dequantize(*mxfp4_quantize(*args), x.dtype)


class FakeQuantInputCall:
    """A deploy layer's bound call ``gemv(x, m, out) -> bool`` (lowbit.ops.library.PreparedCall._bound_gemv) on
    its input fake-quantized first by ``fake_quantize`` (x -> its fake quant in a new tensor, one numba call:
    the bits of :func:`fake_quant_input` for the layer's kind), recorded as runs of the operators in
    ``recorded``. ``max_rows``: gemv's, and x at most the fake quant's one-thread size. Made by
    :func:`fake_quant_input_call`."""

    def __init__(self, gemv: Callable[..., bool], fake_quantize: Callable, recorded: tuple, max_rows: int) -> None:
        self._gemv, self._fake_quantize, self._recorded, self.max_rows = gemv, fake_quantize, recorded, max_rows

    def __call__(self, x: torch.Tensor, m: int, out: torch.Tensor) -> bool:
        x_q = self._fake_quantize(x)
        for op in self._recorded:
            op.record("native")
        return self._gemv(x_q, m, out)


def fake_quant_input_call(gemv: Callable[..., bool], kind: str, dtype: torch.dtype,
                          k: int) -> Optional[FakeQuantInputCall]:
    """``gemv`` (a bound call with ``max_rows``) on x of ``dtype`` and K = ``k`` fake-quantized by ``kind``
    ("hif8_cast", "mxfp4" or "mxfp8") with its kernels' one-call form, where :func:`fake_quant_input` would take
    those kernels for such x under the current backend setting (FP16 / BF16, a plain context, not the
    "reference" backend; the MX kinds: K a multiple of 32; HiF8 and MXFP4: both operators' kernels direct and a
    CPU with AVX512-BW), else None (the caller's full path)."""
    if dtype not in (torch.float16, torch.bfloat16) or not plain_context() or get_backend() == "reference":
        return None
    if kind == "hif8_cast":
        return _hif8_round_trip_call(gemv, dtype, k)
    if k % 32 or kind not in SCALELESS_KINDS:
        return None
    if kind == "mxfp8":
        from lowbit.kernels.cpu import mxfp8 as kernel  # numba: imported on first use

        return FakeQuantInputCall(gemv, kernel.fake_quantize_small, (), min(gemv.max_rows,
                                                                            kernel.ONE_THREAD_ELEMENTS // k))
    from lowbit.kernels.cpu import mxfp4 as kernel  # numba: imported on first use

    x = torch.zeros(1, k, dtype=dtype)
    if (not kernel.fake_quantizes_in_registers(dtype, 32)
            or direct_cpu_kernel(QUANTIZE, (x, 32, *MXFP4_ACT_RULE, -1)) is None
            or direct_cpu_kernel(DEQUANTIZE, (_NO_BYTES, _NO_BYTES, dtype, -1)) is None):
        return None
    fake_quantize = functools.partial(kernel.fake_quantize_small, scale_rule=MXFP4_ACT_RULE[0],
                                      rounding=MXFP4_ACT_RULE[1])
    return FakeQuantInputCall(gemv, fake_quantize, (QUANTIZE, DEQUANTIZE),
                              min(gemv.max_rows, kernel.ONE_THREAD_ELEMENTS // k))


def _hif8_round_trip_call(gemv: Callable[..., bool], dtype: torch.dtype, k: int) -> Optional[FakeQuantInputCall]:
    """fake_quant_input_call for "hif8_cast": HiFloat8's round_trip_small where both operators' kernels are
    direct for ``dtype`` (hif8_round_trip's full path takes them) on a CPU with AVX512-BW, else None."""
    from lowbit.kernels.cpu import _simd, hifloat8 as kernel  # numba: imported on first use
    from lowbit.ops.hifloat8 import DECODE as HIF8_DECODE, ENCODE as HIF8_ENCODE

    if (not _simd.HAS_AVX512BW or direct_cpu_kernel(HIF8_ENCODE, (torch.zeros(1, k, dtype=dtype),)) is None
            or direct_cpu_kernel(HIF8_DECODE, (_NO_BYTES, dtype)) is None):
        return None
    return FakeQuantInputCall(gemv, kernel.round_trip_small, (HIF8_ENCODE, HIF8_DECODE),
                              min(gemv.max_rows, kernel.ONE_THREAD_ELEMENTS // k))


def fake_quant_input(x: torch.Tensor, kind: str, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Quantize-dequantize ``x`` (..., K) by ``kind``; ``scale`` (float32 [1]) for the static kinds."""
    if kind == "none":
        return x
    if kind == "hif8_cast":
        return hif8_round_trip(x)
    if kind == "hif8_static":
        return _scaled_hif8(x, scale)
    if kind == "hif8_token":
        return _scaled_hif8(x, dynamic_token_scale(x))
    if kind == "hif8_position":  # AMCT's static "token" fake quant: one scale per sequence position, (S, 1)
        if x.dim() < 2 or x.shape[-2] != scale.shape[0]:
            raise ShapeError(f"static per-position activation scales were calibrated for sequence length "
                             f"{scale.shape[0]}, got input shape {tuple(x.shape)}")
        return _scaled_hif8(x, scale)
    if kind == "fp8_static":
        return (e4m3_values(e4m3_codes(x.to(torch.float32) / scale)) * scale).to(x.dtype)
    if kind == "mxfp8":
        return _mxfp8_fake_quant(x)
    if kind == "mxfp4":
        return _mxfp4_fake_quant(x)
    raise ValueError(f"unknown activation quantization kind {kind!r}; expected one of {ACT_KINDS}")
