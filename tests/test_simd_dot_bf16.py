"""simd.f32v_dot_bf16 (vdpbf16ps on AVX512-BF16 CPUs, portable IR elsewhere) and its portable lowering give the
instruction's definition (docs/weight_only.md, 'BF16 pairs'): inputs flushed to zero where subnormal, the odd
words' product added first, then the even words', each result rounded to nearest even and flushed. The first
test runs on every CPU: on one without AVX512-BF16 the kernels compile the portable form (the instruction's
intrinsic made LLVM abort the process there)."""

import numba
import numpy as np
import pytest
from numba import types
from numba.extending import intrinsic

from lowbit.kernels.cpu import _simd as simd


@intrinsic
def _portable_dot(typingctx, acc, a, b):
    def codegen(context, builder, sig, args):
        return simd._dot_bf16_portable(builder, *args)

    return simd.F32V(acc, a, b), codegen


def _lanes_kernel(dot):
    @numba.njit
    def run(acc, a, b, out):
        for i in range(0, acc.size, simd.LANES):
            simd.f32v_store(out, i, dot(simd.f32v_load(acc, i), simd.i32v_load(a, i), simd.i32v_load(b, i)))

    return run


INSTRUCTION_OR_PORTABLE = _lanes_kernel(simd.f32v_dot_bf16)
PORTABLE = _lanes_kernel(_portable_dot)


def _flushed(bits):
    """float32 lanes of uint32 ``bits``, subnormals replaced by zero of the same sign."""
    assert bits.dtype == np.uint32
    return np.where(bits & 0x7F800000 == 0, bits & 0x80000000, bits).astype(np.uint32).view(np.float32)


def definition(acc, a, b):
    """vdpbf16ps lane by lane in numpy float32 (IEEE, round to nearest even)."""
    a, b = a.view(np.uint32), b.view(np.uint32)
    with np.errstate(over="ignore", invalid="ignore"):
        return _lane_sums(acc, a, b)


def _lane_sums(acc, a, b):
    total = _flushed(acc.view(np.uint32))
    for a_word, b_word in ((a & 0xFFFF0000, b & 0xFFFF0000), (a << 16, b << 16)):  # odd words, then even
        product = _flushed((_flushed(a_word) * _flushed(b_word)).view(np.uint32))
        total = _flushed((total + product).view(np.uint32))
    return total


def bf16_bits(values):
    return (np.asarray(values, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint32)


def pairs(odd, even):
    """int32 lanes holding two BF16 values: ``odd`` in the high word, ``even`` in the low."""
    return ((bf16_bits(odd) << 16) | bf16_bits(even)).view(np.int32)


def cases():
    """Lanes (acc, a, b) float32 / int32, padded to whole vectors: hand-made edges, then random lanes whose
    products are normal (the range the kernels pair), zeros and subnormal words among them."""
    tiny, sub = 2.0**-126, 2.0**-130  # the smallest normal; a BF16 subnormal
    edges = [  # (acc, a_odd, a_even, b_odd, b_even)
        (1.0, 2.0**-12 * (1 + 2.0**-7), -1.0, 2.0**-12, 1.0),  # odd first: 2^-23; even first: 2^-24 (1 + 2^-7)
        (0.0, 1.5 * tiny, -tiny, 1.0, 1.0),  # the sum 2^-127 is subnormal: flushed to +0
        (0.0, -1.5 * tiny, tiny, 1.0, 1.0),  # -2^-127: flushed to -0
        (0.0, sub, 2.0**100, 2.0**100, sub),  # subnormal words flushed before the product: 0, not 2^-29
        (-0.0, 0.0, -0.0, 5.0, 7.0),  # -0 + 0 * 5 = +0
        (1.0, float("inf"), 1.0, 2.0, 1.0),
        (1.0, float("inf"), 1.0, 0.0, 1.0),  # Inf * 0: NaN
        (float("nan"), 1.0, 1.0, 1.0, 1.0),
        (1.5 * 2.0**127, 2.0**63, 1.0, 2.0**63, 0.0),  # the sum overflows to Inf
    ]
    acc = [e[0] for e in edges]
    a = [pairs(e[1], e[2]) for e in edges]
    b = [pairs(e[3], e[4]) for e in edges]
    g = np.random.default_rng(7)
    n = 32 * 64 - len(edges)
    words = [np.ldexp(g.uniform(1, 2, n), g.integers(-40, 40, n)) * g.choice([-1, 1], n) for _ in range(4)]
    for w in words:
        w[g.random(n) < 0.03] = 0.0
        w[g.random(n) < 0.03] = sub
    acc = np.concatenate([np.float32(acc), (np.ldexp(g.uniform(1, 2, n), g.integers(-80, 80, n))
                                            * g.choice([-1, 1], n)).astype(np.float32)])
    a = np.concatenate([np.int32(a).reshape(-1), pairs(words[0], words[1])])
    b = np.concatenate([np.int32(b).reshape(-1), pairs(words[2], words[3])])
    return acc, a, b


def assert_same_lanes(got, want):
    assert np.array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    assert np.array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))  # signed zeros too


def test_hand_made_lanes_follow_the_definition():
    acc, a, b = cases()
    want = definition(acc, a, b)
    assert want[0] == 2.0**-23 and want[1] == 0.0 and not np.signbit(want[1]) and np.signbit(want[2])
    assert want[3] == 0.0 and want[4] == 0.0 and not np.signbit(want[4])
    assert np.isinf(want[5]) and np.isnan(want[6]) and np.isnan(want[7]) and np.isinf(want[8])


@pytest.mark.parametrize("run", [INSTRUCTION_OR_PORTABLE, PORTABLE], ids=["f32v_dot_bf16", "portable"])
def test_every_lane_is_the_definitions(run):
    acc, a, b = cases()
    out = np.empty_like(acc)
    run(acc, a, b, out)
    assert_same_lanes(out, definition(acc, a, b))
