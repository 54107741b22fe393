"""HiFloat4 operators: ``hifloat4_fake_quant``, ``hifloat4_pack`` and ``hifloat4_unpack`` (docs/hifloat4.md).

Registered as ``torch.ops.lowbit.hifloat4_fake_quant`` / ``hifloat4_pack`` / ``hifloat4_unpack`` and their
``*_out`` variants (see lowbit.ops.library), with fake implementations, so they work under torch.compile.

Contracts (upstream AMCT; docs/hifloat4.md, section 'Contracts'):

* fake-quant: input FP16, BF16 or FP32, any shape and strides, any device; 64-element blocks along
  ``qdim``; output of the input's shape, dtype and device (contiguous). Other dtypes raise DtypeError
  (TypeError and RuntimeError); a qdim that is not an int (``True`` included) raises TypeError naming
  qdim; a 0-d input, a qdim out of range, or a quant-dim length that is 0 or not a multiple of 64 raise
  ShapeError (ValueError and RuntimeError; upstream raises RuntimeError). Blocks holding a NaN or an
  infinity come out entirely NaN; no other block changes. No gradient flows through the quantizer (AMCT's
  4-bit path has no straight-through estimator): the backward returns no gradient for the input.
* pack: a 2-D FP16/BF16/FP32 input with a last dim that is a positive multiple of 64; outputs
  ``(scale, value)``, uint8 (rows, cols / 64, 4) and (rows, cols / 2).
* unpack: uint8 ``scale`` (rows, n_blocks, 4) and ``value`` (rows, n_blocks * 32) on one device, to a
  (rows, n_blocks * 64) tensor of ``dtype`` (FP16/BF16/FP32); DtypeError, ShapeError, DeviceError
  otherwise. FP16 outputs of bytes packed from values beyond FP16's range are +-Inf (a cast's rounding).
* ``out=``: a tensor (pack: a tuple ``(scale, value)``) of the output dtypes and shapes on the input's
  device; any strides, and it may share memory with an input, ``out=x`` included (computed through a
  temporary then).
* ``backend=``: "native", "reference" or "auto" (default: the process default); see lowbit.backends.
  Native: numba on the CPU, Triton on CUDA, AMCT's ``hifloat4_fake_quant`` on an NPU (pack and unpack:
  CPU only; elsewhere ``auto`` runs the reference).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from lowbit import kernels
from lowbit.backends import Kernel, TensorSpec
from lowbit.formats import hifloat4
from lowbit.ops.library import call, define

DTYPES = hifloat4.DTYPES


def _fake_quant_outputs(x: torch.Tensor, qdim: int) -> tuple[TensorSpec]:
    hifloat4.check_qdim(x, qdim)
    return (TensorSpec(tuple(x.shape), x.dtype),)


def _pack_outputs(x: torch.Tensor) -> tuple[TensorSpec, TensorSpec]:
    hifloat4.check_pack_input(x)
    rows, cols = x.shape
    return (TensorSpec((rows, cols // hifloat4.BLOCK, 4), torch.uint8), TensorSpec((rows, cols // 2), torch.uint8))


def _unpack_outputs(scale: torch.Tensor, value: torch.Tensor, dtype: Optional[torch.dtype]) -> tuple[TensorSpec]:
    dtype = torch.float32 if dtype is None else dtype
    hifloat4.check_packed(scale, value, dtype)
    rows, n_blocks = scale.shape[:2]
    return (TensorSpec((rows, n_blocks * hifloat4.BLOCK), dtype),)


class _ReferenceFakeQuant(Kernel):
    def run(self, x: torch.Tensor, qdim: int, *, out: torch.Tensor) -> None:
        out.copy_(hifloat4.fake_quant(x, qdim))


class _ReferencePack(Kernel):
    def run(self, x: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor]) -> None:
        for target, result in zip(out, hifloat4.pack(x)):
            target.copy_(result)


class _ReferenceUnpack(Kernel):
    def run(self, scale: torch.Tensor, value: torch.Tensor, dtype: Optional[torch.dtype], *,
            out: torch.Tensor) -> None:
        out.copy_(hifloat4.unpack(scale, value, out.dtype))


def probe_input(dtype: torch.dtype) -> torch.Tensor:
    """(16, 128) CPU tensor of ``dtype``: the worked blocks of docs/hifloat4.md, section 'Worked blocks'
    (with an infinity block and a negative-zero block added), then heavy-tailed random rows spanning about
    2^-40 ... 2^40."""
    g = torch.Generator().manual_seed(2026)
    worked = hifloat4.worked_blocks()
    extra = torch.zeros(2, hifloat4.BLOCK)
    extra[0, 9] = -float("inf")
    extra[1] = -0.0
    left = torch.cat([worked, extra, torch.randn(6, hifloat4.BLOCK, generator=g)])
    right = torch.randn(16, hifloat4.BLOCK, generator=g) * torch.exp2(torch.randn(16, 1, generator=g) * 12)
    return torch.cat([left, right], dim=1).to(dtype)


def _finite_input() -> torch.Tensor:
    """(3, 128) BF16 normal random values: a probe whose results hold no NaN (a small opcheck example)."""
    return torch.randn(3, 2 * hifloat4.BLOCK, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)


def _fake_quant_probes():
    """Per dtype the probe input along its last dim (quant dim last) and, transposed, along dim 0 (16
    blocks side by side); in FP32 also a (2, 64, 33) input along dim 1 (66 blocks: more than one numba
    tile and Triton program, a partial one at the edge); and the finite input."""
    probes = []
    for dtype in DTYPES:
        x = probe_input(dtype)
        probes += [(x, -1), (x.t().contiguous(), 0)]
    wide = probe_input(torch.float32).repeat(3, 1).reshape(-1)[:2 * 64 * 33].reshape(2, 64, 33)
    return probes + [(wide, 1), (_finite_input(), -1)]


def _pack_probes():
    """The probe input in every dtype."""
    return [(probe_input(dtype),) for dtype in DTYPES]


def _unpack_probes():
    """Per output dtype: the packed probe input, and arbitrary bytes (every scale byte, 0xFF included;
    random flag bytes and nibbles); and the packed finite input."""
    scale, value = hifloat4.pack(probe_input(torch.float32))
    g = torch.Generator().manual_seed(2026)
    any_scale = torch.randint(0, 256, (256, 1, 4), generator=g, dtype=torch.int32).to(torch.uint8)
    any_scale[:, 0, 0] = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    any_value = torch.randint(0, 256, (256, 32), generator=g, dtype=torch.int32).to(torch.uint8)
    probes = [probe for dtype in DTYPES for probe in ((scale, value, dtype), (any_scale, any_value, dtype))]
    return probes + [(*hifloat4.pack(_finite_input()), torch.bfloat16)]


FAKE_QUANT = define("hifloat4_fake_quant", "Tensor input, int qdim=-1", _fake_quant_outputs, _ReferenceFakeQuant(),
                    _fake_quant_probes, kernels.native("hifloat4", "FAKE_QUANT", ("cpu", "cuda", "npu")),
                    differentiable=False)
PACK = define("hifloat4_pack", "Tensor input", _pack_outputs, _ReferencePack(), _pack_probes,
              kernels.native("hifloat4", "PACK", ("cpu",)), output_names=("scale", "value"))
UNPACK = define("hifloat4_unpack", "Tensor scale, Tensor value, ScalarType? dtype=None", _unpack_outputs,
                _ReferenceUnpack(), _unpack_probes, kernels.native("hifloat4", "UNPACK", ("cpu",)))


def hifloat4_fake_quant(
    x: torch.Tensor,
    qdim: int = -1,
    *,
    out: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Quantize ``x`` to HiFloat4 in 64-element blocks along ``qdim`` and dequantize (AMCT, bit-exact).

    ``x``: FP16/BF16/FP32, ``x.shape[qdim] % 64 == 0``. Returns a tensor of x's shape, dtype and device
    (``out`` if given; it may be ``x`` itself). Contracts, errors and backends: see the module docstring.
    """
    return call(FAKE_QUANT, (x, hifloat4.as_qdim(qdim)), out, backend)


def hifloat4_pack(
    x: torch.Tensor,
    *,
    out: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D FP16/BF16/FP32 tensor (blocks along the last dim) into AMCT's packed bytes.

    Returns ``(scale, value)``: uint8 (rows, cols / 64, 4) and uint8 (rows, cols / 2) on x's device
    (``out`` if given); layout in docs/hifloat4.md, section 'Packed layout'. Errors: DtypeError,
    ShapeError (not 2-D, cols not a positive multiple of 64).
    """
    return tuple(call(PACK, (x,), out, backend))


def hifloat4_unpack(
    scale: torch.Tensor | np.ndarray,
    value: torch.Tensor | np.ndarray,
    dtype: Optional[torch.dtype] = None,
    *,
    out: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Decode AMCT-packed HiFloat4 bytes to a (rows, cols) tensor of ``dtype`` (FP16/BF16/FP32).

    ``dtype`` None: ``out``'s dtype, else FP32. ``unpack(*pack(x), x.dtype)`` equals
    ``hifloat4_fake_quant(x)`` bit for bit. Accepts torch tensors or numpy arrays (converted to CPU
    tensors first). Errors: DtypeError, ShapeError, DeviceError (see lowbit.formats.hifloat4.check_packed).
    """
    scale, value = hifloat4.as_packed_tensors(scale, value)
    if dtype is None and isinstance(out, torch.Tensor):
        dtype = out.dtype
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"hifloat4_unpack: dtype must be a torch.dtype or None, got {type(dtype).__name__}")
    return call(UNPACK, (scale, value, torch.float32 if dtype is None else dtype), out, backend)
