"""A16W4 per-group weight-quant matmul: ``weight_quant_batch_matmul`` and its two-stage plan API.

``y = x @ ((W + antiquant_offset) * antiquant_scale)`` with x (..., K) FP16/BF16, weight (K, N/2) uint8
(packed int4, formats/int4.py layout), antiquant_scale and the optional antiquant_offset (K/G, N) in x's
dtype; y (..., N) in x's dtype on x's device. Numerics: lowbit.formats.wqbmm (``algorithm="msd"``: the
Ascend MSD decomposition, bit-exact on every backend; ``"dequant"``: dequantize then a float32 matmul,
reference implementation only). ``template`` ("basic" staged, "preload" fused) selects the MSD pipeline;
both give the same bits.

Registered as ``torch.ops.lowbit.weight_quant_batch_matmul`` (and ``..._out``) with fake
implementations. Errors: DtypeError / ShapeError / DeviceError (lowbit.errors), ValueError for an unknown
algorithm or template, BackendUnavailable for a backend that cannot run here.

Two-stage call (aclnn style): :func:`plan_weight_quant_batch_matmul` fixes the sizes and returns a
:class:`WqbmmPlan` with ``workspace_nbytes``; ``plan.run(..., out=, workspace=)`` with a reused output
and workspace allocates nothing. Nothing is cached behind the caller's back: a raw weight is repacked
on every call (into the workspace); ``plan.pack_weight(weight)`` returns an explicit :class:`PackedWeight`
snapshot that later runs use without repacking.

``lowbit.last_backend("weight_quant_batch_matmul")`` names the backend of the last execution by any path
(one-shot "msd" or "dequant", ``plan.run``). "dequant" also records under
"weight_quant_batch_matmul_dequant", its own dispatcher (shown by ``lowbit info``: reference only).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from lowbit import backends
from lowbit.errors import DeviceError, DtypeError, ShapeError
from lowbit.formats import wqbmm as reference

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16)
ALGORITHMS = ("msd", "dequant")
TEMPLATES = ("basic", "preload")
_OP = "weight_quant_batch_matmul"
WORKSPACE_ALIGNMENT = 64  # bytes; torch's allocators (and new_workspace) align at least this much


# ---- backends ------------------------------------------------------------------------------------------


def _reference_into(x, weight, scale, offset, group_size, template, workspace, out, prepacked=False) -> None:
    out.copy_(reference.wqbmm_msd(x, weight, scale, offset, group_size))


def _reference_dequant_into(x, weight, scale, offset, group_size, template, workspace, out, prepacked=False) -> None:
    out.copy_(reference.wqbmm_dequant(x, weight, scale, offset, group_size))


def _reference_pack(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """The reference reads the (K, N/2) weight as it is: its packed form is a contiguous copy."""
    return weight.clone(memory_format=torch.contiguous_format)


def _self_check(native_into: Callable, device: torch.device) -> None:
    """Both templates equal the reference bit for bit on a small probe, with and without an offset."""
    gen = torch.Generator().manual_seed(0)
    m, k, n, g = 3, 256, 160, 64
    for dtype in ACTIVATION_DTYPES:
        x = (torch.rand(m, k, generator=gen) * 6 - 3).to(dtype)
        weight = torch.randint(0, 256, (k, n // 2), generator=gen, dtype=torch.uint8)
        scale = (torch.rand(k // g, n, generator=gen) * 2 - 1).to(dtype)
        offset = torch.randint(-4, 5, (k // g, n), generator=gen).to(dtype)
        for off in (None, offset):
            expected = reference.wqbmm_msd(x, weight, scale, off, g)
            for template in TEMPLATES:
                out = torch.empty(m, n, dtype=dtype, device=device)
                workspace = _new_workspace(_workspace_nbytes(native_into, m, k, n, g, template), device)
                dev = [t.to(device) if t is not None else None for t in (x, weight, scale, off)]
                native_into(dev[0], dev[1], dev[2], dev[3], g, template, workspace, out)
                if not torch.equal(out.cpu().view(torch.int16), expected.view(torch.int16)):
                    raise RuntimeError(f"native {_OP} ({template}, {dtype}) differs from the reference on {device}")


DISPATCHER = backends.register(
    backends.Dispatcher(
        op=_OP,
        reference=_reference_into,
        native={
            "cpu": "lowbit.kernels.cpu.wqbmm:wqbmm_into",
            "cuda": "lowbit.kernels.triton.wqbmm:wqbmm_into",
        },
        self_check=_self_check,
    )
)
# "dequant" has only the reference implementation: no native kernels, so "auto" picks the reference.
DEQUANT_DISPATCHER = backends.register(
    backends.Dispatcher(
        op=_OP + "_dequant", reference=_reference_dequant_into, native={}, self_check=lambda fn, device: None
    )
)


def _is_reference(fn: Callable) -> bool:
    return fn in (_reference_into, _reference_dequant_into)


def _workspace_nbytes(
    fn: Callable, m: int, k: int, n: int, group_size: int, template: str, prepacked: bool = False
) -> int:
    """Workspace bytes of a backend's ``*_into``: its module's ``workspace_nbytes`` (reference: 0)."""
    if _is_reference(fn):
        return 0
    return importlib.import_module(fn.__module__).workspace_nbytes(m, k, n, group_size, template, prepacked)


def _pack_fn(fn: Callable) -> Callable:
    """``pack(weight, group_size) -> tensor`` in the layout the backend's ``*_into`` reads with prepacked."""
    return _reference_pack if _is_reference(fn) else importlib.import_module(fn.__module__).pack_weight


def _new_workspace(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


# ---- validation ----------------------------------------------------------------------------------------


def _check_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    offset: Optional[torch.Tensor],
    group_size: int,
    algorithm: str,
    template: str,
) -> tuple[int, int, int]:
    """Validate the operands; return (M, K, N) with M the product of x's leading dimensions."""
    if weight.dtype != torch.uint8:
        raise DtypeError(f"{_OP}: weight must be uint8 (two int4 per byte), got {weight.dtype}")
    if weight.device != x.device:
        raise DeviceError(f"{_OP}: weight is on {weight.device} but x is on {x.device}")
    if weight.dim() != 2:
        raise ShapeError(f"{_OP}: weight must be (K, N/2), got shape {tuple(weight.shape)}")
    return _check_operands(x, tuple(weight.shape), scale, offset, group_size, algorithm, template)


def _check_operands(
    x: torch.Tensor,
    weight_shape: tuple[int, int],
    scale: torch.Tensor,
    offset: Optional[torch.Tensor],
    group_size: int,
    algorithm: str,
    template: str,
) -> tuple[int, int, int]:
    """:func:`_check_args` given the (K, N/2) shape of a weight already checked for dtype and device."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{_OP}: algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if template not in TEMPLATES:
        raise ValueError(f"{_OP}: template must be one of {TEMPLATES}, got {template!r}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise DtypeError(f"{_OP}: x must be float16 or bfloat16, got {x.dtype}")
    for name, t in (("antiquant_scale", scale), ("antiquant_offset", offset)):
        if t is not None and t.dtype != x.dtype:
            raise DtypeError(f"{_OP}: {name} must have x's dtype {x.dtype}, got {t.dtype}")
    for name, t in (("antiquant_scale", scale), ("antiquant_offset", offset)):
        if t is not None and t.device != x.device:
            raise DeviceError(f"{_OP}: {name} is on {t.device} but x is on {x.device}")
    if x.dim() < 1:
        raise ShapeError(f"{_OP}: x must be (..., K), got a 0-d tensor")
    k, n = weight_shape[0], 2 * weight_shape[1]
    if x.shape[-1] != k:
        raise ShapeError(f"{_OP}: x has K = {x.shape[-1]} (shape {tuple(x.shape)}) but weight has K = {k}")
    if k == 0 or n == 0:
        raise ShapeError(f"{_OP}: K and N must be positive, got weight shape {weight_shape}")
    if group_size <= 0 or group_size % 32 or k % group_size:
        raise ShapeError(f"{_OP}: group_size must be a positive multiple of 32 dividing K = {k}, got {group_size}")
    expected = (k // group_size, n)
    for name, t in (("antiquant_scale", scale), ("antiquant_offset", offset)):
        if t is not None and tuple(t.shape) != expected:
            raise ShapeError(f"{_OP}: {name} must have shape (K/G, N) = {expected}, got {tuple(t.shape)}")
    return math.prod(x.shape[:-1]), k, n


def _check_out(out: torch.Tensor, x: torch.Tensor, n: int) -> None:
    shape = (*x.shape[:-1], n)
    if out.dtype != x.dtype:
        raise DtypeError(f"{_OP}: out must have dtype {x.dtype}, got {out.dtype}")
    if tuple(out.shape) != shape:
        raise ShapeError(f"{_OP}: out must have shape {shape}, got {tuple(out.shape)}")
    if out.device != x.device:
        raise DeviceError(f"{_OP}: out is on {out.device} but x is on {x.device}")


# ---- execution -----------------------------------------------------------------------------------------


def _execute(fn, x, weight, scale, offset, group_size, template, workspace, out, prepacked=False) -> None:
    """Run ``fn`` (a backend's ``*_into``) on the flattened operands, writing into ``out`` (..., N).
    ``prepacked``: ``weight`` is the backend's packed layout (``_pack_fn``), not the raw weight."""
    m, k, n = x.numel() // x.shape[-1], x.shape[-1], out.shape[-1]
    if m == 0:
        return
    x2d = x.reshape(m, k).contiguous()
    out2d = out.view(m, n) if out.is_contiguous() else torch.empty(m, n, dtype=out.dtype, device=out.device)
    offset = None if offset is None else offset.contiguous()
    fn(x2d, weight, scale.contiguous(), offset, group_size, template, workspace, out2d, prepacked)
    if out2d.data_ptr() != out.data_ptr():
        out.copy_(out2d.view(out.shape))


def _select(device: torch.device, algorithm: str, backend: Optional[str]) -> tuple[str, Callable]:
    """(backend name that runs, its ``*_into`` function) for this device and algorithm."""
    dispatcher = DISPATCHER if algorithm == "msd" else DEQUANT_DISPATCHER
    name = dispatcher.resolve(device, backend)
    return name, dispatcher.select(device, name)


def _run_op(x, weight, scale, offset, group_size, algorithm, template, backend, out) -> None:
    m, k, n = _check_args(x, weight, scale, offset, group_size, algorithm, template)
    name, fn = _select(x.device, algorithm, backend)
    if algorithm != "msd":
        DISPATCHER.record(name)
    workspace = _new_workspace(_workspace_nbytes(fn, m, k, n, group_size, template), x.device)
    _execute(fn, x, weight, scale, offset, group_size, template, workspace, out)


@torch.library.custom_op("lowbit::weight_quant_batch_matmul", mutates_args=())
def _wqbmm_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    antiquant_scale: torch.Tensor,
    antiquant_offset: Optional[torch.Tensor] = None,
    group_size: int = 128,
    algorithm: str = "msd",
    template: str = "preload",
    backend: Optional[str] = None,
) -> torch.Tensor:
    _, _, n = _check_args(x, weight, antiquant_scale, antiquant_offset, group_size, algorithm, template)
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    _run_op(x, weight, antiquant_scale, antiquant_offset, group_size, algorithm, template, backend, out)
    return out


@_wqbmm_op.register_fake
def _(
    x, weight, antiquant_scale, antiquant_offset=None, group_size=128, algorithm="msd", template="preload", backend=None
):
    _, _, n = _check_args(x, weight, antiquant_scale, antiquant_offset, group_size, algorithm, template)
    return x.new_empty(*x.shape[:-1], n)


@torch.library.custom_op("lowbit::weight_quant_batch_matmul_out", mutates_args=("out",))
def _wqbmm_out_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    antiquant_scale: torch.Tensor,
    out: torch.Tensor,
    antiquant_offset: Optional[torch.Tensor] = None,
    group_size: int = 128,
    algorithm: str = "msd",
    template: str = "preload",
    backend: Optional[str] = None,
) -> None:
    _, _, n = _check_args(x, weight, antiquant_scale, antiquant_offset, group_size, algorithm, template)
    _check_out(out, x, n)
    _run_op(x, weight, antiquant_scale, antiquant_offset, group_size, algorithm, template, backend, out)


@_wqbmm_out_op.register_fake
def _(
    x, weight, antiquant_scale, out, antiquant_offset=None, group_size=128, algorithm="msd", template="preload",
    backend=None,
):
    _, _, n = _check_args(x, weight, antiquant_scale, antiquant_offset, group_size, algorithm, template)
    _check_out(out, x, n)


def weight_quant_batch_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    antiquant_scale: torch.Tensor,
    *,
    antiquant_offset: Optional[torch.Tensor] = None,
    group_size: int = 128,
    algorithm: str = "msd",
    template: str = "preload",
    backend: Optional[str] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``x @ ((W + antiquant_offset) * antiquant_scale)`` with int4 W, per K-group scales.

    x (..., K) FP16/BF16; weight (K, N/2) uint8 packed int4 (column 2j in the low nibble of byte j);
    antiquant_scale, antiquant_offset (K/G, N) in x's dtype; group_size G a multiple of 32 dividing K.
    Returns (..., N) in x's dtype on x's device (written into ``out`` when given). ``algorithm``: "msd"
    (bit-exact Ascend MSD numerics) or "dequant"; ``template``: "basic" or "preload" (same bits);
    ``backend``: "native", "reference" or "auto".
    """
    if out is None:
        return torch.ops.lowbit.weight_quant_batch_matmul(
            x, weight, antiquant_scale, antiquant_offset, group_size, algorithm, template, backend
        )
    torch.ops.lowbit.weight_quant_batch_matmul_out(
        x, weight, antiquant_scale, out, antiquant_offset, group_size, algorithm, template, backend
    )
    return out


# ---- two-stage API -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackedWeight:
    """A weight in a plan backend's kernel layout, from :meth:`WqbmmPlan.pack_weight` (like torch's
    ``_convert_weight_to_int4pack``).

    A snapshot: later changes to the source weight are not seen (pack again after changing it). Costs
    one more copy of the packed weight (CPU native: K * ceil(N / 32) * 16 bytes; reference, CUDA: K * N / 2).
    ``data``: the kernel layout; ``shape``: the source (K, N/2); ``group_size``, ``device``, ``backend``:
    of the plan that packed it (a plan only runs its own backend's, group size's and device's packing).
    """

    data: torch.Tensor
    shape: tuple[int, int]
    group_size: int
    device: torch.device
    backend: str


@dataclass(frozen=True)
class WqbmmPlan:
    """Sizes, algorithm, template and backend fixed once (the aclnn "GetWorkspaceSize" stage).

    ``workspace_nbytes``: bytes of the uint8 workspace :meth:`run` needs on ``device`` (0: none).
    ``prepacked``: runs take a :class:`PackedWeight` (the workspace then has no room to repack a raw weight).
    """

    m: int
    k: int
    n: int
    group_size: int
    algorithm: str
    template: str
    device: torch.device
    dtype: torch.dtype
    backend: str
    workspace_nbytes: int
    prepacked: bool
    _fn: Callable

    def new_workspace(self) -> torch.Tensor:
        """A workspace for :meth:`run` (uint8, ``workspace_nbytes`` bytes on the plan's device)."""
        return _new_workspace(self.workspace_nbytes, self.device)

    def pack_weight(self, weight: torch.Tensor) -> PackedWeight:
        """The (K, N/2) uint8 weight on the plan's device in this plan's kernel layout: a snapshot copy
        (see :class:`PackedWeight`). DtypeError / DeviceError / ShapeError for another weight."""
        expected = (self.k, self.n // 2)
        if weight.dtype != torch.uint8:
            raise DtypeError(f"{_OP}: weight must be uint8 (two int4 per byte), got {weight.dtype}")
        if weight.device != self.device:
            raise DeviceError(f"{_OP}: weight is on {weight.device} but the plan is for {self.device}")
        if tuple(weight.shape) != expected:
            raise ShapeError(
                f"{_OP}: the plan needs a weight of shape (K, N/2) = {expected}, got {tuple(weight.shape)}"
            )
        data = _pack_fn(self._fn)(weight, self.group_size)
        return PackedWeight(data, expected, self.group_size, self.device, self.backend)

    def _check_packed(self, packed: PackedWeight) -> None:
        if packed.device != self.device:
            raise DeviceError(f"{_OP}: the weight was packed on {packed.device} but the plan is for {self.device}")
        if packed.shape != (self.k, self.n // 2):
            raise ShapeError(f"{_OP}: the plan needs a weight of shape {(self.k, self.n // 2)}, packed {packed.shape}")
        if (packed.backend, packed.group_size) != (self.backend, self.group_size):
            raise ValueError(
                f"{_OP}: the weight was packed for backend {packed.backend!r}, group_size {packed.group_size}; "
                f"the plan runs backend {self.backend!r}, group_size {self.group_size}: use this plan's pack_weight"
            )

    def _check_workspace(self, workspace: torch.Tensor) -> None:
        if workspace.dtype != torch.uint8:
            raise DtypeError(f"{_OP}: workspace must be uint8, got {workspace.dtype}")
        if workspace.device != self.device:
            raise DeviceError(f"{_OP}: workspace is on {workspace.device} but the plan is for {self.device}")
        if workspace.dim() != 1 or not workspace.is_contiguous():
            raise ShapeError(f"{_OP}: workspace must be a contiguous 1-D tensor, got shape {tuple(workspace.shape)}")
        if workspace.numel() < self.workspace_nbytes:
            raise ShapeError(f"{_OP}: workspace has {workspace.numel()} bytes, the plan needs {self.workspace_nbytes}")
        if self.workspace_nbytes and workspace.data_ptr() % WORKSPACE_ALIGNMENT:
            raise ShapeError(
                f"{_OP}: workspace must start at a {WORKSPACE_ALIGNMENT}-byte aligned address, got one "
                f"{workspace.data_ptr() % WORKSPACE_ALIGNMENT} bytes past it "
                f"(storage offset {workspace.storage_offset()})"
            )

    def _check_x(self, x: torch.Tensor) -> None:
        if x.dtype != self.dtype:
            raise DtypeError(f"{_OP}: the plan is for x of dtype {self.dtype}, got {x.dtype}")
        if x.device != self.device:
            raise DeviceError(f"{_OP}: the plan is for {self.device}, got x on {x.device}")

    def run(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | PackedWeight,
        antiquant_scale: torch.Tensor,
        antiquant_offset: Optional[torch.Tensor] = None,
        *,
        out: Optional[torch.Tensor] = None,
        workspace: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Execute the plan (the aclnn "Execute" stage); x must be (..., K) with M rows, of the plan's
        dtype and device. ``weight``: the raw (K, N/2) uint8 weight (its current values, repacked into the
        workspace on every call; not with a ``prepacked`` plan) or this plan's :class:`PackedWeight` (no
        repack). ``out`` / ``workspace``: reused tensors (allocated when None)."""
        packed = isinstance(weight, PackedWeight)
        if packed:
            self._check_packed(weight)
        elif self.prepacked:
            raise ValueError(f"{_OP}: this plan was made with prepacked=True: pass plan.pack_weight(weight)")
        self._check_x(x)
        args = (antiquant_scale, antiquant_offset, self.group_size, self.algorithm, self.template)
        m, k, n = _check_operands(x, weight.shape, *args) if packed else _check_args(x, weight, *args)
        if (m, k, n) != (self.m, self.k, self.n):
            raise ShapeError(f"{_OP}: the plan is for (M, K, N) = {(self.m, self.k, self.n)}, got {(m, k, n)}")
        if out is None:
            out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
        _check_out(out, x, n)
        if workspace is None:
            workspace = self.new_workspace()
        self._check_workspace(workspace)
        data = weight.data if packed else weight
        _execute(
            self._fn, x, data, antiquant_scale, antiquant_offset, self.group_size, self.template, workspace, out,
            prepacked=packed,
        )
        DISPATCHER.record(self.backend)
        return out


def plan_weight_quant_batch_matmul(
    m: int,
    k: int,
    n: int,
    *,
    group_size: int = 128,
    algorithm: str = "msd",
    template: str = "preload",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float16,
    backend: Optional[str] = None,
    prepacked: bool = False,
) -> WqbmmPlan:
    """Plan an (M, K) x (K, N) weight-quant matmul; see :class:`WqbmmPlan`. Validates like the op.

    ``device`` is normalized ("cpu:0" -> "cpu", "cuda" -> "cuda:<current>"). ``prepacked=True``: runs
    take ``plan.pack_weight(weight)`` only, and the workspace leaves out the room to repack a raw weight.
    """
    device = backends.canonical_device(device)
    if min(m, k, n) < 0:
        raise ShapeError(f"{_OP}: sizes must be non-negative, got (M, K, N) = {(m, k, n)}")
    if n % 2:
        raise ShapeError(f"{_OP}: N must be even (two int4 per byte), got N = {n}")
    meta = torch.empty(0, device="meta")
    _check_args(
        meta.new_empty(m, k, dtype=dtype),
        meta.new_empty(k, n // 2, dtype=torch.uint8),
        meta.new_empty(k // group_size if group_size > 0 else 0, n, dtype=dtype),
        None,
        group_size,
        algorithm,
        template,
    )
    name, fn = _select(device, algorithm, backend)
    nbytes = _workspace_nbytes(fn, m, k, n, group_size, template, prepacked)
    return WqbmmPlan(m, k, n, group_size, algorithm, template, device, dtype, name, nbytes, prepacked, fn)
