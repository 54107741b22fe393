"""MSD A16W4 matmul (lowbit.formats.wqbmm) in Triton: int8 ``tl.dot`` per K-group, float32 post-process.

Kernels (CUDA tensors; CPU tensors under TRITON_INTERPRET=1, how the tests run them):

* ``_preprocess_kernel``, one program per (row, group): a_max and the MSD components A1..A3 (int8 planes
  (3, M, K) in the workspace); a_max is NaN for a group holding a NaN or an infinity, 0 for a zero group.
* ``_matmul_kernel``, one program per (BLOCK_M rows, BLOCK_N columns), loops over the groups: unpacks
  the (G, BLOCK_N/2) nibbles to int8 W, ``Yi = tl.dot(Ai, W)`` (int32, exact), then either post-processes
  at once (``preload``) or stores Y_int (3, M, K/G, N) to the workspace (``basic``, followed by
  ``_post_kernel``).

Bit-exactness: divisions use ``div_rn``, rounding is an explicit half-to-even, and kernels are launched with
``enable_fp_fusion=False`` so that ``a * b + c`` is never contracted into an FMA; the post-process keeps the
reference's order. NaN outputs are canonicalized like the reference.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl

# Tile per program: (16, 64) on a GPU (tl.dot needs 16 rows there). The interpreter (TRITON_INTERPRET=1)
# runs each program in Python with numpy's (BLAS-less) integer matmul, so it gets row tiles no taller than
# the problem and wide column tiles. The numbers do not depend on the tiling.
BLOCK_M, BLOCK_N = 16, 64
INTERPRETER_BLOCK_N = 1024
_F1, _F2 = 7.49, 14.98
# float32 reciprocals as the reference computes them (Python would fold 7.49 * 14.98 in float64)
_R = tuple(float(np.float32(1) / v) for v in (np.float32(_F1), np.float32(_F1) * np.float32(_F2),
                                                np.float32(_F1) * np.float32(_F2) * np.float32(_F2)))


def workspace_nbytes(m: int, k: int, n: int, group_size: int, template: str, prepacked: bool = False) -> int:
    """Bytes of scratch :func:`wqbmm_into` needs (``prepacked`` changes nothing: see :func:`pack_weight`)."""
    groups = k // group_size
    nbytes = 3 * m * k + 4 * m * groups + 4 * m * n + 64 * 3
    if template == "basic":
        nbytes += 4 * 3 * m * groups * n
    return nbytes


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
    F1: tl.constexpr, F2: tl.constexpr,  # 7.49, 14.98
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


def pack_weight(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """The kernels read the (K, N/2) uint8 weight as it is: its packed form is a contiguous copy (a snapshot)."""
    return weight.clone(memory_format=torch.contiguous_format)


def wqbmm_into(
    x: torch.Tensor,
    weight: torch.Tensor,
    antiquant_scale: torch.Tensor,
    antiquant_offset: torch.Tensor | None,
    group_size: int,
    template: str,
    workspace: torch.Tensor,
    out: torch.Tensor,
    prepacked: bool = False,
) -> None:
    """MSD matmul into ``out`` (M, N) x's dtype; x (M, K) contiguous, weight (K, N/2) uint8 (read on every
    call, never cached; ``prepacked`` only says it comes from :func:`pack_weight`), scale/offset
    (K/G, N) contiguous in x's dtype, ``workspace`` uint8 with :func:`workspace_nbytes` bytes. Group size
    must be a power of two (32..256 in practice). Validated by lowbit.ops.wqbmm."""
    if group_size & (group_size - 1):
        raise ValueError(f"the Triton kernels need a power-of-two group_size, got {group_size}")
    m, k = x.shape
    n = out.shape[1]
    groups = k // group_size
    sizes = [3 * m * k, 4 * m * groups, 4 * m * n, 4 * 3 * m * groups * n if template == "basic" else 0]
    views, start = [], 0
    for size in sizes:
        views.append(workspace[start : start + size])
        start += -(-size // 64) * 64
    a_planes = views[0].view(torch.int8)
    amax, y32 = views[1].view(torch.float32), views[2].view(torch.float32)
    yint = views[3].view(torch.int32) if template == "basic" else y32
    weight = weight.contiguous()
    offset = antiquant_offset if antiquant_offset is not None else antiquant_scale
    fusion = dict(enable_fp_fusion=False)
    _preprocess_kernel[(m, groups)](x, a_planes, amax, m, k, G=group_size, F1=_F1, F2=_F2, **fusion)
    block_m, block_n = BLOCK_M, BLOCK_N
    if os.environ.get("TRITON_INTERPRET") == "1":
        block_m, block_n = min(BLOCK_M, triton.next_power_of_2(m)), INTERPRETER_BLOCK_N
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    args = (a_planes, amax, weight, antiquant_scale, offset, y32, yint, m, n, k, *_R)
    meta = dict(G=group_size, BM=block_m, BN=block_n, HAS_OFFSET=antiquant_offset is not None)
    _matmul_kernel[grid](*args, STORE_YINT=template == "basic", **meta, **fusion)
    if template == "basic":
        _post_kernel[grid](a_planes, amax, antiquant_scale, offset, y32, yint, m, n, k, *_R, **meta, **fusion)
    out.copy_(y32.view(m, n))
