"""A16W4 per-group weight-quant matmul: ``weight_quant_batch_matmul`` and its two-stage plan API
(docs/wqbmm.md).

``y = x @ ((W + antiquant_offset) * antiquant_scale)`` with x (..., K) FP16/BF16, weight (K, N/2) uint8
(packed int4, docs/wqbmm.md, section 'Int4 layout'), antiquant_scale and the optional antiquant_offset
(K/G, N) in x's dtype; y (..., N) in x's dtype on x's device.

One operator, :data:`MATMUL`, with an ``algorithm`` argument: ``"msd"`` (the Ascend MSD decomposition,
bit-exact on every backend) or ``"dequant"`` (dequantize, then a float32 sum: in ascending k in the
reference; the CPU kernel decodes the weight tile by tile and lets torch's GEMM sum, within the summation
interval of docs/wqbmm.md, 'Dequant numerics', for a raw weight only). The Triton kernel declines "dequant",
so ``auto`` runs it on the reference there and ``native`` raises BackendUnavailable. ``template`` ("basic" staged, "preload" fused) selects the MSD
pipeline; both give the same bits.

Registered as ``torch.ops.lowbit.weight_quant_batch_matmul`` and ``..._out`` (see lowbit.ops.library).
Errors: DtypeError / ShapeError / DeviceError (lowbit.errors), ValueError for an unknown algorithm or
template, TypeError for a non-int size, BackendUnavailable for a backend that cannot run here.

Two-stage call (aclnn style): :func:`plan_weight_quant_batch_matmul` fixes the sizes and the kernel and
returns a :class:`WqbmmPlan` with ``workspace_nbytes``; ``plan.run(..., out=, workspace=)`` with a reused
output and workspace allocates nothing. A raw weight's current values are used on every call (the CPU kernel
reads it directly for ``preload`` at M <= 16 and repacks it into the workspace otherwise);
``plan.pack_weight(weight)`` returns an explicit :class:`PackedWeight` snapshot that later runs use as it is.
Every path runs through ``MATMUL`` (validation, kernel selection, ``last_backend`` after execution), and
the kernel's ``run`` checks a packed weight and a workspace against its own needs before any kernel code
(lowbit.kernels.wqbmm_kernel). A plan's decode step of few rows with a PackedWeight on the CPU kernel runs
its one-call decode after the same checks (``WqbmmPlan._decoded``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from lowbit import backends, kernels
from lowbit.backends import TensorSpec
from lowbit.errors import DeviceError, DtypeError, ShapeError, check_int
from lowbit.formats import wqbmm as reference
from lowbit.kernels.wqbmm_kernel import MSD, WqbmmKernel
from lowbit.ops.library import RecordedCall, call, check_argument_types, define

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16)
ALGORITHMS = (MSD, "dequant")
TEMPLATES = ("basic", "preload")
_OP = "weight_quant_batch_matmul"


# ---- contract --------------------------------------------------------------------------------------------


def _outputs(
    x: torch.Tensor,
    weight: torch.Tensor,
    antiquant_scale: torch.Tensor,
    antiquant_offset: Optional[torch.Tensor],
    group_size: int,
    algorithm: str,
    template: str,
    workspace: Optional[torch.Tensor] = None,
    prepacked: bool = False,
) -> tuple[TensorSpec]:
    """Validate the operands; the output is (..., N) in x's dtype. K is x's last dimension, N the scale's
    second; a raw weight must be (K, N/2), a ``prepacked`` one is checked by the kernel that reads it."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{_OP}: algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if template not in TEMPLATES:
        raise ValueError(f"{_OP}: template must be one of {TEMPLATES}, got {template!r}")
    check_int("group_size", group_size)
    if x.dtype not in ACTIVATION_DTYPES:
        raise DtypeError(f"{_OP}: x must be float16 or bfloat16, got {x.dtype}")
    if weight.dtype != torch.uint8:
        raise DtypeError(f"{_OP}: weight must be uint8 (two int4 per byte), got {weight.dtype}")
    for name, t in (("antiquant_scale", antiquant_scale), ("antiquant_offset", antiquant_offset)):
        if t is not None and t.dtype != x.dtype:
            raise DtypeError(f"{_OP}: {name} must have x's dtype {x.dtype}, got {t.dtype}")
    for name, t in (("weight", weight), ("antiquant_scale", antiquant_scale), ("antiquant_offset", antiquant_offset),
                    ("workspace", workspace)):
        if t is not None and t.device != x.device:
            raise DeviceError(f"{_OP}: {name} is on {t.device} but x is on {x.device}")
    if x.dim() < 1:
        raise ShapeError(f"{_OP}: x must be (..., K), got a 0-d tensor")
    if antiquant_scale.dim() != 2:
        raise ShapeError(f"{_OP}: antiquant_scale must be (K/G, N), got shape {tuple(antiquant_scale.shape)}")
    k, n = x.shape[-1], antiquant_scale.shape[1]
    if not prepacked and (weight.dim() != 2 or weight.shape[0] != k):
        raise ShapeError(f"{_OP}: weight must be (K, N/2) with x's K = {k}, got shape {tuple(weight.shape)}")
    if not prepacked:
        n = 2 * weight.shape[1]
    if k == 0 or n == 0:
        raise ShapeError(f"{_OP}: K and N must be positive, got K = {k}, N = {n}")
    if group_size <= 0 or group_size % 32 or k % group_size:
        raise ShapeError(f"{_OP}: group_size must be a positive multiple of 32 dividing K = {k}, got {group_size}")
    expected = (k // group_size, n)
    for name, t in (("antiquant_scale", antiquant_scale), ("antiquant_offset", antiquant_offset)):
        if t is not None and tuple(t.shape) != expected:
            raise ShapeError(f"{_OP}: {name} must have shape (K/G, N) = {expected}, got {tuple(t.shape)}")
    return (TensorSpec((*x.shape[:-1], n), x.dtype),)


class _Reference(WqbmmKernel):
    """lowbit.formats.wqbmm on any device: both algorithms; no workspace; the packed weight is a copy of
    the raw one (the base class's layout)."""

    name = f"{_OP} (reference)"

    def supports(self, *args) -> None:
        return None

    def workspace_nbytes(self, m: int, k: int, n: int, group_size: int, template: str, prepacked: bool,
                         algorithm: str = MSD) -> int:
        return 0

    def _compute(self, x, weight, antiquant_scale, antiquant_offset, group_size, algorithm, template, workspace,
                 out, prepacked) -> None:
        compute = reference.wqbmm_msd if algorithm == MSD else reference.wqbmm_dequant
        out.copy_(compute(x, weight, antiquant_scale, antiquant_offset, group_size))


def _probes():
    """Small MSD problems covering the kernels' edge shapes: every group size 32..160 (96 and 160 are not
    powers of two), odd M and M past a multiple of four (the CPU kernel takes rows by fours), N not a
    multiple of 32 (padded column tiles), both templates, FP16 and BF16, with and without an offset, and
    special activations (NaN, Inf, zero group, extremes) and scales. M = 17 is past the CPU kernel's
    raw-weight path (preload reads a raw weight as it is up to M = 16 and repacks it above;
    docs/wqbmm.md, section 'Raw-weight path')."""
    gen = torch.Generator().manual_seed(0)
    cases = [(1, 32, 34), (3, 64, 70), (5, 96, 100), (7, 128, 2), (4, 160, 64), (17, 32, 66)]  # (M, G, N)
    probes = []
    for i, (m, g, n) in enumerate(cases):
        dtype = ACTIVATION_DTYPES[i % 2]
        k = 2 * g
        x = ((torch.rand(m, k, generator=gen) * 2 - 1) * 10 ** (torch.rand(m, 1, generator=gen) * 4 - 2)).to(dtype)
        weight = torch.randint(0, 256, (k, n // 2), generator=gen, dtype=torch.uint8)
        scale = ((torch.rand(k // g, n, generator=gen) * 2 - 1) * 4).to(dtype)
        offset = torch.randint(-8, 8, (k // g, n), generator=gen).to(dtype) if i % 2 == 0 else None
        if m > 1:
            x[m - 1, :g] = 0  # a zero group
            x[m - 2, g + 1] = (float("nan"), float("inf"))[i % 2]
            x[0, g - 1] = torch.finfo(dtype).max
        scale[0, n - 1] = -torch.finfo(dtype).max
        probes += [(x, weight, scale, offset, g, MSD, template) for template in TEMPLATES]
    return probes


MATMUL = define(_OP, "Tensor x, Tensor weight, Tensor antiquant_scale, Tensor? antiquant_offset=None, "
                     "int group_size=128, str algorithm='msd', str template='preload'",
                _outputs, _Reference(), _probes, kernels.native("wqbmm", "MATMUL", ("cpu", "cuda")),
                scratch=(7,))  # the workspace (plan.run), checked by the kernel


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
    Returns (..., N) in x's dtype on x's device (written into ``out`` when given: any strides, may overlap
    the inputs). ``algorithm``: "msd" (bit-exact Ascend MSD numerics) or "dequant" (the dequantized weight times x;
    CPU native: torch's GEMM on decoded tiles, a raw weight only);
    ``template``: "basic" or "preload" (same bits); ``backend``: "native", "reference" or "auto".
    """
    check_int("group_size", group_size)
    args = (x, weight, antiquant_scale, antiquant_offset, group_size, algorithm, template)
    return call(MATMUL, args, out, backend)


# ---- two-stage API -------------------------------------------------------------------------------------


# Each pack_weight result's data -> (shape, group_size, backend) as packed: a PackedWeight whose fields were
# changed afterwards (dataclasses.replace) is refused, not read in another layout of the same byte count.
_PACKED_AS = WeakIdKeyDictionary()


@dataclass(frozen=True)
class PackedWeight:
    """A weight in a plan kernel's layout, from :meth:`WqbmmPlan.pack_weight` (like torch's
    ``_convert_weight_to_int4pack``).

    A snapshot: later changes to the source weight are not seen (pack again after changing it). Costs
    one more copy of the packed weight (CPU native: K * ceil(N / 32) * 16 bytes; reference, CUDA: K * N / 2).
    ``data``: the kernel layout; ``shape``: the source (K, N/2); ``group_size``, ``device``, ``backend``:
    of the plan that packed it (a plan only runs its own backend's, group size's and device's packing).
    ``data`` itself is checked by the kernel on every run (dtype, device, shape, contiguity), and fields
    changed after pack_weight (dataclasses.replace) are refused, so an altered PackedWeight gives a clear error,
    never a wrong read; one made by hand (or loaded) is taken as its fields say.
    """

    data: torch.Tensor
    shape: tuple[int, int]
    group_size: int
    device: torch.device
    backend: str


@dataclass(frozen=True)
class WqbmmPlan:
    """Sizes, algorithm, template and kernel fixed once (the aclnn "GetWorkspaceSize" stage).

    ``backend``: "native" or "reference", chosen by ``MATMUL``'s selection for these sizes;
    ``workspace_nbytes``: bytes of the uint8 workspace :meth:`run` needs on ``device`` (0: none);
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
    kernel: WqbmmKernel = field(repr=False, compare=False)

    def new_workspace(self) -> torch.Tensor:
        """A workspace for :meth:`run` (uint8, ``workspace_nbytes`` bytes on the plan's device)."""
        return torch.empty(self.workspace_nbytes, dtype=torch.uint8, device=self.device)

    def pack_weight(self, weight: torch.Tensor) -> PackedWeight:
        """The (K, N/2) uint8 weight on the plan's device in this plan's kernel layout: a snapshot copy
        (see :class:`PackedWeight`). TypeError / DtypeError / DeviceError / ShapeError for another weight."""
        expected = (self.k, self.n // 2)
        self._check_on_plan("weight", weight, torch.uint8)
        if tuple(weight.shape) != expected:
            raise ShapeError(
                f"{_OP}: the plan needs a weight of shape (K, N/2) = {expected}, got {tuple(weight.shape)}"
            )
        data = self.kernel.pack_weight(weight.contiguous(), self.group_size)
        _PACKED_AS[data] = (expected, self.group_size, self.backend)
        return PackedWeight(data, expected, self.group_size, self.device, self.backend)

    def _check_on_plan(self, name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
        """TypeError / DtypeError / DeviceError unless ``t`` is a tensor of ``dtype`` on the plan's device."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_OP}: {name} must be a tensor, got {type(t).__name__}")
        if t.dtype != dtype:
            raise DtypeError(f"{_OP}: the plan is for {name} of dtype {dtype}, got {t.dtype}")
        if t.device != self.device:
            raise DeviceError(f"{_OP}: the plan is for {self.device}, got {name} on {t.device}")

    def _weight_data(self, weight: torch.Tensor | PackedWeight) -> torch.Tensor:
        """The tensor run passes to the kernel: a PackedWeight's data (labels checked here, the data by
        the kernel) or the raw weight (not with a prepacked plan)."""
        if not isinstance(weight, PackedWeight):
            if self.prepacked:
                raise ValueError(f"{_OP}: this plan was made with prepacked=True: pass plan.pack_weight(weight)")
            return weight
        packed_as = _PACKED_AS.get(weight.data) if isinstance(weight.data, torch.Tensor) else None
        if packed_as is not None and packed_as != (tuple(weight.shape), weight.group_size, weight.backend):
            raise ValueError(f"{_OP}: this PackedWeight's data was packed for shape {packed_as[0]}, group_size "
                             f"{packed_as[1]}, backend {packed_as[2]!r}, not as its fields say (changed after "
                             "pack_weight): pack the weight with the plan that runs it")
        if weight.device != self.device:
            raise DeviceError(f"{_OP}: the weight was packed on {weight.device} but the plan is for {self.device}")
        if tuple(weight.shape) != (self.k, self.n // 2):
            raise ShapeError(f"{_OP}: the plan needs a weight of shape {(self.k, self.n // 2)}, packed {weight.shape}")
        if (weight.backend, weight.group_size) != (self.backend, self.group_size):
            raise ValueError(
                f"{_OP}: the weight was packed for backend {weight.backend!r}, group_size {weight.group_size}; "
                f"the plan runs backend {self.backend!r}, group_size {self.group_size}: use this plan's pack_weight"
            )
        return weight.data

    def _bound_decode(self, weight: PackedWeight, antiquant_scale: torch.Tensor,
                      antiquant_offset: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None):
        """``f(x, m, out) -> bool``, the product of :meth:`run` with this PackedWeight, scale and offset, rounded
        to the plan's dtype, plus ``bias`` ((N,) of that dtype, or None) rounded again, as ``run(...) + bias``,
        in one numba call on x (..., K) with M = ``m`` rows (at most ``f.max_rows``) and out (..., N),
        C-contiguous CPU tensors of that dtype; False where a NaN came out; each call recorded as a run of the
        operator (``last_backend``). For lowbit.quantize's Int4Linear only, which checks x and makes the
        output: f does not check the tensors it is given. None where the plan's kernel has no such call (a prepacked MSD
        ``preload`` plan of the CPU native kernel has). It holds copies of the scale, offset and bias: bind
        again after they change. TypeError / DtypeError / DeviceError / ShapeError for operands not of this
        plan."""
        if not (self.algorithm == MSD and self.template == "preload"):
            return None
        return self._bind("bind_decode", weight, antiquant_scale, antiquant_offset, bias)

    def _bound_dequant(self, weight: PackedWeight, antiquant_scale: torch.Tensor,
                       antiquant_offset: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None):
        """:meth:`_bound_decode` for a prepacked "dequant" plan: ``f(x, m, out) -> True`` for x of any
        number of rows (``f.max_rows``), :meth:`run`'s bits plus ``bias`` as ``run(...) + bias``, the GEMM path's
        tile in the calling thread's scratch buffer; for Int4Linear's prefill only. None where the plan's kernel
        has no such call."""
        if self.algorithm == MSD:
            return None
        return self._bind("bind_dequant", weight, antiquant_scale, antiquant_offset, bias)

    def _bind(self, method: str, weight: PackedWeight, antiquant_scale: torch.Tensor,
              antiquant_offset: Optional[torch.Tensor], bias: Optional[torch.Tensor]):
        """The kernel's ``method`` (bind_decode, bind_dequant) on these operands, checked, recorded as runs of
        the operator; None for a plan that is not prepacked or a kernel without it."""
        bind = getattr(self.kernel, method, None)
        if bind is None or not self.prepacked:
            return None
        data = self._weight_data(weight)
        self.kernel._check_weight(data, self.device, self.kernel.packed_shape(self.k, self.n, self.group_size),
                                  "packed weight")
        for name, t, shape in (("antiquant_scale", antiquant_scale, (self.k // self.group_size, self.n)),
                               ("antiquant_offset", antiquant_offset, (self.k // self.group_size, self.n)),
                               ("bias", bias, (self.n,))):
            if t is not None:
                self._check_on_plan(name, t, self.dtype)
                if tuple(t.shape) != shape:
                    raise ShapeError(f"{_OP}: the plan needs {name} of shape {shape}, got {tuple(t.shape)}")
        return RecordedCall(bind(data, antiquant_scale, antiquant_offset, bias, self.group_size), MATMUL, self.backend)

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
        dtype and device. ``weight``: the raw (K, N/2) uint8 weight (its current values, read on every call:
        by the CPU kernel directly for ``preload`` at M <= 16, else repacked into the workspace; not with a
        ``prepacked`` plan) or this plan's :class:`PackedWeight` (no
        repack). ``out`` / ``workspace``: reused tensors (``out`` allocated when None; without a workspace the
        kernel's own scratch: on the CPU the calling thread's buffer, kept between calls, elsewhere a new one);
        the workspace must share no memory with the operands (ShapeError); an ``out`` that overlaps it goes
        through a temporary."""
        for name, t in (("workspace", workspace), ("out", out)):
            if t is not None and not isinstance(t, torch.Tensor):
                raise TypeError(f"{_OP}: {name} must be a tensor, got {type(t).__name__}")
        prepacked = isinstance(weight, PackedWeight)
        data = self._weight_data(weight)
        self._check_on_plan("x", x, self.dtype)
        args = (x, data, antiquant_scale, antiquant_offset, self.group_size, self.algorithm, self.template,
                workspace, prepacked)
        check_argument_types(MATMUL.name, args)  # the schema's arguments (the first seven)
        (spec,) = MATMUL.outputs(*args)
        sizes = (math.prod(x.shape[:-1]), x.shape[-1], spec.shape[-1])
        if sizes != (self.m, self.k, self.n):
            raise ShapeError(f"{_OP}: the plan is for (M, K, N) = {(self.m, self.k, self.n)}, got {sizes}")
        if prepacked and self.m and self.k and self.n:
            y = self._decoded(args, spec, out)
            if y is not None:
                return y
        return MATMUL(*args, out=out, backend=self.backend)

    def _decoded(self, args: tuple, spec: TensorSpec, out: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """:meth:`run`'s result for validated ``args`` with a PackedWeight through the kernel's one-call decode
        (``decode_into``: the CPU native MSD ``preload`` kernel, few rows; out, workspace and packed weight
        checked here as MATMUL checks them), or None where it does not apply: another kernel, more rows,
        operands or an ``out`` that MATMUL would copy first (not contiguous, not aligned, overlapping), or a NaN
        in the result. Skips MATMUL's per-call Python path (docs/wqbmm.md, 'Two-stage API')."""
        decode_into = getattr(self.kernel, "decode_into", None)
        x, data, scale, offset, group_size, _, _, workspace, _ = args
        operands = (x, scale) if offset is None else (x, scale, offset)
        if (decode_into is None or self.backend != "native" or self.algorithm != MSD or self.template != "preload"
                or not all(backends.is_dense_aligned(t) for t in operands)):
            return None
        if out is None:
            target = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
        else:
            MATMUL.check_out(args, out, (spec,))
            if not backends.is_dense_aligned(out) or any(backends.overlaps(out, t) for t in (*operands, data)):
                return None
            target = out
        self.kernel.check_weight_and_workspace(x, data, scale, offset, group_size, MSD, "preload", workspace, True,
                                               target)
        if not decode_into(x, self.m, data, scale, offset, group_size, workspace, target):
            return None
        MATMUL.record(self.backend)
        return target


_MAX_ELEMENTS = 2**62  # a tensor's size in bytes must fit in int64 (torch's storage sizes)


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
    """Plan an (M, K) x (K, N) weight-quant matmul; see :class:`WqbmmPlan`. Validates like the op
    (TypeError naming a non-int size, ShapeError for sizes out of range) and selects the kernel as a call
    with these sizes would (BackendUnavailable for ``backend="native"`` where it cannot run them). Runs
    nothing, so ``last_backend`` does not change.

    ``device`` is normalized ("cpu:0" -> "cpu", "cuda" -> "cuda:<current>"). ``prepacked=True``: runs
    take ``plan.pack_weight(weight)`` only, and the workspace leaves out the room to repack a raw weight.
    """
    for name, value in (("m", m), ("k", k), ("n", n)):
        check_int(name, value, minimum=0)
    if max(m, k, n, m * k, k * n, m * n) >= _MAX_ELEMENTS:
        raise ShapeError(f"{_OP}: (M, K, N) = {(m, k, n)} is too large: M * K, K * N and M * N must stay below "
                         "2^62 elements")
    check_int("group_size", group_size)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{_OP}: dtype must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")
    if not isinstance(prepacked, bool):
        raise TypeError(f"{_OP}: prepacked must be a bool, got {type(prepacked).__name__} {prepacked!r}")
    if n % 2:
        raise ShapeError(f"{_OP}: N must be even (two int4 per byte), got N = {n}")
    device = backends.canonical_device(device)
    meta = torch.empty(0, device="meta")
    groups = k // group_size if group_size > 0 else 0
    args = (meta.new_empty(m, k, dtype=dtype), meta.new_empty(k, n // 2, dtype=torch.uint8),
            meta.new_empty(groups, n, dtype=dtype), None, group_size, algorithm, template, None, prepacked)
    MATMUL.outputs(*args)
    name, kernel = MATMUL.kernel(device, backend, args)
    nbytes = kernel.workspace_nbytes(m, k, n, group_size, template, prepacked, algorithm)
    return WqbmmPlan(m, k, n, group_size, algorithm, template, device, dtype, name, nbytes, prepacked, kernel)
