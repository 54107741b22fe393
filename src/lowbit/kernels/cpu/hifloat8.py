"""HiFloat8 encode/decode on the CPU: numba table look-ups built from the reference encoder.

Encode: a 32768-entry table maps the magnitude bits (input & 0x7FFF) of an FP16 or BF16 value to the
unsigned code; the sign bit is put back unless the code is zero or NaN (both 0 in the low 7 bits).
Decode: a 256-entry table of FP16/BF16 bit patterns.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
import torch

from lowbit.formats import hifloat8
from lowbit.kernels.cpu._runtime import PARALLEL_NJIT_OPTIONS, as_numpy, sync_threads


@functools.cache
def encode_lut(dtype: torch.dtype) -> np.ndarray:
    """uint8[32768]: unsigned code of each non-negative FP16/BF16 bit pattern, from the reference."""
    magnitudes = torch.arange(32768, dtype=torch.int16).view(dtype)
    return hifloat8.encode(magnitudes).numpy().copy()


@functools.cache
def decode_lut(dtype: torch.dtype) -> np.ndarray:
    """int16[256]: FP16/BF16 bit pattern of each code, from the reference."""
    return hifloat8.decode_table(dtype).view(torch.int16).numpy().copy()


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _encode(src, lut, dst):
    # src: int16[n] bit patterns, lut: uint8[32768], dst: uint8[n]
    for i in numba.prange(src.size):
        bits = src[i]
        code = lut[bits & 0x7FFF]
        sign = np.uint8((bits >> 8) & 0x80)
        dst[i] = code | (sign if code & 0x7F else np.uint8(0))


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _decode(src, lut, dst):
    # src: uint8[n] codes, lut: int16[256], dst: int16[n] bit patterns
    for i in numba.prange(src.size):
        dst[i] = lut[src[i]]


def encode_into(x: torch.Tensor, out: torch.Tensor) -> None:
    """Encode contiguous CPU FP16/BF16 ``x`` into contiguous uint8 ``out`` of the same numel."""
    sync_threads()
    _encode(as_numpy(x).reshape(-1), encode_lut(x.dtype), as_numpy(out).reshape(-1))


def decode_into(codes: torch.Tensor, out: torch.Tensor) -> None:
    """Decode contiguous CPU uint8 ``codes`` into contiguous FP16/BF16 ``out`` of the same numel."""
    sync_threads()
    _decode(as_numpy(codes).reshape(-1), decode_lut(out.dtype), as_numpy(out).reshape(-1))
