"""One task of a streamed quantization, run in a worker process: copy a tensor's bytes, or pack a weight
block of rows by block of rows, into its place in an output shard being written (docs/quantize_checkpoint.md).

Tasks are plain tuples (picklable, small); each reads with its own handles and writes its own byte ranges
of the output file with ``os.pwrite``, so tasks of one shard run in any order and in any process. A
quantize task holds one row block of input (about :data:`BLOCK_BYTES`) and its packed result at a time,
plus, for a packed tensor whose rows are not its first axis (int4's transposed layout), the whole packed
tensor, which it writes at the end.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Optional

import torch

from lowbit.errors import with_context
from lowbit.quantize.shard_io import TORCH_DTYPES, copy_range, write_all
from lowbit.quantize.stream_plan import LayerPlan, PackedTensor, pack_rows

BLOCK_BYTES = 1024 * 1024  # input bytes per row block (its temporaries are ~10-20x that)


@dataclass(frozen=True)
class CopyTask:
    """Copy ``length`` bytes at ``src_offset`` of ``src`` to ``dst_offset`` of ``dst``."""

    src: str
    src_offset: int
    dst: str
    dst_offset: int
    length: int


@dataclass(frozen=True)
class QuantizeTask:
    """Pack the weight of ``layer`` from shard ``src`` with ``scheme``; packed tensor i goes to
    ``dst_offsets[i]`` of ``dst``."""

    scheme: str
    src: str
    layer: LayerPlan
    dst: str
    dst_offsets: tuple[int, ...]


def init_worker(threads: int) -> None:
    """Pool initializer: Ctrl-C is handled by the parent only; ``threads`` torch threads per worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)


def run_task(task) -> int:
    """Run a CopyTask or QuantizeTask; returns the number of input bytes it consumed."""
    if isinstance(task, CopyTask):
        src = os.open(task.src, os.O_RDONLY)
        try:
            dst = os.open(task.dst, os.O_WRONLY)
            try:
                copy_range(src, task.src_offset, dst, task.dst_offset, task.length)
            finally:
                os.close(dst)
        finally:
            os.close(src)
        return task.length
    try:
        return _quantize(task)
    except (ValueError, TypeError, RuntimeError) as exc:  # name the shard (the layer is named inside)
        raise with_context(os.path.basename(task.src), exc) from exc


def _read_rows(path: str, name: str, start: int, stop: int) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:  # mapped per block: the pages read are released after each
        return f.get_slice(name)[start:stop]


def _block_rows(layer: LayerPlan) -> int:
    row_bytes = layer.cols * torch.empty((), dtype=TORCH_DTYPES[layer.dtype]).element_size()
    rows = max(1, BLOCK_BYTES // row_bytes) // layer.row_quantum * layer.row_quantum
    return max(rows, layer.row_quantum)


def _span(t: PackedTensor, start: int, stop: int) -> tuple[int, int]:
    return int(t.per_row * start), int(t.per_row * stop)


def _quantize(task: QuantizeTask) -> int:
    layer = task.layer
    whole: dict[str, Optional[torch.Tensor]] = {
        t.key: None if t.axis == 0 else torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype]) for t in layer.tensors}
    step = _block_rows(layer)
    fd = os.open(task.dst, os.O_WRONLY)
    try:
        for start in range(0, layer.rows, step):
            stop = min(start + step, layer.rows)
            weight = _read_rows(task.src, layer.weight, start, stop)
            packed = pack_rows(layer.name, weight, task.scheme).state_dict()
            for t, offset in zip(layer.tensors, task.dst_offsets):
                block = packed[t.key]
                lo, hi = _span(t, start, stop)
                expected = t.shape[:t.axis] + (hi - lo,) + t.shape[t.axis + 1:]
                if tuple(block.shape) != expected or block.dtype != TORCH_DTYPES[t.dtype]:
                    raise RuntimeError(f"layer {layer.name!r}: packed {t.key!r} of rows {start}:{stop} is "
                                       f"{block.dtype} {tuple(block.shape)}, planned {t.dtype} {expected}")
                if t.axis == 0:
                    row_bytes = t.nbytes // t.shape[0]
                    write_all(fd, _bytes(block), offset + lo * row_bytes)
                else:
                    whole[t.key].narrow(t.axis, lo, hi - lo).copy_(block)
        for t, offset in zip(layer.tensors, task.dst_offsets):
            if whole[t.key] is not None:
                write_all(fd, _bytes(whole[t.key]), offset)
    finally:
        os.close(fd)
    return layer.rows * layer.cols * torch.empty((), dtype=TORCH_DTYPES[layer.dtype]).element_size()


def _bytes(t: torch.Tensor):
    """The little-endian bytes of a tensor, as a buffer (no copy for a contiguous tensor)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def run_indexed(job: tuple[int, object]) -> tuple[int, int]:
    """``(i, task)`` -> ``(i, run_task(task))``: tells the parent which shard a finished task belongs to."""
    i, task = job
    return i, run_task(task)
