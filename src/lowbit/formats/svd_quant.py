"""SVDQuant: the reference computation of the ``svd_quant`` operator, in plain torch (docs/svd_quant.md).

Not a number format of its own: it combines BF16 low-rank matmuls with an MXFP4 x MXFP4 matmul
(docs/svd_quant.md, section 'Semantics'):

    xq     = MXFP4(x) per row, blocks of BLOCK along K, floor scale, ties-away elements
    T      = bf16(x @ d)             fp32 accumulation (torch's BF16 matmul)
    L      = bf16(T @ u)             fp32 accumulation (torch's BF16 matmul)
    P      = deq(xq) @ deq(w)^T      fp32 accumulation of exact products
    out    = bf16(L + bf16(P))       the final add (docs/svd_quant.md, section 'The final add')

Shapes: x (M, K) BF16, w (N, K/2) uint8 codes, s (N, ceil(K/64), 2) uint8 E8M0 pairs (docs/mxfp4.md,
section 'Layouts', torch_npu scale pairs), d (K, R) BF16, u (R, N) BF16 -> (M, N) BF16. Inputs are assumed
validated (see lowbit.ops.svd_quant). The matmul accumulation order is torch's, so backends agree with this
to rounding, not bit for bit; the quantized activation itself is bit-exact across backends.
"""

from __future__ import annotations

import torch

from lowbit.formats import mxfp4

BLOCK = 32  # the MX block of svd_quant: elements along K that share one scale byte


def weight_scales(s: torch.Tensor, k: int) -> torch.Tensor:
    """(N, ceil(K/64), 2) scale pairs -> (N, K/32) per-block scales (the pad slot of odd K/32 dropped)."""
    return mxfp4.scales_from_pairs(s, k // BLOCK)


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation quantizer: MXFP4 along the last axis, blocks of BLOCK, floor scale, TA elements."""
    return mxfp4.quantize(x, BLOCK, "floor", "ta", axis=-1)


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
