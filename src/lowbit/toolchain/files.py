"""Atomic file and directory writes, and raw little-endian tensor files (docs/cli.md, "Files").

A file is written to a temporary file in its own folder and renamed over the target (``os.replace``), so a
reader sees the old file or the new one, never a half-written one. A set of entries of a folder (a dataset)
is built in a staging folder inside it and renamed into place: the old entries are renamed aside, the new
ones renamed in, then the old ones deleted; if anything fails, the old entries stay (or are put back).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch


class DatasetError(ValueError):
    """A data file is missing, empty, unreadable, malformed or of the wrong size; the message names it."""


@contextlib.contextmanager
def named_after(path: Path | str, temporary: Path | str | None = None) -> Iterator[None]:
    """Re-raise an OSError about ``temporary`` (a file or folder, or anything inside it; None: any OSError) as
    the same error about ``path``: the hidden temporary name an atomic write uses means nothing to a user
    (``cannot write a.png: Read-only file system``, not ``.a.png.x1y2: ...``). Without ``temporary``, a name
    in ``path``'s folder that starts as atomic_path's temporary names do (a failed mkstemp) counts as one.
    Another file the error names (a folder on the way) stays in the message; the original error is chained."""
    try:
        yield
    except OSError as exc:
        names = [str(f) for f in (exc.filename, exc.filename2) if f is not None]
        if temporary is None:
            hidden = Path(path).parent / f".{Path(path).name}."
            is_temporary = [n.startswith(str(hidden)) for n in names]
        else:
            is_temporary = [n.startswith(str(temporary)) for n in names]
        if exc.errno is None or temporary is not None and not any(is_temporary):
            raise
        others = [n for n, tmp in zip(names, is_temporary) if not tmp and n != str(path)]
        where = f" ({', '.join(others)})" if others else ""
        raise type(exc)(exc.errno, f"cannot write {path}: {exc.strerror}{where}") from exc


@contextlib.contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield a temporary path in ``path``'s folder; when the block succeeds, rename it to ``path``.

    For writers that want a file name (torch.profiler's trace export). The folder is created if needed.
    On an exception the temporary file is removed and ``path`` is untouched; an OSError about the temporary
    file names ``path`` instead (:func:`named_after`).
    """
    path = Path(path)
    with named_after(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    os.chmod(tmp, 0o644)
    try:
        with named_after(path, tmp):
            yield Path(tmp)
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_bytes_atomic(path: Path | str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and ``os.replace``."""
    with atomic_path(path) as tmp, named_after(path):  # (a full disk's error names no file)
        tmp.write_bytes(data)


@contextlib.contextmanager
def staged_entries(root: Path | str, names: Sequence[str]) -> Iterator[Path]:
    """Yield a staging folder inside ``root``; when the block succeeds, its entries ``names`` replace
    those of ``root`` (module docstring). Entries the block did not create are removed from ``root``.

    The staging folder (``root/.staging-*``) is removed in every case; ``root`` is created if needed.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".staging-"))
    try:
        yield staging
        _swap_in(root, staging, names)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _swap_in(root: Path, staging: Path, names: Sequence[str]) -> None:
    old = Path(tempfile.mkdtemp(dir=root, prefix=".replaced-"))
    aside, placed = [], []
    try:
        for name in names:
            if os.path.lexists(root / name):
                os.rename(root / name, old / name)
                aside.append(name)
        for name in names:
            if os.path.lexists(staging / name):
                os.rename(staging / name, root / name)
                placed.append(name)
    except BaseException:
        for name in placed:
            os.rename(root / name, staging / name)
        for name in aside:
            os.rename(old / name, root / name)
        os.rmdir(old)  # empty again; if putting back failed, the old entries stay there
        raise
    shutil.rmtree(old, ignore_errors=True)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The tensor's elements as raw little-endian bytes, row-major (any strides, any device)."""
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint8).numpy().tobytes() if t.element_size() > 1 else t.numpy().tobytes()


def read_tensor(path: Path | str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The raw little-endian file ``path`` as a CPU tensor of ``dtype`` and ``shape``.

    Raises DatasetError naming the file when it is missing, unreadable, empty or not exactly
    ``prod(shape) * itemsize`` bytes.
    """
    path = Path(path)
    try:
        raw = np.fromfile(path, dtype=np.uint8)
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from exc
    if raw.size == 0:
        raise DatasetError(f"{path}: the file is empty")
    expected = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    if raw.size != expected:
        raise DatasetError(f"{path}: {raw.size} bytes, expected {expected} for {dtype} {tuple(shape)}")
    return torch.from_numpy(raw).view(dtype).reshape(shape)
