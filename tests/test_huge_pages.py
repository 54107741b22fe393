"""lowbit.kernels.cpu.memory. Packed weights in memory advised for huge pages: same values, 2 MiB aligned,
independent of the source, alive as long as any view; deploy modules put their large buffers there at
convert and at load, and compute the same bits. Large outputs of allocating calls advised for huge pages, in
torch's own memory. The per-thread scratch buffer: kept between calls, grown on demand, one per thread."""

import gc
import importlib
import mmap
import threading

import pytest
import torch
from torch import nn

import lowbit
from lowbit.kernels.cpu import memory
from lowbit.kernels.cpu.memory import (FRESH_OUTPUT_BYTES, HUGE_PAGE, huge_page_copy, huge_page_empty, output_empty,
                                       thread_scratch)

MIB3 = 3 << 20
advised = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform")
modules = importlib.import_module("lowbit.quantize.modules")  # lowbit.quantize is also a function


@advised
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.bfloat16, torch.float16, torch.float32, torch.bool])
def test_copy_has_the_values_shape_and_a_2mib_aligned_start(dtype):
    elements = MIB3 // torch.tensor([], dtype=dtype).element_size()
    source = torch.randint(0, 2, (elements // 64, 64)).to(dtype) if dtype == torch.bool else \
        torch.randn(elements // 64, 64).mul(100).to(dtype)
    copy = huge_page_copy(source[:, :48])  # a non-contiguous source
    assert copy.shape == (elements // 64, 48) and copy.dtype == dtype and copy.is_contiguous()
    assert copy.data_ptr() % HUGE_PAGE == 0
    assert copy.untyped_storage().nbytes() == copy.numel() * copy.element_size()  # torch.save writes no more
    assert torch.equal(copy, source[:, :48])
    source.zero_()
    assert copy.any()  # a copy, not a view of the source


def test_a_view_keeps_the_mapping_alive():
    copy = huge_page_copy(torch.arange(MIB3 // 4, dtype=torch.int32))
    tail = copy[-5:]
    del copy
    gc.collect()
    assert tail.tolist() == list(range(MIB3 // 4 - 5, MIB3 // 4))


def test_a_refused_mapping_keeps_the_tensor_where_it_is(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)
    t = torch.ones(MIB3 // 4)
    assert huge_page_copy(t) is t


@pytest.mark.parametrize("shape", [(MIB3 // 2, 2), (HUGE_PAGE - 1,), (3, 7)])
def test_empty_has_the_shape_and_dtype_in_huge_pages_where_large_enough(shape, monkeypatch):
    """huge_page_empty: a contiguous CPU tensor of the shape and dtype asked for, 2 MiB aligned where it holds
    at least a huge page (and the platform advises them), else an ordinary one; also when the OS refuses."""
    empty = huge_page_empty(shape, torch.uint8)
    assert empty.shape == shape and empty.dtype == torch.uint8 and empty.is_contiguous()
    large = empty.numel() >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE")
    assert (empty.data_ptr() % HUGE_PAGE == 0) == large
    empty.fill_(7)  # writable
    monkeypatch.setattr(mmap, "mmap", lambda *args, **kwargs: (_ for _ in ()).throw(OSError(12, "no memory")))
    refused = huge_page_empty(shape, torch.int16)
    assert refused.shape == shape and refused.dtype == torch.int16 and refused.is_contiguous()


def _advised_for_huge_pages(address: int) -> bool:
    """Whether the mapping holding ``address`` is advised for huge pages ("hg" among its VmFlags in
    /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(bound, 16) for bound in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


smaps = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE") or not __import__("os").path.exists(
    "/proc/self/smaps"), reason="needs Linux's MADV_HUGEPAGE and /proc/self/smaps")


@smaps
@pytest.mark.parametrize("nbytes", [FRESH_OUTPUT_BYTES, FRESH_OUTPUT_BYTES + 4 * HUGE_PAGE + 12,
                                    FRESH_OUTPUT_BYTES - 2])
def test_an_output_of_fresh_memory_is_advised_for_huge_pages_a_smaller_one_is_not(nbytes):
    out = output_empty((nbytes // 2,), torch.float16)
    assert out.shape == (nbytes // 2,) and out.dtype == torch.float16 and out.is_contiguous()
    assert out.untyped_storage().resizable()  # torch's own memory, not a mapping of lowbit's
    inside = -(-out.data_ptr() // HUGE_PAGE) * HUGE_PAGE  # the first whole huge page inside it
    assert _advised_for_huge_pages(inside) == (nbytes >= FRESH_OUTPUT_BYTES)
    out.fill_(1.5)  # writable
    assert out[-1] == 1.5


@smaps
def test_an_allocating_call_puts_a_large_output_in_huge_pages_with_the_out_calls_bits():
    codes = lowbit.encode_to_hifloat8(torch.randn(FRESH_OUTPUT_BYTES // 2 // 1024, 1024).bfloat16())
    decoded = lowbit.decode_from_hifloat8(codes, torch.bfloat16)
    assert _advised_for_huge_pages(-(-decoded.data_ptr() // HUGE_PAGE) * HUGE_PAGE)
    into = torch.empty_like(decoded)
    lowbit.decode_from_hifloat8(codes, out=into)
    assert torch.equal(decoded.view(torch.int16), into.view(torch.int16))


def test_small_and_non_cpu_tensors_are_returned_as_they_are():
    small = torch.ones(HUGE_PAGE // 4 - 1)
    assert huge_page_copy(small) is small
    meta = torch.empty(MIB3, dtype=torch.uint8, device="meta")
    assert huge_page_copy(meta) is meta


@advised
@pytest.mark.parametrize("scheme", ["mxfp4-wo", "hif8-wo", "int4-a16w4", "svdquant-r32"])
def test_deploy_modules_hold_large_buffers_in_huge_page_memory(scheme, tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 4096, dtype=torch.bfloat16))  # 8M weights: packed >= 2 MiB
    lowbit.quantize(model, scheme)
    x = torch.randn(2, 2048, dtype=torch.bfloat16)
    model(x)
    lowbit.convert(model)
    layer = model[0]
    large = {k: t for k, t in layer.packed_tensors().items() if t.numel() * t.element_size() >= HUGE_PAGE}
    assert large and all(t.data_ptr() % HUGE_PAGE == 0 for t in large.values())
    if scheme == "int4-a16w4":  # the kernel-layout copy the decode reads
        assert layer._packed.data.data_ptr() % HUGE_PAGE == 0
    before = model(x)
    lowbit.save_quantized(model, tmp_path / "ckpt")
    copied = []
    monkeypatch.setattr(modules, "huge_page_copy",
                        lambda t: (t.device.type != "meta" and copied.append(t.shape)) or huge_page_copy(t))
    loaded = lowbit.load_quantized(tmp_path / "ckpt", nn.Sequential(nn.Linear(2048, 4096, dtype=torch.bfloat16)))
    assert all(loaded[0].packed_tensors()[k].data_ptr() % HUGE_PAGE == 0 for k in large)
    # one copy per buffer and the int4 kernel layout: none of the placeholders the loaded tensors replace (nor
    # of the dry run's tensors on the meta device, which hold no memory)
    assert len(copied) == len(layer.packed_tensors()) + (scheme == "int4-a16w4")
    assert torch.equal(loaded(x), before)


def test_thread_scratch_is_kept_grown_on_demand_and_per_thread():
    with thread_scratch(1000) as first:
        assert first.shape == (1000,) and first.dtype == torch.uint8 and first.device.type == "cpu"
    with thread_scratch(10) as smaller:
        assert smaller.data_ptr() == first.data_ptr() and smaller.shape == (10,)  # the same memory, kept
    with thread_scratch(1 << 20) as larger:
        assert larger.shape == (1 << 20,)
    with thread_scratch(1000) as again:
        assert again.data_ptr() == larger.data_ptr()  # kept at the larger size
    others = []

    def other_thread():
        with thread_scratch(1000) as buffer:
            others.append(buffer.data_ptr())

    worker = threading.Thread(target=other_thread)
    worker.start()
    worker.join()
    assert others[0] != larger.data_ptr()  # another thread has its own buffer


def test_a_nested_thread_scratch_gets_memory_of_its_own():
    with thread_scratch(4096) as outer:
        outer.fill_(7)
        with thread_scratch(4096) as inner:
            assert inner.data_ptr() != outer.data_ptr()
            inner.fill_(9)
        assert (outer == 7).all()  # the nested user did not write into the outer one's memory
    with thread_scratch(4096) as after:
        assert after.data_ptr() == outer.data_ptr()  # lent out again once the outer block ended


def test_thread_scratch_rejects_a_negative_size():
    with pytest.raises(ValueError, match="nbytes must be >= 0, got -1"):
        with thread_scratch(-1):
            pass


def test_an_output_while_torch_traces_is_a_fake_tensor_of_any_size(monkeypatch):
    """Under torch.compile's fake tensors (an operator's fake implementation) and a default device, an output of
    fresh-memory size is made without touching memory: a fake tensor (no advice for an address it does not
    have), or a CPU tensor."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    advised_ranges = []
    monkeypatch.setattr(memory, "_madvise", lambda: lambda *args: advised_ranges.append(args))
    with FakeTensorMode():
        fake = output_empty((FRESH_OUTPUT_BYTES,), torch.uint8)
        codes = lowbit.encode_to_hifloat8(torch.empty(FRESH_OUTPUT_BYTES // 1024, 1024, dtype=torch.bfloat16))
    assert type(fake).__name__ == "FakeTensor" and fake.shape == (FRESH_OUTPUT_BYTES,)
    assert codes.shape == (FRESH_OUTPUT_BYTES // 1024, 1024) and codes.dtype == torch.uint8
    assert advised_ranges == []
    with torch.device("meta"):
        assert output_empty((4,), torch.uint8).device.type == "cpu"
