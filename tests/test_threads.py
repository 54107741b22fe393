"""CPU kernels follow torch's thread count, keep it, and give the same bits for any count."""

import subprocess
import sys
import threading

import numba
import pytest
import torch

from lowbit.kernels.cpu._runtime import sync_threads

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
