"""HiFloat8 codes re-encoded as (column, offset) for CPUs whose byte look-ups are 16-entry ``vpshufb``
(AVX2 without AVX-512): a bijection of the 256 codes, applied once to a prepared weight, under which a BF16
weight is two table look-ups and an add instead of a 128-entry look-up (docs/weight_only.md, 'HiFloat8 by
columns').

A finite nonzero HiFloat8 value is ``2^E (1 + m/8)`` (m 0..7); times a row's BF16 scale ``s`` and rounded to
BF16 it is ``2^E * mu_m`` with ``mu_m = bf16(s (1 + m/8))``, so its bits are ``bits(mu_m) + (E << 7)``
whenever every result stays a normal BF16 number (rows whose scale lies in [2^-110, 2^110]). For each m the
exponents E of the values lie in one run (m = 0: -15..15 but for the subnormal codes, m = 4: -15..14, m = 2
or 6: -7..7, odd m: -3..3), cut here into 16 columns of 8 consecutive exponents, ``COLUMNS[j] = (m, E0)``.
A re-encoded code is ``r = sign << 7 | o << 4 | j`` for the value ``2^(E0 + o) (1 + m/8)`` of column j, so
its bits are ``T[j] + (o << 7) + (sign << 15)`` with the row's 16-entry table ``T[j] = bits(mu_m) + (E0 << 7)``
(mod 2^16). The nine free slots per sign hold zero (handled apart: slot ZERO_CODE), NaN, the infinities
and the seven subnormal codes 0x01-0x07: rows with any of the last three take the table decode.

The sign bit stays bit 7 and a code's magnitude slot does not depend on its sign, so the table decode
serves re-encoded codes too, with its magnitudes permuted (``encoded_magnitudes``) and NaN at
``ENCODED_NAN``.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from lowbit.formats import hifloat8
from lowbit.kernels.cpu._runtime import NJIT_OPTIONS

# (m, first exponent E0) of columns 0..15; column ZERO_COLUMN's slot o = 0 (E = -4) holds zero / NaN
COLUMNS = ((0, -15), (0, -7), (0, 1), (0, 9), (4, -15), (4, -7), (4, 1), (4, 9),
           (2, -7), (2, 1), (6, -7), (6, 1), (1, -4), (3, -3), (5, -3), (7, -3))
ZERO_COLUMN = 12
ZERO_CODE = ZERO_COLUMN  # the re-encoded +0 (sign 0, offset 0)
ENCODED_NAN = 0x80 | ZERO_COLUMN
_SLOW_CODES = tuple(range(1, 8)) + (hifloat8.POS_INF_CODE,)  # magnitudes (either sign) left to the table decode


def _m_and_exponent(code: int) -> tuple[int, int]:
    """(m, E) of a finite nonzero code's magnitude 2^E (1 + m/8)."""
    value = abs(hifloat8.code_value(code))
    exponent = math.floor(math.log2(value))
    return round((value / 2.0**exponent - 1.0) * 8), exponent


def _encode_table() -> np.ndarray:
    """ENCODE[c]: the re-encoded code of HiFloat8 code c (checked to be a bijection that keeps the sign bit
    and gives both signs of a magnitude the same slot)."""
    slots = {(m, first + o): (o << 4) | j for j, (m, first) in enumerate(COLUMNS) for o in range(8)}
    magnitude = {0: ZERO_CODE}
    for c in range(1, 128):
        if c not in _SLOW_CODES:
            magnitude[c] = slots[_m_and_exponent(c)]
    free = sorted(set(range(128)) - set(magnitude.values()))
    for c in _SLOW_CODES:
        magnitude[c] = free.pop(0)
    assert not free and len(set(magnitude.values())) == 128
    table = np.array([magnitude[c & 0x7F] | (c & 0x80) for c in range(256)], dtype=np.uint8)
    table[hifloat8.NAN_CODE] = ENCODED_NAN
    assert len(set(table.tolist())) == 256
    return table


ENCODE = _encode_table()
# floor(log2) of the smallest and the largest magnitude of the nonzero codes the column decode takes
FAST_EXPONENTS = tuple(f(math.floor(math.log2(abs(hifloat8.code_value(c)))) for c in range(1, 128)
                         if c not in _SLOW_CODES) for f in (min, max))
# The table decode's magnitudes in re-encoded order: entry ENCODE[c] & 0x7F is code c's magnitude.
_DECODE_MAGNITUDE = np.argsort(ENCODE[:128])
# Per row-table bytes: the addend (o << 7) + (sign << 15) of a code's high nibble h = sign << 3 | o, as its
# low bytes (0-15) and high bytes (16-31).
ADDENDS = np.array([((h & 1) << 7) for h in range(16)] + [((h >> 3) << 7) | ((h & 7) >> 1) for h in range(16)],
                   dtype=np.uint8)
_COLUMN_M = np.array([m for m, _ in COLUMNS], dtype=np.int64)
_COLUMN_FIRST = np.array([first for _, first in COLUMNS], dtype=np.int64)
_M_FACTORS = np.array([1 + m / 8 for m in range(8)], dtype=np.float32)
_SLOW = np.zeros(256, dtype=np.uint8)
for _c in _SLOW_CODES:
    _SLOW[_c] = _SLOW[_c | 0x80] = 1
_SLOW[hifloat8.NAN_CODE] = 1
# Row scales (BF16 values as float32) whose every column value is a normal BF16 number: 2^-15 s >= 2^-126
# and 2^15 * 2 s < 2^128, with a margin.
_SCALE_LOW, _SCALE_HIGH = np.float32(2.0**-110), np.float32(2.0**110)


def encoded_magnitudes(magnitudes: np.ndarray) -> np.ndarray:
    """The table decode's 128 magnitudes (float32, indexed by a HiFloat8 code's bits 0-6) for re-encoded
    codes."""
    return np.ascontiguousarray(magnitudes[_DECODE_MAGNITUDE])


@numba.njit(**NJIT_OPTIONS)
def encode_rows(codes, scale, encoded, fast):
    """encoded (N, K) uint8 <- ENCODE of codes (N, K) uint8; fast (N,) uint8 <- 1 for the rows the column
    decode serves: no NaN, infinite or subnormal code and the row's ``scale`` (float32, BF16 values) in
    [2^-110, 2^110]."""
    n, k = codes.shape
    for row in range(n):
        slow = np.uint8(0)
        for i in range(k):
            c = codes[row, i]
            encoded[row, i] = ENCODE[c]
            slow |= _SLOW[c]
        s = scale[row]
        fast[row] = 1 if slow == 0 and s >= _SCALE_LOW and s <= _SCALE_HIGH else 0


@numba.njit(**dict(NJIT_OPTIONS, inline="always"))
def fill_column_table(s, table, scratch):
    """table[0:16] / table[16:32] <- the low / high bytes of the row's T[j] = bits(bf16(s (1 + m/8))) + (E0
    << 7) (mod 2^16) of column j = (m, E0); ``s`` the row's float32 scale (a BF16 value in the fast range:
    the product is exact, rounded to nearest even); ``scratch`` float32[8]."""
    for m in range(8):
        scratch[m] = np.float32(s * _M_FACTORS[m])
    bits = scratch.view(np.int32)
    for j in range(16):
        b = np.int64(bits[_COLUMN_M[j]])
        word = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) + (_COLUMN_FIRST[j] << 7)
        table[j] = word & 0xFF
        table[16 + j] = (word >> 8) & 0xFF
