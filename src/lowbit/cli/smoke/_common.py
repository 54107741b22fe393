"""Building blocks of a smoke check: per-case results, the verdict, and the environment record.

Each operator's smoke module (``lowbit/cli/smoke/<op>.py``) defines ``NAME`` and
``run(backend, device) -> list[dict]`` whose dicts come from :func:`case_result`. A case's contracts are
``shape_preserved``, ``dtype_preserved``, ``device_preserved`` and ``matches_reference`` (bit equality
with the reference backend on the same input), plus the names in its ``extra_contracts``. A case built
with a ``tolerance`` (svd_quant: backends accumulate its matmuls in different orders) is judged by
``within_tolerance`` (``allclose`` with the reference at ``tolerance = {"rtol", "atol"}``) instead of
``matches_reference``, which still reports bit equality. ``max_abs_error`` / ``mean_abs_error`` compare
the output with the input over the elements where both are finite (docs/cli.md, "lowbit smoke").
"""

from __future__ import annotations

import os
import platform
from importlib.metadata import PackageNotFoundError, version

import torch

from lowbit import backends

CONTRACT_KEYS = ("shape_preserved", "dtype_preserved", "device_preserved", "matches_reference")
TOLERANCE_CONTRACT = "within_tolerance"


def dtype_name(dtype: torch.dtype) -> str:
    """'float16' for torch.float16."""
    return str(dtype).removeprefix("torch.")


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors have the same shape, dtype and bit patterns (NaN payloads included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.is_floating_point():
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def abs_errors(output: torch.Tensor, target: torch.Tensor) -> tuple[float, float]:
    """(max, mean) of |output - target| in float64 over elements finite in both; (0, 0) if none."""
    o = output.detach().cpu().to(torch.float64).reshape(-1)
    t = target.detach().cpu().to(torch.float64).reshape(-1)
    finite = torch.isfinite(o) & torch.isfinite(t)
    if not bool(finite.any()):
        return 0.0, 0.0
    err = (o[finite] - t[finite]).abs()
    return float(err.max()), float(err.mean())


def case_result(
    *,
    backend: str,
    input_dtype: torch.dtype,
    output: torch.Tensor,
    reference: torch.Tensor,
    expected_shape: tuple[int, ...],
    expected_dtype: torch.dtype,
    expected_device: torch.device,
    error_target: torch.Tensor | None = None,
    checks: dict[str, bool] | None = None,
    tolerance: tuple[float, float] | None = None,
    **extra,
) -> dict:
    """One smoke result. ``backend``: the backend that ran. ``reference``: the reference backend's output
    for the same input. ``error_target``: what the output approximates (usually the input) for the error
    figures; None skips them. ``checks``: further operator-specific contracts (name -> holds), listed in
    the result's ``extra_contracts`` and required by :func:`contracts_hold`. ``tolerance``: (rtol, atol)
    for an operator judged within a tolerance of the reference (module docstring). ``extra`` keys are added
    as they are (JSON-serialisable, informational)."""
    checks = {name: bool(holds) for name, holds in (checks or {}).items()}
    if tolerance is not None:
        checks[TOLERANCE_CONTRACT] = within_tolerance(output, reference, *tolerance)
        extra["tolerance"] = {"rtol": tolerance[0], "atol": tolerance[1]}
    max_err, mean_err = abs_errors(output, error_target) if error_target is not None else (0.0, 0.0)
    return {
        "backend": backend,
        "input_dtype": dtype_name(input_dtype),
        "shape_preserved": tuple(output.shape) == tuple(expected_shape),
        "dtype_preserved": output.dtype == expected_dtype,
        "device_preserved": output.device == torch.device(expected_device),
        "matches_reference": bits_equal(output, reference),
        "max_abs_error": max_err,
        "mean_abs_error": mean_err,
        "warning_count": 0,  # set by the smoke runner from the warnings the check raised
        **checks,
        "extra_contracts": sorted(checks),
        **extra,
    }


def within_tolerance(output: torch.Tensor, reference: torch.Tensor, rtol: float, atol: float) -> bool:
    """Same shape and ``allclose(output, reference, rtol, atol)`` in float32 (NaN equals nothing)."""
    if output.shape != reference.shape:
        return False
    return bool(torch.allclose(output.detach().cpu().float(), reference.detach().cpu().float(), rtol=rtol, atol=atol))


def required_contracts(result: dict) -> tuple[str, ...]:
    """The contract keys a case must meet: the common ones (``matches_reference`` only for a case without a
    tolerance) and its ``extra_contracts``."""
    common = tuple(k for k in CONTRACT_KEYS if not (k == "matches_reference" and "tolerance" in result))
    return (*common, *result["extra_contracts"])


def contracts_hold(results: list[dict]) -> bool:
    """Every required contract (:func:`required_contracts`) of every case holds."""
    return bool(results) and all(r[k] for r in results for k in required_contracts(r))


def backend_that_ran(*ops: str) -> str:
    """The backend that last ran all of ``ops`` (backends.last_backend), or "mixed" if they differ."""
    ran = {backends.last_backend(op) for op in ops}
    return ran.pop() if len(ran) == 1 else "mixed"


def hardware_path_verified(results: list[dict], device: torch.device) -> bool:
    """The native kernel ran on the real device named, met every contract and raised no warning.

    Triton under the interpreter does not verify a GPU path (docs/cli.md, "The upstream smoke contract").
    """
    if device.type == "cuda" and os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return contracts_hold(results) and all(r["backend"] == "native" and not r["warning_count"] for r in results)


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def device_name(device: torch.device) -> str:
    """A human-readable name of the device (CPU model, GPU name)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    if device.type == "npu":
        try:
            return torch.npu.get_device_name(device)  # type: ignore[attr-defined]
        except Exception:  # torch_npu absent or too old: still report something
            return "npu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device) -> dict:
    """Versions and device facts recorded in every smoke report."""
    return {
        "cann_home": os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME"),
        "device": str(device),
        "device_name": device_name(device),
        "lowbit": _dist_version("lowbit"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_npu": _dist_version("torch_npu", "torch-npu"),
        "amct_ops": _dist_version("amct-ops", "amct_ops"),
        "numba": _dist_version("numba"),
        "triton": _dist_version("triton"),
        "cpu_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
    }
