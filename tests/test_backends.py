"""The operator/kernel seam (lowbit.backends): routing, self-check, per-call support, recording, out=."""

import subprocess
import sys
import threading

import pytest
import torch

import lowbit
from lowbit import backends
from lowbit.backends import Kernel, Operator, TensorSpec
from lowbit.errors import BackendUnavailable, DeviceError, DtypeError, ShapeError


class _Double(Kernel):
    """Reference of the toy operator: out = 2 * x."""

    def run(self, x, *, out):
        out.copy_(x * 2)


class _Native(Kernel):
    """A configurable native kernel: right or wrong, supporting only even lengths if asked."""

    def __init__(self, wrong=False, even_only=False, on_run=None):
        self.wrong, self.even_only, self.on_run, self.calls = wrong, even_only, on_run, 0

    def supports(self, x):
        return "odd length" if self.even_only and x.numel() % 2 else None

    def run(self, x, *, out):
        self.calls += 1
        if self.on_run:
            self.on_run()
        out.copy_(x * 2 + (1 if self.wrong else 0))


def _toy(native: Kernel, name="toy_double") -> Operator:
    def outputs(x):
        if x.dtype != torch.float32:
            raise DtypeError(f"{name}: float32 only, got {x.dtype}")
        return (TensorSpec(tuple(x.shape), torch.float32),)

    return Operator(name=name, outputs=outputs, reference=_Double(), native={"cpu": lambda: native},
                    probes=lambda: [(torch.arange(6.0),)])


def test_auto_runs_native_when_the_self_check_passes_and_records_after_running():
    native = _Native()
    op = _toy(native, "toy_ok")
    assert backends.last_backend("toy_ok") is None
    assert op.resolve("cpu", "auto") == "native"
    assert backends.last_backend("toy_ok") is None  # resolving (and self-checking) is not running
    y = op(torch.ones(4), backend="auto")
    assert torch.equal(y, torch.full((4,), 2.0)) and backends.last_backend("toy_ok") == "native"
    op(torch.ones(4), backend="reference")
    assert backends.last_backend("toy_ok") == "reference"


def test_auto_falls_back_when_the_self_check_fails():
    op = _toy(_Native(wrong=True), "toy_wrong")
    assert op.resolve("cpu", "auto") == "reference"
    assert "differs from the reference" in op.auto_check_error("cpu")
    assert torch.equal(op(torch.ones(3), backend="auto"), torch.full((3,), 2.0))
    assert torch.equal(op(torch.ones(3), backend="native"), torch.full((3,), 3.0))  # native is taken at its word


def test_unsupported_arguments_fall_back_under_auto_and_raise_under_native():
    native = _Native(even_only=True)
    op = _toy(native, "toy_even")
    assert torch.equal(op(torch.ones(3), backend="auto"), torch.full((3,), 2.0))
    assert backends.last_backend("toy_even") == "reference"
    with pytest.raises(BackendUnavailable, match="odd length"):
        op(torch.ones(3), backend="native")
    op(torch.ones(4), backend="auto")
    assert backends.last_backend("toy_even") == "native"


def test_a_kernel_that_fails_to_import_is_unavailable():
    def missing():
        raise ImportError("no module named fastlib")

    op = Operator(name="toy_missing", outputs=lambda x: (TensorSpec(tuple(x.shape), x.dtype),),
                  reference=_Double(), native={"cpu": missing}, probes=lambda: [])
    with pytest.raises(BackendUnavailable, match="fastlib"):
        op(torch.ones(2), backend="native")
    assert op.resolve("cpu", "auto") == "reference" and "fastlib" in op.auto_check_error("cpu")
    with pytest.raises(BackendUnavailable, match="meta"):
        op.native_kernel("meta")


def test_the_self_check_holds_no_lock_while_kernels_run():
    """A kernel that calls a public operator under auto during its own self-check must not deadlock."""
    x = torch.ones(2, dtype=torch.float16)
    op = _toy(_Native(on_run=lambda: lowbit.encode_to_hifloat8(x, backend="auto")), "toy_reentrant")
    worker = threading.Thread(target=lambda: op.resolve("cpu", "auto"))
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive()
    assert op.auto_check_error("cpu") is None


def test_validation_happens_before_any_kernel_runs():
    native = _Native()
    op = _toy(native, "toy_validate")
    with pytest.raises(DtypeError, match="float32 only"):
        op(torch.ones(2, dtype=torch.float64), backend="native")
    with pytest.raises(ShapeError, match=r"shape \(2,\)"):
        op(torch.ones(2), out=torch.empty(3), backend="native")
    with pytest.raises(DeviceError):
        op(torch.ones(2), out=torch.empty(2, device="meta"), backend="native")
    with pytest.raises(TypeError, match="out must be a tensor"):
        op(torch.ones(2), out=(torch.empty(2), torch.empty(2)), backend="native")
    assert native.calls == 0


@pytest.mark.parametrize("shift", [0, 1, 3])
def test_out_overlapping_the_input_gives_the_reference_result(shift):
    op = _toy(_Native(), "toy_overlap")
    buffer = torch.arange(12.0)
    x = buffer[:8]
    expected = x * 2
    op(x, out=buffer[shift:shift + 8], backend="native")
    assert torch.equal(buffer[shift:shift + 8], expected)


def test_non_contiguous_out_is_filled():
    op = _toy(_Native(), "toy_strided")
    out = torch.zeros(4, 3).t()
    op(torch.ones(3, 4), out=out, backend="native")
    assert torch.equal(out, torch.full((3, 4), 2.0))


def test_overlap_detection():
    t = torch.arange(10.0)
    assert backends.overlaps(t[:5], t[4:])
    assert not backends.overlaps(t[:5], t[5:])
    assert not backends.overlaps(t, torch.arange(10.0))
    assert backends.overlaps(t.view(2, 5).t(), t[9:])


def test_backend_names_are_checked():
    for bad in ("", "bogus", None, 3):
        with pytest.raises(ValueError):
            backends.check_backend_name(bad)
    with pytest.raises(ValueError, match="bogus"):
        lowbit.encode_to_hifloat8(torch.ones(2, dtype=torch.float16), backend="bogus")
    with pytest.raises(ValueError, match="''"):
        lowbit.encode_to_hifloat8(torch.ones(2, dtype=torch.float16), backend="")
    x = torch.ones(32, dtype=torch.bfloat16)
    for call in (lambda b: lowbit.encode_to_hifloat8(x, backend=b), lambda b: lowbit.mxfp4_quantize(x, backend=b),
                 lambda b: lowbit.encode_to_hifloat8(x, out=torch.empty(32, dtype=torch.uint8), backend=b)):
        with pytest.raises(TypeError, match="backend must be a str .* got int"):
            call(5)


def test_use_backend_is_local_to_the_thread(monkeypatch):
    monkeypatch.setattr(backends, "_process_default", "auto")
    seen = {}
    with lowbit.use_backend("reference"):
        worker = threading.Thread(target=lambda: seen.setdefault("other", lowbit.get_backend()))
        worker.start()
        worker.join()
        assert lowbit.get_backend() == "reference"
    assert seen["other"] == "auto"


def _run_with_env(code: str, value: str) -> subprocess.CompletedProcess:
    env = {"LOWBIT_BACKEND": value, "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_environment_variable_sets_the_default():
    code = "import lowbit, torch; lowbit.encode_to_hifloat8(torch.ones(2).half()); print(lowbit.get_backend(), " \
           "lowbit.last_backend('encode_to_hifloat8'))"
    assert _run_with_env(code, "reference").stdout.split() == ["reference", "reference"]


def test_the_environment_variable_is_read_once(monkeypatch):
    """LOWBIT_BACKEND is read the first time the default is needed (get_backend runs on every operator call),
    again after read_environment; set_backend changes the default whatever the variable says."""
    monkeypatch.setattr(backends, "_environment_value", None)
    monkeypatch.setattr(backends, "_process_default", None)
    monkeypatch.setenv("LOWBIT_BACKEND", "reference")
    assert lowbit.get_backend() == "reference"
    monkeypatch.setenv("LOWBIT_BACKEND", "native")
    assert lowbit.get_backend() == "reference"
    backends.read_environment()
    assert lowbit.get_backend() == "native"
    monkeypatch.setenv("LOWBIT_BACKEND", "auto")
    lowbit.set_backend("reference")
    assert lowbit.get_backend() == "reference"


def test_an_invalid_environment_variable_does_not_break_import():
    result = _run_with_env("import lowbit, torch\ntry:\n    lowbit.get_backend()\nexcept ValueError as e:\n"
                           "    print('refused:', e)\nprint(lowbit.encode_to_hifloat8(torch.ones(2).half(), "
                           "backend='reference').tolist())", "bogus")
    assert result.returncode == 0, result.stderr
    assert "refused: environment variable LOWBIT_BACKEND='bogus'" in result.stdout
    assert "[8, 8]" in result.stdout  # 1.0 is code 0x08 (docs/hifloat8.md)


def test_importing_lowbit_imports_no_kernel_toolkit():
    code = ("import sys, lowbit\nprint(sorted(m for m in ('numba', 'triton', 'torch_npu', 'amct_ops') "
            "if m in sys.modules))")
    result = _run_with_env(code, "auto")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_package_exports_only_its_api_and_subpackages():
    """``dir(lowbit)`` shows the names of __all__ and lowbit's own subpackages, not the modules and helpers its
    __init__ uses (os, sys, importlib's version)."""
    import types

    public = {name for name in dir(lowbit) if not name.startswith("_")}
    modules = {name for name in public if isinstance(getattr(lowbit, name), types.ModuleType)}
    assert public - modules <= set(lowbit.__all__), sorted(public - modules - set(lowbit.__all__))
    assert all(getattr(lowbit, name).__name__ == f"lowbit.{name}" for name in modules), sorted(modules)


class _WrongFor(_Native):
    """A native kernel that is right except for inputs of ``dtype``; records the dtypes it ran."""

    def __init__(self, dtype):
        super().__init__()
        self.dtype, self.ran = dtype, []

    def run(self, x, *, out):
        self.ran.append(x.dtype)
        out.copy_(x * 2 + (1 if x.dtype == self.dtype else 0))


def _two_dtype_toy(native: Kernel, name: str) -> Operator:
    return Operator(name=name, outputs=lambda x: (TensorSpec(tuple(x.shape), x.dtype),), reference=_Double(),
                    native={"cpu": lambda: native},
                    probes=lambda: [(torch.arange(4.0),), (torch.arange(4.0, dtype=torch.float64),)])


def test_auto_self_checks_only_the_probes_with_the_calls_dtypes():
    native = _WrongFor(torch.float64)
    op = _two_dtype_toy(native, "toy_per_dtype")
    op(torch.ones(2), backend="auto")
    assert native.ran == [torch.float32, torch.float32]  # one probe, then the call: float64 never ran
    assert backends.last_backend("toy_per_dtype") == "native"
    assert torch.equal(op(torch.ones(2, dtype=torch.float64), backend="auto"), torch.full((2,), 2.0, dtype=torch.float64))
    assert backends.last_backend("toy_per_dtype") == "reference"  # the float64 probe failed
    assert "differs from the reference" in op.auto_check_error("cpu")  # no arguments: every probe
    assert op.auto_check_error("cpu", (torch.ones(1),)) is None


def test_a_call_with_dtypes_no_probe_has_checks_every_probe_and_a_full_pass_answers_for_all():
    native = _WrongFor(None)  # always right
    op = _two_dtype_toy(native, "toy_unprobed")
    assert op.auto_check_error("cpu", (torch.ones(1, dtype=torch.float16),)) is None
    assert native.ran == [torch.float32, torch.float64]
    assert op.auto_check_error("cpu") is None and op.auto_check_error("cpu", (torch.ones(1),)) is None
    assert len(native.ran) == 2  # the check of every probe answered both
    assert backends.dtype_signature((torch.ones(1), 3, torch.bfloat16, None)) == (torch.float32, torch.bfloat16)
    assert backends.dtype_signature(()) is None
