"""SVDQuant: the reference computation of ``amct.svd_quant`` (formats.md section 4.1), in plain torch.

Not a number format of its own: it combines BF16 low-rank matmuls with an MXFP4 x MXFP4 matmul.

    xq     = MXFP4(x) per row, blocks of 32 along K, floor scale, ties-away elements (in-kernel upstream)
    T      = bf16(x @ d)             fp32 accumulation (torch's BF16 matmul)
    L      = bf16(T @ u)             fp32 accumulation (torch's BF16 matmul)
    P      = deq(xq) @ deq(w)^T      fp32 accumulation of exact products
    out    = bf16(L + bf16(P))       the upstream golden's rounding (see below)

Shapes: x (M, K) BF16, w (N, K/2) uint8 codes, s (N, ceil(K/64), 2) uint8 E8M0 pairs (formats.md 3.7),
d (K, R) BF16, u (R, N) BF16 -> (M, N) BF16. Inputs are assumed validated (see lowbit.ops.svd_quant).
The rounding of the final add is not specified upstream (formats.md 4.1 allows bf16(L + P) or
bf16(L + bf16(P))); this uses the second, which is what the upstream golden computes (two BF16 Linear
results added in BF16): with it every element of the scaled-down golden test meets the upstream
criterion, while bf16(L + P) misses it on about 0.1 % of elements where L and P nearly cancel. The
matmul accumulation order is torch's, so backends agree with this to rounding, not bit for bit; the
quantized activation itself is bit-exact across backends.
"""

from __future__ import annotations

import torch

from lowbit.formats import mxfp4

BLOCK_SIZE = 32


def weight_scales(s: torch.Tensor, k: int) -> torch.Tensor:
    """(N, ceil(K/64), 2) scale pairs -> (N, K/32) per-block scales (the pad slot of odd K/32 dropped)."""
    return mxfp4.scales_from_pairs(s, k // BLOCK_SIZE)


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation quantizer: MXFP4 along the last axis, blocks of 32, floor scale, TA elements."""
    return mxfp4.quantize(x, BLOCK_SIZE, "floor", "ta", axis=-1)


def svd_quant(
    x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, d: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """out = bf16(L + bf16(deq(MXFP4(x)) @ deq(w)^T)), L = bf16(bf16(x @ d) @ u), for 2-D x (M, K)."""
    k = x.shape[-1]
    x_codes, x_scales = quantize_activation(x)
    x_deq = mxfp4.dequantize(x_codes, x_scales, torch.float32)
    w_deq = mxfp4.dequantize(w, weight_scales(s, k), torch.float32)
    low = (x @ d) @ u  # BF16 matmuls: FP32 accumulation, T and L rounded to BF16
    return low + (x_deq @ w_deq.T).to(torch.bfloat16)  # BF16 add: bf16(L + bf16(P))
