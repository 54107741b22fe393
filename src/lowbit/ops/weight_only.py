"""Weight-only linear layers: ``hifloat8_linear``, ``float8_e4m3fn_linear``, ``mxfp8_linear``,
``mxfp4_linear``, ``hifloat4_linear`` (docs/weight_only.md).

``y = x @ W.T + bias`` where W (N, K) is given in its packed format and the kernels decode it on the fly
(never the whole weight in full precision). Numerics: lowbit.formats.weight_only (float32 weight, a
fixed 64-lane summation order, one rounding to x's dtype, canonical NaN). The CPU kernel is bit-exact
for x with up to ``lowbit.kernels.cpu.weight_only.GEMV_MAX_M`` rows (decoding); with more rows it
multiplies decoded weight tiles with torch, within the documented tolerance
(lowbit.formats.weight_only.gemm_interval). The Triton kernel is bit-exact for every M.

Common contract: x (..., K) FP16 or BF16, any strides; bias None or (N,) in x's dtype or float32; all
tensors on one device; y (..., N) in x's dtype. ``out=``: a tensor of that shape and dtype (any strides;
may overlap an input). ``backend=``: "native", "reference" or "auto". Errors: DtypeError, ShapeError,
DeviceError (lowbit.errors). Registered as ``torch.ops.lowbit.<name>`` and ``<name>_out``.
"""

from __future__ import annotations

from typing import Optional

import torch

from lowbit import backends, kernels
from lowbit.backends import Kernel, TensorSpec
from lowbit.errors import DtypeError, ShapeError
from lowbit.formats import hifloat4, hifloat8, mxfp4, mxfp8
from lowbit.formats import weight_only as reference
from lowbit.ops.library import call, define

X_DTYPES = (torch.float16, torch.bfloat16)
MXFP4_BLOCK = 32


# ---- validation --------------------------------------------------------------------------------------------


def _check_byte_tensor(op: str, name: str, t: torch.Tensor, dims: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if t.dtype != torch.uint8:
        raise DtypeError(f"{op}: {name} must be uint8, got {t.dtype}")
    if t.dim() != dims:
        raise ShapeError(f"{op}: {name} must be {layout}, got shape {tuple(t.shape)}")


def _output(op: str, x: torch.Tensor, bias: Optional[torch.Tensor], n: int, k: int) -> tuple[TensorSpec]:
    """Validate x and bias against the weight's (N, K); the output spec (..., N) in x's dtype."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a tensor, got {type(x).__name__}")
    if x.dtype not in X_DTYPES:
        raise DtypeError(f"{op}: x must be float16 or bfloat16, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] != k:
        raise ShapeError(f"{op}: x must be (..., K) with K = {k} (the weight's), got shape {tuple(x.shape)}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"{op}: bias must be a tensor or None, got {type(bias).__name__}")
        if bias.dtype not in (x.dtype, torch.float32):
            raise DtypeError(f"{op}: bias must have x's dtype {x.dtype} or float32, got {bias.dtype}")
        if tuple(bias.shape) != (n,):
            raise ShapeError(f"{op}: bias must have shape (N,) = ({n},), got {tuple(bias.shape)}")
    return (TensorSpec((*x.shape[:-1], n), x.dtype),)


def _row_scaled_outputs(op: str, x, codes, scale, bias) -> tuple[TensorSpec]:
    """8-bit codes (N, K) uint8 with a per-row float32 scale (N,): HiFloat8, FP8 E4M3."""
    _check_byte_tensor(op, "codes", codes, 2, "(N, K)")
    n, k = codes.shape
    if k == 0:
        raise ShapeError(f"{op}: K must be positive, got codes of shape {tuple(codes.shape)}")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        raise DtypeError(f"{op}: scale must be a float32 tensor, got {getattr(scale, 'dtype', type(scale).__name__)}")
    if tuple(scale.shape) != (n,):
        raise ShapeError(f"{op}: scale must have shape (N,) = ({n},), got {tuple(scale.shape)}")
    return _output(op, x, bias, n, k)


def _hifloat8_outputs(x, codes, scale, bias=None) -> tuple[TensorSpec]:
    return _row_scaled_outputs("hifloat8_linear", x, codes, scale, bias)


def _float8_outputs(x, codes, scale, bias=None) -> tuple[TensorSpec]:
    return _row_scaled_outputs("float8_e4m3fn_linear", x, codes, scale, bias)


def _mx_outputs(op: str, x, codes, scales, bias, codes_per_byte: int) -> tuple[TensorSpec]:
    """Codes (N, K / codes_per_byte) uint8 with an E8M0 scale byte per 32 along K (N, K/32): MXFP8, MXFP4."""
    layout = "(N, K)" if codes_per_byte == 1 else f"(N, K/{codes_per_byte})"
    _check_byte_tensor(op, "codes", codes, 2, layout)
    _check_byte_tensor(op, "scales", scales, 2, "(N, K/32)")
    n, k = codes.shape[0], codes_per_byte * codes.shape[1]
    if k == 0 or k % MXFP4_BLOCK or tuple(scales.shape) != (n, k // MXFP4_BLOCK):
        raise ShapeError(f"{op}: codes {layout} and scales (N, K/32) need a positive K that is a multiple of 32, "
                         f"got {tuple(codes.shape)} and {tuple(scales.shape)}")
    return _output(op, x, bias, n, k)


def _mxfp8_outputs(x, codes, scales, bias=None) -> tuple[TensorSpec]:
    return _mx_outputs("mxfp8_linear", x, codes, scales, bias, 1)


def _mxfp4_outputs(x, codes, scales, bias=None) -> tuple[TensorSpec]:
    return _mx_outputs("mxfp4_linear", x, codes, scales, bias, 2)


def _hifloat4_outputs(x, scale, value, bias=None) -> tuple[TensorSpec]:
    op = "hifloat4_linear"
    _check_byte_tensor(op, "scale", scale, 3, "(N, K/64, 4)")
    _check_byte_tensor(op, "value", value, 2, "(N, K/2)")
    n, k = scale.shape[0], hifloat4.BLOCK * scale.shape[1]
    if k == 0 or scale.shape[2] != 4 or tuple(value.shape) != (n, k // 2):
        raise ShapeError(f"{op}: scale (N, K/64, 4) and value (N, K/2) need a positive K, got "
                         f"{tuple(scale.shape)} and {tuple(value.shape)}")
    return _output(op, x, bias, n, k)


# ---- reference kernel --------------------------------------------------------------------------------------


class _ReferenceLinear(Kernel):
    """``run(x, a, b, bias, out=)``: lowbit.formats.weight_only.linear of the format's float32 weight."""

    def __init__(self, weight):
        self.weight = weight  # (a, b, x's dtype) -> (N, K) float32

    def run(self, x, a, b, bias, *, out):
        out.copy_(reference.linear(x, self.weight(a, b, x.dtype), bias))


# ---- probes: edge shapes and special values of every kernel, small ------------------------------------------
# Shapes: M = 1 (decode), M = 2..4 (the CPU GEMV loop), M = 6 (the CPU GEMM path: there with operands whose
# sums are exact in float32 in any order, so every path must give the same bits; for MXFP4 and HiFloat4 both
# of its tile kinds, BF16 and float32); K with a tail of a 64-lane step (HiFloat8) or an odd number of
# 32-blocks (MXFP4); FP16 and BF16; bias absent, x's dtype, FP32.


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _small_integers(shape, gen, dtype, bound=4) -> torch.Tensor:
    return torch.randint(-bound, bound + 1, shape, generator=gen).to(dtype)


def _hifloat8_probes():
    g = _gen(8)
    finite = torch.tensor([c for c in range(256) if abs(hifloat8.code_value(c)) < float("inf")], dtype=torch.uint8)
    exact = torch.tensor([c for c in range(256) if (4 * abs(hifloat8.code_value(c))).is_integer()
                          and abs(hifloat8.code_value(c)) <= 16], dtype=torch.uint8)

    def pick(codes, shape):
        return codes[torch.randint(0, len(codes), shape, generator=g)]

    probes = [
        (torch.randn(1, 200, generator=g).bfloat16(), pick(finite, (5, 200)), torch.rand(5, generator=g) + 0.5, None),
        (torch.randn(3, 64, generator=g).half(), pick(finite, (3, 64)), torch.rand(3, generator=g) / 64,
         torch.randn(3, generator=g)),
    ]
    # Specials: every code, scales 0 / Inf / NaN / tiny / huge, x with 0, Inf and NaN; K = 130 (a tail of 2).
    codes = torch.arange(256, dtype=torch.uint8)[torch.randperm(256, generator=g)][:130].repeat(6, 1)
    codes[1:, 0] = torch.tensor([0x80, 0x6F, 0xEF, 0x00, 0x01], dtype=torch.uint8)
    codes[3] = pick(finite, (130,))
    scale = torch.tensor([1.0, 0.0, float("inf"), 2.0**-120, 2.0**100, float("nan")])
    x = torch.randn(2, 130, generator=g).bfloat16()
    x[1, :4] = torch.tensor([0.0, float("inf"), -0.0, float("nan")])
    probes.append((x, codes, scale, torch.randn(6, generator=g).bfloat16()))
    probes.append((torch.tensor([[2.0]]).half(), torch.tensor([[0x18], [0xE0]], dtype=torch.uint8),
                   torch.tensor([3.0, -0.5]), None))  # K = 1
    for dtype, bias_dtype in ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)):
        probes.append((_small_integers((6, 96), g, dtype), pick(exact, (4, 96)), torch.tensor([1.0, 2.0, 0.5, 4.0]),
                       _small_integers((4,), g, bias_dtype)))
    return probes


def _exact_e4m3_codes() -> torch.Tensor:
    """The E4M3 codes whose values are multiples of 1/4 up to 16 in magnitude (GEMM probes with exact sums)."""
    every = torch.arange(256, dtype=torch.uint8)
    values = mxfp8.e4m3_values(every)
    return every[((4 * values) == (4 * values).round()) & (values.abs() <= 16)]


def _float8_probes():
    g = _gen(83)
    every = torch.arange(256, dtype=torch.uint8)
    probes = [
        (torch.randn(1, 200, generator=g).bfloat16(), every[torch.randint(0, 256, (5, 200), generator=g)],
         torch.rand(5, generator=g) / 448, None),
        (torch.randn(3, 64, generator=g).half(), every[torch.randint(0, 256, (3, 64), generator=g)],
         torch.rand(3, generator=g) * 3, torch.randn(3, generator=g)),
    ]
    # Every code (NaN 0x7F / 0xFF, -0 0x80), scales 0 / Inf / NaN / tiny / huge / negative; K = 130.
    codes = every[torch.randperm(256, generator=g)][:130].repeat(7, 1)
    scale = torch.tensor([1.0, 0.0, float("inf"), 2.0**-140, 2.0**120, float("nan"), -0.7])
    x = torch.randn(2, 130, generator=g).bfloat16()
    x[1, :4] = torch.tensor([0.0, float("inf"), -0.0, float("nan")])
    probes.append((x, codes, scale, torch.randn(7, generator=g).bfloat16()))
    exact = _exact_e4m3_codes()
    for dtype, bias_dtype in ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)):
        probes.append((_small_integers((6, 96), g, dtype), exact[torch.randint(len(exact), (4, 96), generator=g)],
                       torch.tensor([1.0, 2.0, 0.5, 4.0]), _small_integers((4,), g, bias_dtype)))
    return probes


def _block_scales(g: torch.Generator, n: int, k: int, low: int, high: int) -> torch.Tensor:
    """(n, k/32) uint8 E8M0 bytes drawn from [low, high]."""
    return torch.randint(low, high + 1, (n, k // MXFP4_BLOCK), generator=g, dtype=torch.uint8)


def _random_mx_probes(g: torch.Generator, codes) -> list[tuple]:
    """Two random MX probes: (1, 96) BF16 x without bias, (4, 160) FP16 x with an FP16 bias (an odd number of
    32-blocks); ``codes(n, k)``: random code bytes of an (n, k) weight."""
    return [
        (torch.randn(1, 96, generator=g).bfloat16(), codes(3, 96), _block_scales(g, 3, 96, 118, 130), None),
        (torch.randn(4, 160, generator=g).half(), codes(2, 160), _block_scales(g, 2, 160, 110, 125),
         torch.randn(2, generator=g).half()),
    ]


def _mxfp8_probes():
    g = _gen(88)

    def codes(n, k):
        return torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)

    probes = _random_mx_probes(g, codes)
    # Every code under every scale byte (0x00: 2^-127; 0xFE: products beyond float32; 0xFF: NaN); FP16 x,
    # whose dtype overflows and flushes many of these weights.
    every = torch.arange(256, dtype=torch.uint8)
    probes.append((torch.randn(2, 32 * 8, generator=g).half(), every.repeat(32, 1), every.reshape(32, 8),
                   torch.randn(32, generator=g)))
    x = torch.randn(3, 64, generator=g).bfloat16()
    x[2, :3] = torch.tensor([float("inf"), float("nan"), -0.0])
    probes.append((x, codes(4, 64), _block_scales(g, 4, 64, 100, 140), None))
    exact = _exact_e4m3_codes()
    for dtype, bias_dtype in ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)):
        probes.append((_small_integers((6, 96), g, dtype), exact[torch.randint(len(exact), (4, 96), generator=g)],
                       _block_scales(g, 4, 96, 127, 127), _small_integers((4,), g, bias_dtype)))
    return probes


def _mxfp4_probes():
    g = _gen(4)

    def codes(n, k):
        return torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)

    probes = _random_mx_probes(g, codes)
    # Every code under every scale byte (0x00 is 2^-127, 0xFE overflows to Inf for |code| >= 2, 0xFF is NaN).
    every_code = torch.arange(16, dtype=torch.uint8).repeat(2)
    row = (every_code[0::2] | every_code[1::2] << 4).unsqueeze(0)
    probes.append((torch.randn(2, 32, generator=g).bfloat16(), row.repeat(256, 1),
                   torch.arange(256, dtype=torch.uint8).unsqueeze(1), torch.randn(256, generator=g)))
    # Zero blocks (+0 and -0 codes), NaN-scale blocks, x with Inf / NaN / -0.
    c = codes(4, 128)
    c[0, :16], c[1, 16:32], c[2] = 0x00, 0x88, 0x77
    s = _block_scales(g, 4, 128, 100, 140)
    s[3, 1] = 0xFF
    x = torch.randn(3, 128, generator=g).half()
    x[2, :3] = torch.tensor([float("inf"), float("nan"), -0.0])
    probes.append((x, c, s, None))
    probes.append((_small_integers((6, 64), g, torch.float16), codes(3, 64), _block_scales(g, 3, 64, 126, 129),
                   _small_integers((3,), g, torch.float32)))
    probes.append((_small_integers((6, 64), g, torch.bfloat16), codes(3, 64), _block_scales(g, 3, 64, 126, 129),
                   _small_integers((3,), g, torch.bfloat16)))
    # One and four BF16 rows of x, blocks of four weight rows, an even number of steps: the BF16 pairs where the
    # CPU has them (docs/weight_only.md, 'BF16 pairs'; one row on AMD Zen, four elsewhere), so that the check
    # covers vdpbf16ps's order too.
    for rows in (1, 4):
        probes.append((torch.randn(rows, 512, generator=g).bfloat16(), codes(8, 512),
                       _block_scales(g, 8, 512, 118, 130), None))
    return probes


def _hifloat4_probes():
    g = _gen(64)
    w = torch.randn(3, 128, generator=g) * torch.tensor([1e-3, 1.0, 1e4]).unsqueeze(1)
    w[1, 64:] = 0.0  # a zero block
    w[2, 5] = float("nan")  # a poisoned block
    probes = [(torch.randn(1, 128, generator=g).bfloat16(), *hifloat4.pack(w), None)]
    # Raw bytes: every E6M2 byte (0x00 .. 0xFE, and 0xFF) and random flags and values.
    scale = torch.randint(0, 256, (16, 16, 4), generator=g, dtype=torch.uint8)
    scale[..., 0] = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    value = torch.randint(0, 256, (16, 16 * 32), generator=g, dtype=torch.uint8)
    probes.append((torch.randn(3, 16 * 64, generator=g).half(), scale, value, torch.randn(16, generator=g).half()))
    x = torch.randn(2, 128, generator=g).bfloat16()
    x[1, :3] = torch.tensor([float("inf"), float("nan"), -0.0])
    probes.append((x, *hifloat4.pack(torch.randn(5, 128, generator=g)), torch.randn(5, generator=g)))
    exact = torch.randint(0, 256, (3, 1, 4), generator=g, dtype=torch.uint8)
    exact[..., 0] = 48 << 2  # scale 1.0: weights are multiples of 1/4 below 8
    probes.append((_small_integers((6, 64), g, torch.bfloat16), exact,
                   torch.randint(0, 256, (3, 32), generator=g, dtype=torch.uint8), None))
    probes.append((_small_integers((6, 64), g, torch.float16), exact,
                   torch.randint(0, 256, (3, 32), generator=g, dtype=torch.uint8),
                   _small_integers((3,), g, torch.float32)))
    # The BF16 pairs (as for MXFP4): one BF16 row of x, eight weight rows of four blocks.
    probes.append((torch.randn(1, 256, generator=g).bfloat16(), *hifloat4.pack(torch.randn(8, 256, generator=g)),
                   None))
    return probes


# ---- operators ---------------------------------------------------------------------------------------------

def _operator(name: str, outputs, weight, probes, params: tuple[str, str]) -> backends.Operator:
    """Register the Operator ``name`` (reference: ``weight`` then the lane sums) and its custom ops; a
    kernel's result is checked with lowbit.formats.weight_only.meets_contract."""

    def agrees(got, want, args) -> bool:
        x, a, b, bias = args
        return reference.meets_contract(got, want, x, weight(a, b, x.dtype), bias)

    return define(name, f"Tensor x, Tensor {params[0]}, Tensor {params[1]}, Tensor? bias=None", outputs,
                  _ReferenceLinear(weight), probes, kernels.native("weight_only", name.upper(), ("cpu", "cuda")),
                  agrees=agrees)


HIFLOAT8_LINEAR = _operator("hifloat8_linear", _hifloat8_outputs, reference.hifloat8_weight, _hifloat8_probes,
                            ("codes", "scale"))
FLOAT8_E4M3FN_LINEAR = _operator("float8_e4m3fn_linear", _float8_outputs, reference.float8_e4m3fn_weight,
                                 _float8_probes, ("codes", "scale"))
MXFP8_LINEAR = _operator("mxfp8_linear", _mxfp8_outputs, reference.mxfp8_weight, _mxfp8_probes, ("codes", "scales"))
MXFP4_LINEAR = _operator("mxfp4_linear", _mxfp4_outputs, lambda a, b, dtype: reference.mxfp4_weight(a, b),
                         _mxfp4_probes, ("codes", "scales"))
HIFLOAT4_LINEAR = _operator("hifloat4_linear", _hifloat4_outputs, lambda a, b, dtype: reference.hifloat4_weight(a, b),
                            _hifloat4_probes, ("scale", "value"))


def hifloat8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
        out: Optional[torch.Tensor] = None, backend: Optional[str] = None) -> torch.Tensor:
    """``x @ W.T + bias`` with W[n, k] = decode(codes[n, k]) * scale[n] dequantized in x's dtype (HiFloat8,
    W8A16): the code's value and the scale each in x's dtype, their product rounded to it (AMCT's fake quant).

    codes (N, K) uint8 HiFloat8 codes (lowbit.encode_to_hifloat8 of the weight divided by its row scale);
    scale (N,) float32. x (..., K) FP16/BF16 -> (..., N) in x's dtype (module docstring).
    """
    return call(HIFLOAT8_LINEAR, (x, codes, scale, bias), out, backend)


def float8_e4m3fn_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, *, out: Optional[torch.Tensor] = None,
                         backend: Optional[str] = None) -> torch.Tensor:
    """``x @ W.T + bias`` with W[n, k] = e4m3(codes[n, k]) * scale[n] (float32) rounded to x's dtype (FP8
    weight-only, W8A16; fake quant's dequantization).

    codes (N, K) uint8 float8_e4m3fn bit patterns (0x7F / 0xFF: NaN); scale (N,) float32. x (..., K)
    FP16/BF16 -> (..., N) in x's dtype (module docstring).
    """
    return call(FLOAT8_E4M3FN_LINEAR, (x, codes, scale, bias), out, backend)


def mxfp8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
        out: Optional[torch.Tensor] = None, backend: Optional[str] = None) -> torch.Tensor:
    """``x @ W.T + bias`` with W (N, K) MXFP8: ``codes, scales = lowbit.formats.mxfp8.quantize(W)`` (E4M3
    elements, an E8M0 scale per 32 along K), dequantized in x's dtype as mxfp8.dequantize does.

    codes (N, K) uint8 float8_e4m3fn bit patterns, scales (N, K/32) uint8 (0xFF: a NaN block). x (..., K)
    FP16/BF16 -> (..., N) in x's dtype (module docstring).
    """
    return call(MXFP8_LINEAR, (x, codes, scales, bias), out, backend)


def mxfp4_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
        out: Optional[torch.Tensor] = None, backend: Optional[str] = None) -> torch.Tensor:
    """``x @ W.T + bias`` with W (N, K) MXFP4: ``codes, scales = lowbit.mxfp4_quantize(W)`` (axis -1, block 32).

    codes (N, K/2) uint8 (element 2i in the low nibble), scales (N, K/32) uint8 E8M0 (0xFF: a NaN block); the
    float4_e2m1fn_x2 / float8_e8m0fnu views of them are accepted too.
    x (..., K) FP16/BF16 -> (..., N) in x's dtype (module docstring).
    """
    return call(MXFP4_LINEAR, (x, mxfp4.byte_view(codes), mxfp4.byte_view(scales), bias), out, backend)


def hifloat4_linear(x: torch.Tensor, scale: torch.Tensor, value: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
        out: Optional[torch.Tensor] = None, backend: Optional[str] = None) -> torch.Tensor:
    """``x @ W.T + bias`` with W (N, K) HiFloat4: ``scale, value = lowbit.hifloat4_pack(W)`` (AMCT layout).

    scale (N, K/64, 4) uint8 [E6M2 byte, e2 flags, e3 flags x2] per 64-block (0xFF: a NaN block), value
    (N, K/2) uint8. x (..., K) FP16/BF16 -> (..., N) in x's dtype (module docstring).
    """
    return call(HIFLOAT4_LINEAR, (x, scale, value, bias), out, backend)
