"""MSD A16W4 matmul (lowbit.formats.wqbmm) in Triton: int8 ``tl.dot`` per K-group, float32 post-process; the
kernel object is :data:`MATMUL` (docs/wqbmm.md, section 'CUDA kernel').

Kernels (CUDA tensors; CPU tensors under TRITON_INTERPRET=1, how the tests run them):

* ``_preprocess_kernel``, one program per (row, group): a_max and the MSD components A1..A3 (int8 planes
  (3, M, K) in the workspace); a_max is NaN for a group holding a NaN or an infinity, 0 for a zero group.
* ``_matmul_kernel``, one program per tile of (TILE_M rows, TILE_N columns), loops over the groups: unpacks
  the (G, TILE_N/2) nibbles to int8 W, ``Yi = tl.dot(Ai, W)`` (int32, exact), then either post-processes
  at once (``preload``) or stores Y_int (3, M, K/G, N) to the workspace (``basic``, followed by
  ``_post_kernel``).

Bit-exactness: divisions use ``div_rn``, rounding is an explicit half-to-even, and kernels are launched with
``enable_fp_fusion=False`` so that ``a * b + c`` is never contracted into an FMA; the post-process keeps the
reference's order. NaN outputs are canonicalized like the reference.

Limits (``MATMUL.supports``): the group size must be a power of two (``tl.arange(0, G)``); other sizes run
on the reference under ``auto`` and raise BackendUnavailable under ``native``. The packed weight is the raw
(K, N/2) weight itself (a contiguous copy).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from lowbit.formats import wqbmm as reference
from lowbit.kernels.wqbmm_kernel import MSD, WqbmmKernel, aligned_offsets

# Tile per program: (16, 64) on a GPU (tl.dot needs 16 rows there). The interpreter (TRITON_INTERPRET=1)
# runs each program in Python with numpy's (BLAS-less) integer matmul, so it gets row tiles no taller than
# the problem and wide column tiles. The numbers do not depend on the tiling.
TILE_M, TILE_N = 16, 64
INTERPRETER_TILE_N = 1024
_R = (reference.R1, reference.R2, reference.R3)  # float32 values, exact as Python floats


def _workspace_layout(m: int, k: int, n: int, group_size: int, template: str) -> tuple[dict, int]:
    """Offsets of the A planes (int8 (3, M, K)), a_max (float32 (M, K/G)), y32 (float32 (M, N)) and, for
    ``basic``, Y_int (int32 (3, M, K/G, N)) in the workspace, and its total bytes."""
    groups = k // group_size
    sizes = {"a_planes": 3 * m * k, "a_max": 4 * m * groups, "y32": 4 * m * n}
    if template == "basic":
        sizes["y_int"] = 4 * 3 * m * groups * n
    return aligned_offsets(sizes)


@triton.jit
def _rint(t):
    """Round half to even for |t| < 2**22 (here |t| <= 7.5): floor(t + 0.5), minus one on odd ties."""
    r = tl.floor(t + 0.5)
    tie_to_odd = ((r - t) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) == 1.0)
    return tl.where(tie_to_odd, r - 1.0, r)


@triton.jit
def _preprocess_kernel(
    x_ptr,  # *fp16|bf16 (M, K) contiguous
    a_ptr,  # *int8 (3, M, K): A1..A3
    amax_ptr,  # *fp32 (M, K/G)
    M, K,  # sizes
    G: tl.constexpr,  # group size (power of two for tl.arange)
    F1: tl.constexpr, F2: tl.constexpr,  # the MSD constants float32(7.49), float32(14.98)
):
    m = tl.program_id(0)
    g = tl.program_id(1)
    offs = g * G + tl.arange(0, G)
    a = tl.load(x_ptr + m.to(tl.int64) * K + offs).to(tl.float32)
    mag = tl.abs(a)
    finite = tl.min(tl.where((mag == float("inf")) | (mag != mag), 0, 1), axis=0) == 1
    amax = tl.max(tl.where(mag == mag, mag, 0.0), axis=0)
    safe = finite & (amax != 0)
    t1 = tl.where(safe, tl.math.div_rn(a, tl.where(safe, amax, 1.0)) * F1, 0.0)
    q1 = _rint(t1)
    t2 = (t1 - q1) * F2
    q2 = _rint(t2)
    t3 = (t2 - q2) * F2
    q3 = _rint(t3)
    plane = M.to(tl.int64) * K
    base = m.to(tl.int64) * K + offs
    tl.store(a_ptr + base, q1.to(tl.int8))
    tl.store(a_ptr + plane + base, q2.to(tl.int8))
    tl.store(a_ptr + 2 * plane + base, q3.to(tl.int8))
    tl.store(amax_ptr + m * (K // G) + g, tl.where(finite, amax, float("nan")))


@triton.jit
def _post_process(acc, y1, y2, y3, s1, s2, s3, amax, scale, offset, r1, r2, r3, HAS_OFFSET: tl.constexpr):
    """acc + (c * scale) * a_max (float32, reference order); rows with a_max = 0 unchanged."""
    f1 = y1.to(tl.float32)
    f2 = y2.to(tl.float32)
    f3 = y3.to(tl.float32)
    if HAS_OFFSET:
        f1 = f1 + s1.to(tl.float32)[:, None] * offset[None, :]
        f2 = f2 + s2.to(tl.float32)[:, None] * offset[None, :]
        f3 = f3 + s3.to(tl.float32)[:, None] * offset[None, :]
    c = f1 * r1 + f2 * r2 + f3 * r3
    term = (c * scale[None, :]) * amax[:, None]
    return tl.where((amax != 0)[:, None], acc + term, acc)


@triton.jit
def _matmul_kernel(
    a_ptr,  # *int8 (3, M, K)
    amax_ptr,  # *fp32 (M, K/G)
    w_ptr,  # *uint8 (K, N/2) packed int4, column 2j in the low nibble of byte j
    scale_ptr,  # *fp16|bf16 (K/G, N)
    offset_ptr,  # *fp16|bf16 (K/G, N) (unused without an offset)
    y32_ptr,  # *fp32 (M, N): preload output
    yint_ptr,  # *int32 (3, M, K/G, N): basic output
    M, N, K,  # sizes
    r1, r2, r3,  # fp32 1/f1, 1/(f1*f2), 1/(f1*f2*f2)
    G: tl.constexpr,  # group size
    BM: tl.constexpr, BN: tl.constexpr,  # tile
    HAS_OFFSET: tl.constexpr,
    STORE_YINT: tl.constexpr,  # True: basic (store Y_int); False: preload (post-process here)
):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    half_cols = tl.program_id(1) * (BN // 2) + tl.arange(0, BN // 2)
    row_ok = rows < M
    col_ok = cols < N
    groups = K // G
    plane = M.to(tl.int64) * K
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for g in range(0, groups):
        ks = g * G + tl.arange(0, G)
        a_off = rows.to(tl.int64)[:, None] * K + ks[None, :]
        a1 = tl.load(a_ptr + a_off, mask=row_ok[:, None], other=0)
        a2 = tl.load(a_ptr + plane + a_off, mask=row_ok[:, None], other=0)
        a3 = tl.load(a_ptr + 2 * plane + a_off, mask=row_ok[:, None], other=0)
        packed = tl.load(w_ptr + ks.to(tl.int64)[:, None] * (N // 2) + half_cols[None, :],
                         mask=(half_cols < N // 2)[None, :], other=0).to(tl.int32)
        low = ((packed & 0xF) ^ 8) - 8
        high = ((packed >> 4) ^ 8) - 8
        w = tl.reshape(tl.join(low, high), (G, BN)).to(tl.int8)
        y1 = tl.dot(a1, w, out_dtype=tl.int32)
        y2 = tl.dot(a2, w, out_dtype=tl.int32)
        y3 = tl.dot(a3, w, out_dtype=tl.int32)
        if STORE_YINT:
            y_off = (rows.to(tl.int64)[:, None] * groups + g) * N + cols[None, :]
            ymask = row_ok[:, None] & col_ok[None, :]
            yplane = M.to(tl.int64) * groups * N
            tl.store(yint_ptr + y_off, y1, mask=ymask)
            tl.store(yint_ptr + yplane + y_off, y2, mask=ymask)
            tl.store(yint_ptr + 2 * yplane + y_off, y3, mask=ymask)
        else:
            amax = tl.load(amax_ptr + rows * groups + g, mask=row_ok, other=0.0)
            scale = tl.load(scale_ptr + g * N + cols, mask=col_ok, other=0.0).to(tl.float32)
            offset = scale
            if HAS_OFFSET:
                offset = tl.load(offset_ptr + g * N + cols, mask=col_ok, other=0.0).to(tl.float32)
            s1 = tl.sum(a1.to(tl.int32), axis=1)
            s2 = tl.sum(a2.to(tl.int32), axis=1)
            s3 = tl.sum(a3.to(tl.int32), axis=1)
            acc = _post_process(acc, y1, y2, y3, s1, s2, s3, amax, scale, offset, r1, r2, r3, HAS_OFFSET)
    if not STORE_YINT:
        acc = tl.where(acc != acc, float("nan"), acc)
        tl.store(y32_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _post_kernel(
    a_ptr, amax_ptr, scale_ptr, offset_ptr, y32_ptr, yint_ptr,  # as in _matmul_kernel
    M, N, K, r1, r2, r3,
    G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, HAS_OFFSET: tl.constexpr,
):
    """Stage 3 of ``basic``: y32 from Y_int, group by group in order."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    row_ok = rows < M
    col_ok = cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    groups = K // G
    plane = M.to(tl.int64) * K
    yplane = M.to(tl.int64) * groups * N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for g in range(0, groups):
        y_off = (rows.to(tl.int64)[:, None] * groups + g) * N + cols[None, :]
        y1 = tl.load(yint_ptr + y_off, mask=mask, other=0)
        y2 = tl.load(yint_ptr + yplane + y_off, mask=mask, other=0)
        y3 = tl.load(yint_ptr + 2 * yplane + y_off, mask=mask, other=0)
        amax = tl.load(amax_ptr + rows * groups + g, mask=row_ok, other=0.0)
        scale = tl.load(scale_ptr + g * N + cols, mask=col_ok, other=0.0).to(tl.float32)
        offset = scale
        s1 = tl.zeros((BM,), dtype=tl.int32)
        s2 = s1
        s3 = s1
        if HAS_OFFSET:
            offset = tl.load(offset_ptr + g * N + cols, mask=col_ok, other=0.0).to(tl.float32)
            ks = g * G + tl.arange(0, G)
            a_off = rows.to(tl.int64)[:, None] * K + ks[None, :]
            s1 = tl.sum(tl.load(a_ptr + a_off, mask=row_ok[:, None], other=0).to(tl.int32), axis=1)
            s2 = tl.sum(tl.load(a_ptr + plane + a_off, mask=row_ok[:, None], other=0).to(tl.int32), axis=1)
            s3 = tl.sum(tl.load(a_ptr + 2 * plane + a_off, mask=row_ok[:, None], other=0).to(tl.int32), axis=1)
        acc = _post_process(acc, y1, y2, y3, s1, s2, s3, amax, scale, offset, r1, r2, r3, HAS_OFFSET)
    acc = tl.where(acc != acc, float("nan"), acc)
    tl.store(y32_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], acc, mask=mask)


class WeightQuantBatchMatmul(WqbmmKernel):
    """weight_quant_batch_matmul (MSD) in Triton: CUDA tensors (CPU tensors under TRITON_INTERPRET=1).
    Power-of-two group sizes only (see :meth:`supports`). Reads the raw (K, N/2) weight (the base class's
    packed layout)."""

    name = "weight_quant_batch_matmul (Triton)"

    def supports(self, x, weight, antiquant_scale, antiquant_offset, group_size, algorithm, template,
                 workspace=None, prepacked=False):
        reason = super().supports(x, weight, antiquant_scale, antiquant_offset, group_size, algorithm, template)
        if reason is None and group_size & (group_size - 1):
            reason = f"group_size {group_size}: the Triton kernels take power-of-two group sizes only"
        return reason

    def workspace_nbytes(self, m: int, k: int, n: int, group_size: int, template: str, prepacked: bool,
                         algorithm: str = MSD) -> int:
        return _workspace_layout(m, k, n, group_size, template)[1]

    def _compute(self, x, weight, antiquant_scale, antiquant_offset, group_size, algorithm, template, workspace,
                 out, prepacked) -> None:
        m, k = x.shape
        n = out.shape[1]
        groups = k // group_size
        offsets, _ = _workspace_layout(m, k, n, group_size, template)
        views = {name: workspace[start : start + size] for name, (start, size) in offsets.items()}
        a_planes = views["a_planes"].view(torch.int8)
        amax, y32 = views["a_max"].view(torch.float32), views["y32"].view(torch.float32)
        yint = views["y_int"].view(torch.int32) if template == "basic" else y32
        offset = antiquant_offset if antiquant_offset is not None else antiquant_scale
        fusion = dict(enable_fp_fusion=False)
        _preprocess_kernel[(m, groups)](x, a_planes, amax, m, k, G=group_size, F1=reference.F1, F2=reference.F2,
                                        **fusion)
        tile_m, tile_n = TILE_M, TILE_N
        if os.environ.get("TRITON_INTERPRET") == "1":
            tile_m, tile_n = min(TILE_M, triton.next_power_of_2(m)), INTERPRETER_TILE_N
        grid = (triton.cdiv(m, tile_m), triton.cdiv(n, tile_n))
        args = (a_planes, amax, weight, antiquant_scale, offset, y32, yint, m, n, k, *_R)
        meta = dict(G=group_size, BM=tile_m, BN=tile_n, HAS_OFFSET=antiquant_offset is not None)
        _matmul_kernel[grid](*args, STORE_YINT=template == "basic", **meta, **fusion)
        if template == "basic":
            _post_kernel[grid](a_planes, amax, antiquant_scale, offset, y32, yint, m, n, k, *_R, **meta, **fusion)
        out.copy_(y32.view(m, n))


MATMUL = WeightQuantBatchMatmul()
