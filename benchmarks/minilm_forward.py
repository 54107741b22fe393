"""Whole-model speed: the all-MiniLM-L6-v2 forward in BF16 against the same model converted by
``lowbit.quantize_`` with each scheme, on the first --sentences sentences of lowbit's evaluation text, in one
run: per round every model once, interleaved; medians of --rounds rounds under torch.inference_mode.
Needs the `models` extra (transformers and the packaged all-MiniLM-L6-v2).

    PYTHONPATH=src python benchmarks/minilm_forward.py [--sentences 1] [--rounds 7] [--schemes mxfp4-wo,...]
"""

from __future__ import annotations

import lowbit  # noqa: I001  (first: sets the OpenMP wait policy before torch loads)

import argparse
import copy
import statistics
import time

import torch

from lowbit.evaluation.models import load_model
from lowbit.evaluation.text import all_sentences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sentences", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--schemes", default="int4-a16w4,mxfp4-wo,hif4-wo,hif8-wo")
    args = parser.parse_args()
    loaded = load_model("minilm")
    batch = loaded.tokenizer(all_sentences()[: args.sentences], padding=True, truncation=True, max_length=128,
                             return_tensors="pt")
    models = {"bf16": copy.deepcopy(loaded.model).to(torch.bfloat16)}
    for scheme in args.schemes.split(","):
        models[scheme] = copy.deepcopy(loaded.model).to(torch.bfloat16)
        lowbit.quantize_(models[scheme], scheme)
    times: dict[str, list[float]] = {name: [] for name in models}
    with torch.inference_mode():
        for model in models.values():
            model(**batch)  # compile / load kernels, plans
        for _ in range(args.rounds):
            for name, model in models.items():
                start = time.perf_counter()
                model(**batch)
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["bf16"])
    print(f"tokens per Linear call: {batch['input_ids'].numel()}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print("| model | ms | x BF16 time |")
    print("|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values) * 1e3:.1f} | {statistics.median(values) / base:.2f} |")


if __name__ == "__main__":
    main()
