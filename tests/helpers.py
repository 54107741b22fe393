"""Helpers shared by the tests: bit views, dtype lists, WeightQuantBatchMatmul operands, SIMD intrinsics run
from Python, a CPU kernel's serial and parallel forms, running the CLI, modes that record what they see."""

import numba
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lowbit.dtypes import bit_view

HALF_DTYPES = [torch.float16, torch.bfloat16]
# For tests that need numba's parallel loops on two threads (skipped under NUMBA_NUM_THREADS=1).
needs_two_numba_threads = pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2,
                                             reason="numba's thread pool has one thread (NUMBA_NUM_THREADS=1)")
FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of ``t`` (same-width integers for floats), contiguous: compare with torch.equal."""
    return bit_view(t.contiguous())


def simd_binary(intrinsic, load_a, load_b, store):
    """A jitted ``run(a, b, out)``: ``store(out, 0, intrinsic(load_a(a, 0), load_b(b, 0)))`` (lowbit's SIMD
    intrinsics on one register's worth of each array)."""

    @numba.njit
    def run(a, b, out):
        store(out, 0, intrinsic(load_a(a, 0), load_b(b, 0)))

    return run


def wqbmm_operands(m: int, k: int, n: int, g: int, dtype=torch.float16, seed: int = 0):
    """Random (x (m, k), packed int4 weight (k, n/2), scale (k/g, n)) for the weight-quant matmul."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    weight = torch.randint(0, 256, (k, n // 2), generator=gen, dtype=torch.uint8)
    scale = torch.rand(k // g, n, generator=gen).to(dtype)
    return x, weight, scale


def wqbmm_spread_operands(gen: torch.Generator, m: int, k: int, n: int, g: int, dtype, with_offset: bool):
    """Random (x, weight, scale, offset or None) with row magnitudes spread over six decades, scales in
    (-4, 4) and int offsets in [-8, 7]: the kernel tests' draws."""
    x = ((torch.rand(m, k, generator=gen) * 2 - 1) * 10 ** (torch.rand(m, 1, generator=gen) * 6 - 3)).to(dtype)
    weight = torch.randint(0, 256, (k, n // 2), generator=gen, dtype=torch.uint8)
    scale = ((torch.rand(k // g, n, generator=gen) * 2 - 1) * 4).to(dtype)
    offset = torch.randint(-8, 8, (k // g, n), generator=gen).to(dtype) if with_offset else None
    return x, weight, scale, offset


def serial_then_parallel(monkeypatch, module, threshold: str, run) -> list:
    """[``run()`` with ``module.<threshold>`` (a one-thread bound) above every input: the kernels' serial forms,
    ``run()`` with it 0: their parallel loops], on two torch threads."""
    results = []
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for below in (1 << 62, 0):
            monkeypatch.setattr(module, threshold, below)
            results.append(run())
    finally:
        torch.set_num_threads(previous)
    return results


def run_cli(capsys, *argv):
    """Run ``lowbit *argv`` in this process; returns (exit code, stdout, stderr)."""
    from lowbit.cli import main as cli

    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


class _Seen:
    """A mode that records the names of the functions or ops it sees (``seen``)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def _record(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


class SeenOps(_Seen, TorchDispatchMode):
    """A TorchDispatchMode recording the ops it sees."""

    __torch_dispatch__ = _Seen._record


class SeenFunctions(_Seen, TorchFunctionMode):
    """A TorchFunctionMode recording the functions it sees."""

    __torch_function__ = _Seen._record


def force_k_chunk(monkeypatch, m: int, k_chunk: int) -> None:
    """lowbit's AMX kernel takes K in chunks of ``k_chunk`` columns (a multiple of its TILE_K) for M = ``m``,
    whatever K (amx.k_chunk_of)."""
    from lowbit.kernels.cpu import amx  # numba: only for the tests that use it

    monkeypatch.setattr(amx, "CHUNKED_K", 0)
    monkeypatch.setattr(amx, "X_CHUNK_BYTES", 2 * -(-m // amx.PANEL) * amx.PANEL * k_chunk)
    assert amx.k_chunk_of(m, 1 << 20) == k_chunk
