"""HiFloat4 operators: ``hifloat4_fake_quant``, ``hifloat4_pack`` and ``hifloat4_unpack`` (formats.md 2).

``hifloat4_fake_quant`` is registered as ``torch.ops.lowbit.hifloat4_fake_quant`` (and
``hifloat4_fake_quant_out``, writing into a given tensor) with fake implementations, so it works under
torch.compile. Pack and unpack are plain functions (their outputs are byte tensors for storage).

Contracts (upstream AMCT, section 2.6):

* input FP16, BF16 or FP32, any shape and strides, any device; 64-element blocks along ``qdim``; output of
  the input's shape, dtype and device (contiguous). Other dtypes raise DtypeError (TypeError and
  RuntimeError); a 0-d input, a qdim out of range, or a quant-dim length that is 0 or not a multiple of 64
  raise ShapeError (ValueError and RuntimeError; upstream raises RuntimeError).
* blocks holding a NaN or an infinity come out entirely NaN; no other block changes. All-zero blocks give
  zeros. No gradient flows through the quantizer (AMCT's 4-bit path has no straight-through estimator):
  the backward returns no gradient for the input.
* ``out=``: a tensor of the input's dtype, shape and device; it may be non-contiguous.
* ``backend=``: "native", "reference" or "auto" (default: the process default); see lowbit.backends.
  Native: numba on the CPU, Triton on CUDA, AMCT's ``hifloat4_fake_quant`` on an NPU (pack and unpack:
  CPU only; elsewhere ``auto`` runs the reference).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from lowbit import backends
from lowbit.errors import DeviceError, DtypeError, ShapeError
from lowbit.formats import hifloat4

DTYPES = hifloat4.DTYPES


def _reference_fake_quant_into(x: torch.Tensor, qdim: int, out: torch.Tensor) -> None:
    out.copy_(hifloat4.fake_quant(x, qdim))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def probe_input(dtype: torch.dtype) -> torch.Tensor:
    """(16, 128) CPU tensor of ``dtype``: the worked blocks of section 2.9 (with an infinity block and a
    negative-zero block added), then heavy-tailed random rows spanning about 2^-40 ... 2^40."""
    g = torch.Generator().manual_seed(2026)
    worked = hifloat4.worked_blocks()
    extra = torch.zeros(2, hifloat4.BLOCK)
    extra[0, 9] = -float("inf")
    extra[1] = -0.0
    left = torch.cat([worked, extra, torch.randn(6, hifloat4.BLOCK, generator=g)])
    right = torch.randn(16, hifloat4.BLOCK, generator=g) * torch.exp2(torch.randn(16, 1, generator=g) * 12)
    return torch.cat([left, right], dim=1).to(dtype)


def _check_fake_quant(fake_quant_into, device: torch.device) -> None:
    """Self-check: the probe input, every dtype, qdim last and first, equals the reference bit for bit."""
    for dtype in DTYPES:
        x = probe_input(dtype)
        for qdim, xq in ((-1, x), (0, x.t().contiguous())):
            out = torch.empty(xq.shape, dtype=dtype, device=device)
            fake_quant_into(xq.to(device), qdim, out)
            if not torch.equal(_bits(out.cpu()), _bits(hifloat4.fake_quant(xq, qdim))):
                raise RuntimeError(f"native HiFloat4 fake-quant differs from the reference for {dtype}, "
                                   f"qdim {qdim} on {device}")


def _check_pack(pack, device: torch.device) -> None:
    """Self-check: packing the probe input gives the reference's bytes for every dtype."""
    for dtype in DTYPES:
        x = probe_input(dtype)
        scale, value = pack(x.to(device))
        expected = hifloat4.pack(x)
        if not (torch.equal(scale.cpu(), expected[0]) and torch.equal(value.cpu(), expected[1])):
            raise RuntimeError(f"native HiFloat4 pack differs from the reference for {dtype} on {device}")


def _check_unpack(unpack, device: torch.device) -> None:
    """Self-check: unpacking the probe input's bytes gives the reference's values for every dtype."""
    scale, value = hifloat4.pack(probe_input(torch.float32))
    for dtype in DTYPES:
        out = unpack(scale.to(device), value.to(device), dtype)
        if not torch.equal(_bits(out.cpu()), _bits(hifloat4.unpack(scale, value, dtype))):
            raise RuntimeError(f"native HiFloat4 unpack differs from the reference for {dtype} on {device}")


FAKE_QUANT = backends.register(
    backends.Dispatcher(
        op="hifloat4_fake_quant",
        reference=_reference_fake_quant_into,
        native={
            "cpu": "lowbit.kernels.cpu.hifloat4:fake_quant_into",
            "cuda": "lowbit.kernels.triton.hifloat4:fake_quant_into",
            "npu": "lowbit.kernels.npu.hifloat4:fake_quant_into",
        },
        self_check=_check_fake_quant,
    )
)
PACK = backends.register(
    backends.Dispatcher(
        op="hifloat4_pack",
        reference=hifloat4.pack,
        native={"cpu": "lowbit.kernels.cpu.hifloat4:pack"},
        self_check=_check_pack,
    )
)
UNPACK = backends.register(
    backends.Dispatcher(
        op="hifloat4_unpack",
        reference=hifloat4.unpack,
        native={"cpu": "lowbit.kernels.cpu.hifloat4:unpack"},
        self_check=_check_unpack,
    )
)


def _validate_out(out: torch.Tensor, x: torch.Tensor) -> None:
    if out.dtype != x.dtype:
        raise DtypeError(f"hifloat4_fake_quant: out must have dtype {x.dtype}, got {out.dtype}")
    if out.shape != x.shape:
        raise ShapeError(f"hifloat4_fake_quant: out must have shape {tuple(x.shape)}, got {tuple(out.shape)}")
    if out.device != x.device:
        raise DeviceError(f"hifloat4_fake_quant: out is on {out.device} but the input is on {x.device}")


def _run_into(x: torch.Tensor, qdim: int, out: torch.Tensor, backend: Optional[str]) -> None:
    """Run the selected backend on contiguous data and write the result into ``out``."""
    fn = FAKE_QUANT.select(x.device, backend)
    if x.numel() == 0:
        return
    x = x.contiguous()
    if out.is_contiguous():
        fn(x, qdim, out)
    else:
        tmp = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        fn(x, qdim, tmp)
        out.copy_(tmp)


@torch.library.custom_op("lowbit::hifloat4_fake_quant", mutates_args=())
def _fake_quant_op(input: torch.Tensor, qdim: int = -1, backend: Optional[str] = None) -> torch.Tensor:
    hifloat4.check_qdim(input, qdim)
    out = torch.empty(input.shape, dtype=input.dtype, device=input.device)
    _run_into(input, qdim, out, backend)
    return out


@_fake_quant_op.register_fake
def _(input: torch.Tensor, qdim: int = -1, backend: Optional[str] = None) -> torch.Tensor:
    hifloat4.check_qdim(input, qdim)
    return torch.empty(input.shape, dtype=input.dtype, device=input.device)


def _no_gradient(ctx, grad: torch.Tensor):
    return None, None, None


_fake_quant_op.register_autograd(_no_gradient)


@torch.library.custom_op("lowbit::hifloat4_fake_quant_out", mutates_args=("out",))
def _fake_quant_out_op(input: torch.Tensor, out: torch.Tensor, qdim: int = -1,
                       backend: Optional[str] = None) -> None:
    hifloat4.check_qdim(input, qdim)
    _validate_out(out, input)
    _run_into(input, qdim, out, backend)


@_fake_quant_out_op.register_fake
def _(input: torch.Tensor, out: torch.Tensor, qdim: int = -1, backend: Optional[str] = None) -> None:
    hifloat4.check_qdim(input, qdim)
    _validate_out(out, input)


def hifloat4_fake_quant(
    x: torch.Tensor,
    qdim: int = -1,
    *,
    out: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Quantize ``x`` to HiFloat4 in 64-element blocks along ``qdim`` and dequantize (AMCT, bit-exact).

    ``x``: FP16/BF16/FP32, ``x.shape[qdim] % 64 == 0``. Returns a tensor of x's shape, dtype and device
    (``out`` if given). Contracts, errors and backends: see the module docstring.
    """
    if out is None:
        return torch.ops.lowbit.hifloat4_fake_quant(x, qdim, backend)
    torch.ops.lowbit.hifloat4_fake_quant_out(x, out, qdim, backend)
    return out


def hifloat4_pack(x: torch.Tensor, *, backend: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D FP16/BF16/FP32 tensor (blocks along the last dim) into AMCT's packed bytes.

    Returns ``(scale, value)``: uint8 (rows, cols / 64, 4) and uint8 (rows, cols / 2) on x's device; layout
    in :mod:`lowbit.formats.hifloat4`. Errors: DtypeError, ShapeError (not 2-D, cols % 64 != 0).
    """
    hifloat4.check_pack_input(x)
    return PACK.select(x.device, backend)(x.contiguous())


def hifloat4_unpack(
    scale: torch.Tensor | np.ndarray,
    value: torch.Tensor | np.ndarray,
    dtype: torch.dtype = torch.float32,
    *,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Decode AMCT-packed HiFloat4 bytes to a (rows, cols) tensor of ``dtype`` (FP16/BF16/FP32).

    ``unpack(*pack(x), x.dtype)`` equals ``hifloat4_fake_quant(x)`` bit for bit. Accepts torch tensors or
    numpy arrays. Errors: DtypeError, ShapeError, DeviceError (see lowbit.formats.hifloat4.check_packed).
    """
    scale, value = hifloat4.check_packed(scale, value, dtype)
    return UNPACK.select(scale.device, backend)(scale, value, dtype)
