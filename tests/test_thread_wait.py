"""How long idle OpenMP threads wait: `import lowbit` before torch sets a bounded spin (README, 'Threads'),
keeps a user's own setting, and torch's libgomp reads it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SHOW = "import os; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_DISPLAY_ENV")}
    result = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return result


def test_lowbit_first_sets_a_bounded_spin():
    assert _run("import lowbit; " + SHOW).stdout.split() == ["PASSIVE", "50000"]


@pytest.mark.parametrize("name, value, want", [("OMP_WAIT_POLICY", "ACTIVE", ["ACTIVE", "None"]),
                                               ("GOMP_SPINCOUNT", "7", ["None", "7"])])
def test_a_users_setting_is_kept(name, value, want):
    assert _run("import lowbit; " + SHOW, **{name: value}).stdout.split() == want


def test_torch_first_is_left_alone():
    """The variables are read when OpenMP loads with torch: set later they would only mislead."""
    assert _run("import torch, lowbit; " + SHOW).stdout.split() == ["None", "None"]


def test_torchs_openmp_reads_the_spin():
    """OMP_DISPLAY_ENV: each libgomp prints its settings when it loads (torch's at `import torch`)."""
    import torch

    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch is not built with OpenMP")
    shown = _run("import lowbit, torch", OMP_DISPLAY_ENV="verbose").stderr
    if "GOMP_SPINCOUNT" not in shown:
        pytest.skip("torch's OpenMP runtime is not libgomp")
    assert "GOMP_SPINCOUNT = '50000'" in shown and "OMP_WAIT_POLICY = 'PASSIVE'" in shown
