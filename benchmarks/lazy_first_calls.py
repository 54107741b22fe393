"""A converted model's first calls in a fresh process, with no self-check: one 1024 x 1024 layer of each of
mxfp4-wo, hif8-wo and hif4-wo (a bias, BF16) called with M = 1, 2 and 300 rows under the native backend, every
kernel compiled on its first call (numba compiles nothing ahead here). Prints the seconds from the start of the
imports. Run it with an empty numba cache, or it only loads:

    NUMBA_CACHE_DIR=$(mktemp -d) PYTHONPATH=src python benchmarks/lazy_first_calls.py
"""

from __future__ import annotations

import time

START = time.perf_counter()

import lowbit  # noqa: E402, I001  (after the clock starts: the imports count)
import torch  # noqa: E402

from lowbit.cli.bench.model import quantized_layer  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(1024, 1024).bfloat16(), torch.zeros(1024).bfloat16()
    with torch.inference_mode(), lowbit.use_backend("native"):
        for scheme in ("mxfp4-wo", "hif8-wo", "hif4-wo"):
            layer = quantized_layer(weight, bias, scheme)[0]
            for m in (1, 2, 300):
                layer(torch.randn(m, 1024).bfloat16())
    print(f"lazy first calls {time.perf_counter() - START:.1f} s")


if __name__ == "__main__":
    main()
