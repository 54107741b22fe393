"""SVDQuant on the CPU: the numba MXFP4 activation quantizer, the fused MXFP4 weight-only kernel, and
torch's BF16 matmuls (oneDNN) for the low-rank branch.

The quantized activation is exact in BF16 (an E2M1 value times a power of two), so the MX product
``P = deq(xq) @ deq(w)^T`` is the weight-only linear of that activation with the MXFP4 weight
(lowbit.kernels.cpu.weight_only: it reads the packed codes and scales directly, never a dense weight;
float32 sums rounded once to BF16), and L is added in BF16: ``out = bf16(L + bf16(P))`` (docs/svd_quant.md,
section 'The final add'). At decode (up to GEMV_MAX_M rows) that reads 4.25 bits per weight instead of
a BF16 copy of the whole weight per call; with more rows the weight is dequantized to BF16 once per call
and multiplied by torch's BF16 GEMM (faster there than the fused kernel's tiles).

Memory: the activation's (M, K) BF16 dequantized copy, the (N, K/32) per-block scales, and with more than
GEMV_MAX_M rows a temporary (N, K) BF16 weight; nothing is cached between calls.
"""

from __future__ import annotations

import torch

from lowbit.backends import Kernel
from lowbit.formats.svd_quant import BLOCK, weight_scales
from lowbit.kernels.cpu import mxfp4
from lowbit.kernels.cpu.weight_only import GEMV_MAX_M, MXFP4_LINEAR


class SvdQuant(Kernel):
    """svd_quant on the CPU: contiguous x (B..., S, K) BF16 and the other inputs into contiguous BF16 ``out``."""

    def run(self, x, w, s, d, u, *, out) -> None:
        k, n = x.shape[-1], u.shape[1]
        x2d, out2d = x.view(-1, k), out.view(-1, n)
        x_deq = torch.empty_like(x2d)
        mxfp4.fake_quantize(x2d, BLOCK, "floor", "ta", out=x_deq)
        scales = weight_scales(s, k).contiguous()
        if x2d.shape[0] <= GEMV_MAX_M:
            MXFP4_LINEAR.run(x_deq, w, scales, None, out=out2d)
        else:
            w_deq = torch.empty((n, k), dtype=torch.bfloat16)
            mxfp4.DEQUANTIZE.run(w, scales, torch.bfloat16, -1, out=w_deq)
            torch.mm(x_deq, w_deq.T, out=out2d)
        out2d.add_((x2d @ d) @ u)


SVD_QUANT = SvdQuant()
