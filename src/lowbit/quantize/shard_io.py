"""Safetensors files at the byte level, for streaming: read and check a shard's header, find a model
directory's shards, and build a header for a shard written piece by piece (docs/quantize_checkpoint.md).

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON (``{name: {"dtype",
"shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, offsets relative to the data start
``8 + n``, which may be padded with spaces), then the data, every byte of it belonging to exactly one
tensor. Errors are :class:`~lowbit.quantize.checkpoint.CheckpointError` naming the file.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from lowbit.quantize.checkpoint import TENSORS_FILE, CheckpointError

INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
# Bits per element of every dtype name the safetensors format defines (its specification; copied tensors may
# have any of them): a tensor's byte range must be exactly its elements' bits.
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E5M2FNUZ": 8, "F8_E4M3FNUZ": 8,
              "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
              "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a shard: safetensors dtype name, shape, and its byte range in the file (absolute)."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def element_size(self) -> int:
        """Bytes per element (1 for empty tensors and sub-byte types): the alignment safetensors sorts by."""
        numel = math.prod(self.shape)
        return max(1, self.nbytes // numel) if numel else 1


@dataclass(frozen=True)
class Shard:
    """A checked input shard: its path, size and mtime (for resuming), and its tensors by name."""

    path: Path
    size: int
    mtime_ns: int
    tensors: dict[str, TensorEntry]


def read_shard(path: Path) -> Shard:
    """Parse and check ``path``'s header: CheckpointError if it is truncated, padded, overlapping or not
    safetensors at all (the data bytes themselves carry no checksum and are not checked)."""
    try:
        stat = path.stat()
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({stat.st_size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > stat.st_size:
                raise CheckpointError(f"{path}: truncated or corrupt safetensors file (header of {n} bytes, file "
                                      f"of {stat.st_size})")
            header = json.loads(f.read(n).decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # (JSONDecodeError, UnicodeDecodeError, integer digits limit)
        raise CheckpointError(f"{path}: corrupt safetensors header ({type(exc).__name__}: {exc})") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}  # (null: safetensors reads it as no metadata)
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise CheckpointError(f"{path}: corrupt safetensors header (__metadata__ must map names to strings, as "
                              "safetensors reads it)")
    start = 8 + n
    tensors, spans = {}, []
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            valid = all(type(v) is int and v >= 0 for v in (*shape, begin, end))  # not bool, float or str
        except (KeyError, TypeError, ValueError):
            valid = False
        if not valid or end < begin:
            raise CheckpointError(f"{path}: corrupt safetensors header entry for tensor {name!r}")
        _check_size(path, name, dtype, shape, end - begin)
        tensors[name] = TensorEntry(dtype, shape, start + begin, start + end)
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise CheckpointError(f"{path}: corrupt safetensors file: tensor {name!r} starts at data byte {begin}, "
                                  f"expected {position}")
        position = end
    if start + position != stat.st_size:
        raise CheckpointError(f"{path}: truncated or corrupt safetensors file: the header describes "
                              f"{start + position} bytes, the file has {stat.st_size}")
    return Shard(path, stat.st_size, stat.st_mtime_ns, tensors)


def _check_size(path: Path, name: str, dtype: Any, shape: tuple[int, ...], nbytes: int) -> None:
    """CheckpointError unless ``dtype`` is a safetensors dtype name and ``shape``'s elements take ``nbytes``."""
    bits = DTYPE_BITS.get(dtype) if isinstance(dtype, str) else None
    if bits is None:
        raise CheckpointError(f"{path}: tensor {name!r} has unknown dtype {dtype!r} (safetensors dtypes: "
                              f"{', '.join(DTYPE_BITS)})")
    need = math.prod(shape) * bits
    if need != 8 * nbytes:
        raise CheckpointError(f"{path}: corrupt safetensors header: tensor {name!r} ({dtype}, shape {list(shape)}) "
                              f"needs {need} bits, its data_offsets span {nbytes} bytes")


def _read_index(path: Path) -> dict[str, str]:
    try:
        index = json.loads(path.read_text())
        weight_map = index["weight_map"]
    except (OSError, ValueError, RecursionError, KeyError, TypeError) as exc:  # ValueError: JSON and digits
        raise CheckpointError(f"{path}: not a safetensors index (needs a 'weight_map' object): {exc}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise CheckpointError(f"{path}: 'weight_map' must map tensor names to shard file names")
    for shard in set(weight_map.values()):
        if Path(shard).name != shard or shard in ("", ".", ".."):
            raise CheckpointError(f"{path}: shard {shard!r} is not a file name in the same directory")
        if not shard.endswith(".safetensors"):
            raise CheckpointError(f"{path}: shard {shard!r} is not a .safetensors file")
    return weight_map


def model_shards(directory: Path) -> tuple[list[Shard], Optional[dict[str, str]]]:
    """The checked shards of a model directory (``model.safetensors.index.json`` if present, else
    ``model.safetensors``) and the index's weight map (None for a single file). CheckpointError for a
    missing file, a tensor the index does not list (or lists in another shard), an index entry no shard
    holds, or a tensor in two shards."""
    index_path = directory / INDEX_FILE
    if not index_path.is_file():
        single = directory / TENSORS_FILE
        if not single.is_file():
            raise CheckpointError(f"{directory}: no {TENSORS_FILE} or {INDEX_FILE}")
        return [read_shard(single)], None
    weight_map = _read_index(index_path)
    names = sorted(set(weight_map.values()))
    for name in names:
        if not (directory / name).is_file():
            raise CheckpointError(f"{index_path} lists shard {name!r}, which is missing")
    shards = [read_shard(directory / name) for name in names]
    seen: dict[str, str] = {}
    for shard in shards:
        for tensor in shard.tensors:
            listed = weight_map.get(tensor)
            if listed != shard.path.name:
                where = "does not list it" if listed is None else f"lists it in {listed!r}"
                raise CheckpointError(f"{shard.path} holds tensor {tensor!r} but {index_path.name} {where}")
            if tensor in seen:
                raise CheckpointError(f"tensor {tensor!r} is in both {seen[tensor]} and {shard.path.name}")
            seen[tensor] = shard.path.name
    missing = sorted(set(weight_map) - set(seen))
    if missing:
        raise CheckpointError(f"{index_path} lists tensors no shard holds: {missing[:10]}")
    return shards, weight_map


def encode_header(entries: dict[str, tuple[str, tuple[int, ...], int, int]], metadata: dict[str, str]) -> bytes:
    """The 8-byte length and JSON header for ``{name: (dtype, shape, begin, end)}`` (offsets relative to the
    data start), padded with spaces so that the data starts at a multiple of 8 bytes."""
    header: dict[str, Any] = {"__metadata__": metadata}
    for name, (dtype, shape, begin, end) in entries.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % 8)
    return struct.pack("<Q", len(text)) + text


def write_all(fd: int, data, offset: int) -> None:
    """``os.pwrite`` until every byte of ``data`` (a buffer) is written at ``offset``."""
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def copy_range(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, length: int,
               block: int = 8 * 1024 * 1024) -> None:
    """Copy ``length`` bytes between two files at the given offsets, ``block`` bytes at a time."""
    while length > 0:
        data = os.pread(src_fd, min(block, length), src_offset)
        if not data:
            raise CheckpointError(f"input file shrank while being read (at byte {src_offset})")
        write_all(dst_fd, data, dst_offset)
        src_offset, dst_offset, length = src_offset + len(data), dst_offset + len(data), length - len(data)
