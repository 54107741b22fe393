"""HiFloat4 (HiF4): the reference block quantizer, packer and unpacker (docs/hifloat4.md).

One HiF4 unit is 64 consecutive elements along the quant dim plus 32 bits of scale metadata
(docs/hifloat4.md, section 'Format'):

* level 1: an E6M2 scale ``sf = 2^((b >> 2) - 48) * (1 + (b & 3) / 4)`` in one byte ``b`` (0x00 = 2^-48 ...
  0xFE = 49152); 0xFF marks a block that held a NaN or an infinity;
* level 2: one bit ``e2[j]`` per 8-element group j = 0..7 (a factor 2);
* level 3: one bit ``e3[k]`` per 4-element group k = 0..15 (a factor 2; group k lies in 8-group k // 2);
* element: sign and a 3-bit magnitude code ``c`` = 0..7 meaning c / 4 (the FP4 E1M2 magnitudes).

Decoded value: ``(-1)^s * (c / 4) * 2^(e2 + e3) * sf``; the largest is 1.75 * 4 * 49152 = 344064.

Quantization follows AMCT's reference bit for bit (docs/hifloat4.md, section 'Quantization'): fp32
arithmetic on the widened input, bf16 round-to-nearest-even at exactly three points (``M * c7``, ``1 / sf``
and the in-group quotient), element codes rounded half up and clamped to 1.75. The output is cast to the
input dtype (exact for BF16 and FP32; FP16 may flush tiny values with round-to-nearest-even).

Signed zeros, NaN bits and clamps: docs/hifloat4.md, section 'Special values'. The output is negative zero
exactly when the input is negative and its code is 0; an input -0.0 gives +0.0. This is also what the
packed sign bit (``x < 0``) decodes to, so unpack(pack(x)) equals fake_quant(x) bit for bit. Blocks with a
NaN or an infinity decode to the default quiet NaN (``NAN_BITS``) in every element; no other block changes.

Packed layout (docs/hifloat4.md, section 'Packed layout'; blocks along the last dim of a 2-D input):
``scale`` uint8 (rows, cols / 64, 4) = [E6M2 byte, e2 flags, e3 flags of 4-groups 0-7, e3 flags of
4-groups 8-15], flag bytes MSB first (group 0 is bit 7); ``value`` uint8 (rows, cols / 2) with element 2i in
the low nibble and 2i + 1 in the high nibble, nibble = sign << 3 | c.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lowbit.dtypes import SAME_WIDTH_INT
from lowbit.errors import DeviceError, DtypeError, ShapeError, check_int

BLOCK = 64  # elements per quantization block
GROUP8 = 8
GROUP4 = 4
C7 = 0.142578125  # bf16(1 / 7) = 0x3E12
# bf16(1 / (1 + m / 4)) for the E6M2 mantissa m = 0..3: with it the kernels get r = bf16(1 / sf) as
# 2^-E * RECIPROCAL_MANTISSA[m], no division (docs/hifloat4.md, section 'Format').
RECIPROCAL_MANTISSA = (1.0, 0.80078125, 0.66796875, 0.5703125)
SCALE_MIN = 2.0**-48  # E6M2 byte 0x00
SCALE_MAX = 49152.0  # 1.5 * 2^15, E6M2 byte 0xFE
POISON_BYTE = 0xFF  # the block held a NaN or an infinity
MAX_VALUE = 1.75 * 4 * SCALE_MAX  # 344064

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Poisoned blocks decode to the default quiet NaN, given as bits (torch's own fp32 -> bf16 cast of a NaN
# differs between its scalar and vector paths, so the reference writes the bits itself).
NAN_BITS = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}


@dataclass
class Blocks:
    """The fields of quantized blocks; leading dims ``...`` are those of the blocked input.

    ``scale_byte``: int32 (...), E6M2 byte or 0xFF; ``e2``: bool (..., 8); ``e3``: bool (..., 16);
    ``negative``: bool (..., 64), the sign bit; ``code``: int32 (..., 64), magnitude codes 0..7.
    """

    scale_byte: torch.Tensor
    e2: torch.Tensor
    e3: torch.Tensor
    negative: torch.Tensor
    code: torch.Tensor


def _bf16(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to bfloat16 (nearest, ties to even) and widen back to fp32."""
    return v.to(torch.bfloat16).to(torch.float32)


def scale_value(scale_byte: torch.Tensor) -> torch.Tensor:
    """The fp32 value of E6M2 bytes (int tensor, 0..254), built exactly from its exponent and mantissa."""
    exponent = (scale_byte >> 2) - 48 + 127  # fp32 biased exponent
    bits = (exponent << 23) | ((scale_byte & 3) << 21)
    return bits.to(torch.int32).view(torch.float32)


def _group_levels(e2: torch.Tensor, e3: torch.Tensor) -> torch.Tensor:
    """Per element exponent e2 + e3 (int32 (..., 64)) from the group flags."""
    return (e2.repeat_interleave(GROUP8, -1).to(torch.int32)
            + e3.repeat_interleave(GROUP4, -1).to(torch.int32))


def _pow2(level: torch.Tensor) -> torch.Tensor:
    """2^level for small integer levels (-2..2), exact in fp32."""
    return torch.tensor([0.25, 0.5, 1.0, 2.0, 4.0], device=level.device)[level + 2]


def encode_blocks(blocks: torch.Tensor) -> Blocks:
    """Quantize fp32 ``blocks`` of shape (..., 64) to HiF4 fields (docs/hifloat4.md, 'Quantization')."""
    finite = torch.isfinite(blocks)
    poisoned = ~finite.all(-1)
    x = torch.where(finite, blocks, 0.0)
    a = x.abs()
    m4 = a.unflatten(-1, (-1, GROUP4)).amax(-1)  # (..., 16)
    m8 = a.unflatten(-1, (-1, GROUP8)).amax(-1)  # (..., 8)
    block_max = a.amax(-1)

    # Level-1 scale: bf16(M * c7), clamped, then rounded to E6M2 (q in 4..8; q = 8 carries).
    sf1 = _bf16(block_max * C7).clamp(SCALE_MIN, SCALE_MAX)
    mantissa, exponent = torch.frexp(sf1)  # sf1 = mantissa * 2^exponent, mantissa in [0.5, 1)
    q = torch.round(mantissa * 8).to(torch.int32)  # = RNE(sf1 / 2^(E - 2)) with E = exponent - 1
    scale_byte = (exponent - 1 + 48) * 4 + (q - 4)
    sf = scale_value(scale_byte)
    r = _bf16(1.0 / sf).unsqueeze(-1)

    e2 = m8 * r >= 4
    e3 = (m4 * r) * _pow2(-e2.repeat_interleave(2, -1).to(torch.int32)) >= 2
    level = _group_levels(e2, e3)
    v = _bf16((a * r) * _pow2(-level))
    code = torch.floor(4 * v + 0.5).clamp(max=7).to(torch.int32)  # round half up, saturate at 1.75
    return Blocks(
        scale_byte=torch.where(poisoned, POISON_BYTE, scale_byte),
        e2=e2,
        e3=e3,
        negative=x < 0,
        code=code,
    )


def nan_value(dtype: torch.dtype) -> torch.Tensor:
    """The NaN written for poisoned blocks: the default quiet NaN of ``dtype`` (0-d CPU tensor)."""
    return torch.tensor(NAN_BITS[dtype], dtype=SAME_WIDTH_INT[dtype]).view(dtype)


def decode_blocks(fields: Blocks, dtype: torch.dtype) -> torch.Tensor:
    """Values (..., 64) of HiF4 fields in ``dtype``; blocks whose scale byte is 0xFF are all NaN.

    The fp32 values are exact; the cast to ``dtype`` rounds to nearest even (only FP16 can round).
    """
    poisoned = (fields.scale_byte == POISON_BYTE).unsqueeze(-1)
    sf = scale_value(torch.where(poisoned.squeeze(-1), 0, fields.scale_byte)).unsqueeze(-1)
    magnitude = fields.code.to(torch.float32) * 0.25 * _pow2(_group_levels(fields.e2, fields.e3)) * sf
    value = torch.where(fields.negative, -magnitude, magnitude).to(dtype)  # a negative code 0 is -0.0
    return torch.where(poisoned, nan_value(dtype).to(value.device), value)


def as_qdim(qdim) -> int:
    """``qdim`` as an int (numpy integers accepted); TypeError naming qdim for bools, floats and others."""
    if isinstance(qdim, np.integer) and not isinstance(qdim, np.bool_):
        qdim = int(qdim)
    return check_int("qdim", qdim)


def check_qdim(x: torch.Tensor, qdim: int) -> int:
    """Validate a fake-quant input and return ``qdim`` as a non-negative dim index.

    Raises DtypeError (a TypeError and a RuntimeError) for a dtype other than FP16/BF16/FP32, TypeError
    for a qdim that is not an int (bools included), ShapeError (a ValueError and a RuntimeError, as
    upstream raises RuntimeError) for a 0-d tensor, a qdim out of range, or a quant-dim length that is 0 or
    not a multiple of 64.
    """
    if not isinstance(x, torch.Tensor):
        raise DtypeError(f"HiFloat4 expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in DTYPES:
        raise DtypeError(f"HiFloat4 expects float16, bfloat16 or float32, got {x.dtype}")
    qdim = as_qdim(qdim)
    if x.dim() == 0:
        raise ShapeError("HiFloat4 fake-quant needs a tensor with at least 1 dim, got a 0-d tensor")
    if not -x.dim() <= qdim < x.dim():
        raise ShapeError(f"HiFloat4 qdim {qdim} is out of range for shape {tuple(x.shape)}")
    qdim %= x.dim()
    length = x.shape[qdim]
    if length == 0 or length % BLOCK:
        raise ShapeError(
            f"HiFloat4 quant dim length must be a multiple of 64, got {length} "
            f"(dim {qdim} of shape {tuple(x.shape)})"
        )
    return qdim


def fake_quant(x: torch.Tensor, qdim: int = -1) -> torch.Tensor:
    """Quantize to HiF4 in 64-blocks along ``qdim`` and dequantize (reference, any device).

    ``x``: FP16, BF16 or FP32, any shape with ``x.shape[qdim] % 64 == 0``. Returns a new contiguous
    tensor of the same shape, dtype and device. Errors: see :func:`check_qdim`. No gradient.
    """
    qdim = check_qdim(x, qdim)
    with torch.no_grad():
        moved = x.to(torch.float32).movedim(qdim, -1)
        blocks = moved.reshape(*moved.shape[:-1], moved.shape[-1] // BLOCK, BLOCK)
        out = decode_blocks(encode_blocks(blocks), x.dtype).reshape(moved.shape)
        return out.movedim(-1, qdim).contiguous()


def _flag_byte(flags: torch.Tensor) -> torch.Tensor:
    """Pack bool flags (..., 8) into one uint8, element 0 in the most significant bit."""
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.int32, device=flags.device)
    return (flags.to(torch.int32) * weights).sum(-1).to(torch.uint8)


def _flag_bits(byte: torch.Tensor) -> torch.Tensor:
    """Unpack uint8 bytes (...) into bool flags (..., 8), most significant bit first."""
    shifts = torch.arange(7, -1, -1, dtype=torch.int32, device=byte.device)
    return ((byte.to(torch.int32).unsqueeze(-1) >> shifts) & 1).bool()


def check_pack_input(x: torch.Tensor) -> None:
    """Validate a pack input: DtypeError for a wrong dtype, ShapeError (a RuntimeError, as upstream) unless
    x is 2-D with a last dim that is a positive multiple of 64."""
    if isinstance(x, torch.Tensor) and x.dim() != 2:
        raise ShapeError(f"HiFloat4 pack expects a 2-D tensor, got shape {tuple(x.shape)}")
    check_qdim(x, -1)


def pack(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D tensor in 64-blocks along its last dim into AMCT's packed HiF4 bytes.

    ``x``: FP16, BF16 or FP32 (rows, cols), ``cols % 64 == 0``. Returns ``(scale, value)``: uint8
    (rows, cols / 64, 4) and uint8 (rows, cols / 2) on x's device (layout: module docstring).
    Errors: see :func:`check_pack_input`.
    """
    check_pack_input(x)
    rows, cols = x.shape
    fields = encode_blocks(x.to(torch.float32).reshape(rows, cols // BLOCK, BLOCK))
    scale = torch.stack(
        [
            fields.scale_byte.to(torch.uint8),
            _flag_byte(fields.e2),
            _flag_byte(fields.e3[..., :8]),
            _flag_byte(fields.e3[..., 8:]),
        ],
        dim=-1,
    )
    nibble = (fields.negative.to(torch.int32) << 3 | fields.code).reshape(rows, cols // 2, 2)
    value = (nibble[..., 0] | nibble[..., 1] << 4).to(torch.uint8)
    return scale, value


def as_packed_tensors(
    scale: torch.Tensor | np.ndarray, value: torch.Tensor | np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, value) as torch tensors: numpy arrays are converted (copied if not contiguous), anything
    else is returned as it is (:func:`check_packed` refuses what is not a uint8 tensor)."""
    return tuple(torch.from_numpy(np.ascontiguousarray(t)) if isinstance(t, np.ndarray) else t
                 for t in (scale, value))


def check_packed(scale: torch.Tensor, value: torch.Tensor, dtype: torch.dtype) -> None:
    """Validate unpack inputs (torch tensors; works on meta and fake tensors).

    Raises DtypeError unless both are uint8 tensors and dtype is FP16/BF16/FP32, ShapeError unless the
    shapes are scale (rows, n_blocks, 4) and value (rows, n_blocks * 32), DeviceError if they are on
    different devices.
    """
    for name, t in (("scale", scale), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
            raise DtypeError(f"HiFloat4 unpack expects {name} as a uint8 tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)}")
    if dtype not in DTYPES:
        raise DtypeError(f"HiFloat4 unpack produces float16, bfloat16 or float32, got dtype={dtype}")
    if scale.dim() != 3 or scale.shape[-1] != 4 or value.dim() != 2 or \
            tuple(value.shape) != (scale.shape[0], scale.shape[1] * BLOCK // 2):
        raise ShapeError(
            "HiFloat4 unpack expects scale (rows, cols/64, 4) and value (rows, cols/2), got "
            f"{tuple(scale.shape)} and {tuple(value.shape)}"
        )
    if scale.device != value.device:
        raise DeviceError(f"HiFloat4 unpack: scale on {scale.device} but value on {value.device}")


def unpack(
    scale: torch.Tensor | np.ndarray,
    value: torch.Tensor | np.ndarray,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode AMCT-packed HiF4 bytes (see :func:`pack`) to a (rows, cols) tensor of ``dtype``.

    ``scale``: uint8 (rows, cols / 64, 4); ``value``: uint8 (rows, cols / 2); torch tensors (any device,
    the same) or numpy arrays. ``dtype``: FP16, BF16 or FP32. Blocks with scale byte 0xFF are all NaN.
    Errors: see :func:`check_packed`.
    """
    scale, value = as_packed_tensors(scale, value)
    check_packed(scale, value, dtype)
    rows, n_blocks = scale.shape[:2]
    raw = value.to(torch.int32)
    nibble = torch.stack([raw & 0xF, raw >> 4], dim=-1).reshape(rows, n_blocks, BLOCK)
    fields = Blocks(
        scale_byte=scale[..., 0].to(torch.int32),
        e2=_flag_bits(scale[..., 1]),
        e3=torch.cat([_flag_bits(scale[..., 2]), _flag_bits(scale[..., 3])], dim=-1),
        negative=(nibble & 8).bool(),
        code=nibble & 7,
    )
    return decode_blocks(fields, dtype).reshape(rows, n_blocks * BLOCK)


def worked_blocks() -> torch.Tensor:
    """The eight single-block inputs of docs/hifloat4.md, section 'Worked blocks', as an fp32 (8, 64) CPU
    tensor, in order:
    all 2.0; x_i = i; [1, 0...]; [10, -3, 0.5, 0.1, 1 x4, 0.3 x8, -6.5, 0...]; [1e5, -2e4, 3, 0...];
    [1e-20, 0...]; zeros; ones with x_3 = NaN."""
    blocks = torch.zeros(8, BLOCK)
    blocks[0] = 2.0
    blocks[1] = torch.arange(BLOCK, dtype=torch.float32)
    blocks[2, 0] = 1.0
    blocks[3, :17] = torch.tensor([10, -3, 0.5, 0.1] + [1.0] * 4 + [0.3] * 8 + [-6.5])
    blocks[4, :3] = torch.tensor([1e5, -2e4, 3.0])
    blocks[5, 0] = 1e-20
    blocks[7] = 1.0
    blocks[7, 3] = float("nan")
    return blocks
