"""An independent HiFloat8 oracle for the tests, written from docs/hifloat8.md in the value domain.

It does not share code with lowbit.formats.hifloat8: codes are enumerated from the class table of
docs/hifloat8.md ("Layout"), and encoding picks the nearest grid value with ties to the larger magnitude
(the TA rule, with the linear midpoints of the denormal band), in float64 where every FP16/BF16 value
and every midpoint is exact.
"""

from __future__ import annotations

import math

import numpy as np


def class_table_value(code: int) -> float:
    """Value of a code from the row ranges of docs/hifloat8.md ("Layout") (NaN for 0x80, inf for 0x6F/0xEF)."""
    if code == 0x80:
        return math.nan
    sign = -1.0 if code >= 0x80 else 1.0
    c = code & 0x7F
    if c == 0x6F:
        return sign * math.inf
    if c == 0:
        return 0.0
    if c <= 0x07:
        return sign * 2.0 ** (c - 23)
    rows = [  # (first code, last code, exponent, mantissa bits)
        (0x08, 0x0F, 0, 3), (0x10, 0x17, 1, 3), (0x18, 0x1F, -1, 3),
        (0x20, 0x27, 2, 3), (0x28, 0x2F, 3, 3), (0x30, 0x37, -2, 3), (0x38, 0x3F, -3, 3),
    ]
    rows += [(0x40 + 4 * i, 0x43 + 4 * i, e, 2) for i, e in enumerate([4, 5, 6, 7, -4, -5, -6, -7])]
    rows += [(0x60 + 2 * i, 0x61 + 2 * i, e, 1) for i, e in enumerate(list(range(8, 16)) + list(range(-8, -16, -1)))]
    for first, last, exponent, m_bits in rows:
        if first <= c <= last:
            return sign * 2.0**exponent * (1 + (c - first) / 2**m_bits)
    raise AssertionError(f"code {code:#x} not in the class table")


def positive_grid(saturate: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Sorted finite non-negative values and their codes; non-saturating adds Inf at 1.5 * 2^15."""
    pairs = sorted((class_table_value(c), c) for c in range(0x80) if c != 0x6F)
    values = [v for v, _ in pairs]
    codes = [c for _, c in pairs]
    if not saturate:
        values.append(1.5 * 2.0**15)
        codes.append(0x6F)
    return np.array(values), np.array(codes)


def encode(values: np.ndarray, saturate: bool = True) -> np.ndarray:
    """Codes of float64 ``values`` (exact FP16/BF16 values): nearest grid value, ties up in magnitude."""
    grid, grid_codes = positive_grid(saturate)
    mag = np.abs(values)
    finite = np.isfinite(values)
    safe = np.where(finite, mag, 0.0)
    i = np.searchsorted(grid, safe, side="right") - 1  # largest grid value <= |x|
    upper = np.minimum(i + 1, grid.size - 1)
    midpoint = (grid[i] + grid[upper]) / 2
    idx = np.where((i < grid.size - 1) & (safe >= midpoint), upper, i)
    code = grid_codes[idx]
    if not saturate:  # beyond the last step the value is Inf
        code = np.where(safe >= grid[-1], 0x6F, code)
    code = np.where(np.isinf(values), 0x6F, code)
    code = np.where((values < 0) & (code != 0), code | 0x80, code)
    code = np.where(np.isnan(values), 0x80, code)
    return code.astype(np.uint8)
