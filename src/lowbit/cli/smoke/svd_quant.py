"""Smoke check of svd_quant (docs/svd_quant.md) on upstream-style data, scaled down.

Cases (B, S, N, K, R): decode (1, 1, 64, 128, 32), prefill (2, 33, 96, 128, 64) and a K % 64 == 32 case
(1, 8, 40, 96, 32); data as the upstream test (U(-10, 10) in BF16, weights from dynamic_mx_quant).
Backends accumulate the matmuls in different orders, so the contract is ``within_tolerance``: allclose
with the reference backend at the upstream ``tolerance`` (rtol = atol = 1e-2). ``matches_reference``
reports bit equality, as for every operator, but is not required here; ``bitwise_equal_reference`` is the
same value under its older name. ``max_abs_error`` compares with x @ (d @ u + deq(w)^T) in FP32, i.e. the
same layer with an unquantized activation.
"""

from __future__ import annotations

import torch

from lowbit.cli.smoke._common import backend_that_ran, case_result
from lowbit.formats import mxfp4
from lowbit.formats import svd_quant as ref
from lowbit.ops.svd_quant import ATOL, RTOL, SVD_QUANT, probe_inputs, svd_quant

NAME = "svd_quant"
OPERATORS = (SVD_QUANT,)
CASES = ((1, 1, 64, 128, 32), (2, 33, 96, 128, 64), (1, 8, 40, 96, 32))


def run(backend: str, device: torch.device) -> list[dict]:
    """One result per case."""
    results = []
    for b, s_len, n, k, r in CASES:
        x, w, s, d, u = probe_inputs(b * s_len, n, k, r, seed=2026)
        x_batched = x.reshape(b, s_len, k)
        out = svd_quant(*(t.to(device) for t in (x_batched, w, s, d, u)), backend=backend)
        want = ref.svd_quant(x, w, s, d, u).reshape(b, s_len, n)
        w_deq = mxfp4.dequantize(w, ref.weight_scales(s, k), torch.float32)
        dense = x.float() @ (d.float() @ u.float() + w_deq.T)
        result = case_result(
            backend=backend_that_ran(SVD_QUANT.name),
            input_dtype=torch.bfloat16,
            output=out,
            reference=want,
            expected_shape=(b, s_len, n),
            expected_dtype=torch.bfloat16,
            expected_device=device,
            error_target=dense.reshape(b, s_len, n),
            tolerance=(RTOL, ATOL),
            shape_bsnkr=[b, s_len, n, k, r],
        )
        result["bitwise_equal_reference"] = result["matches_reference"]
        results.append(result)
    return results
