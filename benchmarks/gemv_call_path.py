"""Where a converted layer's decode call (M = 1, BF16 x) spends its time when each call follows a BF16
F.linear of the same shape, as in a model's forward (the F.linear streams its weight through the caches, so
the call's own code and data come back from memory). Per scheme, in one process and interleaved: the deploy
module (from its second call on, its one kernel call: QuantizedLinearBase._run_one_call); its PreparedCall
(the path of more rows); ``run_prepared`` (the kernel's entry, output given); the GEMV's one numba call
(``serial_gemv`` with --threads 1, else ``parallel_gemv`` on numba's threads, given the tensors' addresses); and the
three numba calls it made before (``_gather_x``, ``gemv_sums``, ``_round_into``). For int4-a16w4: the module,
its bound decode's one numba call, and the full path's operator (WqbmmPlan.run, then the bias add). Median
of --rounds calls of each, and F.linear's own.

    PYTHONPATH=src python benchmarks/gemv_call_path.py [--shape 4096x4096]
        [--schemes hif8-wo,mxfp4-wo,hif4-wo,int4-a16w4]
        [--threads 1]
"""

from __future__ import annotations

import lowbit  # noqa: I001  (first: sets the OpenMP wait policy before torch loads)

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from lowbit.cli.bench.model import quantized_layer
from lowbit.cli.smoke._common import device_name
from lowbit.kernels.cpu import weight_only as cpu
from lowbit.kernels.cpu._runtime import as_numpy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="4096x4096")
    parser.add_argument("--schemes", default="hif8-wo,mxfp4-wo,hif4-wo,int4-a16w4")
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--threads", type=int, default=1, help="torch's (and numba's) thread count")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    serial = args.threads == 1
    n, k = map(int, args.shape.split("x"))
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(1, k, generator=g).bfloat16()
    print(f"CPU: {device_name(torch.device('cpu'))}, {args.threads} thread(s), {n} x {k}, M = 1, BF16; median ms of {args.rounds} calls, each after F.linear")
    for scheme in args.schemes.split(","):
        module = quantized_layer(weight, bias, scheme)[0]
        with torch.inference_mode():
            module(x)  # compile, prepare
            module(x)  # the one call (QuantizedLinearBase._run_one_call), bound on the second call
            if scheme == "int4-a16w4":
                report(scheme, int4_cases(module, x), weight, bias, x, args.rounds)
                continue
            prepared_call = module.__dict__["_prepared"][0]
            (prepared,) = prepared_call._prepared.values()
            operands, bias_, bias_bits = prepared
            kernel = next(iter(prepared_call._plans.values()))[2]
            out = torch.empty(1, n, dtype=torch.bfloat16)

            def three_calls():
                x_reg = np.empty((1, cpu._padded_k(k)), dtype=np.float32)
                cpu._gather_x(as_numpy(x), True, kernel.order, x_reg)
                y32 = np.empty((1, n), dtype=np.float32)
                kernel.gemv_sums(x_reg, operands, y32, serial)
                cpu._round_into(y32, bias_, True, out)
                return out

            def one_call():
                args = (x.data_ptr(), 1, k, True, kernel.order, n, operands, kernel.x_consts, *bias_bits,
                        out.data_ptr())
                if serial:
                    kernel.serial_gemv(*args)
                else:
                    kernel.parallel_gemv(*args, cpu._gemv_chunksize(n))
                return out

            def run_prepared():
                kernel.run_prepared(x, prepared, out=out)
                return out

            cases = {
                "module": lambda: module(x),
                "PreparedCall": lambda: prepared_call(x),
                "run_prepared": run_prepared,
                "one call": one_call,
                "three calls": three_calls,
            }
            report(scheme, cases, weight, bias, x, args.rounds, out)


def int4_cases(module, x: torch.Tensor) -> dict:
    """An int4-a16w4 layer: the module; its bound decode (one numba call); the full path's operator (the plan's
    run with its workspace and output given, then the bias add)."""
    decode = module.__dict__["_one_call"][0].bound
    plan = module._plan(1, x.device)
    workspace, y = plan.new_workspace(), torch.empty(1, module.out_features, dtype=x.dtype)
    out = torch.empty_like(y)

    def one_call():
        decode(x, 1, out)
        return out

    def plan_run():
        plan.run(x, module._packed, module.antiquant_scale, out=y, workspace=workspace)
        return y + module.bias

    return {"module": lambda: module(x), "one call": one_call, "plan.run + bias": plan_run}


def report(scheme: str, cases: dict, weight, bias, x, rounds: int, out=None) -> None:
    """Check that every case gives the module's bits, then print the median time of each, each call after an
    F.linear, in rounds that take every case in turn."""
    want = cases["module"]()
    for call in cases.values():
        if out is not None:
            out.zero_()
        assert torch.equal(call().view(torch.int16), want.view(torch.int16))
    times: dict[str, list[float]] = {"F.linear": [], **{name: [] for name in cases}}
    for _ in range(rounds):
        for name, call in cases.items():
            start = time.perf_counter()
            F.linear(x, weight, bias)
            middle = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - middle)
            times["F.linear"].append(middle - start)
    cells = [f"{name} {statistics.median(t) * 1e3:.3f}" for name, t in times.items()]
    print(f"{scheme}: " + "  ".join(cells))


if __name__ == "__main__":
    main()
