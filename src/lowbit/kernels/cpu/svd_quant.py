"""SVDQuant on the CPU: numba MXFP4 (de)quantization around torch's BF16 matmuls (oneDNN).

The quantized activation and the dequantized weight are exact in BF16 (an E2M1 value times a power of
two has at most two significant bits, inside BF16's exponent range), so the MX matmul runs as a BF16
matmul with FP32 accumulation, rounded to BF16 into the output, and L is added in BF16:
``out = bf16(L + bf16(P))`` (docs/svd_quant.md, section 'The final add'; measured faster here than
oneDNN's addmm with beta = 1).

Memory: every call dequantizes the weight into a temporary (N, K) BF16 tensor (2 bytes per weight, 4x
the packed size) and the activation into an (M, K) BF16 tensor; nothing is cached between calls.
"""

from __future__ import annotations

import torch

from lowbit.backends import Kernel
from lowbit.formats.svd_quant import BLOCK, weight_scales
from lowbit.kernels.cpu import mxfp4


class SvdQuant(Kernel):
    """svd_quant on the CPU: contiguous x (B..., S, K) BF16 and the other inputs into contiguous BF16 ``out``."""

    def run(self, x, w, s, d, u, *, out) -> None:
        k, n = x.shape[-1], u.shape[1]
        x2d, out2d = x.view(-1, k), out.view(-1, n)
        x_deq = torch.empty_like(x2d)
        mxfp4.fake_quantize(x2d, BLOCK, "floor", "ta", out=x_deq)
        w_deq = torch.empty((n, k), dtype=torch.bfloat16)
        mxfp4.DEQUANTIZE.run(w, weight_scales(s, k).contiguous(), torch.bfloat16, -1, out=w_deq)
        torch.mm(x_deq, w_deq.T, out=out2d)
        out2d.add_((x2d @ d) @ u)


SVD_QUANT = SvdQuant()
