"""How long svd_quant_decompose takes per weight (the svdquant scheme's quantization of a layer, data-free), and
its low-rank factors (lowbit.nn.svd_quant.low_rank_factors: the Gram matrix's eigendecomposition) against the
rank-R truncation of LAPACK's full SVD in float64 (torch.linalg.svd, which the decomposition ran before), both
in this run. Prints the median of --repeats seconds of each and whether their BF16 factors are the same bits
(signs of the SVD's made as low_rank_factors makes them).

    PYTHONPATH=src python benchmarks/svd_quant_decompose.py [--shapes 4096x2048,4096x4096] [--rank 32]
        [--repeats 3]
"""

from __future__ import annotations

import lowbit  # noqa: I001  (first: sets the OpenMP wait policy before torch loads)

import argparse
import statistics
import time

import torch

from lowbit.cli.smoke._common import device_name
from lowbit.nn.svd_quant import low_rank_factors, svd_quant_decompose


def full_svd_factors(w64: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """d, u of the rank-``rank`` truncation of LAPACK's full SVD of W^T, with low_rank_factors' signs."""
    left, singular, right_t = torch.linalg.svd(w64.T, full_matrices=False)
    root = singular[:rank].sqrt()
    d, u = left[:, :rank] * root, root[:, None] * right_t[:rank]
    sign = torch.where(u.gather(1, u.abs().argmax(dim=1, keepdim=True)) < 0, -1.0, 1.0).to(torch.float64)
    return d * sign.T, u * sign


def median_seconds(fn, repeats: int):
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="4096x2048,4096x4096", help="comma-separated N x K of the weights")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"CPU: {device_name(torch.device('cpu'))}, {torch.get_num_threads()} threads, rank {args.rank}, "
          f"median of {args.repeats}")
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        weight = (torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
        w64 = weight.to(torch.float64)
        full, (want_d, want_u) = median_seconds(lambda: full_svd_factors(w64, args.rank), args.repeats)
        gram, (d, u) = median_seconds(lambda: low_rank_factors(w64, args.rank), args.repeats)
        whole, _ = median_seconds(lambda: svd_quant_decompose(weight, args.rank), args.repeats)
        same = all(torch.equal(a.to(torch.bfloat16), b.to(torch.bfloat16)) for a, b in ((d, want_d), (u, want_u)))
        print(f"{n} x {k}: full SVD {full:.2f} s, Gram eigendecomposition {gram:.2f} s ({full / gram:.1f}x), "
              f"svd_quant_decompose {whole:.2f} s; BF16 factors the same: {same}")


if __name__ == "__main__":
    main()
