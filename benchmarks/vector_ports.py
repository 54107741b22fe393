"""Throughput of the AVX-512 instruction mixes the weight-only GEMV's BF16-pair steps are made of.

Each case is a block of independent instructions on zeroed registers (no dependency chains, no memory),
run in a compiled loop; the figure is ns per block, the fastest of five runs of --blocks blocks. A block
of 64 dependent scalar adds gives the clock (64 cycles). The 4-bit pair step of four rows (512 weights)
takes 16 vdpbf16ps, 16 vpermw look-ups, 8 vpermb and 8 vpsrlw for the nibbles, and 16 vpternlogq for the
indices plus 8 vinserti64x4 for the block tables (benchmarks/results_weight_only.md, 'Intel Xeon Emerald
Rapids: the instruction floor of the 4-bit pair step'). The MXFP4 fused step of four rows (256 weights) takes 8
byte widenings (vpmovzxbd), 8 vpsrld, 16 vpermd look-ups and 16 FMAs ('MXFP4's lone row of x by fused
multiply-adds'). Needs AVX512-BF16 and AVX512-VBMI.

    PYTHONPATH=src python benchmarks/vector_ports.py [--blocks 200000]
"""

from __future__ import annotations

import lowbit  # noqa: F401,I001  (first: sets the OpenMP wait policy before torch loads)

import argparse
import time

import numba
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from lowbit.cli.smoke._common import device_name
import lowbit.kernels.cpu._simd  # noqa: F401  (initializes LLVM's assembly parser for the inline assembly)

ZERO = "".join(f"vpxorq %zmm{r}, %zmm{r}, %zmm{r}\n" for r in (29, 30, 31))


def _dp(i: int) -> str:
    return f"vdpbf16ps %zmm30, %zmm31, %zmm{i}\n"


def _op(name: str, i: int) -> str:
    """One instruction writing zmm16 + i % 16 from the zeroed zmm29-31."""
    sources = {"vpsrlw": "$$4, %zmm29", "vpsrld": "$$4, %zmm29", "vpternlogq": "$$236, %zmm29, %zmm30",
               "vinserti64x4": "$$1, %ymm29, %zmm30", "vpmovzxbd": "%xmm29"}.get(name, "%zmm30, %zmm31")
    return f"{name} {sources}, %zmm{16 + i % 16}\n"


def mix(dots: int, **others: int) -> str:
    """A block of ``dots`` vdpbf16ps and, per instruction name, that many of it, interleaved."""
    lines = []
    for i in range(16):
        lines += [_dp(i)] if i < dots else []
        lines += [_op(name, i + 3 * j) for j, (name, count) in enumerate(others.items()) if i < count]
    return ZERO + "".join(lines)


CASES = {
    "64 dependent scalar adds (the clock)": "".join("add %rax, %rax\n" for _ in range(64)),
    "16 vdpbf16ps": mix(16),
    "16 vpermw": mix(0, vpermw=16),
    "16 vpermb": mix(0, vpermb=16),
    "16 vpsrlw": mix(0, vpsrlw=16),
    "16 vpsubusw": mix(0, vpsubusw=16),
    "16 vpaddd": mix(0, vpaddd=16),
    "16 vpternlogq": mix(0, vpternlogq=16),
    "16 vpermi2b": mix(0, vpermi2b=16),
    "16 vdpbf16ps + 16 vpermw": mix(16, vpermw=16),
    "16 vdpbf16ps + 16 vpternlogq": mix(16, vpternlogq=16),
    "4-bit pair step as built (4 rows, 512 weights)": mix(16, vpermw=16, vpermb=8, vpsrlw=8, vpternlogq=16,
                                                           vinserti64x4=8),
    "the same, tables by subtraction (no vinserti64x4, vpsubusw for vpternlogq)": mix(
        16, vpermw=16, vpermb=8, vpsrlw=8, vpsubusw=16),
    "look-ups and products only (16 vpermw, 16 vdpbf16ps)": mix(16, vpermw=16),
    "16 vfmadd231ps": mix(0, vfmadd231ps=16),
    "16 vpermd": mix(0, vpermd=16),
    "16 vpmovzxbd": mix(0, vpmovzxbd=16),
    "16 vpsrld": mix(0, vpsrld=16),
    "16 vfmadd231ps + 16 vpermd": mix(0, vfmadd231ps=16, vpermd=16),
    "MXFP4 fused step of four rows (256 weights: 16 vfmadd231ps, 16 vpermd, 8 vpmovzxbd, 8 vpsrld)": mix(
        0, vfmadd231ps=16, vpermd=16, vpmovzxbd=8, vpsrld=8),
}


def _looped(body: str):
    @intrinsic
    def block(typingctx, i):
        def codegen(context, builder, sig, args):
            clobbers = ",".join([f"~{{xmm{r}}}" for r in range(32)] + ["~{rax}"])
            builder.asm(ir.FunctionType(ir.VoidType(), []), body, clobbers, [], True)
            return context.get_dummy_value()

        return types.void(i), codegen

    @numba.njit(nogil=True)
    def loop(n):
        for i in range(n):
            block(i)

    return loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=200_000)
    args = parser.parse_args()
    print(f"CPU: {device_name(torch.device('cpu'))}; ns per block, fastest of 5 runs of {args.blocks} blocks")
    for name, body in CASES.items():
        loop = _looped(body)
        loop(10)  # compile
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            loop(args.blocks)
            best = min(best, time.perf_counter() - start)
        print(f"  {name}: {best / args.blocks * 1e9:.2f}")


if __name__ == "__main__":
    main()
