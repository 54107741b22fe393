"""The sample's ``verify_result.py`` decision, with its defects fixed (docs/wqbmm.md, "The sample's tool
chain").

Mismatch = not ``isclose(rtol, atol, equal_nan=True)``; an error = a mismatch whose relative difference
``|out - golden| / |golden|`` exceeds ``error_tol`` (a zero golden gives an infinite difference, a NaN
against a number is an error); pass iff errors / size <= error_tol. Every mismatch is counted, not only
the first 101 the sample prints, and outputs of another size than the golden are an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from lowbit.toolchain.files import DatasetError, read_tensor


@dataclass
class VerifyResult:
    """The verdict: ``first`` holds (index, expected, actual, rdiff) of the first ``show`` mismatches."""

    size: int
    mismatches: int
    errors: int
    error_ratio: float
    passed: bool
    first: list[tuple[int, float, float, float]] = field(default_factory=list)

    def report_lines(self) -> list[str]:
        """The sample's printout (one line per shown mismatch), the totals, and the verdict line."""
        lines = [
            f"data index: {i:06d}, expected: {expected:-.9f}, actual: {actual:-.9f}, rdiff: {rdiff:-.6f}"
            for i, expected, actual, rdiff in self.first
        ]
        lines.append(f"mismatches: {self.mismatches}, errors: {self.errors} of {self.size}, "
                     f"error ratio: {self.error_ratio:.4f}")
        lines.append("test pass" if self.passed else "[ERROR] result error")
        return lines


def verify_arrays(
    output: np.ndarray,
    golden: np.ndarray,
    *,
    rtol: float = 1e-6,
    atol: float = 1e-9,
    error_tol: float = 1e-3,
    show: int = 101,
) -> VerifyResult:
    """Compare two arrays of the same size (compared as float32). ValueError if the sizes differ."""
    if output.size != golden.size:
        raise ValueError(f"output has {output.size} elements but golden has {golden.size}")
    out, gold = output.reshape(-1).astype(np.float32), golden.reshape(-1).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # infinite tolerances, zero golden
        mismatch = np.flatnonzero(~np.isclose(out, gold, rtol=rtol, atol=atol, equal_nan=True))
        rdiff = np.abs(out[mismatch] - gold[mismatch]) / np.abs(gold[mismatch])
    errors = int(np.count_nonzero(~(rdiff <= error_tol)))  # NaN rdiff (NaN vs number) is an error
    ratio = errors / out.size if out.size else 0.0
    first = [(int(i), float(gold[i]), float(out[i]), float(r)) for i, r in zip(mismatch[:show], rdiff[:show])]
    return VerifyResult(int(out.size), int(mismatch.size), errors, ratio, ratio <= error_tol, first)


def verify_files(
    output: Path | str, golden: Path | str, dtype: torch.dtype = torch.float16, **tolerances: float
) -> VerifyResult:
    """:func:`verify_arrays` on two raw little-endian files of ``dtype``.

    Raises DatasetError naming the file when one is missing, empty, not a whole number of elements, or
    when the two sizes differ.
    """
    output, golden = Path(output), Path(golden)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    sizes = []
    for path in (output, golden):
        if path.is_dir():
            raise DatasetError(f"{path} is a directory, not a file")
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise DatasetError(f"{path}: cannot read: {exc.strerror or exc}") from exc
        if size == 0:
            raise DatasetError(f"{path}: the file is empty")
        if size % itemsize:
            raise DatasetError(f"{path}: {size} bytes is not a whole number of {dtype} elements")
        sizes.append(size)
    if sizes[0] != sizes[1]:
        raise DatasetError(f"{output} has {sizes[0]} bytes but {golden} has {sizes[1]}")
    out, gold = (read_tensor(p, dtype, (size // itemsize,)).float().numpy() for p, size in zip((output, golden), sizes))
    return verify_arrays(out, gold, **tolerances)
