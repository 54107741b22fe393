"""HiFloat8 (HiF8): the reference encoder and decoder (specification: docs/hifloat8.md).

Layout of a code, 8 bits: ``[S | Dot (2-4 bits, prefix code) | exponent (D bits) | mantissa (M bits)]``.

=========  ===  ====================================  ===  ===========================
Dot bits   D    exponent field                        M    exponents E
=========  ===  ====================================  ===  ===========================
``11``     4    sign, 3 low magnitude bits            1    +-8 ... +-15
``10``     3    sign, 2 low magnitude bits            2    +-4 ... +-7
``01``     2    sign, 1 low magnitude bit             3    +-2, +-3
``001``    1    sign                                  3    +-1
``0001``   0    (E = 0)                               3    0
``0000``   -    denormal: value 2^(m - 23), m = 1..7  3    -
=========  ===  ====================================  ===  ===========================

The magnitude of E is ``2^(D-1) + low bits`` (implicit MSB), no bias. Value ``(-1)^S 2^E (1 + m/2^M)``.
Specials: 0x00 = zero (both signs), 0x80 = NaN, 0x6F / 0xEF = +Inf / -Inf. Largest finite 0x6E = 2^15.

Encoding rounds the exact input value to the nearest code, ties away from zero ("TA"), on the grid of its
binade ``E = floor(log2|x|)``; below 2^-15 the grid is {0, 2^-22, ..., 2^-16, 2^-15} with linear midpoints.
By default finite ``|x| >= 2^15`` saturates to +-32768 (AMCT); with ``saturate=False`` rounding continues
past 2^15 into the Inf code (paper / en_dtypes: ``|x| >= 1.25 * 2^15`` gives +-Inf). Inf -> +-Inf,
NaN -> 0x80, -0 and negative underflow -> 0x00. FP16 / BF16 / FP32 inputs are all encoded directly from
their exact value (one rounding; AMCT rounds FP32 to BF16 first, see ``amct_compat``).

Decoding is exact into FP16, BF16 and FP32. NaN decodes to the positive quiet NaN with every mantissa bit
set (FP16/BF16 0x7FFF, FP32 0x7FFFFFFF); FP16 outputs below 2^-14 are FP16 subnormals (exact).
"""

from __future__ import annotations

import math

import torch

from lowbit.dtypes import SAME_WIDTH_INT
from lowbit.errors import DtypeError

NAN_CODE = 0x80
POS_INF_CODE = 0x6F
MAX_CODE = 0x6E  # 2^15 = 32768, the largest finite value
MAX_VALUE = 32768.0

DECODE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ENCODE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Bit patterns of the NaN each decode dtype produces (positive, every mantissa bit set).
_NAN_BITS = {torch.float16: 0x7FFF, torch.bfloat16: 0x7FFF, torch.float32: 0x7FFFFFFF}

_DOT_PREFIX = {1: 0x10, 2: 0x20, 3: 0x40, 4: 0x60}  # D -> prefix bits, already shifted into place


def code_value(code: int) -> float:
    """The exact value of one code 0..255 as a Python float (NaN for 0x80, +-inf for 0x6F/0xEF)."""
    if not 0 <= code <= 255:
        raise ValueError(f"HiFloat8 code must be in 0..255, got {code}")
    sign = -1.0 if code & 0x80 else 1.0
    mag = code & 0x7F
    if code == NAN_CODE:
        return math.nan
    if mag == POS_INF_CODE:
        return sign * math.inf
    if mag < 0x08:  # denormal band (0 for m = 0)
        return sign * (0.0 if mag == 0 else 2.0 ** (mag - 23))
    if mag < 0x10:  # Dot 0001: E = 0
        return sign * (1.0 + (mag & 7) / 8)
    if mag < 0x20:  # Dot 001: D = 1, M = 3, exponent sign at bit 3
        d, m_bits = 1, 3
    elif mag < 0x40:  # Dot 01
        d, m_bits = 2, 3
    elif mag < 0x60:  # Dot 10
        d, m_bits = 3, 2
    else:  # Dot 11
        d, m_bits = 4, 1
    exp_sign = (mag >> (d - 1 + m_bits)) & 1
    low = (mag >> m_bits) & ((1 << (d - 1)) - 1)
    exponent = (1 << (d - 1)) + low
    if exp_sign:
        exponent = -exponent
    m = mag & ((1 << m_bits) - 1)
    return sign * 2.0**exponent * (1.0 + m / (1 << m_bits))


def code_table() -> list[tuple[int, float]]:
    """All 256 codes with their exact values, in code order."""
    return [(code, code_value(code)) for code in range(256)]


def _magnitude_code(exponent: torch.Tensor, frac: torch.Tensor, saturate: bool) -> torch.Tensor:
    """Code (without sign) of finite nonzero magnitudes given fp32 exponent E and 23-bit fraction.

    ``exponent`` and ``frac`` are int32 tensors of the same shape; returns int32 codes.
    """
    first_dropped = lambda shift: (frac >> shift) & 1  # noqa: E731  (bit just below the kept ones)

    # Normal band -15 <= E <= 14 (and E = 15 when not saturating): keep M bits, round half away.
    abs_e = exponent.abs()
    m_bits = torch.where(abs_e <= 3, 3, torch.where(abs_e <= 7, 2, 1))
    m = (frac >> (23 - m_bits)) + first_dropped(22 - m_bits)
    carry = m == (1 << m_bits)
    e = torch.where(carry, exponent + 1, exponent)
    m = torch.where(carry, 0, m)
    abs_e = e.abs()
    m_bits = torch.where(abs_e <= 3, 3, torch.where(abs_e <= 7, 2, 1))  # re-derived after a carry
    d = torch.where(abs_e <= 1, 1, torch.where(abs_e <= 3, 2, torch.where(abs_e <= 7, 3, 4)))
    prefix = torch.full_like(d, _DOT_PREFIX[1])
    for dd in (2, 3, 4):
        prefix = torch.where(d == dd, _DOT_PREFIX[dd], prefix)
    exp_sign = (e < 0).to(torch.int32)
    normal = prefix | (exp_sign << (d - 1 + m_bits)) | ((abs_e - (1 << (d - 1))) << m_bits) | m
    normal = torch.where(e == 0, 0x08 | m, normal)
    # 2^15 is 0x6E; the would-be 1.5 * 2^15 (0x6F) is the Inf code, so the grid's next step is Inf.
    normal = torch.where(e == 15, torch.where(m == 0, MAX_CODE, POS_INF_CODE), normal)
    if saturate:
        normal = torch.where(exponent >= 15, MAX_CODE, normal)
    else:
        normal = torch.where(e >= 16, POS_INF_CODE, normal)

    # Denormal band E < -15: grid 2^(k-23), k = 1..7, and 2^-15 above; linear midpoints, ties up.
    k = exponent + 23 + first_dropped(22)
    denormal = torch.where(k >= 8, 0x7E, k)
    denormal = torch.where(exponent == -23, 1, denormal)
    denormal = torch.where(exponent < -23, 0, denormal)

    return torch.where(exponent < -15, denormal, normal)


def encode(x: torch.Tensor, *, saturate: bool = True, amct_compat: bool = False) -> torch.Tensor:
    """Encode a floating tensor to HiFloat8 codes (uint8, same shape, contiguous, same device).

    ``x``: FP16, BF16 or FP32, any shape. ``saturate``: finite |x| >= 2^15 -> +-32768 (default, AMCT);
    False rounds past 2^15 into +-Inf. ``amct_compat``: round FP32 inputs to BF16 first (AMCT's fake-quant
    path; double rounding). Raises DtypeError (a TypeError) for other dtypes.
    """
    if x.dtype not in ENCODE_DTYPES:
        raise DtypeError(f"HiFloat8 encode expects float16, bfloat16 or float32, got {x.dtype}")
    if amct_compat and x.dtype == torch.float32:
        x = x.to(torch.bfloat16)
    bits = x.to(torch.float32).contiguous().view(torch.int32)  # exact widening
    negative = bits < 0
    mag = bits & 0x7FFFFFFF
    exponent_field = mag >> 23
    frac = mag & 0x7FFFFF
    code = _magnitude_code(exponent_field - 127, frac, saturate)
    code = torch.where(exponent_field == 0, 0, code)  # zero and FP32 subnormals (< 2^-126)
    code = torch.where(exponent_field == 255, torch.where(frac == 0, POS_INF_CODE, NAN_CODE), code)
    signed = negative & ((code & 0x7F) != 0)  # zero and NaN (both 0 in the low 7 bits) keep no sign
    code = torch.where(signed, code | 0x80, code)
    return code.to(torch.uint8)


def decode_table(dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The 256 decoded values as a CPU tensor of ``dtype`` (FP16, BF16 or FP32); index = code."""
    if dtype not in DECODE_DTYPES:
        raise DtypeError(f"HiFloat8 decode produces float16, bfloat16 or float32, got {dtype}")
    values = torch.tensor([code_value(c) for c in range(256)], dtype=torch.float64).to(dtype)
    bits = values.view(SAME_WIDTH_INT[dtype])
    bits[NAN_CODE] = _NAN_BITS[dtype]
    return bits.view(dtype)


def decode(codes: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Decode uint8 HiFloat8 codes to ``dtype`` (FP16, BF16 or FP32), exactly; same shape and device."""
    if codes.dtype != torch.uint8:
        raise DtypeError(f"HiFloat8 decode expects uint8 codes, got {codes.dtype}")
    table = decode_table(dtype).to(codes.device)
    return table[codes.to(torch.int64)]
