"""Peak memory and throughput of ``lowbit quantize-checkpoint`` on a synthetic sharded checkpoint.

Usage: ``PYTHONPATH=src python benchmarks/quantize_checkpoint.py --shards 2,8 --workers 1,2 --scheme hif8-wo``

Builds, in ``--dir`` (default: a temporary folder, removed at the end), checkpoints of S shards of
``--per-shard`` random (``--rows``, ``--cols``) weights plus a 1-D norm each (the layout of a decoder's MLP
weights), then runs the command in a subprocess for each (shards, workers) pair and reports:

* ``peak_rss_process``: the largest peak RSS of any one process of the run (the command or one of its pool
  workers): ``getrusage(RUSAGE_CHILDREN).ru_maxrss`` in a small launcher process that runs the command
  (it covers the waited-for descendants: the maximum over the processes, not their sum);
* ``peak_rss_sum``: the largest sum of the RSS of the command and its workers, sampled every 20 ms from /proc;
* the same two for a run on a 1-tensor checkpoint of (64, ``--cols``) (process start-up: interpreter,
  torch, lowbit's kernels), and the difference, to compare with the largest tensor's size;
* throughput: input bytes / wall time of the run (process start and kernel warm-up included).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

MIB = 1024 * 1024


def write_checkpoint(root: Path, shards: int, per_shard: int, rows: int, cols: int, dtype: torch.dtype) -> int:
    """A sharded checkpoint with an index; returns the input bytes (the shard files' sizes)."""
    from safetensors.torch import save_file

    root.mkdir(parents=True)
    weight_map, total = {}, 0
    generator = torch.Generator().manual_seed(0)
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {}
        for t in range(per_shard):
            layer = f"model.layers.{s}.mlp.proj{t}"
            tensors[f"{layer}.weight"] = torch.randn(rows, cols, generator=generator).to(dtype)
            tensors[f"model.layers.{s}.norm{t}.weight"] = torch.ones(cols, dtype=dtype)
        save_file(tensors, str(root / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total += (root / file).stat().st_size
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (root / "config.json").write_text("{}")
    return total


def _tree_rss(pid: int) -> int:
    """Sum of VmRSS (bytes) of ``pid`` and its descendants, from /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, frontier = {pid}, [pid]
    while frontier:
        p = frontier.pop()
        children = [c for c, parent in parents.items() if parent == p and c not in tree]
        tree.update(children)
        frontier += children
    total = 0
    for p in tree:
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
    return total


# A small launcher process runs the command and prints RUSAGE_CHILDREN's ru_maxrss (KiB): the command and
# its pool workers (waited for by the command). Measured from this process instead, the command's figure
# would include this process's own memory at the fork (the checkpoint writer's torch heap).
LAUNCHER = ("import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)")


def run_command(in_dir: Path, out_dir: Path, scheme: str, workers: int) -> dict:
    """Run the command; wall time, peak RSS of its largest process and of all of them together (sampled)."""
    command = [sys.executable, "-m", "lowbit", "quantize-checkpoint", str(in_dir), str(out_dir), "--scheme", scheme,
               "--workers", str(workers), "--no-progress"]
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, *command], stdout=subprocess.PIPE, text=True)
    peak_sum, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            peak_sum[0] = max(peak_sum[0], _tree_rss(proc.pid))
            done.wait(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    out, _ = proc.communicate()
    wall = time.perf_counter() - start
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited with {proc.returncode}")
    return {"wall_s": wall, "peak_rss_process": int(out.split()[-1]) * 1024, "peak_rss_sum": peak_sum[0],
            "command": " ".join(command)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", default="2,8", help="comma-separated shard counts")
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    parser.add_argument("--per-shard", type=int, default=3, help="weights per shard")
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--scheme", default="hif8-wo")
    parser.add_argument("--dir", default=None, help="work folder (default: a temporary one, removed)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    work = Path(args.dir or tempfile.mkdtemp(prefix="lowbit-qc-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        tiny = work / "tiny"
        if not tiny.exists():
            write_checkpoint(tiny, 1, 1, 64, args.cols, dtype)
        largest = args.rows * args.cols * dtype.itemsize
        print(f"largest tensor: {largest / MIB:.1f} MiB ({args.rows}x{args.cols} {args.dtype}); scheme {args.scheme}")
        print("| shards | input MiB | workers | wall s | MB/s | peak RSS, largest process MiB (start-up) | "
              "increment / largest tensor | peak RSS, all processes MiB (start-up) |")
        print("|---|---|---|---|---|---|---|---|")
        for shards in [int(s) for s in args.shards.split(",")]:
            src = work / f"in-{shards}"
            if not src.exists():
                write_checkpoint(src, shards, args.per_shard, args.rows, args.cols, dtype)
            size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
            for workers in [int(w) for w in args.workers.split(",")]:
                shutil.rmtree(work / "out", ignore_errors=True)
                shutil.rmtree(work / "out-tiny", ignore_errors=True)
                base = run_command(tiny, work / "out-tiny", args.scheme, workers)
                run = run_command(src, work / "out", args.scheme, workers)
                increment = run["peak_rss_process"] - base["peak_rss_process"]
                print(f"| {shards} | {size / MIB:.0f} | {workers} | {run['wall_s']:.1f} | "
                      f"{size / 1e6 / run['wall_s']:.1f} | {run['peak_rss_process'] / MIB:.0f} "
                      f"({base['peak_rss_process'] / MIB:.0f}) | {increment / largest:.2f} | "
                      f"{run['peak_rss_sum'] / MIB:.0f} ({base['peak_rss_sum'] / MIB:.0f}) |", flush=True)
        print(f"command: {run['command']}")
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
