"""Base classes of the native MXFP4 kernels: they compute blocks along the last axis only.

``run`` takes the operators' arguments (any ``axis``) and contiguous outputs, as every Kernel does. For
the last axis it hands the outputs to the subclass's ``*_last_axis`` method, which writes into them
directly; for another axis it moves that axis last (one copy of the input), computes into temporaries
and copies them back into the outputs.
"""

from __future__ import annotations

import torch

from lowbit.backends import Kernel


def moved_last(t: torch.Tensor, axis: int) -> torch.Tensor:
    """A contiguous copy of ``t`` with dimension ``axis`` moved last."""
    return t.movedim(axis, -1).contiguous()


def _empty_moved(out: torch.Tensor, axis: int) -> torch.Tensor:
    """An empty contiguous tensor shaped like ``out`` with dimension ``axis`` moved last."""
    return torch.empty(out.movedim(axis, -1).shape, dtype=out.dtype, device=out.device)


class LastAxisQuantize(Kernel):
    """mxfp4_quantize(x, block_size, scale_rule, rounding, axis) for a kernel of the last axis."""

    def run(self, x: torch.Tensor, block_size: int, scale_rule: str, rounding: str, axis: int, *,
            out: tuple[torch.Tensor, torch.Tensor]) -> None:
        codes, scales = out
        axis = axis % x.dim()
        if axis == x.dim() - 1:
            self.quantize_last_axis(x, block_size, scale_rule, rounding, codes, scales)
            return
        moved_codes, moved_scales = _empty_moved(codes, axis), _empty_moved(scales, axis)
        self.quantize_last_axis(moved_last(x, axis), block_size, scale_rule, rounding, moved_codes, moved_scales)
        codes.copy_(moved_codes.movedim(-1, axis))
        scales.copy_(moved_scales.movedim(-1, axis))

    def quantize_last_axis(self, x: torch.Tensor, block_size: int, scale_rule: str, rounding: str,
                           codes: torch.Tensor, scales: torch.Tensor) -> None:
        """Quantize contiguous ``x`` in blocks along its last axis into contiguous ``codes``, ``scales``."""
        raise NotImplementedError


class LastAxisDequantize(Kernel):
    """mxfp4_dequantize(codes, scales, dtype, axis) for a kernel of the last axis."""

    def run(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype | None, axis: int, *,
            out: torch.Tensor) -> None:
        axis = axis % codes.dim()
        if axis == codes.dim() - 1:
            self.dequantize_last_axis(codes, scales, out)
            return
        moved = _empty_moved(out, axis)
        self.dequantize_last_axis(moved_last(codes, axis), moved_last(scales, axis), moved)
        out.copy_(moved.movedim(-1, axis))

    def dequantize_last_axis(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        """Decode contiguous ``codes`` / ``scales`` (blocks along the last axis) into contiguous ``out``."""
        raise NotImplementedError
