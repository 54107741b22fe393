"""SVDQuant operator ``svd_quant(x, w, s, d, u)`` (formats.md section 4), as ``torch.ops.lowbit.svd_quant``.

    out = x @ d @ u + MXFP4(x) @ MXFP4(W)^T

with the activation quantized per row (blocks of 32 along K, floor scale, ties-away elements) inside
the operator, and the weight given already quantized by ``dynamic_mx_quant(W, 32, "round")``.

Contract (upstream ``amct.svd_quant`` checks, in order; every error is also a RuntimeError as upstream):

* x BF16 with >= 2 dims (B..., S, K); w (N, K/2) and s (N, ceil(K/64), 2) uint8 (or float4_e2m1fn_x2 /
  float8_e8m0fnu views); d (K, R) and u (R, N) BF16. Wrong dtype -> DtypeError "Data Type is wrong";
  wrong rank -> ShapeError "invalid input shapes"; K % 32 != 0 -> ShapeError "K dimension should be a
  multiple of 32"; mismatched sizes -> ShapeError "Input shapes are incompatible"; inputs on different
  devices -> DeviceError.
* Output: x.shape[:-1] + (N,), BF16, on x's device. Decode (S = 1) and prefill use the same math.
* Decisions where upstream is silent or wrong (formats.md section 7, items 11-12): K % 64 == 32 is
  accepted and computed as documented (scale of K-block g at s[n, g // 2, g % 2], the pad slot ignored);
  the Ascend kernel may misalign activation scales there, so those shapes are unverified against it.
  Empty batch dimensions give an empty output (upstream counts them as 1). NaN/Inf in a block of x gives
  a NaN scale for that block (OCP), so the result is NaN there; upstream uses scale byte 252 instead, and
  its output is non-finite there too through x @ d @ u.
* Rounding: out = bf16(L + bf16(P)) with L = bf16(bf16(x @ d) @ u), as the upstream golden computes it.
* ``backend``: "reference" (lowbit.formats.svd_quant: torch matmuls, P in FP32), "native" (CPU: numba
  quantizer + oneDNN BF16 matmuls; CUDA: Triton; NPU: AMCT's ``torch.ops.amct.svd_quant``, unverified),
  "auto". Backends agree up to the matmuls'
  accumulation order (P may round to the neighbouring BF16 value), not bit for bit.
* ``out``: optional BF16 tensor of the output shape on x's device; the result is copied into it.
"""

from __future__ import annotations

from typing import Optional

import torch

from lowbit import backends
from lowbit.errors import DeviceError, DtypeError, ShapeError
from lowbit.formats import mxfp4
from lowbit.formats import svd_quant as ref

OP = "svd_quant"
RTOL = ATOL = 1e-2  # the upstream test's criterion (tests/amct_ops/test_svd_quant.py)


def probe_inputs(m: int, n: int, k: int, r: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Upstream-style data on the CPU: x, W, d, u ~ U(-10, 10) in BF16, W quantized -> (x, w, s, d, u)."""
    generator = torch.Generator().manual_seed(seed)

    def uniform(*shape):
        return (torch.rand(*shape, generator=generator, dtype=torch.float64) * 20 - 10).to(torch.bfloat16)

    x, weight, d, u = uniform(m, k), uniform(n, k), uniform(k, r), uniform(r, n)
    w, s = mxfp4.dynamic_mx_quant(weight, 32, "round")
    return x, w, s, d, u


def _self_check(fn, device: torch.device) -> None:
    """Native agrees with the reference within the upstream tolerance on a probe (M=5, N=40, K=128, R=32)."""
    inputs = probe_inputs(5, 40, 128, 32)
    got = fn(*(t.to(device) for t in inputs)).cpu().float()
    want = ref.svd_quant(*inputs).float()
    if not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
        raise RuntimeError(f"native svd_quant differs from the reference on {device}")


DISPATCH = backends.register(
    backends.Dispatcher(
        op=OP,
        reference=ref.svd_quant,
        native={
            "cpu": "lowbit.kernels.cpu.svd_quant:svd_quant",
            "cuda": "lowbit.kernels.triton.svd_quant:svd_quant",
            "npu": "lowbit.kernels.npu.svd_quant:svd_quant",
        },
        self_check=_self_check,
    )
)


def _validate(x, w, s, d, u) -> tuple[int, ...]:
    """Upstream checks; returns the output shape."""
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
    if k == 0 or k % 32:
        raise ShapeError(f"svd_quant: K dimension should be a multiple of 32 and positive, got K={k}")
    r, n = d.shape[1], u.shape[1]
    fits = (tuple(d.shape), tuple(u.shape), tuple(w.shape), tuple(s.shape)) == (
        (k, r), (r, n), (n, k // 2), (n, -(-k // 64), 2)
    )
    if not fits:
        raise ShapeError(f"svd_quant: Input shapes are incompatible: {_shapes(x, w, s, d, u)}")
    devices = {t.device for t in (x, w, s, d, u)}
    if len(devices) > 1:
        raise DeviceError(f"svd_quant: inputs are on different devices: {sorted(str(v) for v in devices)}")
    return tuple(x.shape[:-1]) + (n,)


def _shapes(*tensors: torch.Tensor) -> str:
    names = ("activation", "weights", "scales", "down", "up")
    return ", ".join(f"{name} {tuple(t.shape)}" for name, t in zip(names, tensors))


@torch.library.custom_op("lowbit::svd_quant", mutates_args=())
def _svd_quant_op(
    x: torch.Tensor,
    w: torch.Tensor,
    s: torch.Tensor,
    d: torch.Tensor,
    u: torch.Tensor,
    backend: Optional[str] = None,
) -> torch.Tensor:
    out_shape = _validate(x, w, s, d, u)
    fn = DISPATCH.select(x.device, backend)
    k = x.shape[-1]
    x2d = x.reshape(-1, k).contiguous()
    if x2d.shape[0] == 0:
        return torch.empty(out_shape, dtype=torch.bfloat16, device=x.device)
    return fn(x2d, w.contiguous(), s.contiguous(), d.contiguous(), u.contiguous()).reshape(out_shape)


@_svd_quant_op.register_fake
def _(x, w, s, d, u, backend=None):
    return x.new_empty(_validate(x, w, s, d, u), dtype=torch.bfloat16)


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

    x (B..., S, K) BF16; w (N, K/2), s (N, ceil(K/64), 2) from :func:`lowbit.formats.mxfp4.dynamic_mx_quant`;
    d (K, R), u (R, N) BF16. Returns (B..., S, N) BF16.
    """
    result = torch.ops.lowbit.svd_quant(x, _as_bytes(w), _as_bytes(s), d, u, backend)
    if out is None:
        return result
    if out.dtype != torch.bfloat16:
        raise DtypeError(f"svd_quant: out must be bfloat16, got {out.dtype}")
    if out.shape != result.shape:
        raise ShapeError(f"svd_quant: out must have shape {tuple(result.shape)}, got {tuple(out.shape)}")
    if out.device != result.device:
        raise DeviceError(f"svd_quant: out is on {out.device} but the result is on {result.device}")
    return out.copy_(result)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """uint8 view of float4_e2m1fn_x2 / float8_e8m0fnu tensors; anything else unchanged (checked later)."""
    return t.view(torch.uint8) if t.dtype in mxfp4.BYTE_VIEW_DTYPES else t
