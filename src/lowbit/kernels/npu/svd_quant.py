"""svd_quant on an Ascend 950 NPU through AMCT's operator (unverified until it runs on an NPU).

Calls ``torch.ops.amct.svd_quant(activation, weights, scales, down, up)`` from an installed ``amct_ops``
built for Ascend 950 (the op is registered only by ``import amct_ops.svd_quant``). Shapes whose K is an
odd multiple of 32 are zero-padded to the next multiple of 64 before the call: the kernel's
activation-scale row stride looks wrong for them (docs/svd_quant.md, section 'Decisions'), and the padding
(zero activations, zero down-projection rows, zero codes with scale 1.0) adds exact zeros, so the result
is the documented one for every K. A missing ``amct_ops`` or op raises
BackendUnavailable.
"""

from __future__ import annotations

import torch.nn.functional as F

from lowbit.backends import Kernel
from lowbit.kernels.npu import amct_operator
from lowbit.formats.mxfp4 import E8M0_BIAS
from lowbit.formats.svd_quant import BLOCK


class SvdQuant(Kernel):
    """svd_quant with AMCT's NPU operator, K padded to a multiple of 2 * BLOCK."""

    def run(self, x, w, s, d, u, *, out) -> None:
        op = amct_operator("amct_ops.svd_quant", "svd_quant", "it is built only for Ascend 950")
        if x.shape[-1] % (2 * BLOCK):
            x = F.pad(x, (0, BLOCK))
            d = F.pad(d, (0, 0, 0, BLOCK))
            w = F.pad(w, (0, BLOCK // 2))
            s = s.clone()
            s[:, -1, 1] = E8M0_BIAS  # the pad slot now scales the zero block: 2^0
        out.copy_(op(x, w, s, d, u))


SVD_QUANT = SvdQuant()
