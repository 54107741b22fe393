"""SVDQuant for models: decompose a dense weight into a low-rank BF16 branch plus an MXFP4 residual.

    W (N, K) = (d @ u)^T + Res,   d (K, R) and u (R, N) BF16,
    w, s = dynamic_mx_quant(Res, 32, "round"):   w (N, K/2), s (N, ceil(K/64), 2) uint8

so that ``F.linear(x, W) ~= svd_quant(x, w, s, d, u) = x @ d @ u + Q(x) @ Q(R)^T``. The low-rank factors
are the rank-``rank`` truncated SVD of W (computed in float64, from the eigendecomposition of a Gram matrix:
:func:`low_rank_factors`): W^T = U S V^T, d = U_r sqrt(S_r), u = sqrt(S_r) V_r^T. No activation smoothing
and no iterative refinement (the SVDQuant paper and deepcompressor add both); this is the decomposition the
upstream operator consumes.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lowbit.errors import DtypeError, ShapeError, check_int
from lowbit.formats.svd_quant import BLOCK
from lowbit.ops.mxfp4 import dynamic_mx_quant
from lowbit.ops.svd_quant import svd_quant


def low_rank_factors(w64: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d, u)`` float64, d (K, rank) = U_r sqrt(S_r) and u (rank, N) = sqrt(S_r) V_r^T for the float64 weight
    ``w64`` (N, K) (finite, 1 <= rank <= min(N, K)), where W^T = U S V^T: the rank-``rank`` truncated SVD.

    Computed from the symmetric eigendecomposition of the Gram matrix of W's shorter side (W W^T or W^T W,
    float64), whose top eigenvalues are S_r^2: the factors of LAPACK's full SVD to float64 rounding, in a
    fraction of its time (docs/svd_quant.md, 'svd_quant_decompose'). Each component's sign makes the
    largest-magnitude entry of its row of u positive (a full SVD's signs depend on the LAPACK build). A
    component whose singular value is below sqrt(eps * max(N, K)) (about 1e-7) times the largest, where the Gram
    matrix's rounding leaves only noise, is zero in d and u: a weight of lower rank than ``rank``."""
    n, k = w64.shape
    values, vectors = torch.linalg.eigh(w64 @ w64.T if n <= k else w64.T @ w64)  # ascending
    top = vectors[:, -rank:].flip(1)  # unit eigenvectors by descending eigenvalue: V_r (N <= K) or U_r
    singular = values[-rank:].flip(0).clamp(min=0).sqrt()
    # below the Gram matrix's rounding (relative eps * size in S^2): zero, as LAPACK's would be to that precision
    tiny = singular <= singular[0] * (torch.finfo(torch.float64).eps * max(n, k)) ** 0.5
    root = torch.where(tiny, 1.0, singular.sqrt())
    if n <= k:
        d, u = (w64.T @ top) / root, (top * root).T  # W^T V_r = U_r S_r
    else:
        d, u = top * root, ((w64 @ top) / root).T  # W U_r = V_r S_r
    sign = torch.where(u.gather(1, u.abs().argmax(dim=1, keepdim=True)) < 0, -1.0, 1.0).to(torch.float64)
    return (d * sign.T).masked_fill(tiny, 0.0), (u * sign).masked_fill(tiny[:, None], 0.0)


def svd_quant_decompose(weight: torch.Tensor, rank: int = 32) -> tuple[torch.Tensor, ...]:
    """Split ``weight`` (N, K) float into ``(w, s, d, u)`` for :func:`lowbit.ops.svd_quant.svd_quant`.

    d (K, rank) and u (rank, N) are BF16; the residual W - (d @ u)^T (with the BF16-rounded factors) is
    quantized with floor scales and ties-away elements. Returns contiguous tensors on weight's device (the
    operator would copy non-contiguous factors on every call).
    Errors: DtypeError unless weight is a floating tensor; ShapeError unless it is 2-D with K a positive
    multiple of 32 and 1 <= rank <= min(N, K); TypeError naming ``rank`` unless it is an int; ValueError
    (stating how many) if weight holds NaN or Inf, whose SVD would be NaN or fail (docs/svd_quant.md,
    section 'svd_quant_decompose').
    """
    if not weight.is_floating_point():
        raise DtypeError(f"svd_quant_decompose expects a floating-point weight, got {weight.dtype}")
    if weight.dim() != 2:
        raise ShapeError(f"svd_quant_decompose expects a 2-D weight (N, K), got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if k == 0 or k % BLOCK:
        raise ShapeError(f"svd_quant_decompose: K = {k} is not a positive multiple of {BLOCK}")
    check_int("rank", rank)
    if not 1 <= rank <= min(n, k):
        raise ShapeError(f"svd_quant_decompose: rank must be in [1, {min(n, k)}], got {rank}")
    w64 = weight.detach().to(torch.float64)
    non_finite = int((~torch.isfinite(w64)).sum())
    if non_finite:
        raise ValueError(f"svd_quant_decompose: the weight holds {non_finite} non-finite (NaN or Inf) "
                         f"element(s) of {w64.numel()}; it has no SVD")
    d64, u64 = low_rank_factors(w64, rank)
    d, u = d64.to(torch.bfloat16).contiguous(), u64.to(torch.bfloat16).contiguous()
    residual = w64 - (d.to(torch.float64) @ u.to(torch.float64)).T
    w, s = dynamic_mx_quant(residual.to(torch.float32), BLOCK, "round")
    return w, s, d, u


class SVDQuantLinear(nn.Module):
    """A Linear layer computed by ``svd_quant``: BF16 in/out, an MXFP4 residual plus a BF16 low-rank branch.

    Buffers: ``w`` (N, K/2) uint8, ``s`` (N, ceil(K/64), 2) uint8, ``down`` (K, R) and ``up`` (R, N) BF16,
    optional ``bias`` (N,) BF16. Input (..., K) is cast to BF16; output (..., N) BF16. Weights are stored
    packed (4.25 bits per weight plus the low-rank factors); the CPU backend dequantizes them in every
    forward (a temporary of N * K * 2 bytes), nothing is cached.
    """

    def __init__(self, in_features: int, out_features: int, rank: int = 32, bias: bool = True,
                 device: Optional[torch.device] = None, backend: Optional[str] = None):
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features), ("rank", rank)):
            check_int(name, value, minimum=1)
        if in_features % BLOCK:
            raise ShapeError(f"SVDQuantLinear: in_features = {in_features} is not a multiple of {BLOCK}")
        self.in_features, self.out_features = in_features, out_features
        self.rank, self.backend = rank, backend
        codes = dict(dtype=torch.uint8, device=device)
        bf16 = dict(dtype=torch.bfloat16, device=device)
        self.register_buffer("w", torch.zeros(out_features, in_features // 2, **codes))
        self.register_buffer("s", torch.zeros(out_features, -(-in_features // 64), 2, **codes))
        self.register_buffer("down", torch.zeros(in_features, rank, **bf16))
        self.register_buffer("up", torch.zeros(rank, out_features, **bf16))
        self.register_buffer("bias", torch.zeros(out_features, **bf16) if bias else None)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, rank: int = 32, backend: Optional[str] = None
    ) -> "SVDQuantLinear":
        """Build from an ``nn.Linear`` (its weight decomposed by :func:`svd_quant_decompose`); TypeError for
        another module."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"SVDQuantLinear.from_linear: expected an nn.Linear, got {type(linear).__name__}")
        weight = linear.weight
        has_bias = linear.bias is not None
        module = cls(linear.in_features, linear.out_features, rank, has_bias, weight.device, backend)
        w, s, d, u = svd_quant_decompose(weight, rank)
        module.w.copy_(w)
        module.s.copy_(s)
        module.down.copy_(d)
        module.up.copy_(u)
        if linear.bias is not None:
            module.bias.copy_(linear.bias.detach())
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        squeeze = x.dim() == 1
        x = x.to(torch.bfloat16)
        x2 = x.unsqueeze(0) if squeeze else x
        out = svd_quant(x2, self.w, self.s, self.down, self.up, backend=self.backend)
        if self.bias is not None:
            out = out + self.bias
        return out.squeeze(0) if squeeze else out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}"
