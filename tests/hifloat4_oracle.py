"""An independent, scalar HiFloat4 oracle written straight from docs/hifloat4.md, section
'Quantization' (no torch).

Each fp32 operation of that section is one numpy float32 scalar operation; bf16 rounding and the E6M2
rounding are done on integers and fractions, the element code with exact rational arithmetic. Slow (pure
Python): for single blocks in tests.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import numpy as np

f32 = np.float32


def bf16(v: np.float32) -> np.float32:
    """Round a finite fp32 value to bfloat16, nearest with ties to even (integer arithmetic on the bits)."""
    (u,) = struct.unpack("<I", struct.pack("<f", float(v)))
    keep, dropped = u >> 16, u & 0xFFFF
    if dropped > 0x8000 or (dropped == 0x8000 and keep & 1):
        keep += 1
    return f32(struct.unpack("<f", struct.pack("<I", keep << 16))[0])


def quantize_block(block: list[float]) -> tuple[int, list[int], list[int], list[int], list[bool]]:
    """One 64-element block -> (scale byte, e2[8], e3[16], codes[64], negative[64])."""
    x = [f32(v) for v in block]
    poisoned = any(not math.isfinite(float(v)) for v in x)
    x = [v if math.isfinite(float(v)) else f32(0.0) for v in x]
    a = [abs(v) for v in x]
    m4 = [max(a[4 * k:4 * k + 4]) for k in range(16)]
    m8 = [max(a[8 * j:8 * j + 8]) for j in range(8)]
    sf1 = min(max(bf16(max(a) * f32(0.142578125)), f32(2.0**-48)), f32(49152.0))
    exponent = math.frexp(float(sf1))[1] - 1  # floor(log2 sf1)
    ratio = Fraction(float(sf1)) / Fraction(2) ** (exponent - 2)  # in [4, 8)
    q = round(ratio)  # Python rounds Fractions half to even
    sf = f32(q * 2.0 ** (exponent - 2))
    byte = (exponent + 48) * 4 + (q - 4)
    r = bf16(f32(1.0) / sf)
    e2 = [int(m8[j] * r >= f32(4.0)) for j in range(8)]
    e3 = [int((m4[k] * r) * f32(2.0 ** -e2[k // 2]) >= f32(2.0)) for k in range(16)]
    codes = []
    for i in range(64):
        v = bf16((a[i] * r) * f32(2.0 ** -(e2[i // 8] + e3[i // 4])))
        codes.append(min(math.floor(Fraction(float(v)) * 4 + Fraction(1, 2)), 7))
    return (0xFF if poisoned else byte), e2, e3, codes, [bool(v < 0) for v in x]


def fake_quant_block(block: list[float]) -> list[float]:
    """The block's dequantized values as Python floats (exact; NaN for a poisoned block)."""
    byte, e2, e3, codes, negative = quantize_block(block)
    if byte == 0xFF:
        return [math.nan] * 64
    sf = 2.0 ** ((byte >> 2) - 48) * (1 + (byte & 3) / 4)
    out = []
    for i in range(64):
        magnitude = codes[i] / 4 * 2.0 ** (e2[i // 8] + e3[i // 4]) * sf
        out.append(-magnitude if negative[i] else magnitude)
    return out
