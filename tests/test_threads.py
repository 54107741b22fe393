"""CPU kernels follow torch's thread count, keep it, and give the same bits for any count."""

import os
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


FORK_SCRIPT = """
import os, time
import numpy as np, torch
torch.set_num_threads(2)
import lowbit
from lowbit.cli.bench.model import quantized_layer
from lowbit.formats.int4 import quantize_int4_per_group


def bits(t):
    return t.contiguous().view(torch.uint8).numpy().copy()  # numpy: a torch op this size would hang here


def in_child(check):
    pid = os.fork()
    if pid == 0:
        with torch.inference_mode():
            os._exit(check() if not lowbit.kernels.cpu.parallel_loops else 3)
    for _ in range(600):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.1)
    os.kill(pid, 9)
    return "hung"


g = torch.Generator().manual_seed(0)
big = torch.randn(4096, 256, generator=g).bfloat16()  # torch's OpenMP threads ran; numba's did not start yet
print("torch only", in_child(lambda: int(lowbit.hifloat4_fake_quant(big).shape != big.shape)))
n = k = 2048  # each weight above every kernel's one-thread size on Intel and AMD Zen
x = torch.randn(4, k, generator=g).bfloat16()
calls = {}
for scheme in ("mxfp4-wo", "hif4-wo", "hif8-wo", "int4-a16w4", "svdquant-r32"):
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    layer = quantized_layer(w, torch.randn(n, generator=g).bfloat16(), scheme)[0]
    for m in (1, 4):
        calls[scheme, m] = lambda layer=layer, m=m: layer(x[:m])
packed, scale, _ = quantize_int4_per_group(torch.randn(k, n, generator=g), 128, dtype=torch.bfloat16)
calls["wqbmm"] = lambda: lowbit.weight_quant_batch_matmul(x[:1], packed, scale, group_size=128)
calls["hif8"] = lambda: lowbit.decode_from_hifloat8(lowbit.encode_to_hifloat8(big), torch.bfloat16)
calls["hif4"] = lambda: lowbit.hifloat4_fake_quant(big)
calls["mxfp4"] = lambda: lowbit.mxfp4_dequantize(*lowbit.mxfp4_quantize(big), torch.bfloat16)
with torch.inference_mode():
    want = {name: bits(call()) for name, call in calls.items()}
print("both", in_child(lambda: int(not all(np.array_equal(bits(call()), want[name]) for name, call in calls.items()))))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork")
def test_a_forked_child_runs_the_kernels_on_its_thread():
    """A parallel region entered in a child forked from a process that ran one hangs (GNU OpenMP, after torch's
    ops) or ends the child (numba's SIGTERM, after numba's loops): in a forked child every lowbit kernel runs on
    the calling thread, with the parent's bits, whatever torch's thread count."""
    result = subprocess.run([sys.executable, "-c", FORK_SCRIPT], capture_output=True, text=True,
                            env={"PYTHONPATH": ":".join(sys.path), "PATH": ""}, timeout=600)
    assert result.returncode == 0 and result.stdout.split("\n")[:2] == ["torch only 0", "both 0"], (
        result.stdout, result.stderr)
