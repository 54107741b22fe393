"""SVDQuant operator ``svd_quant(x, w, s, d, u)`` (docs/svd_quant.md), as ``torch.ops.lowbit.svd_quant``.

    out = x @ d @ u + MXFP4(x) @ MXFP4(W)^T

with the activation quantized per row (blocks of 32 along K, floor scale, ties-away elements) inside
the operator, and the weight given already quantized by ``dynamic_mx_quant(W, 32, "round")``. Also
``torch.ops.lowbit.svd_quant_out(x, w, s, d, u, out)`` (see lowbit.ops.library).

Contract (upstream checks, in order; every error is also a RuntimeError as upstream; docs/svd_quant.md,
section 'Contract and errors'):

* x BF16 with >= 2 dims (B..., S, K); w (N, K/2) and s (N, ceil(K/64), 2) uint8 (or float4_e2m1fn_x2 /
  float8_e8m0fnu views); d (K, R) and u (R, N) BF16. Wrong dtype -> DtypeError "Data Type is wrong";
  wrong rank -> ShapeError "invalid input shapes"; K == 0 or K % 32 != 0 -> ShapeError "K dimension
  should be a multiple of 32"; mismatched sizes -> ShapeError "Input shapes are incompatible"; inputs on
  different devices -> DeviceError.
* Output: x.shape[:-1] + (N,), BF16, on x's device. Decode (S = 1) and prefill use the same math.
  Empty batch dimensions give an empty output. K % 64 == 32 is computed as documented; NaN/Inf in a
  block of x gives NaN in that row (docs/svd_quant.md, section 'Decisions').
* Rounding: out = bf16(L + bf16(P)) with L = bf16(bf16(x @ d) @ u) (docs/svd_quant.md, section 'The
  final add').
* Backends agree up to the matmuls' accumulation order (P may round to the neighbouring BF16 value), not
  bit for bit: the self-check of ``auto`` compares with the upstream test's tolerance, rtol = atol = 1e-2
  (:func:`agrees`; docs/svd_quant.md, section 'Backends').
* ``out``: optional BF16 tensor of the output shape on x's device; any strides, it may share memory with
  an input (computed through a temporary then).
"""

from __future__ import annotations

from typing import Optional

import torch

from lowbit import kernels
from lowbit.backends import Kernel, TensorSpec
from lowbit.errors import DtypeError, ShapeError
from lowbit.formats import mxfp4
from lowbit.formats import svd_quant as ref
from lowbit.ops.library import call, define

RTOL = ATOL = 1e-2  # the upstream test's criterion (docs/svd_quant.md, section 'Backends')


def agrees(got: torch.Tensor, want: torch.Tensor, args=()) -> bool:
    """The self-check's comparison: same shape and dtype, NaN exactly where the reference has NaN, and
    ``allclose(rtol=RTOL, atol=ATOL)`` elsewhere (backends sum the matmuls in different orders)."""
    return (got.shape == want.shape and got.dtype == want.dtype
            and torch.allclose(got.float(), want.float(), rtol=RTOL, atol=ATOL, equal_nan=True))


def probe_inputs(m: int, n: int, k: int, r: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Upstream-style data on the CPU: x, W, d, u ~ U(-10, 10) in BF16, W quantized -> (x, w, s, d, u)."""
    generator = torch.Generator().manual_seed(seed)

    def uniform(*shape):
        return (torch.rand(*shape, generator=generator, dtype=torch.float64) * 20 - 10).to(torch.bfloat16)

    x, weight, d, u = uniform(m, k), uniform(n, k), uniform(k, r), uniform(r, n)
    w, s = mxfp4.dynamic_mx_quant(weight, 32, "round")
    return x, w, s, d, u


def _probes():
    """Prefill with K % 64 == 0 (65 rows: more than the CPU's batched kernels take, so its GEMM path too),
    decode (M = 1) with K % 64 == 32, a single block of K, sizes that are not multiples of the Triton tiles,
    a 3-D activation, and rows with a zero block, a NaN and an Inf (on both the prefill and the decode
    path)."""
    yield probe_inputs(65, 40, 128, 32)
    yield probe_inputs(1, 64, 96, 32, seed=1)
    yield probe_inputs(33, 72, 32, 8, seed=2)
    x, w, s, d, u = probe_inputs(6, 24, 64, 16, seed=3)
    x[0, :32] = 0
    x[2, 40] = float("nan")
    x[4, 3] = float("-inf")
    yield x.reshape(2, 3, 64), w, s, d, u
    x, w, s, d, u = probe_inputs(2, 40, 64, 8, seed=4)  # the decode path with a NaN and an Inf
    x[0, 7], x[1, 50] = float("nan"), float("inf")
    yield x, w, s, d, u


def _outputs(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, d: torch.Tensor,
             u: torch.Tensor) -> tuple[TensorSpec]:
    """The upstream checks, in order; the output's shape and dtype."""
    expected = (
        ("activation", x, torch.bfloat16),
        ("weights", w, torch.uint8),
        ("scales", s, torch.uint8),
        ("down", d, torch.bfloat16),
        ("up", u, torch.bfloat16),
    )
    for name, t, want in expected:
        if t.dtype != want:
            raise DtypeError(f"svd_quant: Data Type is wrong: {name} must be {want}, got {t.dtype}")
    if x.dim() < 2 or w.dim() != 2 or s.dim() != 3 or d.dim() != 2 or u.dim() != 2:
        raise ShapeError(
            "svd_quant: invalid input shapes: expected activation (*, m, k), weights (n, k/2), scales "
            f"(n, ceil(k/64), 2), down (k, r), up (r, n); got {_shapes(x, w, s, d, u)}"
        )
    k = x.shape[-1]
    if k == 0 or k % ref.BLOCK:
        raise ShapeError(f"svd_quant: K dimension should be a multiple of 32 and positive, got K={k}")
    r, n = d.shape[1], u.shape[1]
    fits = (tuple(d.shape), tuple(u.shape), tuple(w.shape), tuple(s.shape)) == (
        (k, r), (r, n), (n, k // 2), (n, -(-k // (2 * ref.BLOCK)), 2)
    )
    if not fits:
        raise ShapeError(f"svd_quant: Input shapes are incompatible: {_shapes(x, w, s, d, u)}")
    return (TensorSpec(tuple(x.shape[:-1]) + (n,), torch.bfloat16),)


def _shapes(*tensors: torch.Tensor) -> str:
    names = ("activation", "weights", "scales", "down", "up")
    return ", ".join(f"{name} {tuple(t.shape)}" for name, t in zip(names, tensors))


class _Reference(Kernel):
    def run(self, x, w, s, d, u, *, out) -> None:
        out.copy_(ref.svd_quant(x.reshape(-1, x.shape[-1]), w, s, d, u).reshape(out.shape))


SVD_QUANT = define("svd_quant", "Tensor x, Tensor w, Tensor s, Tensor d, Tensor u", _outputs, _Reference(), _probes,
                   kernels.native("svd_quant", "SVD_QUANT", ("cpu", "cuda", "npu")), agrees=agrees)


def svd_quant(
    x: torch.Tensor,
    w: torch.Tensor,
    s: torch.Tensor,
    d: torch.Tensor,
    u: torch.Tensor,
    *,
    out: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """``x @ d @ u + MXFP4(x) @ MXFP4(W)^T`` in BF16; see the module docstring for the full contract.

    x (B..., S, K) BF16; w (N, K/2), s (N, ceil(K/64), 2) from :func:`lowbit.ops.mxfp4.dynamic_mx_quant`;
    d (K, R), u (R, N) BF16. Returns (B..., S, N) BF16 (``out``, when given).
    """
    return call(SVD_QUANT, (x, mxfp4.byte_view(w), mxfp4.byte_view(s), d, u), out, backend)
