"""Independent MXFP4 oracles for the tests (not the library's formulation).

* :func:`oracle_quantize_block` works on Python Fractions, one block at a time: the shared exponent by
  exact search over powers of two (and FBGEMM's fp32 bit trick for "even"), each element to the nearest
  E2M1 grid value by exact distance, ties broken as the rounding mode says.
* :func:`fbgemm_fake_quant` follows FBGEMM's ``py_quantize_mx4`` steps (docs/mxfp4.md, sections 'Scale
  rules' and 'Element rounding') in fp32 torch ops: log2 of the amax, add-half-then-shift element
  rounding; used for the svd_quant golden.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import torch

GRID = [Fraction(v) for v in ("0", "1/2", "1", "3/2", "2", "3", "4", "6")]


def _largest_power_at_most(a: Fraction) -> int:
    """max e with 2^e <= a (a > 0), by search."""
    e = a.numerator.bit_length() - a.denominator.bit_length()
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    return e


def _shared_exponent(amax: Fraction, rule: str) -> int:
    if amax == 0:
        return -127
    floor_log2 = _largest_power_at_most(amax)
    if rule == "floor":
        e = floor_log2 - 2
    elif rule == "nearest":  # floor(log2 amax + 1/2): largest e with 2^(2e - 1) <= amax^2
        e = floor_log2 + 1 if Fraction(2) ** (2 * floor_log2 + 1) <= amax * amax else floor_log2
        e -= 2
    elif rule == "even":  # FBGEMM: add 2^21 - 1 to the fp32 bits, take the exponent field
        bits = struct.unpack("<I", struct.pack("<f", float(amax)))[0]
        e = (((bits + 0x1FFFFF) >> 23) & 0xFF) - 127 - 2
        if (bits >> 23) == 0:  # fp32-subnormal amax: below every clamp anyway
            e = -200
    elif rule == "ceil":  # smallest e with 2^e >= amax
        e = floor_log2 if Fraction(2) ** floor_log2 == amax else floor_log2 + 1
        e -= 2
    elif rule == "rceil":  # smallest e with 6 * 2^e >= amax
        e = floor_log2 - 3
        while 6 * Fraction(2) ** e < amax:
            e += 1
    else:
        raise ValueError(rule)
    return max(-127, min(e, 127 if rule == "rceil" else 125))


def _element_code(x: float, scale: Fraction, rounding: str) -> int:
    sign = 8 if math.copysign(1.0, x) < 0 else 0
    v = abs(Fraction(x)) / scale
    if v >= 6:
        return sign | 7
    best = min(range(8), key=lambda i: abs(GRID[i] - v))
    others = [i for i in range(8) if i != best and abs(GRID[i] - v) == abs(GRID[best] - v)]
    if others:  # a tie between best and others[0]
        pair = sorted([best, others[0]])
        best = pair[1] if rounding == "ta" else (pair[0] if pair[0] % 2 == 0 else pair[1])
    return sign | best


def oracle_quantize_block(values: list[float], rule: str, rounding: str) -> tuple[int, list[int]]:
    """(scale byte, element codes 0..15) of one block of Python floats."""
    if any(not math.isfinite(v) for v in values):
        return 0xFF, [0] * len(values)
    amax = max(abs(Fraction(v)) for v in values)
    shared = _shared_exponent(amax, rule)
    scale = Fraction(2) ** shared
    return shared + 127, [_element_code(v, scale, rounding) for v in values]


def oracle_quantize(x: torch.Tensor, block_size: int, rule: str, rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Last-axis MXFP4 of a 2-D tensor through :func:`oracle_quantize_block`; packed like the library."""
    rows, k = x.shape
    values = x.double().tolist()
    codes = torch.zeros(rows, k // 2, dtype=torch.uint8)
    scales = torch.zeros(rows, k // block_size, dtype=torch.uint8)
    for r in range(rows):
        for b in range(k // block_size):
            byte, block = oracle_quantize_block(values[r][b * block_size : (b + 1) * block_size], rule, rounding)
            scales[r, b] = byte
            for i in range(0, block_size, 2):
                codes[r, (b * block_size + i) // 2] = block[i] | (block[i + 1] << 4)
    return codes, scales


def fbgemm_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """FBGEMM ``py_quantize_mx4`` + dequantize with rounding_mode=1 (floor), in fp32: (..., K), K % 32 == 0."""
    groups = x.float().reshape(-1, 32)
    amax = groups.abs().amax(dim=1, keepdim=True)
    amax = torch.where(amax == 0, torch.full_like(amax, 2.0**-126), amax)
    shared = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 125)
    scaled = groups / torch.exp2(shared)
    # E2M1 element rounding as FBGEMM: keep implicit bit + 1 mantissa bit + 1 rounding bit, add 1, shift.
    mag = scaled.abs()
    exp = torch.floor(torch.log2(mag.clamp_min(2.0**-30))).clamp(min=0)  # 0 for the subnormal range
    quantum = torch.exp2(exp - 1)  # spacing of the E2M1 grid at this binade (0.5 below 2)
    rounded = torch.floor(mag / quantum + 0.5) * quantum
    rounded = torch.where(mag >= 5, torch.full_like(mag, 6.0), rounded.clamp(max=6.0))
    deq = torch.copysign(rounded, scaled) * torch.exp2(shared)
    return deq.reshape(x.shape)
