"""Dtype tables shared by the reference code, the kernels and the tests (one home for each)."""

from __future__ import annotations

import torch

# Floating dtype -> the integer dtype of the same width, for viewing values as bit patterns.
SAME_WIDTH_INT = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


# The quiet NaN (sign clear, top fraction bit set) of each 16-bit float: what lowbit writes for a NaN result
# where a format does not fix another pattern (torch's conversions write 0xFFFF or 0x7FC0 to BF16 by position).
QUIET_NAN_BITS = {torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}


def bit_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as signed integers of its width (floats), or ``t`` itself (integers)."""
    return t.view(SAME_WIDTH_INT[t.dtype]) if t.dtype in SAME_WIDTH_INT else t
