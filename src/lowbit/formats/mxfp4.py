"""MXFP4 (OCP MX): the reference quantizer and dequantizer, readable torch code in float64.

A block of ``block_size`` (default 32) consecutive elements along ``axis`` shares one E8M0 scale byte;
each element is an E2M1 code (docs/mxfp4.md, section 'Format': the E2M1 grid 0, 0.5, 1, 1.5, 2, 3, 4, 6
with bit 3 the sign; E8M0 byte ``b`` = 2^(b - 127), 0xFF NaN). One block, ``amax`` its largest magnitude,
``m`` in [1, 2) the significand of ``amax = m * 2^floor(log2 amax)``:

    shared_exp = floor(log2 amax) - 2 + bump(m)        (clamped; docs/mxfp4.md, section 'Scale rules')
    codes      = round(x / 2^shared_exp) on the E2M1 grid, saturating to +-6
                                                       (docs/mxfp4.md, section 'Element rounding')
    scale byte = shared_exp + 127                      (integer arithmetic, never torch's e8m0 cast)

Everything is exact: the bump comes from the significand (no floating-point log2) and dividing by a power
of two is exact in float64. Zero, NaN and Inf blocks: docs/mxfp4.md, section 'Policies'. Layouts
(packed nibbles, torch's fp4/e8m0 views, FBGEMM's interleaved bytes, torch_npu's scale pairs):
docs/mxfp4.md, section 'Layouts'.
"""

from __future__ import annotations

import math

import torch

from lowbit.dtypes import QUIET_NAN_BITS
from lowbit.errors import DtypeError, ShapeError, check_int

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; code | 0x8 is the negative
E2M1_EMAX = 2
E8M0_BIAS = 127
E8M0_NAN = 0xFF
SCALE_RULES = ("floor", "nearest", "even", "ceil", "rceil")
ROUNDINGS = ("ta", "rne")
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OUTPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Midpoints between neighbouring E2M1 magnitudes, and whether a value exactly on one rounds up under RNE
# (it does when the upper neighbour has the even code: 0.75 -> 1.0 (code 2), 1.75 -> 2 (4), 3.5 -> 4 (6)).
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
RNE_TIE_ROUNDS_UP = (False, True, False, True, False, True, False)

DYNAMIC_MX_ROUND_MODES = {"round": "ta", "rint": "rne"}  # torch_npu round_mode -> element rounding

_SCALE_CLAMP = {"floor": 125, "nearest": 125, "even": 125, "ceil": 125, "rceil": 127}


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; expected one of {', '.join(choices)}")


def check_options(block_size: int, scale_rule: str, rounding: str, axis: int) -> None:
    """Check :func:`quantize`'s non-tensor arguments: TypeError unless ``block_size`` and ``axis`` are ints
    (bools and floats refused), ShapeError unless ``block_size`` is even and >= 2, ValueError naming the
    allowed names for an unknown ``scale_rule`` or ``rounding``."""
    _check_block_size(block_size)
    _check_choice("scale_rule", scale_rule, SCALE_RULES)
    _check_choice("rounding", rounding, ROUNDINGS)
    check_int("axis", axis)


def _check_block_size(block_size: int) -> None:
    """TypeError unless an int (bools and floats refused); ShapeError unless even and >= 2."""
    check_int("block_size", block_size, minimum=2)
    if block_size % 2:
        raise ShapeError(f"block_size must be a positive even integer, got {block_size}")


def e2m1_values(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16 E2M1 codes decoded, indexed by code (codes 8..15 are the negatives, 8 is -0.0)."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=dtype)
    return torch.cat([magnitudes, -magnitudes])


def shared_exponent(amax: torch.Tensor, scale_rule: str = "floor") -> torch.Tensor:
    """Unbiased shared exponent (int32) of blocks with largest magnitude ``amax`` (finite, >= 0).

    ``amax`` is a float tensor of any shape; zero gives -127. See the module docstring for the rules.
    """
    _check_choice("scale_rule", scale_rule, SCALE_RULES)
    significand, exponent = torch.frexp(amax.to(torch.float64))  # amax = significand * 2^exponent
    m = 2 * significand  # in [1, 2) for amax > 0; 0 for amax == 0
    floor_log2 = exponent.to(torch.int32) - 1
    if scale_rule == "floor":
        bump = torch.zeros_like(m, dtype=torch.bool)
    elif scale_rule == "nearest":
        bump = m * m >= 2  # m has <= 24 significant bits, so m*m is exact in float64
    elif scale_rule == "even":
        bump = m > 1.75
    elif scale_rule == "ceil":
        bump = m > 1
    else:  # rceil
        bump = m > 1.5
    shared = floor_log2 - E2M1_EMAX + bump.to(torch.int32)
    shared = torch.where(amax == 0, -E8M0_BIAS, shared)
    return shared.clamp(-E8M0_BIAS, _SCALE_CLAMP[scale_rule])


def round_to_e2m1(v: torch.Tensor, rounding: str = "ta") -> torch.Tensor:
    """E2M1 codes (uint8, sign in bit 3) of the real values ``v`` (float64, finite), saturating to +-6."""
    _check_choice("rounding", rounding, ROUNDINGS)
    magnitude = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for midpoint, rne_up in zip(E2M1_MIDPOINTS, RNE_TIE_ROUNDS_UP):
        up = magnitude >= midpoint if (rounding == "ta" or rne_up) else magnitude > midpoint
        code += up.to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(..., 2n) uint8 codes 0..15 -> (..., n) bytes, element 2i in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(..., n) bytes -> (..., 2n) uint8 codes; inverse of :func:`pack_nibbles`."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def quantized_shapes(
    x: torch.Tensor, block_size: int, scale_rule: str, rounding: str, axis: int
) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """Validate :func:`quantize`'s arguments; return (codes shape, scales shape, axis in [0, x.dim()))."""
    if x.dtype not in INPUT_DTYPES:
        raise DtypeError(f"mxfp4 quantize expects float16, bfloat16 or float32 input, got {x.dtype}")
    check_options(block_size, scale_rule, rounding, axis)
    if x.dim() == 0:
        raise ShapeError("mxfp4 quantize needs at least one dimension, got a 0-d tensor")
    axis = _normalize_axis(axis, x.dim())
    k = x.shape[axis]
    if k % block_size:
        raise ShapeError(
            f"mxfp4 quantize: size {k} of axis {axis} (shape {tuple(x.shape)}) is not a multiple of "
            f"block_size {block_size}"
        )
    before, after = tuple(x.shape[:axis]), tuple(x.shape[axis + 1 :])
    return before + (k // 2,) + after, before + (k // block_size,) + after, axis


def dequantized_shape(
    codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, axis: int
) -> tuple[tuple[int, ...], int, int]:
    """Validate :func:`dequantize`'s arguments; return (output shape, block size, axis).

    codes and scales must be uint8 (DtypeError naming them; convert torch's float4/e8m0 views with
    :func:`byte_view` first); their shapes must fit (ShapeError). Nothing is read from the tensors, so
    this is safe on meta and fake tensors.
    """
    for name, t in (("codes", codes), ("scales", scales)):
        if t.dtype != torch.uint8:
            raise DtypeError(f"mxfp4 dequantize: {name} must be uint8, got {t.dtype}")
    if dtype not in OUTPUT_DTYPES:
        raise DtypeError(f"mxfp4 dequantize: unsupported output dtype {dtype}")
    if codes.dim() == 0 or codes.dim() != scales.dim():
        raise ShapeError(
            f"mxfp4 dequantize: codes {tuple(codes.shape)} and scales {tuple(scales.shape)} must have "
            "the same, nonzero number of dimensions"
        )
    axis = _normalize_axis(axis, codes.dim())
    k = 2 * codes.shape[axis]
    n_blocks = scales.shape[axis]
    block_size = k // n_blocks if n_blocks else 0
    other_codes = codes.shape[:axis] + codes.shape[axis + 1 :]
    other_scales = scales.shape[:axis] + scales.shape[axis + 1 :]
    if other_codes != other_scales or block_size * n_blocks != k or block_size % 2 or bool(k) != bool(n_blocks):
        raise ShapeError(
            f"mxfp4 dequantize: codes {tuple(codes.shape)} and scales {tuple(scales.shape)} do not fit "
            f"along axis {axis} (need 2 * codes.shape[axis] = an even multiple of scales.shape[axis])"
        )
    out_shape = tuple(codes.shape[:axis]) + (k,) + tuple(codes.shape[axis + 1 :])
    return out_shape, block_size or 2, axis


def quantize(
    x: torch.Tensor,
    block_size: int = 32,
    scale_rule: str = "floor",
    rounding: str = "ta",
    axis: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4-quantize ``x`` in blocks of ``block_size`` along ``axis``.

    x: FP16/BF16/FP32, any device, ``x.shape[axis] % block_size == 0``. Returns ``(codes, scales)``, both
    uint8 on x's device: codes with ``shape[axis] // 2`` (two E2M1 codes per byte, even element in the low
    nibble), scales with ``shape[axis] // block_size`` (E8M0 bytes). Raises DtypeError for other dtypes,
    ShapeError for a bad axis, length or block size (TypeError if one is not an int), ValueError for an
    unknown rule or rounding name.
    """
    _, _, axis = quantized_shapes(x, block_size, scale_rule, rounding, axis)
    k = x.shape[axis]
    xt = x.movedim(axis, -1)
    blocks = xt.reshape(*xt.shape[:-1], k // block_size, block_size).to(torch.float64)
    finite = torch.isfinite(blocks).all(dim=-1)
    amax = torch.where(finite, blocks.abs().amax(dim=-1), 0.0)
    shared = shared_exponent(amax, scale_rule)
    v = blocks * torch.exp2(-shared.to(torch.float64)).unsqueeze(-1)  # exact: power-of-two scaling
    v = torch.where(finite.unsqueeze(-1), v, 0.0)
    codes = pack_nibbles(round_to_e2m1(v, rounding).flatten(-2))
    scales = torch.where(finite, (shared + E8M0_BIAS).to(torch.uint8), E8M0_NAN)
    return codes.movedim(-1, axis).contiguous(), scales.to(torch.uint8).movedim(-1, axis).contiguous()


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16, axis: int = -1
) -> torch.Tensor:
    """Decode ``(codes, scales)`` from :func:`quantize` into ``dtype`` (exact, then one RNE rounding).

    codes/scales: uint8 (or torch's float4_e2m1fn_x2 / float8_e8m0fnu views), same shape except along
    ``axis``, where ``2 * codes.shape[axis]`` must be a multiple of ``scales.shape[axis]`` (the block size
    is their ratio). A NaN scale (0xFF) gives NaN for its whole block (the quiet NaN, 0x7FC0 in BF16 and
    0x7E00 in FP16). Result shape: codes' shape with ``shape[axis] * 2``; dtype FP16/BF16/FP32/FP64 (values
    outside the FP16 range become +-Inf there).
    """
    codes, scales = byte_view(codes), byte_view(scales)
    _, block_size, axis = dequantized_shape(codes, scales, dtype, axis)
    n_blocks = scales.shape[axis]
    ct = codes.movedim(axis, -1)
    st = scales.movedim(axis, -1)
    values = e2m1_values(torch.float64).to(codes.device)[unpack_nibbles(ct).long()]
    values = values.reshape(*ct.shape[:-1], n_blocks, block_size)
    scale = torch.exp2(st.to(torch.float64) - E8M0_BIAS)
    scale = torch.where(st == E8M0_NAN, math.nan, scale)
    out = (values * scale.unsqueeze(-1)).flatten(-2).to(dtype)
    if dtype in QUIET_NAN_BITS:  # one NaN pattern wherever the block sits (torch's vector and scalar paths differ)
        nan = torch.tensor(QUIET_NAN_BITS[dtype], dtype=torch.int16, device=out.device).view(dtype)
        out = torch.where(out.isnan(), nan, out)
    return out.movedim(-1, axis).contiguous()


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """uint8 view of a float4_e2m1fn_x2 / float8_e8m0fnu tensor; any other tensor unchanged (an operator's
    validation then names it if its dtype is wrong, and a non-tensor too)."""
    return t.view(torch.uint8) if isinstance(t, torch.Tensor) and t.dtype in BYTE_VIEW_DTYPES else t


def as_uint8(t: torch.Tensor) -> torch.Tensor:
    """Byte view of codes or scales given as uint8, float4_e2m1fn_x2 or float8_e8m0fnu."""
    if t.dtype == torch.uint8:
        return t
    if t.dtype in BYTE_VIEW_DTYPES:
        return t.view(torch.uint8)
    raise DtypeError(f"expected uint8, float4_e2m1fn_x2 or float8_e8m0fnu bytes, got {t.dtype}")


BYTE_VIEW_DTYPES = tuple(
    getattr(torch, name) for name in ("float4_e2m1fn_x2", "float8_e8m0fnu") if hasattr(torch, name)
)


def as_torch_fp4(codes: torch.Tensor) -> torch.Tensor:
    """View uint8 codes as ``torch.float4_e2m1fn_x2`` (same bytes); TypeError if this torch lacks it."""
    if not hasattr(torch, "float4_e2m1fn_x2"):
        raise DtypeError(f"torch {torch.__version__} has no float4_e2m1fn_x2 dtype")
    return as_uint8(codes).view(torch.float4_e2m1fn_x2)


def as_torch_e8m0(scales: torch.Tensor) -> torch.Tensor:
    """View uint8 scale bytes as ``torch.float8_e8m0fnu`` (same bytes); TypeError if this torch lacks it."""
    if not hasattr(torch, "float8_e8m0fnu"):
        raise DtypeError(f"torch {torch.__version__} has no float8_e8m0fnu dtype")
    return as_uint8(scales).view(torch.float8_e8m0fnu)


def to_fbgemm_layout(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Interleave last-axis ``(codes, scales)`` into FBGEMM's MX4 layout.

    Per block: ``block_size / 2`` data bytes followed by its scale byte (17 bytes per block of 32).
    codes (..., K/2) and scales (..., K/block_size) uint8 -> (..., K/2 + K/block_size) uint8.
    """
    codes, scales = as_uint8(codes), as_uint8(scales)
    if codes.dim() == 0 or codes.shape[:-1] != scales.shape[:-1] or (
        scales.shape[-1] and codes.shape[-1] % scales.shape[-1]
    ):
        raise ShapeError(f"codes {tuple(codes.shape)} and scales {tuple(scales.shape)} do not fit")
    n_blocks = scales.shape[-1]
    data = codes.reshape(*codes.shape[:-1], n_blocks, -1) if n_blocks else codes.unsqueeze(-1)
    return torch.cat([data, scales.unsqueeze(-1)], dim=-1).flatten(-2)


def from_fbgemm_layout(packed: torch.Tensor, block_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Split FBGEMM's interleaved MX4 bytes (..., n * (block_size/2 + 1)) into ``(codes, scales)``."""
    packed = as_uint8(packed)
    _check_block_size(block_size)
    group = block_size // 2 + 1
    if packed.dim() == 0 or packed.shape[-1] % group:
        raise ShapeError(f"last dim of {tuple(packed.shape)} is not a multiple of {group} bytes")
    groups = packed.reshape(*packed.shape[:-1], packed.shape[-1] // group, group)  # (-1 fails with no rows)
    return groups[..., :-1].flatten(-2).contiguous(), groups[..., -1].contiguous()


def dynamic_mx_quant(
    x: torch.Tensor, block_size: int = 32, round_mode: str = "round"
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_npu ``npu_dynamic_mx_quant`` (dst FLOAT4_E2M1, scale_alg 0) along the last axis.

    Floor scale; ``round_mode`` "round" = ties away (TA, what svd_quant uses), "rint" = RNE. Returns
    codes (..., L/2) uint8 and scales (..., ceil(L/64), 2) uint8: the per-32 scales of a row laid out in
    pairs, the last pair padded with byte 0 when L/32 is odd (the layout the svd_quant op takes). Only
    block_size 32 and L % 32 == 0 are supported (ShapeError otherwise); an unknown ``round_mode`` raises
    ValueError. Layout: docs/mxfp4.md, section 'Layouts'.
    """
    codes, scales = quantize(x, 32, "floor", dynamic_mx_rounding(block_size, round_mode), axis=-1)
    return codes, scales_to_pairs(scales)


def dynamic_mx_rounding(block_size: int, round_mode: str) -> str:
    """The element rounding ("ta" / "rne") of torch_npu's ``round_mode``, after checking the arguments of
    :func:`dynamic_mx_quant`: ValueError naming the allowed round modes, TypeError / ShapeError unless
    ``block_size`` is the int 32."""
    _check_choice("round_mode", round_mode, tuple(DYNAMIC_MX_ROUND_MODES))
    if check_int("block_size", block_size) != 32:
        raise ShapeError(f"dynamic_mx_quant: only block_size 32 is supported, got {block_size}")
    return DYNAMIC_MX_ROUND_MODES[round_mode]


def scales_to_pairs(scales: torch.Tensor) -> torch.Tensor:
    """Per-32 scales (..., G) -> torch_npu's (..., ceil(G/2), 2), padding an odd G with byte 0."""
    scales = as_uint8(scales)
    if scales.shape[-1] % 2:
        scales = torch.nn.functional.pad(scales, (0, 1), value=0)
    return scales.reshape(*scales.shape[:-1], scales.shape[-1] // 2, 2)  # (-1 fails with no rows)


def scales_from_pairs(pairs: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """Inverse of :func:`scales_to_pairs`: (..., ceil(G/2), 2) -> (..., G) with G = ``n_blocks``."""
    pairs = as_uint8(pairs)
    return pairs.flatten(-2)[..., :n_blocks]


def _normalize_axis(axis: int, ndim: int) -> int:
    check_int("axis", axis)
    if not -ndim <= axis < ndim:
        raise ShapeError(f"axis {axis} is out of range for a {ndim}-d tensor")
    return axis % ndim
