"""The CANN ops-nn WeightQuantBatchMatmul sample's data flow (docs/wqbmm.md, "The sample's tool chain"):
generate the inputs and golden, read and write the dataset, run the operator on it, profile it.

Dataset layout under a root folder (the sample's)::

    input/input_a.bin                       x (M, K), raw little-endian FP16 (BF16 with dtype bfloat16)
    input/input_weight.bin                  packed int4 weight (K, N/2) uint8
    input/input_antiquant_scale_fp16.bin    scale (K/G, N) (``..._bf16.bin`` for BF16)
    input/meta.json                         sizes, dtype and seed (lowbit's addition: the sample hard-codes them)
    input_input_weight_real.bin             unpacked int8 weight (K, N), beside the two folders
    output/golden.bin                       the MSD result (M, N) of the reference
    output/output_z.bin                     written by :func:`run_sample`
    output/profile/                         :func:`profile_sample`'s torch.profiler traces

:func:`gen_data` draws with ``np.random.seed(seed)``: x = uniform(-3, 3, (M, K)), scale = uniform(-3, 3,
(K/G, N)), W = uniform(-7, 7, (K, N)) -> int8 (truncation), in that order, as the sample's gen_data.py; at
its default sizes and seed the files and golden are byte-identical to the sample's. The golden uses per-row
maxima, so it is right for M > 1 too (the sample's script is not). A new dataset replaces ``input/``,
``output/`` and the real weight as a whole (lowbit.toolchain.files.staged_entries): a folder never holds
new inputs beside an old golden or an old output.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from lowbit import backends
from lowbit.errors import ShapeError
from lowbit.formats import wqbmm as reference
from lowbit.ops.wqbmm import TEMPLATES, plan_weight_quant_batch_matmul
from lowbit.toolchain.files import (
    DatasetError,
    atomic_path,
    read_tensor,
    staged_entries,
    tensor_bytes,
    write_bytes_atomic,
)
from lowbit.toolchain.timing import median_seconds

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
SAMPLE_SIZES = dict(m=1, n=12288, k=8192, group_size=128, seed=1)
DATASET_ENTRIES = ("input", "output", "input_input_weight_real.bin")
SEED_LIMIT = 2**32  # np.random.seed takes 0 .. 2**32 - 1
_SCALE_FILE = {"float16": "input_antiquant_scale_fp16.bin", "bfloat16": "input_antiquant_scale_bf16.bin"}


@dataclass(frozen=True)
class SampleMeta:
    """Sizes, seed and dtype of a dataset (input/meta.json).

    Validated on construction by the operator's rules: M, K, N positive, N even, group_size a positive
    multiple of 32 dividing K (ShapeError); dtype "float16" or "bfloat16", 0 <= seed < 2**32 (ValueError);
    integers, not bools (TypeError).
    """

    m: int
    n: int
    k: int
    group_size: int
    seed: int
    dtype: str = "float16"

    def __post_init__(self) -> None:
        for name in ("m", "n", "k", "group_size", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an integer, got {value!r}")
        if min(self.m, self.k, self.n) <= 0:
            raise ShapeError(f"M, K and N must be positive, got M={self.m}, K={self.k}, N={self.n}")
        if self.n % 2:
            raise ShapeError(f"N must be even (two int4 per byte), got N={self.n}")
        if self.group_size <= 0 or self.group_size % 32 or self.k % self.group_size:
            raise ShapeError(f"group size must be a positive multiple of 32 dividing K={self.k}, got {self.group_size}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def path(self, root: Path | str, name: str) -> Path:
        """The file ``name`` (x, weight, scale, weight_real, golden, output, meta) of the dataset at ``root``."""
        files = {
            "x": "input/input_a.bin",
            "weight": "input/input_weight.bin",
            "scale": f"input/{_SCALE_FILE[self.dtype]}",
            "meta": "input/meta.json",
            "weight_real": "input_input_weight_real.bin",
            "golden": "output/golden.bin",
            "output": "output/output_z.bin",
        }
        return Path(root) / files[name]


@dataclass(frozen=True)
class SampleData:
    """A generated dataset, on the CPU: x (M, K), packed weight (K, N/2) uint8, scale (K/G, N), the int8
    weight (K, N) and the golden (M, N) (x's dtype)."""

    x: torch.Tensor
    weight: torch.Tensor
    scale: torch.Tensor
    weight_real: torch.Tensor
    golden: torch.Tensor


def generate(meta: SampleMeta) -> SampleData:
    """Draw the sample's inputs and compute the golden (module docstring); no file is touched."""
    dtype = meta.torch_dtype
    rng = np.random.RandomState(meta.seed)  # the legacy global generator's stream, as np.random.seed
    x_f64 = rng.uniform(low=-3, high=3, size=(meta.m, meta.k))
    scale_f64 = rng.uniform(low=-3, high=3, size=(meta.k // meta.group_size, meta.n))
    w_int8 = rng.uniform(low=-7, high=7, size=(meta.k, meta.n)).astype(np.int8)
    # numpy's float64 -> float16 is one correctly rounded step; BF16 goes through torch (also one step).
    if dtype == torch.float16:
        x, scale = torch.from_numpy(x_f64.astype(np.float16)), torch.from_numpy(scale_f64.astype(np.float16))
    else:
        x, scale = torch.from_numpy(x_f64).to(dtype), torch.from_numpy(scale_f64).to(dtype)
    w_u8 = w_int8.astype(np.uint8)
    packed = torch.from_numpy((w_u8 << 4)[:, 1::2] + (w_u8 & 0x0F)[:, 0::2])
    del x_f64, scale_f64, w_u8
    golden = reference.wqbmm_msd(x, packed, scale, None, meta.group_size)
    return SampleData(x, packed, scale, torch.from_numpy(w_int8), golden)


def write_dataset(root: Path | str, meta: SampleMeta, data: SampleData) -> None:
    """Write ``data`` as the dataset at ``root``, replacing input/, output/ and the real weight as a whole
    (module docstring); on any failure the previous dataset is left as it was."""
    with staged_entries(root, DATASET_ENTRIES) as staging:
        for name in ("x", "weight", "scale", "weight_real", "golden"):
            write_bytes_atomic(meta.path(staging, name), tensor_bytes(getattr(data, name)))
        write_bytes_atomic(meta.path(staging, "meta"), json.dumps(asdict(meta), indent=2).encode())


def gen_data(root: Path | str, meta: SampleMeta) -> None:
    """Generate the dataset of ``meta`` and write it at ``root`` (:func:`generate`, :func:`write_dataset`)."""
    write_dataset(root, meta, generate(meta))


def read_meta(root: Path | str) -> SampleMeta:
    """input/meta.json of the dataset at ``root``, or the sample's fixed sizes when it is absent (files from
    the sample itself). DatasetError naming the file if it is unreadable or not valid sizes."""
    path = Path(root) / "input/meta.json"
    if not path.exists():
        return SampleMeta(**SAMPLE_SIZES)
    try:
        fields = json.loads(path.read_text())
        if not isinstance(fields, dict):
            raise ValueError(f"expected a JSON object, got {type(fields).__name__}")
        return SampleMeta(**fields)
    except (OSError, UnicodeDecodeError, ValueError, TypeError, RecursionError) as exc:
        raise DatasetError(f"{path}: not a valid meta.json: {exc}") from exc


def read_inputs(root: Path | str, meta: SampleMeta) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, packed weight, scale) as CPU tensors from the input files; DatasetError for a bad file."""
    dtype = meta.torch_dtype
    x = read_tensor(meta.path(root, "x"), dtype, (meta.m, meta.k))
    weight = read_tensor(meta.path(root, "weight"), torch.uint8, (meta.k, meta.n // 2))
    scale = read_tensor(meta.path(root, "scale"), dtype, (meta.k // meta.group_size, meta.n))
    return x, weight, scale


def run_sample(root: Path | str, template: str = "preload", algorithm: str = "msd", backend: str | None = None) -> Path:
    """Compute output/output_z.bin from input/ with the two-stage API (CPU); returns its path.

    ``backend``: as the operator's (None: the process default). BackendUnavailable if it cannot run here.
    """
    meta = read_meta(root)
    x, weight, scale = read_inputs(root, meta)
    plan = plan_weight_quant_batch_matmul(
        meta.m, meta.k, meta.n, group_size=meta.group_size, algorithm=algorithm, template=template,
        dtype=x.dtype, backend=backend,
    )
    y = plan.run(x, weight, scale, workspace=plan.new_workspace())
    path = meta.path(root, "output")
    write_bytes_atomic(path, tensor_bytes(y))
    return path


def profile_sample(
    root: Path | str,
    templates: Sequence[str] = TEMPLATES,
    backend_names: Sequence[str] = ("native", "reference"),
    repeats: int = 5,
) -> tuple[list[dict], list[str]]:
    """Time plan.run on input/ with the weight packed once (plan.pack_weight) per (backend, template):
    median of ``repeats`` runs for native, one run otherwise; write a torch.profiler trace of each to
    output/profile/<template>_<backend>.json (atomically).

    Returns (rows, skipped): rows {"template", "backend", "us", "trace"}; skipped, one message per case
    whose backend cannot run here.
    """
    from torch.profiler import ProfilerActivity, profile

    root = Path(root)
    meta = read_meta(root)
    x, weight, scale = read_inputs(root, meta)
    rows, skipped = [], []
    for backend in backend_names:
        for template in templates:
            try:
                plan = plan_weight_quant_batch_matmul(
                    meta.m, meta.k, meta.n, group_size=meta.group_size, template=template, dtype=x.dtype,
                    backend=backend, prepacked=True,
                )
            except backends.BackendUnavailable as exc:
                skipped.append(f"skipping {template}/{backend}: {exc}")
                continue
            out, workspace = torch.empty(meta.m, meta.n, dtype=x.dtype), plan.new_workspace()
            packed = plan.pack_weight(weight)
            run = lambda: plan.run(x, packed, scale, out=out, workspace=workspace)
            seconds = median_seconds(run, repeats=repeats if backend == "native" else 1, warmup=1)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                run()
            trace = root / f"output/profile/{template}_{backend}.json"
            with atomic_path(trace) as tmp:
                prof.export_chrome_trace(str(tmp))
            rows.append({"template": template, "backend": plan.backend, "us": seconds * 1e6, "trace": str(trace)})
    return rows, skipped
