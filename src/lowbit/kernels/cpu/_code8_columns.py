"""8-bit codes (HiFloat8, FP8 E4M3) re-encoded as (column, offset) for CPUs whose byte look-ups are 16-entry
``vpshufb`` (AVX2 without AVX-512): a bijection of the 256 codes, applied once to a prepared weight, under
which a BF16 weight is two table look-ups and an add instead of a 128-entry look-up (docs/weight_only.md,
'8-bit codes by columns').

A finite nonzero code's magnitude is ``2^E (1 + m/8)`` (m 0..7); times a row's float32 scale ``s`` and
rounded to BF16 (the float32 product first, then BF16: HiFloat8's scale is a BF16 value, so its product is
exact; FP8's is any float32) it is ``2^E * mu_m`` with ``mu_m = bf16(fl32(s (1 + m/8)))``, since a power of two
commutes with both roundings while every result stays a normal number (rows whose scale lies in [2^-110,
2^110]): its bits are ``bits(mu_m) + (E << 7)``. A format's 16 columns ``(m, E0)`` each hold one m and the
eight exponents E0 .. E0 + 7; a re-encoded code is ``r = sign << 7 | o << 4 | j`` for the magnitude
``2^(E0 + o) (1 + m/8)`` of column j, so its bits are ``T[j] + (o << 7) + (sign << 15)`` (mod 2^16) with the
row's 16-entry table ``T[j] = bits(mu_m) + (E0 << 7)`` (made once per row: ``encode_rows``). The free slots
hold zero (slot ZERO_CODE, looked up as 0), NaN and the codes left to the table decode (HiFloat8: the
infinities and the seven subnormal codes; FP8 E4M3: its three smallest subnormal codes, 2^-9, 2^-8 and
1.5 * 2^-8): a block of codes holding any of those (``slow_blocks``) takes the table decode. FP8's -0 is
re-encoded as +0: no lane sum of the reference can show a zero weight's sign (a lane starts at +0, and +0 +
-0 is +0), so the weights' sums are the same; HiFloat8 has no -0 (its code 0x80 is NaN, which takes -0's slot).

The sign bit stays bit 7 (but for FP8's -0) and a code's magnitude slot does not depend on its sign, so the
table decode serves re-encoded codes too, with its magnitudes permuted (``encoded_magnitudes``) and NaN at
``encoded_nan``.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from lowbit.formats import hifloat8
from lowbit.kernels.cpu._runtime import NJIT_OPTIONS

ZERO_COLUMN = 12
ZERO_CODE = ZERO_COLUMN  # zero's slot (offset 0 of column ZERO_COLUMN)
# Per row-table bytes: the addend (o << 7) + (sign << 15) of a code's high nibble h = sign << 3 | o, as its
# low bytes (0-15) and high bytes (16-31).
ADDENDS = np.array([((h & 1) << 7) for h in range(16)] + [((h >> 3) << 7) | ((h & 7) >> 1) for h in range(16)],
                   dtype=np.uint8)
TABLE_BYTES = 32  # a row's column table: T's 16 low bytes, then its 16 high bytes
BLOCK = 32  # codes of a block, which slow_blocks marks as a whole (the column decode's unit: 32 codes)
_M_FACTORS = np.array([1 + m / 8 for m in range(8)], dtype=np.float32)
# Row scales (float32) whose every column value is a normal BF16 number, for both formats (magnitudes 2^-15
# .. 2^16): 2^-15 s >= 2^-126 and 2^16 s < 2^128, with a margin.
_SCALE_LOW, _SCALE_HIGH = np.float32(2.0**-110), np.float32(2.0**110)


def _m_and_exponent(value: float) -> tuple[int, int]:
    """(m, E) of a finite nonzero magnitude 2^E (1 + m/8)."""
    exponent = math.floor(math.log2(value))
    return round((value / 2.0**exponent - 1.0) * 8), exponent


class ColumnCode:
    """One format's re-encoding. ``magnitudes``: the values of codes 0..127 (NaN for its NaN magnitude,
    infinite ones allowed); ``nan_code``: the code that is NaN whatever its sign bit (HiFloat8's 0x80) or
    None (the NaN magnitude's codes: FP8's 0x7F and 0xFF); ``columns``: the 16 (m, E0), column ZERO_COLUMN's
    offset 0 free for zero; ``slow``: the magnitude codes left to the table decode, placed in the free slots
    with the NaN magnitude. Attributes: ``encode`` (uint8[256]: code -> re-encoded code), ``encoded_nan``
    (the re-encoded NaN code for the table decode), ``fast_exponents`` (floor(log2) of the smallest and the
    largest magnitude the column decode takes), ``lowest_exponent`` (floor(log2) of the smallest nonzero
    magnitude), ``slow_codes`` (uint8[256]: 1 for the codes the column decode leaves to the table).
    ValueError unless the encoding is a bijection of the 256 codes that keeps the sign bit, but that FP8's -0
    (``nan_code`` None) is +0's code."""

    def __init__(self, magnitudes, nan_code, columns, slow):
        slots = {(m, first + o): (o << 4) | j for j, (m, first) in enumerate(columns) for o in range(8)}
        slot = {0: ZERO_CODE}
        nan_magnitude = [c for c in range(128) if math.isnan(magnitudes[c])]
        left = [c for c in range(1, 128) if c in slow or not math.isfinite(magnitudes[c])]
        for c in range(1, 128):
            if c not in left:
                slot[c] = slots[_m_and_exponent(magnitudes[c])]
        free = sorted(set(range(128)) - set(slot.values()))
        for c in left:
            slot[c] = free.pop(0)
        encode = np.array([slot[c & 0x7F] | (c & 0x80) for c in range(256)], dtype=np.uint8)
        if nan_code is not None:  # HiFloat8: 0x80, -0's slot with the sign bit
            encode[nan_code] = 0x80 | ZERO_CODE
        if free or sorted(encode.tolist()) != list(range(256)) or ((encode ^ np.arange(256)) & 0x80).any():
            raise ValueError("the columns do not make a bijection that keeps the sign bit")
        if nan_code is None:
            encode[0x80] = ZERO_CODE  # -0 as +0
        self.encode = encode
        self.encoded_nan = int(encode[nan_code if nan_code is not None else nan_magnitude[0]])
        fast = [abs(magnitudes[c]) for c in range(1, 128) if c not in left]
        self.fast_exponents = tuple(f(math.floor(math.log2(v)) for v in fast) for f in (min, max))
        self.lowest_exponent = min(math.floor(math.log2(abs(v))) for v in magnitudes[1:] if math.isfinite(v))
        slow_codes = np.zeros(256, dtype=np.uint8)
        for c in left:
            slow_codes[c] = slow_codes[c | 0x80] = 1
        if nan_code is not None:
            slow_codes[nan_code] = 1
        self.slow_codes = slow_codes
        self._decode_magnitude = np.argsort(encode[:128])  # entry encode[c] & 0x7F: code c's magnitude
        self._column_m = np.array([m for m, _ in columns], dtype=np.int64)
        self._column_first = np.array([first for _, first in columns], dtype=np.int64)

    def encoded_magnitudes(self, magnitudes: np.ndarray) -> np.ndarray:
        """The table decode's 128 magnitudes (float32, indexed by a code's bits 0-6) for re-encoded codes."""
        return np.ascontiguousarray(magnitudes[self._decode_magnitude])

    def encode_rows(self, codes: np.ndarray, scale: np.ndarray, encoded: np.ndarray, fast: np.ndarray,
                    tables: np.ndarray, slow_blocks: np.ndarray) -> None:
        """encoded (N, K) uint8 <- the re-encoded codes (N, K) uint8; slow_blocks (N, ceil(K / BLOCK)) uint8 <-
        1 for each block of BLOCK codes of a row (the last one may be shorter) holding a slow code; fast (N,)
        uint8 <- for the rows whose ``scale`` (float32) lies in [2^-110, 2^110], 1 where the column decode
        takes all of the row's codes and 2 where it holds a slow code (the column decode serves it but for the
        blocks holding one), else 0; tables (N, TABLE_BYTES) uint8 <- the column tables of the rows of fast != 0
        (fill_column_table; other rows not written). One pass over the codes."""
        _encode_rows(codes, scale, self.encode, self.slow_codes, self._column_m, self._column_first, encoded, fast,
                     tables, slow_blocks)

    def scale_tables(self, scales: np.ndarray) -> np.ndarray:
        """(S, TABLE_BYTES) uint8: the column tables (fill_column_table) of the float32 ``scales`` (S,), each
        in [2^-110, 2^110] (ValueError otherwise)."""
        scales = np.asarray(scales, dtype=np.float32)
        if not ((scales >= _SCALE_LOW) & (scales <= _SCALE_HIGH)).all():
            raise ValueError("a scale lies outside the columns' range [2^-110, 2^110]")
        tables = np.empty((scales.size, TABLE_BYTES), dtype=np.uint8)
        _scale_tables(scales, self._column_m, self._column_first, tables)
        return tables


@numba.njit(**NJIT_OPTIONS)
def _scale_tables(scales, column_m, column_first, tables):
    scratch = np.empty(8, dtype=np.float32)
    for i in range(scales.size):
        fill_column_table(scales[i], column_m, column_first, tables[i], scratch)


@numba.njit(**NJIT_OPTIONS)
def _encode_rows(codes, scale, encode, slow_codes, column_m, column_first, encoded, fast, tables, slow_blocks):
    n, k = codes.shape
    scratch = np.empty(8, dtype=np.float32)
    for row in range(n):
        slow = np.uint8(0)
        for b in range(slow_blocks.shape[1]):
            block_slow = np.uint8(0)
            for i in range(b * BLOCK, min(k, (b + 1) * BLOCK)):
                c = codes[row, i]
                encoded[row, i] = encode[c]
                block_slow |= slow_codes[c]
            slow_blocks[row, b] = block_slow
            slow |= block_slow
        s = scale[row]
        fast[row] = (1 if slow == 0 else 2) if s >= _SCALE_LOW and s <= _SCALE_HIGH else 0
        if fast[row]:
            fill_column_table(s, column_m, column_first, tables[row], scratch)


@numba.njit(**NJIT_OPTIONS)
def fill_column_table(s, column_m, column_first, table, scratch):
    """table[0:16] / table[16:32] <- the low / high bytes of the row's T[j] = bits(bf16(fl32(s (1 + m/8)))) +
    (E0 << 7) (mod 2^16) of column j = (column_m[j], column_first[j]); ``s`` the row's float32 scale in the
    fast range (rounded to nearest even); ``scratch`` float32[8]."""
    for m in range(8):
        scratch[m] = np.float32(s * _M_FACTORS[m])
    bits = scratch.view(np.int32)
    for j in range(16):
        b = np.int64(bits[column_m[j]])
        word = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) + (column_first[j] << 7)
        table[j] = word & 0xFF
        table[16 + j] = (word >> 8) & 0xFF


# HiFloat8: m = 0: E = -15 .. 15 besides the seven subnormal codes; m = 4: -15 .. 14; m = 2, 6: -7 .. 7; odd
# m: -3 .. 3. Column ZERO_COLUMN's offset 0 (m = 1, E = -4) holds zero and -0's slot the NaN code 0x80.
HIFLOAT8 = ColumnCode(
    [abs(hifloat8.code_value(c)) for c in range(128)], hifloat8.NAN_CODE,
    ((0, -15), (0, -7), (0, 1), (0, 9), (4, -15), (4, -7), (4, 1), (4, 9),
     (2, -7), (2, 1), (6, -7), (6, 1), (1, -4), (3, -3), (5, -3), (7, -3)),
    slow=range(1, 8))

# FP8 E4M3: normal values 2^E (1 + m/8), E = -6 .. 8 (m = 7, E = 8 is NaN); subnormal ones m 2^-9 (m = 1..7) are
# 2^-9 (m 0), 2^-8 (m 0), 1.5 * 2^-8 (m 4), 2^-7 (m 0), 1.25 * 2^-7 (m 2), 1.5 * 2^-7 (m 4), 1.75 * 2^-7 (m 6).
# Two columns per m cover E = -7 .. 8; the first three subnormal codes (E -9 and -8) do not fit and are slow.
# The odd m's E = -7 slots are free: column ZERO_COLUMN's (m = 1) holds zero.
FLOAT8_E4M3 = ColumnCode(
    [float(np.ldexp(c & 7, -9)) if c < 8 else (math.nan if c == 0x7F else
                                                 float(np.ldexp(8 + (c & 7), (c >> 3) - 10))) for c in range(128)],
    None,
    ((0, -7), (0, 1), (4, -7), (4, 1), (2, -7), (2, 1), (6, -7), (6, 1),
     (3, -7), (3, 1), (5, -7), (5, 1), (1, -7), (1, 1), (7, -7), (7, 1)),
    slow=range(1, 4))
