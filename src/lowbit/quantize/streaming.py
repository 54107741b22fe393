"""Bounded-memory quantization of a safetensors checkpoint directory, tensor by tensor, without building the
model: :func:`quantize_checkpoint` (docs/quantize_checkpoint.md).

The output directory is loadable by :func:`lowbit.load_quantized` and holds what ``quantize_`` +
``save_quantized`` would write for the same layers, split into the input's shards. Every input shard is
checked before anything is written. Each output shard is written under a temporary name and renamed when
complete; a manifest records the completed shards (input name, size, mtime, and the settings), which a
rerun skips. The index, the copied config files and, last, ``quantization.json`` are written at the end:
a directory that has ``quantization.json`` is complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Iterator, Optional, Union

from lowbit.errors import check_int
from lowbit.quantize.checkpoint import FORMAT_VERSION, META_FILE, CheckpointError, safetensors_torch
from lowbit.quantize.shard_io import INDEX_FILE, Shard, encode_header, model_shards, read_shard
from lowbit.quantize.stream_plan import Planner
from lowbit.quantize.stream_worker import CopyTask, QuantizeTask, init_worker, run_indexed
from lowbit.toolchain.files import atomic_path, write_bytes_atomic

PathLike = Union[str, os.PathLike]
MANIFEST_FILE = ".quantize-checkpoint.json"
PARTIAL_SUFFIX = ".partial"
# weight files of other formats are not copied (they would be float copies of the weights)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf", ".ot")


@dataclass
class StreamReport:
    """What :func:`quantize_checkpoint` did: the packed layers, the 2-D ``.weight`` tensors left as they were
    (with the reason), the number of tensors copied, and the shards written now or kept from an earlier run."""

    out_dir: Path
    layers: list[str] = field(default_factory=list)
    not_quantized: dict[str, str] = field(default_factory=dict)
    copied: int = 0
    shards_written: list[str] = field(default_factory=list)
    shards_kept: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{self.out_dir}: {len(self.layers)} layers quantized; {self.copied} tensors copied as they were, "
                f"{len(self.not_quantized)} of them 2-D weights; {len(self.shards_written)} shards written, "
                f"{len(self.shards_kept)} kept from an earlier run")


@dataclass
class _ShardPlan:
    source: Shard
    header: bytes
    size: int
    tasks: list
    layers: dict
    tensors: list[str]

    @property
    def name(self) -> str:
        return self.source.path.name

    @property
    def record(self) -> dict:
        """The manifest entry of this shard once written."""
        return {"input_size": self.source.size, "input_mtime_ns": self.source.mtime_ns, "output_size": self.size}


def default_workers() -> int:
    return min(os.cpu_count() or 1, 4)


def _check_dirs(in_dir: Path, out_dir: Path) -> None:
    if not in_dir.is_dir():
        raise CheckpointError(f"input {in_dir} is not a directory")
    src, dst = in_dir.resolve(), out_dir.resolve()
    if dst == src or src in dst.parents:
        raise ValueError(f"output {out_dir} must not be the input directory {in_dir} or inside it")
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"output {out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / MANIFEST_FILE).is_file():
        raise ValueError(f"output {out_dir} is not empty and was not written by quantize-checkpoint "
                         "(no manifest); choose a new or empty directory")


def _plan_shard(shard: Shard, all_names: set[str], planner: Planner, scheme: str, out_dir: Path,
                report: StreamReport) -> _ShardPlan:
    """Decide every tensor of ``shard``, lay the output out (larger elements first, then by name, as
    safetensors does) and make the tasks that fill it."""
    copies, layers = {}, []
    for name, entry in sorted(shard.tensors.items()):
        has_bias = f"{name.rpartition('.')[0]}.bias" in all_names
        reason = planner.reason_to_copy(name, entry, has_bias)
        if reason is None:
            layers.append(planner.plan_layer(name, entry, has_bias))
            continue
        if name.endswith(".weight") and len(entry.shape) == 2:
            report.not_quantized[name] = reason
        copies[name] = entry
    items = [(name, e.dtype, e.shape, e.nbytes, e.element_size) for name, e in copies.items()]
    items += [(f"{layer.name}.{t.key}", t.dtype, t.shape, t.nbytes, t.element_size)
              for layer in layers for t in layer.tensors]
    _check_unique_outputs(shard, layers, all_names)
    entries, position = {}, 0
    for name, dtype, shape, nbytes, _ in sorted(items, key=lambda i: (-i[4], i[0])):
        entries[name] = (dtype, shape, position, position + nbytes)
        position += nbytes
    header = encode_header(entries, {"format": "pt"})
    start, tmp, src = len(header), str(out_dir / f".{shard.path.name}{PARTIAL_SUFFIX}"), str(shard.path)
    tasks = [CopyTask(src, e.begin, tmp, start + entries[name][2], e.nbytes) for name, e in copies.items()]
    tasks += [QuantizeTask(scheme, src, layer, tmp,
                           tuple(start + entries[f"{layer.name}.{t.key}"][2] for t in layer.tensors))
              for layer in layers]
    report.layers += [layer.name for layer in layers]
    report.copied += len(copies)
    return _ShardPlan(shard, header, start + position, tasks, {layer.name: layer.meta for layer in layers},
                      list(entries))


def _check_unique_outputs(shard: Shard, layers: list, all_names: set[str]) -> None:
    """CheckpointError where a packed tensor of this shard would take the name of a tensor of the checkpoint
    (or of another packed tensor): writing it would lose one of the two."""
    made = {}
    for layer in layers:
        for t in layer.tensors:
            out = f"{layer.name}.{t.key}"
            other = made.get(out) or (out if out in all_names and out != layer.weight else None)
            if other is not None:
                raise CheckpointError(f"{shard.path}: packing {layer.weight!r} makes a tensor {out!r}, but the "
                                      f"checkpoint already has {other!r}: skip the layer (--skip {layer.name})")
            made[out] = layer.weight


def _write_json(path: Path, obj, **kwargs) -> None:
    write_bytes_atomic(path, json.dumps(obj, **kwargs).encode())


def _load_manifest(out_dir: Path, settings: dict) -> dict:
    """The manifest of an earlier run with the same settings, else a fresh one (nothing reusable)."""
    try:
        manifest = json.loads((out_dir / MANIFEST_FILE).read_text())
    except (OSError, ValueError, RecursionError):
        manifest = None
    if not isinstance(manifest, dict) or manifest.get("settings") != settings or not isinstance(
            manifest.get("shards"), dict):
        manifest = {"settings": settings, "shards": {}}
    return manifest


def _is_done(plan: _ShardPlan, manifest: dict, out_dir: Path) -> bool:
    path = out_dir / plan.name
    return manifest["shards"].get(plan.name) == plan.record and path.is_file() and path.stat().st_size == plan.size


def _clear_output(out_dir: Path, plans: list[_ShardPlan]) -> None:
    """Before writing: remove the completion markers, leftovers of an interrupted run (hidden temporary
    files) and shards that are not outputs of this input."""
    keep = {p.name for p in plans}
    for path in out_dir.iterdir():
        stale = path.name.startswith(".") and path.name != MANIFEST_FILE
        stale |= path.name in (META_FILE, INDEX_FILE) or (path.suffix == ".safetensors" and path.name not in keep)
        if stale and path.is_file():
            path.unlink()


def _fsync(path: Path, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Ctrl-C ignored in the block (on the main thread; elsewhere nothing changes): on POSIX, processes spawned
    in it start with it ignored, so one pressed while they import torch prints no traceback from them (one
    pressed in the block itself is lost; the block only submits the tasks)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _mapper(workers: int) -> Iterator:
    """``map`` in this process for one worker, else ``mapper(f, jobs)`` yielding ``f(job)`` from spawned worker
    processes as they finish; RuntimeError if a worker dies (a multiprocessing.Pool waited for its lost task
    for ever). The workers are stopped on exit, their running tasks too."""
    if workers == 1:
        yield map
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    executor = ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=init_worker,
                                   initargs=(threads,))

    def mapper(f, jobs):
        with _sigint_ignored():
            futures = [executor.submit(f, job) for job in jobs]
        try:
            for future in as_completed(futures):
                yield future.result()
        except BrokenProcessPool:
            raise RuntimeError("a worker process exited unexpectedly (killed by a signal, such as the out-of-memory "
                               "killer's?); the shards already written are kept: run the command again to "
                               "resume") from None

    try:
        yield mapper
    finally:
        # No public way to stop running tasks before Python 3.14's terminate_workers: the executor's processes
        # (a dict attribute since 3.2; checked on 3.10-3.13)
        processes = list((getattr(executor, "_processes", None) or {}).values())
        executor.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.terminate()
        for process in processes:
            process.join()


def _tqdm():
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - depends on the environment
        raise ModuleNotFoundError("the progress bar needs the 'tqdm' package: pip install 'lowbit[models]' "
                                  "(or turn the progress bar off)") from None
    return tqdm


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return contextlib.nullcontext(None)
    return _tqdm()(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="quantize-checkpoint")


def _write_shards(todo: list[_ShardPlan], out_dir: Path, manifest: dict, workers: int, progress: bool,
                  report: StreamReport) -> None:
    """Run the shards' tasks; rename each shard into place and record it in the manifest when complete.
    On any error or interruption the temporary files are removed (completed shards stay recorded)."""
    if not todo:
        return
    temps = [out_dir / f".{p.name}{PARTIAL_SUFFIX}" for p in todo]
    remaining = [len(p.tasks) for p in todo]

    def finish(i: int) -> None:
        _fsync(temps[i])
        read_shard(temps[i])  # the header describes exactly the bytes written
        os.replace(temps[i], out_dir / todo[i].name)
        _fsync(out_dir)
        manifest["shards"][todo[i].name] = todo[i].record
        _write_json(out_dir / MANIFEST_FILE, manifest, indent=1, sort_keys=True)
        report.shards_written.append(todo[i].name)

    try:
        for plan, tmp in zip(todo, temps):
            with open(tmp, "wb") as f:
                f.write(plan.header)
                f.truncate(plan.size)
        total = sum(e.nbytes for p in todo for e in p.source.tensors.values())
        jobs = [(i, task) for i, p in enumerate(todo) for task in p.tasks]
        workers = max(1, min(workers, len(jobs), os.cpu_count() or 1))  # each worker holds a tensor in flight
        with _progress_bar(total, progress) as bar, _mapper(workers) as mapper:
            for i, count in enumerate(remaining):
                if count == 0:
                    finish(i)
            for i, nbytes in mapper(run_indexed, jobs):
                if bar is not None:
                    bar.update(nbytes)
                remaining[i] -= 1
                if remaining[i] == 0:
                    finish(i)
    finally:
        for tmp in temps:
            tmp.unlink(missing_ok=True)


def _copy_side_files(in_dir: Path, out_dir: Path) -> None:
    """Copy the input's other files (config, tokenizer, ...; not hidden ones, not weight files) atomically."""
    for path in sorted(in_dir.rglob("*")):
        rel = path.relative_to(in_dir)
        if (not path.is_file() or any(part.startswith(".") for part in rel.parts)
                or path.suffix in WEIGHT_SUFFIXES or rel.as_posix() in (INDEX_FILE, META_FILE)):
            continue
        with atomic_path(out_dir / rel) as tmp:
            shutil.copyfile(path, tmp)


def quantize_checkpoint(in_dir: PathLike, out_dir: PathLike, scheme: str, *, skip: tuple[str, ...] = (),
                        workers: Optional[int] = None, progress: bool = False) -> StreamReport:
    """Quantize the safetensors checkpoint directory ``in_dir`` with the data-free ``scheme`` into ``out_dir``,
    reading one tensor (in blocks of rows) per worker at a time; see the module docstring.

    ``skip``: substrings of layer names not to quantize (embeddings and the scheme's skip list are never
    quantized). ``workers``: processes (default ``min(cpu count, 4)``; at most one per CPU and per tensor to
    write; 1 runs in this process).
    ``progress``: a progress bar on stderr (needs tqdm). Rerunning after an interruption keeps the shards
    already written. Errors, raised before anything is written: ModuleNotFoundError (safetensors, or tqdm for
    the progress bar, missing: the ``models`` extra), ValueError (unknown scheme, one that needs
    calibration or quantizes whole tensors, ``out_dir`` inside ``in_dir`` or not an earlier output),
    CheckpointError (missing, truncated or corrupt input shard or index)."""
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    safetensors_torch()  # the packages the writing needs, before anything is written
    if progress:
        _tqdm()
    if isinstance(skip, str) or not all(isinstance(s, str) and s for s in skip):
        raise ValueError(f"skip must be a sequence of non-empty strings, got {skip!r}")
    skip = tuple(skip)
    planner = Planner(scheme, skip)
    workers = default_workers() if workers is None else check_int("workers", workers, minimum=1)
    _check_dirs(in_dir, out_dir)
    shards, weight_map = model_shards(in_dir)
    all_names = {name for shard in shards for name in shard.tensors}
    report = StreamReport(out_dir)
    plans = [_plan_shard(shard, all_names, planner, scheme, out_dir, report) for shard in shards]

    import lowbit

    settings = {"scheme": scheme, "skip": sorted(skip), "lowbit_version": lowbit.__version__,
                "format_version": FORMAT_VERSION}
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = _load_manifest(out_dir, settings)
    _write_json(out_dir / MANIFEST_FILE, manifest, indent=1, sort_keys=True)  # marks the directory as ours
    _clear_output(out_dir, plans)
    todo = [p for p in plans if not _is_done(p, manifest, out_dir)]
    report.shards_kept = [p.name for p in plans if p not in todo]
    _write_shards(todo, out_dir, manifest, workers, progress, report)
    if weight_map is not None:
        index = {"metadata": {"total_size": sum(p.size - len(p.header) for p in plans)},
                 "weight_map": {name: p.name for p in plans for name in p.tensors}}
        _write_json(out_dir / INDEX_FILE, index, indent=2, sort_keys=True)
    _copy_side_files(in_dir, out_dir)
    layers = {name: meta for p in plans for name, meta in p.layers.items()}
    meta = {"format_version": FORMAT_VERSION, "lowbit_version": lowbit.__version__, "layers": layers}
    _write_json(out_dir / META_FILE, meta, indent=1, sort_keys=True)
    return report
