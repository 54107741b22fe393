"""SVDQuant on the CPU: numba MXFP4 (de)quantization around torch's BF16 matmuls (oneDNN).

The quantized activation and the dequantized weight are exact in BF16 (an E2M1 value times a power of
two has at most two significant bits, inside BF16's exponent range), so the MX matmul runs as a BF16
matmul with FP32 accumulation, rounded to BF16, and L is added in BF16: ``out = bf16(L + bf16(P))`` (one
of the two roundings formats.md 4.1 allows; measured faster here than oneDNN's addmm with beta = 1).

Memory: every call dequantizes the weight into a temporary (N, K) BF16 tensor (2 bytes per weight, 4x
the packed size) and the activation into an (M, K) BF16 tensor; nothing is cached between calls.
"""

from __future__ import annotations

import torch

from lowbit.formats.svd_quant import BLOCK_SIZE, weight_scales
from lowbit.kernels.cpu import mxfp4


def svd_quant(
    x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, d: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """Same contract as :func:`lowbit.formats.svd_quant.svd_quant`: x (M, K) BF16 -> (M, N) BF16."""
    k = x.shape[-1]
    x_deq = mxfp4.fake_quantize(x, BLOCK_SIZE, "floor", "ta", torch.bfloat16)
    w_deq = mxfp4.dequantize(w, weight_scales(s, k), torch.bfloat16)
    return torch.mm(x_deq, w_deq.T).add_((x @ d) @ u)
