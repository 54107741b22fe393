"""Peak resident memory of loading all-MiniLM-L6-v2 (or a local HF directory): the float model vs a quantized
checkpoint loaded into a meta-device skeleton with lowbit.load_quantized.

After loading, one forward pass on 8 tokens reads every weight (safetensors files are memory-mapped, so a
weight counts in the resident set only once it is read). Each measurement runs in a fresh subprocess (peak RSS only grows), reading ``ru_maxrss`` at the end; a third
subprocess that only builds the meta skeleton (libraries and modelling code imported, no weights) gives the
baseline to subtract.

    PYTHONPATH=src python benchmarks/checkpoint_rss.py --checkpoint CKPT_DIR [--model minilm]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import torch


def _child(mode: str, model: str, checkpoint: str) -> None:
    import lowbit
    from lowbit.evaluation.models import load_hf_dir, load_model, minilm_dir

    path = minilm_dir() if model == "minilm" else model
    if mode == "skeleton":
        load_hf_dir(path, meta=True)
    else:
        if mode == "float":
            model = load_model(str(path)).model
        else:
            model = lowbit.load_quantized(checkpoint, load_hf_dir(path, meta=True).model)
        with torch.no_grad():  # touch every weight: memory-mapped tensors count only once read
            model(input_ids=torch.ones(1, 8, dtype=torch.int64))
    print(json.dumps({"mode": mode, "max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a directory written by lowbit quantize --out")
    parser.add_argument("--model", default="minilm", help="the model the checkpoint was made from")
    parser.add_argument("--child", choices=["skeleton", "float", "quantized"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.model, args.checkpoint)
        return
    peaks = {}
    for mode in ("skeleton", "float", "quantized"):
        out = subprocess.run([sys.executable, __file__, "--checkpoint", args.checkpoint, "--model", args.model,
                              "--child", mode], check=True, capture_output=True, text=True).stdout
        peaks[mode] = json.loads(out.strip().splitlines()[-1])["max_rss_kib"]
    base = peaks["skeleton"]
    print("| load | peak RSS (MiB) | above the skeleton (MiB) |\n|---|---|---|")
    for mode in ("skeleton", "float", "quantized"):
        print(f"| {mode} | {peaks[mode] / 1024:.1f} | {(peaks[mode] - base) / 1024:.1f} |")


if __name__ == "__main__":
    main()
