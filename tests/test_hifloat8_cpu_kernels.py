"""The numba HiFloat8 FP16 encoder's two block paths (with / without FP16 subnormals), bit for bit; the serial
versions (small inputs) and the parallel loops give the same bits."""

import pytest
import torch

from helpers import serial_then_parallel
from lowbit.formats import hifloat8
from lowbit.kernels.cpu import hifloat8 as cpu_kernels


def all_fp16_patterns():
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)


def encode(bits):
    out = torch.empty(bits.numel(), dtype=torch.uint8)
    cpu_kernels.ENCODE.run(bits.view(torch.float16), out=out)
    return out


def test_blocks_without_subnormals_every_other_pattern():
    bits = all_fp16_patterns()
    magnitude = bits.to(torch.int32) & 0x7FFF
    bits = bits[(magnitude == 0) | (magnitude >= 0x400)]  # zero, normals, Inf, NaN: the 16-bit path only
    assert bits.numel() % cpu_kernels._BLOCK != 0  # a partial last block too
    assert torch.equal(encode(bits), hifloat8.encode(bits.view(torch.float16)))


def test_subnormals_spread_over_every_block():
    bits = all_fp16_patterns()[torch.randperm(65536, generator=torch.Generator().manual_seed(0))]
    assert torch.equal(encode(bits), hifloat8.encode(bits.view(torch.float16)))


def test_one_subnormal_in_an_otherwise_normal_block():
    x = torch.full((3 * cpu_kernels._BLOCK + 5,), 1.5, dtype=torch.float16)
    x[cpu_kernels._BLOCK + 7] = 2.0**-20
    x[-1] = -(2.0**-15) * 1.25
    assert torch.equal(encode(x.view(torch.int16)), hifloat8.encode(x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_serial_and_parallel_versions_agree(dtype, monkeypatch):
    """Every bit pattern encoded (shuffled, a partial last block) and every code decoded, by the serial versions
    and by the parallel loops on two threads (each forced here): the same bits, the reference's."""
    bits = all_fp16_patterns()[torch.randperm(65536, generator=torch.Generator().manual_seed(1))][:65536 - 77]
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(300)

    def run():
        encoded = torch.empty(bits.numel(), dtype=torch.uint8)
        cpu_kernels.ENCODE.run(bits.view(dtype), out=encoded)
        decoded = torch.empty(codes.numel(), dtype=dtype)
        cpu_kernels.DECODE.run(codes, dtype, out=decoded)
        return encoded, decoded.view(torch.int16)

    results = serial_then_parallel(monkeypatch, cpu_kernels, "ONE_THREAD_ELEMENTS", run)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert torch.equal(results[0][0], hifloat8.encode(bits.view(dtype)))
    assert torch.equal(results[0][1], hifloat8.decode(codes, dtype).view(torch.int16))


@pytest.mark.parametrize("serial", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("decoder", ["table", "words"])
def test_both_decoders_every_code_at_every_tail_length(decoder, dtype, serial):
    """The byte look-up decoder (64 codes per vpermi2b pair, AVX512-VBMI) and the word look-up one (CPUs
    without VBMI), called directly: every code, shuffled, at lengths whose last 64 codes are a partial step,
    across several blocks."""
    if decoder == "table" and not cpu_kernels.HAS_AVX512VBMI:
        pytest.skip("the look-up decoder needs AVX512-VBMI")
    generator = torch.Generator().manual_seed(2)
    for n in (1, 63, 64, 65, 255, 256, 257, cpu_kernels._BLOCK + 64 * 3 + 17, 5 * cpu_kernels._BLOCK - 1):
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(n // 256 + 1)
        codes = codes[torch.randperm(codes.numel(), generator=generator)][:n]
        out = torch.empty(n, dtype=torch.int16)
        if decoder == "table":
            cpu_kernels._decode_by_table(codes.numpy(), out.numpy(), cpu_kernels._byte_table(dtype), serial=serial)
        else:
            cpu_kernels._decode_by_words(codes.numpy(), out.numpy(), cpu_kernels._word_table(dtype), serial=serial)
        assert torch.equal(out, hifloat8.decode(codes, dtype).view(torch.int16)), n


@pytest.mark.parametrize("serial", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("encoders", ["table", "patterns"])
def test_both_encoders_every_bit_pattern(encoders, dtype, serial):
    """The encoders by exponent tables (32 elements per step, AVX512-BW) and by the table of every pattern's
    code (CPUs without AVX512-BW), called directly: every bit pattern in order (FP16: subnormal and normal
    blocks) and shuffled, then a length whose last step is short."""
    if encoders == "table" and not cpu_kernels.HAS_AVX512BW:
        pytest.skip("the table encoders need AVX512-BW")
    if encoders == "table":
        kernel = cpu_kernels._ENCODERS_BY_TABLE[dtype]
    else:
        def kernel(src, dst, serial):
            cpu_kernels._encode_by_patterns(src, dst, cpu_kernels._pattern_table(dtype), serial=serial)
    bits = all_fp16_patterns()
    shuffled = bits[torch.randperm(65536, generator=torch.Generator().manual_seed(3))]
    for patterns in (bits, shuffled, shuffled[:cpu_kernels._BLOCK * 3 + 32 * 5 + 7]):
        out = torch.empty(patterns.numel(), dtype=torch.uint8)
        kernel(patterns.numpy(), out.numpy(), serial=serial)
        assert torch.equal(out, hifloat8.encode(patterns.view(dtype))), patterns.numel()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_round_trip_in_one_call_every_pattern(dtype):
    """round_trip_small (a hif8-cast layer's activation in one numba call): every bit pattern of the dtype,
    shuffled, and short runs with partial vector steps: the reference's decode(encode(x)), bit for bit."""
    if not cpu_kernels.HAS_AVX512BW:
        pytest.skip("the one-call round trip runs the AVX512-BW encoders")
    bits = all_fp16_patterns()[torch.randperm(65536, generator=torch.Generator().manual_seed(3))]
    assert bits.numel() <= cpu_kernels.ONE_THREAD_ELEMENTS
    for n in (65536, 4096 + 17, 5):
        x = bits[:n].view(dtype).reshape(-1, n).clone()
        got = cpu_kernels.round_trip_small(x)  # first: no freed result under its output
        assert got.shape == x.shape and got.dtype == dtype
        assert torch.equal(got.view(torch.int16), hifloat8.decode(hifloat8.encode(x), dtype).view(torch.int16)), n
