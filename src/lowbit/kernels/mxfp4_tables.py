"""Lookup tables shared by the MXFP4 kernels (numba and Triton), derived exactly from the reference.

* :func:`thresholds`: for each scale byte and each E2M1 midpoint, the bit pattern of the smallest
  magnitude of the input dtype that rounds past that midpoint (``>=`` for a tie that rounds up, the next
  pattern for one that rounds down under RNE). An element's magnitude code is the number of thresholds
  its magnitude bits reach.
* :func:`dequant_pairs`: for each (scale byte, code byte), both decoded elements packed in one word.
* :func:`scale_bytes`: for each magnitude bit pattern of a 16-bit dtype, the scale byte of a block whose
  largest magnitude it is.
"""

from __future__ import annotations

import functools

import torch

from lowbit.dtypes import SAME_WIDTH_INT
from lowbit.formats import mxfp4 as ref

RULE_ID = {name: i for i, name in enumerate(ref.SCALE_RULES)}  # floor, nearest, even, ceil, rceil
# input/output dtype -> (integer dtype holding two consecutive elements, bits per element)
PAIR_WORD = {
    torch.bfloat16: (torch.int32, 16),
    torch.float16: (torch.int32, 16),
    torch.float32: (torch.int64, 32),
}


@functools.cache
def thresholds(dtype: torch.dtype, rounding: str) -> torch.Tensor:
    """(256, 7) int64: per scale byte, bits of the smallest ``dtype`` magnitude rounding past each midpoint.

    A threshold beyond the dtype's range is its +Inf pattern (no finite magnitude reaches it).
    """
    bits_dtype = SAME_WIDTH_INT[dtype]
    scale = torch.exp2(torch.arange(256, dtype=torch.float64) - ref.E8M0_BIAS).unsqueeze(1)
    midpoints = torch.tensor(ref.E2M1_MIDPOINTS, dtype=torch.float64)
    strict = torch.tensor([rounding == "rne" and not up for up in ref.RNE_TIE_ROUNDS_UP])
    target = scale * midpoints  # exact
    candidate = target.to(dtype)  # the nearest value; step up one pattern while it misses the predicate
    for _ in range(2):
        value = candidate.to(torch.float64)
        short = torch.where(strict, value <= target, value < target)
        stepped = (candidate.view(bits_dtype) + short.to(bits_dtype)).view(dtype)
        candidate = torch.where(short, stepped, candidate)
    return candidate.view(bits_dtype).to(torch.int64)


@functools.cache
def dequant_pairs(dtype: torch.dtype) -> torch.Tensor:
    """Flat (256 * 256,) words: [256 * scale byte + code byte] -> its two decoded elements (low = even).

    Word dtype: PAIR_WORD[dtype][0] (int32 for FP16/BF16 outputs, int64 for FP32).
    """
    code_bytes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(256).unsqueeze(1)
    scale_bytes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat_interleave(256).unsqueeze(1)
    values = ref.dequantize(code_bytes, scale_bytes, dtype)
    return values.contiguous().view(PAIR_WORD[dtype][0]).reshape(-1)


@functools.cache
def scale_bytes(dtype: torch.dtype, scale_rule: str) -> torch.Tensor:
    """(32768,) uint8: [magnitude bits m] -> the E8M0 scale byte of a block of FP16 / BF16 ``dtype`` whose
    largest magnitude has the bit pattern m (0xFF where m is Inf or NaN), by the reference's rule."""
    magnitudes = torch.arange(0x8000, dtype=torch.int32).to(SAME_WIDTH_INT[dtype]).view(dtype)
    finite = torch.isfinite(magnitudes)
    shared = ref.shared_exponent(torch.where(finite, magnitudes, 0).to(torch.float64), scale_rule)
    return torch.where(finite, shared + ref.E8M0_BIAS, 0xFF).to(torch.uint8)
