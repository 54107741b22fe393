"""CPU kernels follow torch's thread count, keep it, and give the same bits for any count."""

import subprocess
import sys
import threading

import numba
import pytest
import torch

from lowbit.kernels.cpu._runtime import swap_parallel_chunksize, sync_threads

SCRIPT = """
import torch
torch.set_num_threads(1)
import numba, lowbit
x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
one = [lowbit.encode_to_hifloat8(x, backend="native"), lowbit.hifloat4_fake_quant(x, backend="native"),
       *lowbit.mxfp4_quantize(x, backend="native")]
assert torch.get_num_threads() == 1 and numba.get_num_threads() == 1, (torch.get_num_threads(), numba.get_num_threads())
torch.set_num_threads(2)
two = [lowbit.encode_to_hifloat8(x, backend="native"), lowbit.hifloat4_fake_quant(x, backend="native"),
       *lowbit.mxfp4_quantize(x, backend="native")]
assert numba.get_num_threads() == min(2, numba.config.NUMBA_NUM_THREADS)
assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(one, two))
print("ok")
"""


def test_thread_count_is_followed_and_kept_and_results_do_not_depend_on_it():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                            env={"PYTHONPATH": ":".join(sys.path), "PATH": ""})
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_sync_threads_syncs_each_python_thread():
    """numba's thread count is per thread: sync_threads remembers what it set per thread, so a new thread
    (whose numba count starts at the pool's size) is synced too, not skipped."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba's pool has one thread: every count is 1")
    previous = torch.get_num_threads()
    seen = []
    try:
        torch.set_num_threads(1)
        assert sync_threads() == 1 and numba.get_num_threads() == 1
        worker = threading.Thread(target=lambda: seen.append((sync_threads(), numba.get_num_threads())))
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(previous)
    assert seen == [(1, 1)]


@numba.njit(parallel=True)
def _swap_twice(chunksize):
    total = 0
    for i in numba.prange(4):  # a parallel loop: the threading layer that defines the functions is loaded
        total += i
    previous = swap_parallel_chunksize(numba.uintp(chunksize))
    seen = swap_parallel_chunksize(previous)
    return previous, seen, total


def test_swap_parallel_chunksize_sets_and_returns_the_threads_chunk_size_in_compiled_code():
    before = numba.set_parallel_chunksize(3)
    try:
        assert _swap_twice(7) == (3, 7, 6)
        assert numba.get_parallel_chunksize() == 3  # put back by the second swap
    finally:
        numba.set_parallel_chunksize(before)


CACHED = """
import numba
from lowbit.kernels.cpu._runtime import swap_parallel_chunksize

@numba.njit(parallel=True, cache=True)
def swapped(chunksize):
    total = 0
    for i in numba.prange(4):
        total += i
    previous = swap_parallel_chunksize(numba.uintp(chunksize))
    swap_parallel_chunksize(previous)
    return previous + total

assert swapped(9) == 6
print(len(swapped.stats.cache_hits))
"""


def test_a_function_that_swaps_the_chunk_size_is_cached(tmp_path):
    """The intrinsic declares the threading layer's functions by name (numba.set_parallel_chunksize in compiled
    code holds a ctypes pointer, which numba refuses to cache): a second process loads the first's compiled
    function instead of compiling it again."""
    (tmp_path / "swapped.py").write_text(CACHED)
    env = {"PYTHONPATH": ":".join([str(tmp_path), *sys.path]), "PATH": "", "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    hits = [subprocess.run([sys.executable, "-W", "error::numba.NumbaWarning", "-c", "import swapped"],
                           capture_output=True, text=True, env=env) for _ in range(2)]
    assert [r.returncode for r in hits] == [0, 0], [r.stderr for r in hits]
    assert [r.stdout.strip() for r in hits] == ["0", "1"]
