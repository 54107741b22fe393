"""Independent oracles for the WeightQuantBatchMatmul tests (numpy / float64, no lowbit code)."""

from __future__ import annotations

import numpy as np


def sample_golden_m1(x_f16: np.ndarray, w_int8: np.ndarray, scale_f16: np.ndarray, group_size: int) -> np.ndarray:
    """The sample gen_data.py's golden loop (docs/wqbmm.md, section 'The sample'), numpy float32 throughout; right for M = 1 only
    (a_max has shape (M,) and broadcasts along the last axis, as in the sample)."""
    f1, f2 = np.float32(7.49), np.float32(14.98)
    m, k = x_f16.shape
    out = np.zeros((m, w_int8.shape[1]), dtype=np.float32)
    for g in range(k // group_size):
        a = x_f16[:, g * group_size : (g + 1) * group_size].astype(np.float32)
        a_max = np.max(np.abs(a), axis=-1)
        tmp1 = a / a_max * f1
        a1 = np.round(tmp1)
        tmp2 = (tmp1 - a1) * f2
        a2 = np.round(tmp2)
        tmp3 = (tmp2 - a2) * f2
        a3 = np.round(tmp3)
        w = w_int8[g * group_size : (g + 1) * group_size].astype(np.float32)
        y1, y2, y3 = a1 @ w, a2 @ w, a3 @ w
        c = y1 * (np.float32(1) / f1) + y2 * (np.float32(1) / (f1 * f2)) + y3 * (np.float32(1) / (f1 * f2 * f2))
        out += c * scale_f16[g].astype(np.float32) * a_max
    return out.astype(np.float16)


def float64_matmul_and_bound(x: np.ndarray, w_int8: np.ndarray, scale: np.ndarray, group_size: int, out_rel: float):
    """(y64, bound): the exact product x @ (W * scale) in float64 per row, and a bound on |MSD - y64|.

    MSD truncation: |t3 - A3| <= 1/2 loses at most a_max / (2 * 7.49 * 14.98**2) ~ 2.97e-4 * a_max per
    activation, so per group at most that times sum_k |W[k, n] * scale[g, n]|; we allow 1e-3 (float32
    rounding of the partial sums and constants is far below it) plus ``out_rel`` (half an ulp of the
    output dtype) relative to |y64| and the smallest output subnormal.
    """
    x64 = x.astype(np.float64)
    m, k = x64.shape
    groups = k // group_size
    scale_rows = np.repeat(scale.astype(np.float64), group_size, axis=0)
    y64 = x64 @ (w_int8.astype(np.float64) * scale_rows)
    a_max = np.abs(x64.reshape(m, groups, group_size)).max(axis=2)  # (M, groups)
    weight_mass = np.abs(w_int8.astype(np.float64)).reshape(groups, group_size, -1).sum(axis=1) * np.abs(scale)
    bound = 1e-3 * a_max @ weight_mass + out_rel * np.abs(y64) + 2.0**-24
    return y64, bound
