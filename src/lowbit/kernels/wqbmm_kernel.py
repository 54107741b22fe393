"""What every WeightQuantBatchMatmul kernel (reference, numba, Triton) declares, and the checks its ``run``
makes before any kernel code runs (docs/wqbmm.md, section 'Kernels, packed weights and workspaces').

A :class:`WqbmmKernel` takes the operator's arguments
``(x, weight, antiquant_scale, antiquant_offset, group_size, algorithm, template, workspace=None,
prepacked=False)``, already validated by the operator (dtypes, devices, the shapes of x, scale, offset and
of a raw weight; inputs contiguous, ``out`` contiguous and overlapping no input). Two of them depend on the
kernel, so ``run`` checks them itself, for every caller:

* ``weight`` with ``prepacked=True`` is this kernel's :meth:`pack_weight` layout: a contiguous uint8 tensor of
  :meth:`packed_shape` on x's device (a wrong size would make a numba kernel read past its end); without,
  the contiguous (K, N/2) uint8 weight;
* ``workspace`` (None: ``run`` allocates one) is a contiguous 1-D uint8 tensor on x's device with at least
  :meth:`workspace_nbytes` bytes, starting at a :data:`WORKSPACE_ALIGNMENT`-byte aligned address, and sharing
  no memory with x, the weight, the scale, the offset or ``out``.

Violations raise DtypeError / DeviceError / ShapeError naming the tensor, what the kernel needs and what it got.
"""

from __future__ import annotations

from typing import Optional

import torch

from lowbit.backends import Kernel, overlaps
from lowbit.errors import DeviceError, DtypeError, ShapeError
from lowbit.kernels.cpu.memory import thread_scratch

WORKSPACE_ALIGNMENT = 64  # bytes; torch's allocators align every allocation at least this much
MSD = "msd"


def aligned_offsets(sizes: dict[str, int]) -> tuple[dict[str, tuple[int, int]], int]:
    """Lay out named byte sizes one after another, each starting at a WORKSPACE_ALIGNMENT multiple:
    ``({name: (start, size)}, total bytes)``."""
    offsets, total = {}, 0
    for name, size in sizes.items():
        offsets[name] = (total, size)
        total += -(-size // WORKSPACE_ALIGNMENT) * WORKSPACE_ALIGNMENT
    return offsets, total


def _shares_memory(t: torch.Tensor, workspace: torch.Tensor, nbytes: int) -> bool:
    """Whether ``t`` may touch the first ``nbytes`` bytes of the contiguous 1-D ``workspace`` (a cheap
    address comparison for a contiguous ``t``; lowbit.backends.overlaps otherwise)."""
    if nbytes == 0 or t.numel() == 0 or t.device != workspace.device:
        return False
    if not t.is_contiguous():
        return overlaps(t, workspace[:nbytes])
    first, start = t.data_ptr(), workspace.data_ptr()
    return first < start + nbytes and start < first + t.numel() * t.element_size()


class WqbmmKernel(Kernel):
    """One WeightQuantBatchMatmul kernel. Subclasses implement :meth:`workspace_nbytes` and ``_compute``, and
    override :meth:`packed_shape` and :meth:`pack_weight` when they read another layout than the raw
    (K, N/2) weight; ``run`` checks, then calls ``_compute``."""

    name = "wqbmm"  # for messages

    def supports(self, x, weight, antiquant_scale, antiquant_offset, group_size, algorithm, template,
                 workspace=None, prepacked=False) -> Optional[str]:
        """The native kernels compute the MSD algorithm only; "dequant" is the reference's."""
        if algorithm != MSD:
            return f"algorithm {algorithm!r} has only the reference implementation"
        return None

    def workspace_nbytes(self, m: int, k: int, n: int, group_size: int, template: str, prepacked: bool,
                         algorithm: str = MSD) -> int:
        """Bytes of the uint8 workspace ``run`` needs for an (M, K) x (K, N) product (``prepacked``: the
        weight comes from :meth:`pack_weight`, else it is the raw (K, N/2) weight)."""
        raise NotImplementedError

    def packed_shape(self, k: int, n: int, group_size: int) -> tuple[int, ...]:
        """Shape of :meth:`pack_weight`'s uint8 result for a (K, N/2) weight (here: the same)."""
        return (k, n // 2)

    def pack_weight(self, weight: torch.Tensor, group_size: int) -> torch.Tensor:
        """A new contiguous uint8 tensor of :meth:`packed_shape`: the validated (K, N/2) uint8 ``weight`` in
        the layout ``run`` reads with ``prepacked=True`` (a snapshot: later changes of ``weight`` are not
        seen). Here: a contiguous copy of the weight itself."""
        return weight.clone(memory_format=torch.contiguous_format)

    def _compute(self, x, weight, antiquant_scale, antiquant_offset, group_size, algorithm, template, workspace,
                 out, prepacked) -> None:
        """x (M, K), out (M, N), everything checked by ``run``."""
        raise NotImplementedError

    def run(self, x, weight, antiquant_scale, antiquant_offset, group_size, algorithm, template, workspace=None,
            prepacked=False, *, out) -> None:
        """``out`` (..., N) <- the product, for operands validated by the operator (see the module
        docstring); the weight and the workspace are checked here. Without a workspace: the calling thread's
        scratch buffer on the CPU (lowbit.kernels.cpu.memory.thread_scratch), a new one elsewhere."""
        k, n = x.shape[-1], out.shape[-1]
        m = out.numel() // n if n else 0
        if m == 0:
            return
        if not out.is_contiguous():
            raise ShapeError(f"{self.name}: out must be contiguous, got strides {out.stride()}")
        nbytes = self.check_weight_and_workspace(x, weight, antiquant_scale, antiquant_offset, group_size, algorithm,
                                                 template, workspace, prepacked, out)
        args = (x.reshape(m, k).contiguous(), weight, antiquant_scale.contiguous(),
                None if antiquant_offset is None else antiquant_offset.contiguous(), group_size, algorithm,
                template)
        if workspace is not None:
            self._compute(*args, workspace, out.view(m, n), prepacked)
        elif x.device.type == "cpu":  # the thread's scratch buffer: kept between calls, no page faults
            with thread_scratch(nbytes) as scratch:
                self._compute(*args, scratch, out.view(m, n), prepacked)
        else:
            self._compute(*args, torch.empty(nbytes, dtype=torch.uint8, device=x.device), out.view(m, n), prepacked)

    def check_weight_and_workspace(self, x, weight, antiquant_scale, antiquant_offset, group_size, algorithm,
                                   template, workspace, prepacked, out) -> int:
        """The workspace bytes of a call with these operands (``out`` (..., N) of M rows, not empty), after
        checking the weight (raw, or ``prepacked`` in :meth:`pack_weight`'s layout) and, where given, the
        workspace (uint8 on x's device, contiguous 1-D, large and aligned enough, sharing no memory with an
        operand). TypeError / DtypeError / DeviceError / ShapeError."""
        k, n = x.shape[-1], out.shape[-1]
        self._check_weight(weight, x.device, self.packed_shape(k, n, group_size) if prepacked else (k, n // 2),
                           "packed weight" if prepacked else "weight")
        nbytes = self.workspace_nbytes(out.numel() // n, k, n, group_size, template, prepacked, algorithm)
        if workspace is not None:
            operands = {"x": x, "weight": weight, "antiquant_scale": antiquant_scale,
                        "antiquant_offset": antiquant_offset, "out": out}
            self._check_workspace(workspace, nbytes, x.device, operands)
        return nbytes

    @staticmethod
    def _check_bytes(what: str, t: torch.Tensor, device: torch.device) -> None:
        """TypeError / DtypeError / DeviceError unless ``t`` is a uint8 tensor on ``device``."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what} must be a tensor, got {type(t).__name__}")
        if t.dtype != torch.uint8:
            raise DtypeError(f"{what} must be uint8, got {t.dtype}")
        if t.device != device:
            raise DeviceError(f"{what} is on {t.device} but x is on {device}")

    def _check_weight(self, data: torch.Tensor, device: torch.device, shape: tuple[int, ...], label: str) -> None:
        what = f"{self.name}: the {label}"
        self._check_bytes(what, data, device)
        if tuple(data.shape) != shape:
            raise ShapeError(f"{what} must have shape {shape}, got {tuple(data.shape)}")
        if not data.is_contiguous():
            raise ShapeError(f"{what} must be contiguous, got strides {data.stride()}")

    def _check_workspace(self, workspace: torch.Tensor, nbytes: int, device: torch.device,
                         operands: dict[str, Optional[torch.Tensor]]) -> None:
        what = f"{self.name}: workspace"
        self._check_bytes(what, workspace, device)
        if workspace.dim() != 1 or not workspace.is_contiguous():
            raise ShapeError(f"{what} must be a contiguous 1-D tensor, got shape {tuple(workspace.shape)}, "
                             f"strides {workspace.stride()}")
        if workspace.numel() < nbytes:
            raise ShapeError(f"{what} has {workspace.numel()} bytes, this call needs {nbytes}")
        if nbytes and workspace.data_ptr() % WORKSPACE_ALIGNMENT:
            raise ShapeError(
                f"{what} must start at a {WORKSPACE_ALIGNMENT}-byte aligned address, got one "
                f"{workspace.data_ptr() % WORKSPACE_ALIGNMENT} bytes past it (storage offset "
                f"{workspace.storage_offset()})"
            )
        for label, t in operands.items():
            if t is not None and _shares_memory(t, workspace, nbytes):
                raise ShapeError(f"{what} shares memory with {label}: pass a separate buffer")
