"""lowbit's AMX kernel (lowbit.kernels.cpu.amx) against the paths it replaces, on a CPU with AMX-BF16: for each
weight-only format and (N x K, M), BF16 x through the operator with the AMX kernel (whatever the size of x:
AMX_MAX_M and AMX_X_BYTES lifted) and without it (the batched kernel up to its rows, then torch's BF16 GEMM on decoded
tiles), time over BF16 F.linear's, the cases of a round
interleaved, each call after a SiLU, medians of --rounds (after half a second of warm-up calls). With
--x-chunk-kib, the AMX kernel once per budget of x^T per chunk of K (amx.X_CHUNK_BYTES, for any K; 0: one pass
over K) instead of once with the module's settings.

    PYTHONPATH=src python benchmarks/amx_gemm.py --shapes 384x384 1536x384 384x1536 4096x4096 \
        --ms 5 8 16 32 64 128 256 512 [--formats mxfp4 hifloat4 hifloat8] [--threads 2]
    PYTHONPATH=src python benchmarks/amx_gemm.py --shapes 4096x11008 12288x8192 4096x4096 --ms 256 512 \
        --formats mxfp4 --x-chunk-kib 0 512 256
"""

from __future__ import annotations

import lowbit  # noqa: I001  (first: sets the OpenMP wait policy before torch loads)

import argparse

import torch
import torch.nn.functional as F
from gemm_path import _medians  # the sibling benchmark's interleaved medians (this script's folder is on the path)

from lowbit.cli.smoke._common import device_name
from lowbit.formats import hifloat4, mxfp4
from lowbit.kernels.cpu import amx
from lowbit.kernels.cpu import weight_only as cpu


def _weights(w: torch.Tensor) -> dict:
    """Each format's operator and quantized weight of ``w`` (N, K) float32."""
    row_scale = w.abs().amax(1) / 32768
    return {"mxfp4": (lowbit.mxfp4_linear, mxfp4.quantize(w)),
            "hifloat4": (lowbit.hifloat4_linear, hifloat4.pack(w)),
            "hifloat8": (lowbit.hifloat8_linear,
                         (lowbit.encode_to_hifloat8((w / row_scale[:, None]).bfloat16()), row_scale))}


def _amx_settings(chunk_kib):
    """(label, (CHUNKED_K, X_CHUNK_BYTES)) of each AMX case: the module's settings, or per budget in KiB."""
    if chunk_kib is None:
        return [("amx", (amx.CHUNKED_K, amx.X_CHUNK_BYTES))]
    return [(f"amx {kib} KiB" if kib else "amx one pass", (0, kib << 10) if kib else (1 << 62, 1 << 62))
            for kib in chunk_kib]


def compare(n: int, k: int, ms: list[int], formats: list[str], rounds: int, chunk_kib=None) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen)
    w_bf16 = w.bfloat16()
    weights = {name: value for name, value in _weights(w).items() if name in formats}
    saved = cpu.AMX_GEMM, cpu.AMX_MAX_M, cpu.AMX_X_BYTES, amx.CHUNKED_K, amx.X_CHUNK_BYTES
    variants = [(label, True, chunks) for label, chunks in _amx_settings(chunk_kib)] + [("before", False, saved[3:])]
    try:
        for m in ms:
            x = torch.randn(m, k, generator=gen).bfloat16()
            cases = {"F.linear": lambda: F.linear(x, w_bf16)}
            for name, (op, weight) in weights.items():
                for label, on, chunks in variants:
                    def call(op=op, weight=weight, on=on, chunks=chunks):
                        cpu.AMX_GEMM, cpu.AMX_MAX_M, cpu.AMX_X_BYTES = on, 1 << 62, 1 << 62
                        amx.CHUNKED_K, amx.X_CHUNK_BYTES = chunks
                        op(x, *weight, backend="native")
                    cases[f"{name} {label}"] = call
            times = _medians(cases, rounds, torch.randn(64, 4 * k).bfloat16())
            base = times.pop("F.linear")
            print(f"{n} x {k}, M = {m}: F.linear {base * 1e3:.3f} ms; time over F.linear's: "
                  + "  ".join(f"{name} {t / base:.2f}" for name, t in times.items()), flush=True)
    finally:
        cpu.AMX_GEMM, cpu.AMX_MAX_M, cpu.AMX_X_BYTES, amx.CHUNKED_K, amx.X_CHUNK_BYTES = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["384x384", "1536x384", "384x1536", "4096x4096"],
                        help="N x K of each weight")
    parser.add_argument("--ms", type=int, nargs="+", default=[5, 8, 16, 32, 64, 128, 256, 512])
    parser.add_argument("--formats", nargs="+", default=["mxfp4", "hifloat4", "hifloat8"])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--x-chunk-kib", type=int, nargs="+", default=None,
                        help="AMX cases per budget of x^T per chunk of K, KiB (0: one pass)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not amx.AVAILABLE:
        raise SystemExit("this CPU (or OS) runs no AMX-BF16: nothing to compare")
    print(f"CPU: {device_name(torch.device('cpu'))}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"AMX_MAX_M {cpu.AMX_MAX_M}, AMX_X_BYTES {cpu.AMX_X_BYTES}, SUBPANELS {amx.SUBPANELS}, "
          f"CHUNKED_K {amx.CHUNKED_K}, X_CHUNK_BYTES {amx.X_CHUNK_BYTES}")
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        compare(n, k, args.ms, args.formats, args.rounds, args.x_chunk_kib)


if __name__ == "__main__":
    main()
