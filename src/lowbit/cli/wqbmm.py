"""The ops-nn WeightQuantBatchMatmul sample's tool chain (wqbmm.md): ``lowbit wqbmm gen-data | run |
profile | example`` and ``lowbit verify OUTPUT GOLDEN``.

Folder layout (relative to ``--dir``, default the current folder, as in the sample)::

    input/input_a.bin                       x (M, K), raw little-endian FP16 (BF16 with --dtype bfloat16)
    input/input_weight.bin                  packed int4 weight (K, N/2) uint8
    input/input_antiquant_scale_fp16.bin    scale (K/G, N) (``..._bf16.bin`` for BF16)
    input/meta.json                         sizes, dtype and seed (lowbit's addition: the sample hard-codes them)
    input_input_weight_real.bin             unpacked int8 weight (K, N), beside the two folders
    output/golden.bin                       the MSD result (M, N) of the reference
    output/output_z.bin                     written by ``run``
    output/profile/                         ``profile``'s torch.profiler traces

``gen-data`` draws with ``np.random.seed(seed)``: x = uniform(-3, 3, (M, K)), scale = uniform(-3, 3,
(K/G, N)), W = uniform(-7, 7, (K, N)) -> int8 (truncation), in that order, as the sample's gen_data.py; at
its default sizes and seed the files and golden are byte-identical to the sample's. The golden uses per-row
maxima, so it is right for M > 1 too (the sample's script is not).

``verify`` keeps the sample's semantics (mismatch = not isclose(rtol=1e-6, atol=1e-9, equal_nan); a
mismatch with relative difference > error_tol is an error; pass iff errors / size <= error_tol) and fixes
its defects: every mismatch is counted (not only the first 101 printed), the relative difference divides by
|golden| (a negative golden can fail; a zero golden gives an infinite difference), a NaN against a number
is an error, and files of different sizes are an error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from lowbit import backends
from lowbit.formats import wqbmm as reference
from lowbit.ops.wqbmm import TEMPLATES, plan_weight_quant_batch_matmul

SAMPLE_SIZES = dict(m=1, n=12288, k=8192, group_size=128, seed=1)
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_SCALE_FILE = {"float16": "input_antiquant_scale_fp16.bin", "bfloat16": "input_antiquant_scale_bf16.bin"}


@dataclass(frozen=True)
class SampleMeta:
    """What ``gen-data`` generated (input/meta.json)."""

    m: int
    n: int
    k: int
    group_size: int
    seed: int
    dtype: str = "float16"

    def path(self, root: Path, name: str) -> Path:
        files = {
            "x": "input/input_a.bin",
            "weight": "input/input_weight.bin",
            "scale": f"input/{_SCALE_FILE[self.dtype]}",
            "weight_real": "input_input_weight_real.bin",
            "golden": "output/golden.bin",
            "output": "output/output_z.bin",
        }
        return root / files[name]


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and os.replace: never a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.fchmod(fd, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return t.view(torch.uint8).numpy().tobytes() if t.element_size() > 1 else t.numpy().tobytes()


def _read_tensor(path: Path, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The raw little-endian file as a (CPU) tensor of ``shape``; ValueError for an empty or wrong-sized file."""
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size == 0:
        raise ValueError(f"{path} is empty")
    expected = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    if raw.size != expected:
        raise ValueError(f"{path}: {raw.size} bytes, expected {expected} for {dtype} {shape}")
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def gen_data(root: Path, meta: SampleMeta) -> None:
    """Generate the sample's inputs and golden under ``root`` (see the module docstring)."""
    if meta.k % meta.group_size or meta.n % 2:
        raise ValueError(f"need K % G == 0 and even N, got K={meta.k}, N={meta.n}, G={meta.group_size}")
    dtype = _DTYPES[meta.dtype]
    np.random.seed(meta.seed)
    x_f64 = np.random.uniform(low=-3, high=3, size=(meta.m, meta.k))
    scale_f64 = np.random.uniform(low=-3, high=3, size=(meta.k // meta.group_size, meta.n))
    w_int8 = np.random.uniform(low=-7, high=7, size=(meta.k, meta.n)).astype(np.int8)
    # numpy's float64 -> float16 is one correctly rounded step; BF16 goes through torch (also one step).
    if dtype == torch.float16:
        x, scale = torch.from_numpy(x_f64.astype(np.float16)), torch.from_numpy(scale_f64.astype(np.float16))
    else:
        x, scale = torch.from_numpy(x_f64).to(dtype), torch.from_numpy(scale_f64).to(dtype)
    w_u8 = w_int8.astype(np.uint8)
    packed = torch.from_numpy((w_u8 << 4)[:, 1::2] + (w_u8 & 0x0F)[:, 0::2])
    del x_f64, scale_f64, w_u8
    golden = reference.wqbmm_msd(x, packed, scale, None, meta.group_size)
    _write_atomic(meta.path(root, "x"), _tensor_bytes(x))
    _write_atomic(meta.path(root, "weight"), _tensor_bytes(packed))
    _write_atomic(meta.path(root, "scale"), _tensor_bytes(scale))
    _write_atomic(meta.path(root, "weight_real"), w_int8.tobytes())
    _write_atomic(meta.path(root, "golden"), _tensor_bytes(golden))
    _write_atomic(root / "input/meta.json", json.dumps(asdict(meta), indent=2).encode())


def read_meta(root: Path) -> SampleMeta:
    """input/meta.json, or the sample's fixed sizes when it is absent (files from the sample itself)."""
    path = root / "input/meta.json"
    if not path.exists():
        return SampleMeta(**SAMPLE_SIZES)
    return SampleMeta(**json.loads(path.read_text()))


def read_inputs(root: Path, meta: SampleMeta) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, packed weight, scale) as CPU tensors from the input files."""
    dtype = _DTYPES[meta.dtype]
    x = _read_tensor(meta.path(root, "x"), dtype, (meta.m, meta.k))
    weight = _read_tensor(meta.path(root, "weight"), torch.uint8, (meta.k, meta.n // 2))
    scale = _read_tensor(meta.path(root, "scale"), dtype, (meta.k // meta.group_size, meta.n))
    return x, weight, scale


def run_sample(root: Path, template: str, algorithm: str = "msd", backend: str | None = None) -> Path:
    """Compute output/output_z.bin from input/ with the two-stage API; returns its path."""
    meta = read_meta(root)
    x, weight, scale = read_inputs(root, meta)
    plan = plan_weight_quant_batch_matmul(
        meta.m, meta.k, meta.n, group_size=meta.group_size, algorithm=algorithm, template=template,
        dtype=x.dtype, backend=backend,
    )
    y = plan.run(x, weight, scale, workspace=plan.new_workspace())
    path = meta.path(root, "output")
    _write_atomic(path, _tensor_bytes(y))
    return path


@dataclass
class VerifyResult:
    size: int
    mismatches: int
    errors: int
    error_ratio: float
    passed: bool
    first: list  # (index, expected, actual, rdiff) of the first ``show`` mismatches


def verify_arrays(
    output: np.ndarray, golden: np.ndarray, *, rtol=1e-6, atol=1e-9, error_tol=1e-3, show=101
) -> VerifyResult:
    """The sample's verify_result.py decision, fixed (module docstring). Arrays: same size, float32."""
    if output.size != golden.size:
        raise ValueError(f"output has {output.size} elements but golden has {golden.size}")
    out, gold = output.reshape(-1).astype(np.float32), golden.reshape(-1).astype(np.float32)
    mismatch = np.flatnonzero(~np.isclose(out, gold, rtol=rtol, atol=atol, equal_nan=True))
    with np.errstate(divide="ignore", invalid="ignore"):
        rdiff = np.abs(out[mismatch] - gold[mismatch]) / np.abs(gold[mismatch])
    errors = int(np.count_nonzero(~(rdiff <= error_tol)))  # NaN rdiff (NaN vs number) is an error
    ratio = errors / out.size if out.size else 0.0
    first = [(int(i), float(gold[i]), float(out[i]), float(r)) for i, r in zip(mismatch[:show], rdiff[:show])]
    return VerifyResult(int(out.size), int(mismatch.size), errors, ratio, ratio <= error_tol, first)


def verify_files(output: Path, golden: Path, dtype: torch.dtype = torch.float16, **tolerances) -> VerifyResult:
    """:func:`verify_arrays` on two raw files of ``dtype`` (non-empty, sizes must match)."""
    sizes = output.stat().st_size, golden.stat().st_size
    for path, size in zip((output, golden), sizes):
        if size == 0:
            raise ValueError(f"{path} is empty")
    if sizes[0] != sizes[1]:
        raise ValueError(f"{output} has {sizes[0]} bytes but {golden} has {sizes[1]}")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    to_f32 = lambda p: _read_tensor(p, dtype, (p.stat().st_size // itemsize,)).to(torch.float32).numpy()
    return verify_arrays(to_f32(output), to_f32(golden), **tolerances)


def print_verify(result: VerifyResult, file=None) -> None:
    """The sample's printout, plus the totals it did not print."""
    for index, expected, actual, rdiff in result.first:
        print(
            f"data index: {index:06d}, expected: {expected:-.9f}, actual: {actual:-.9f}, rdiff: {rdiff:-.6f}",
            file=file,
        )
    print(f"mismatches: {result.mismatches}, errors: {result.errors} of {result.size}, "
          f"error ratio: {result.error_ratio:.4f}", file=file)
    print("test pass" if result.passed else "[ERROR] result error", file=file)


def profile_sample(
    root: Path, templates=TEMPLATES, backend_names=("native", "reference"), repeats: int = 5
) -> list[dict]:
    """Median time per (template, backend) of plan.run on input/ with the weight packed once
    (plan.pack_weight), and a torch.profiler trace of each under output/profile/<template>_<backend>.json.
    Backends that cannot run here are skipped."""
    from torch.profiler import ProfilerActivity, profile

    from lowbit.cli.bench._timing import median_seconds

    meta = read_meta(root)
    x, weight, scale = read_inputs(root, meta)
    rows = []
    (root / "output/profile").mkdir(parents=True, exist_ok=True)
    for backend in backend_names:
        for template in templates:
            try:
                plan = plan_weight_quant_batch_matmul(
                    meta.m, meta.k, meta.n, group_size=meta.group_size, template=template, dtype=x.dtype,
                    backend=backend, prepacked=True,
                )
            except backends.BackendUnavailable as exc:
                print(f"skipping {template}/{backend}: {exc}", file=sys.stderr)
                continue
            out, workspace = torch.empty(meta.m, meta.n, dtype=x.dtype), plan.new_workspace()
            packed = plan.pack_weight(weight)
            run = lambda: plan.run(x, packed, scale, out=out, workspace=workspace)
            seconds = median_seconds(run, repeats=repeats if backend == "native" else 1, warmup=1)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                run()
            trace = root / f"output/profile/{template}_{backend}.json"
            prof.export_chrome_trace(str(trace))
            rows.append({"template": template, "backend": plan.backend, "us": seconds * 1e6, "trace": str(trace)})
    return rows


def _print_rows(rows: list[dict]) -> None:
    if not rows:
        return
    keys = list(rows[0])
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(f"{row[k]:.1f}" if isinstance(row[k], float) else str(row[k]) for k in keys))


def example(root: Path, backend: str | None = None, meta: SampleMeta | None = None) -> int:
    """run.sh end to end: clean, gen-data, run + verify per template, profile; prints basic vs preload."""
    root.mkdir(parents=True, exist_ok=True)
    for folder in ("input", "output"):
        for stale in (root / folder).glob("*.bin"):
            stale.unlink()
    meta = meta or SampleMeta(**SAMPLE_SIZES)
    print(f"[gen-data] M={meta.m} N={meta.n} K={meta.k} G={meta.group_size} seed={meta.seed}")
    gen_data(root, meta)
    status = 0
    verdicts = {}
    for template in TEMPLATES:
        path = run_sample(root, template, backend=backend)
        result = verify_files(path, meta.path(root, "golden"), _DTYPES[meta.dtype])
        print(f"[run+verify] template={template}")
        print_verify(result)
        verdicts[template] = "pass" if result.passed else "FAIL"
        status |= 0 if result.passed else 1
    rows = profile_sample(root, backend_names=(backend or "auto",))
    print("[profile] basic vs preload (median us; traces under output/profile/)")
    _print_rows([{**{k: r[k] for k in ("template", "backend", "us")}, "verify": verdicts[r["template"]]} for r in rows])
    return status


# ---- argparse ------------------------------------------------------------------------------------------


def _meta_from_args(args: argparse.Namespace) -> SampleMeta:
    return SampleMeta(args.m, args.n, args.k, args.group_size, args.seed, args.dtype)


def _add_size_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--m", type=int, default=SAMPLE_SIZES["m"])
    parser.add_argument("--n", type=int, default=SAMPLE_SIZES["n"])
    parser.add_argument("--k", type=int, default=SAMPLE_SIZES["k"])
    parser.add_argument("--group-size", type=int, default=SAMPLE_SIZES["group_size"])
    parser.add_argument("--seed", type=int, default=SAMPLE_SIZES["seed"])
    parser.add_argument("--dtype", choices=list(_DTYPES), default="float16")


def _cmd_gen_data(args: argparse.Namespace) -> int:
    gen_data(Path(args.dir), _meta_from_args(args))
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    print(run_sample(Path(args.dir), args.template, args.algorithm, args.backend))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    try:
        result = verify_files(Path(args.output), Path(args.golden), _DTYPES[args.dtype],
                              rtol=args.rtol, atol=args.atol, error_tol=args.error_tol)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"[ERROR] {exc}", file=sys.stderr)
        return 1
    print_verify(result)
    return 0 if result.passed else 1


def _cmd_profile(args: argparse.Namespace) -> int:
    _print_rows(profile_sample(Path(args.dir), backend_names=args.backends.split(","), repeats=args.repeats))
    return 0


def _cmd_example(args: argparse.Namespace) -> int:
    return example(Path(args.dir), args.backend, _meta_from_args(args))


def add_subcommands(subparsers) -> None:
    """Add ``wqbmm`` (gen-data, run, profile, example) and ``verify`` to the ``lowbit`` parser."""
    backend_choices = list(backends.BACKENDS)
    wqbmm = subparsers.add_parser("wqbmm", help="the ops-nn WeightQuantBatchMatmul sample flow")
    sub = wqbmm.add_subparsers(dest="wqbmm_command", required=True)

    gen = sub.add_parser("gen-data", help="inputs and golden as the sample's gen_data.py")
    gen.add_argument("--dir", default=".")
    _add_size_flags(gen)
    gen.set_defaults(func=_cmd_gen_data)

    run = sub.add_parser("run", help="input/ -> output/output_z.bin")
    run.add_argument("--dir", default=".")
    run.add_argument("--template", choices=list(TEMPLATES), default="preload")
    run.add_argument("--algorithm", choices=["msd", "dequant"], default="msd")
    run.add_argument("--backend", choices=backend_choices, default=None)
    run.set_defaults(func=_cmd_run)

    prof = sub.add_parser("profile", help="per-template, per-backend timing and torch.profiler traces")
    prof.add_argument("--dir", default=".")
    prof.add_argument("--backends", default="native,reference", help="comma-separated backends")
    prof.add_argument("--repeats", type=int, default=7)
    prof.set_defaults(func=_cmd_profile)

    ex = sub.add_parser("example", help="run.sh: clean, gen-data, run, verify, profile for both templates")
    ex.add_argument("--dir", default=".")
    ex.add_argument("--backend", choices=backend_choices, default=None)
    _add_size_flags(ex)
    ex.set_defaults(func=_cmd_example)

    verify = subparsers.add_parser("verify", help="compare OUTPUT with GOLDEN as the sample's verify_result.py")
    verify.add_argument("output")
    verify.add_argument("golden")
    verify.add_argument("--dtype", choices=list(_DTYPES), default="float16")
    verify.add_argument("--rtol", type=float, default=1e-6)
    verify.add_argument("--atol", type=float, default=1e-9)
    verify.add_argument("--error-tol", type=float, default=1e-3)
    verify.set_defaults(func=_cmd_verify)
