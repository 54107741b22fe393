"""FP16 conversions of the SIMD layer without F16C: the integer-arithmetic versions (used where numba
compiles for a target without vcvtps2ph / vcvtph2ps, e.g. NUMBA_CPU_NAME=generic, where LLVM's library calls
for half conversions would be left unresolved) give the bits of the hardware conversions, for every FP16
pattern and for float32 patterns around every FP16 rounding boundary; and a whole FP16 weight-only call
compiled for the generic target runs and equals the reference."""

import os
import subprocess
import sys

import numba
import numpy as np
import pytest
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from lowbit.kernels.cpu import _simd as simd

needs_f16c = pytest.mark.skipif(not simd.HAS_F16C, reason="compares with the F16C instructions")
_V16 = ir.VectorType(ir.IntType(16), 16)
_VF = ir.VectorType(ir.FloatType(), 16)


def _vector_intrinsic(convert, source, target):
    """An intrinsic (src, dst, i): 16 lanes of ``src`` at i converted by ``convert(builder, vector)``."""

    @intrinsic
    def run(typingctx, src, dst, index):
        def codegen(context, builder, sig, args):
            value = builder.load(simd._element_ptr(context, builder, sig.args[0], args[0], args[2], source), align=1)
            result = convert(builder, value)
            builder.store(result, simd._element_ptr(context, builder, sig.args[1], args[1], args[2], target), align=1)
            return context.get_dummy_value()

        return types.void(src, dst, index), codegen

    @numba.njit
    def apply(src, dst):
        for i in range(0, src.size, 16):
            run(src, dst, i)

    return apply


def _hardware_to_f32(builder, bits):
    return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), 16)), _VF)


def _hardware_bits(builder, value):
    return builder.bitcast(builder.fptrunc(value, ir.VectorType(ir.HalfType(), 16)), _V16)


@needs_f16c
def test_every_fp16_pattern_widens_to_the_hardware_bits():
    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.int16)
    got, want = np.empty(patterns.size, np.float32), np.empty(patterns.size, np.float32)
    _vector_intrinsic(simd.f16_to_f32_portable, _V16, _VF)(patterns, got)
    _vector_intrinsic(_hardware_to_f32, _V16, _VF)(patterns, want)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@needs_f16c
def test_float32_rounds_to_the_hardware_fp16_bits():
    """Every FP16 value's float32 pattern and its neighbours, the midpoints between FP16 values and theirs
    (ties to even), both signs, the overflow and underflow edges, NaNs with payloads, and random patterns."""
    values = np.arange(1 << 15, dtype=np.uint16).view(np.float16).astype(np.float32)
    finite = values[np.isfinite(values)].astype(np.float64)
    midpoints = ((finite[:-1] + finite[1:]) / 2).astype(np.float32)  # exact in float32
    edges = np.concatenate([values, midpoints, np.float32([65504, 65519.99, 65520, 65536, 2.0 ** -24, 2.0 ** -25,
                                                          2.0 ** -26, 3 * 2.0 ** -26, 2.0 ** -14, 1e-30, 1e30])])
    bits = edges.view(np.uint32)
    near = (bits[:, None].astype(np.int64) + np.arange(-2, 3)).clip(0, 0x7F7FFFFF).astype(np.uint32).ravel()
    specials = np.uint32([0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0x7FA00000, 0x7F802000])
    rng = np.random.default_rng(0)
    patterns = np.concatenate([near, specials, rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint32)])
    patterns = np.concatenate([patterns, patterns | 0x80000000])
    patterns = np.concatenate([patterns, np.zeros(-patterns.size % 16, np.uint32)]).view(np.float32)
    got, want = np.empty(patterns.size, np.int16), np.empty(patterns.size, np.int16)
    _vector_intrinsic(simd.f16_bits_portable, _VF, _V16)(patterns, got)
    _vector_intrinsic(_hardware_bits, _VF, _V16)(patterns, want)
    assert np.array_equal(got, want)


GENERIC_FP16_CALLS = """
import torch, lowbit
from lowbit.backends import operators
g = torch.Generator().manual_seed(0)
w = torch.randn(40, 128, generator=g)
x = torch.randn(3, 128, generator=g).half()
cases = [('mxfp4_linear', (x, *lowbit.mxfp4_quantize(w), None)),
         ('hifloat8_linear', (x, lowbit.encode_to_hifloat8(w.half()), torch.ones(40), None))]
for name, args in cases:
    op = operators()[name]
    got, want = op(*args, backend='native'), op(*args, backend='reference')
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), name
print('ok')
"""


def test_fp16_weight_only_calls_compiled_for_the_generic_target(tmp_path):
    """numba compiling for NUMBA_CPU_NAME=generic (portable caches) used to call address 0 for each FP16
    conversion and crash the process (SIGSEGV)."""
    env = {**os.environ, "NUMBA_CPU_NAME": "generic", "NUMBA_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", GENERIC_FP16_CALLS], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
