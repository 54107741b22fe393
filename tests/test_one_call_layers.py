"""Deploy layers' decode in one numba call (QuantizedLinearBase._run_one_call): Int4Linear (the plan's bound
decode: the bits of its full path, the operator then torch's rounding and bias add), PackedLinear's fused
weight-only kernels (PreparedCall._bound_gemv: the operator's bits) and SVDQuantLinearDeploy (svd_quant's
decode and torch's bias add), for every x they take; the full path for every other x."""

import copy
import pickle

import numba
import pytest
import torch
from torch import nn

import lowbit
from helpers import SeenOps, bits, needs_two_numba_threads
from lowbit.kernels.cpu import weight_only as cpu
from lowbit.kernels.cpu.weight_only import GEMV_MAX_M
from lowbit.ops.library import PreparedCall
from lowbit.kernels.cpu import svd_quant as svd_cpu
from lowbit.kernels.cpu import wqbmm as wqbmm_cpu
from lowbit.quantize import modules
from lowbit.quantize.modules import (INT4_MSD_MAX_ROWS, Int4Linear, PackedLinear, QuantizedLinearBase,
                                     SVDQuantLinearDeploy, int4_msd_max_rows)

K, N = 256, 70  # N not a multiple of the kernel's 32-column tiles


def layer(dtype, symmetric=True, bias=True, seed=0, k=K, n=N):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(k, n, bias=bias)).to(dtype)
    config = {"batch_num": 1, "algorithm": "minmax", "quant_cfg": {
        "weights": {"type": "int4", "symmetric": symmetric, "strategy": "group", "group_size": 32}}}
    lowbit.quantize_(model, config)
    assert isinstance(model[0], Int4Linear)
    return model[0]


def full_path(module, x):
    return PackedLinear.forward(module, x)  # the input checks, then compute: the operator and torch's ops


def operator_result(module, x):
    y = lowbit.weight_quant_batch_matmul(x, module.weight, module.antiquant_scale, group_size=32,
                                         antiquant_offset=module._buffers.get("antiquant_offset"))
    return y if module.bias is None else y + module.bias


@pytest.fixture
def one_call_only(monkeypatch):
    """Int4Linear.compute (the full path) fails: a call that succeeds took the one numba call."""
    def refuse(self, x_q):
        raise AssertionError("took the full path")
    monkeypatch.setattr(Int4Linear, "compute", refuse)


def random_x(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    scale = 10.0 ** (torch.rand(*shape[:-1], 1, generator=g) * 6 - 3)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "offset"])
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("threads", [1, 2])
def test_one_call_gives_the_full_paths_bits(dtype, symmetric, has_bias, threads, monkeypatch):
    module = layer(dtype, symmetric, has_bias)
    shapes = [(1, K), (K,), (3, K), (2, 1, K), (5, K), (min(16, int4_msd_max_rows(dtype)), K)]  # MSD's rows
    xs = [random_x(shape, dtype, seed) for seed, shape in enumerate(shapes)]
    xs[4][1, :32] = 0  # a zero group
    xs[4][2, 40] = torch.finfo(dtype).max  # a group whose products round to Inf
    wants = [full_path(module, x) for x in xs]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        monkeypatch.setattr(Int4Linear, "compute", lambda self, x_q: pytest.fail("took the full path"))
        for x, want in zip(xs, wants):
            lowbit.backends._last_ran.pop("weight_quant_batch_matmul", None)
            got = module(x)
            assert lowbit.last_backend("weight_quant_batch_matmul") == "native"
            assert got.shape == want.shape and got.dtype == dtype
            assert torch.equal(bits(got), bits(want)), x.shape
            assert torch.equal(bits(got), bits(operator_result(module, x)))
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_overflow_of_the_bias_add_and_infinite_inputs(dtype, one_call_only):
    """Finite sums that round to Inf in x's dtype, a bias that overflows them, an infinite x (its group's a_max
    NaN makes the row NaN: that x takes the full path)."""
    module = layer(dtype)
    with torch.no_grad():
        module.bias[:5] = torch.finfo(dtype).max
        module.bias[5:10] = -torch.finfo(dtype).max
    x = random_x((2, K), dtype, 7) * 100
    assert torch.equal(bits(module(x)), bits(operator_result(module, x)))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_nan_result_takes_the_full_path_and_its_nan_bits(value, monkeypatch):
    module = layer(torch.bfloat16)
    x = random_x((3, K), torch.bfloat16, 3)
    x[1, 5] = value
    want = full_path(module, x)
    assert want[1].isnan().all() and not want[0].isnan().any()
    calls = []
    monkeypatch.setattr(Int4Linear, "compute", lambda self, x_q: calls.append(1) or want)
    assert module(x) is want and calls == [1]


def test_other_inputs_and_contexts_take_the_full_path(monkeypatch):
    """x requiring grad, more rows than MSD runs, a dispatch mode (it sees torch's ops), another backend
    setting: the full path. A non-contiguous x: the one call, on a contiguous copy."""
    module = layer(torch.bfloat16)
    x = random_x((2, K), torch.bfloat16, 4)
    x_many = random_x((INT4_MSD_MAX_ROWS + 1, K), torch.bfloat16, 5)
    want = full_path(module, x)
    calls = []
    full = Int4Linear.compute
    monkeypatch.setattr(Int4Linear, "compute", lambda self, x_q: calls.append(tuple(x_q.shape)) or full(self, x_q))
    got = module(x.clone().requires_grad_())  # in x's graph, with a backward that raises
    assert got.requires_grad and torch.equal(bits(got.detach()), bits(want))
    module(x_many)
    with SeenOps() as mode:
        assert torch.equal(bits(module(x)), bits(want))
    assert "aten.add.Tensor" in mode.seen  # the full path's bias add, which the mode saw
    with lowbit.use_backend("reference"):
        assert torch.equal(bits(module(x)), bits(want))
    many = [] if modules._dequant_reads_packed(torch.bfloat16) else [(INT4_MSD_MAX_ROWS + 1, K)]  # else the prefill's
    assert calls == [(2, K), *many, (2, K), (2, K)]
    strided = torch.cat([x, x], dim=1)[:, ::2]
    assert not strided.is_contiguous() and torch.equal(bits(module(strided)), bits(full(module, strided)))
    assert len(calls) == 3 + len(many)


@pytest.mark.parametrize("rows", [2, INT4_MSD_MAX_ROWS + 1])
@pytest.mark.parametrize("kind", ["int4", "svdquant"])
def test_a_bias_that_broadcasts_further_is_added_as_torch_adds_it(rows, kind):
    """torch.func.functional_call with a bias of more dimensions, and vmap over biases: the layer's output without
    its bias, plus that bias by torch's broadcasting add (the in-place add and the bound calls take (N,) biases
    only)."""
    if kind == "int4":
        module = layer(torch.bfloat16)
    else:
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(K, N)).bfloat16()
        lowbit.quantize_(model, "svdquant-r32")
        module = model[0]
        assert isinstance(module, SVDQuantLinearDeploy)
    x = random_x((rows, K), torch.bfloat16, 11)
    biases = random_x((3, 1, N), torch.bfloat16, 12)
    bias = module.bias
    module.bias = None
    plain = module(x)
    module.bias = bias
    module(x)  # binds the layer's own (N,) bias
    got = torch.func.functional_call(module, {"bias": biases}, (x,))
    assert torch.equal(bits(got), bits(plain + biases))
    mapped = torch.func.vmap(lambda b: torch.func.functional_call(module, {"bias": b}, (x,)))(biases[:, 0])
    assert torch.equal(bits(mapped), bits(plain + biases))
    assert torch.equal(bits(module(x)), bits(plain + bias))


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "offset"])
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_on_the_packed_weight_gives_the_full_paths_bits(symmetric, has_bias, threads, monkeypatch):
    """More rows than the decode takes, BF16 x, where compute would run the dequant algorithm on the PackedWeight
    (forced here on any CPU): the plan's bound prefill, the full path's bits (NaN rows included), recorded as
    a native run; FP16 x, and under the reference backend, the full path."""
    monkeypatch.setattr(modules, "_dequant_reads_packed", lambda dtype: dtype == torch.bfloat16)
    module = layer(torch.bfloat16, symmetric, has_bias, n=150)
    rows = int4_msd_max_rows(torch.bfloat16)
    shapes = [(rows + 1, K), (2, 40, K), (300, K)]
    xs = [random_x(shape, torch.bfloat16, seed) for seed, shape in enumerate(shapes)]
    xs[2][7, 3] = float("nan")
    xs[2][9] = -0.0  # a row of negative zeros
    xs[2][11, 5] = float("inf")
    xs[0][1, :8] = 1e-40  # BF16 subnormals (a BF16 GEMM flushes them: both paths run the same GEMM)
    xs.append(torch.cat([xs[0], xs[0]], dim=1)[:, ::2])  # not contiguous
    wants = [full_path(module, x) for x in xs]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(Int4Linear, "compute", lambda self, x_q: pytest.fail("took the full path"))
            for x, want in zip(xs, wants):
                lowbit.backends._last_ran.pop("weight_quant_batch_matmul", None)
                got = module(x)
                assert lowbit.last_backend("weight_quant_batch_matmul") == "native"
                assert got.shape == want.shape and torch.equal(bits(got), bits(want)), x.shape
        assert wants[2][7].isnan().all() and wants[2][11].isinf().any() and not xs[-1].is_contiguous()
        calls = []
        full = Int4Linear.compute
        monkeypatch.setattr(Int4Linear, "compute", lambda self, x_q: calls.append(x_q.dtype) or full(self, x_q))
        with lowbit.use_backend("reference"):
            module(xs[0])
        half = layer(torch.float16, symmetric, has_bias, n=150)
        half(xs[2].half())
        assert calls == [torch.bfloat16, torch.float16]
    finally:
        torch.set_num_threads(previous)


def test_the_one_call_follows_every_change_of_the_layers_tensors(one_call_only):
    module, other = layer(torch.bfloat16, seed=0), layer(torch.bfloat16, seed=1)
    x = random_x((1, K), torch.bfloat16, 6)
    before = module(x)
    module.load_state_dict(other.state_dict())  # in place
    assert torch.equal(bits(module(x)), bits(other(x))) and not torch.equal(before, module(x))
    with torch.no_grad():
        module.antiquant_scale.mul_(2)
    assert torch.equal(bits(module(x)), bits(operator_result(module, x)))
    module.bias.data = -module.bias.data.clone()  # new memory, version unchanged
    assert torch.equal(bits(module(x)), bits(operator_result(module, x)))
    with torch.no_grad():
        module.weight.bitwise_xor_(0x11)  # the packed weight is made again from the changed one
    assert torch.equal(bits(module(x)), bits(operator_result(module, x)))
    assert copy.deepcopy(module)._one_call is None and pickle.loads(pickle.dumps(module))._one_call is None


@needs_two_numba_threads
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_a_layer_large_enough_for_numbas_threads(dtype, one_call_only):
    """M * K * N past the kernel's one-thread work: the preload on numba's threads, in the same one call."""
    module = layer(dtype, symmetric=False, k=1024, n=1600)
    xs = [random_x((m, 1024), dtype, m) for m in (1, 3)]
    assert 1 * 1024 * 1600 >= wqbmm_cpu._ONE_THREAD_WORK  # every x here takes the parallel preload
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    chunksize = numba.set_parallel_chunksize(5)
    try:
        for x in xs:
            assert torch.equal(bits(module(x)), bits(operator_result(module, x)))
            assert numba.get_parallel_chunksize() == 5  # set inside the one call, and put back
    finally:
        torch.set_num_threads(previous)
        numba.set_parallel_chunksize(chunksize)
    assert module._one_call[0].bound._parallel.signatures  # compiled: it ran


@needs_two_numba_threads
@pytest.mark.parametrize("scheme", ["mxfp4-wo", "hif8-wo"])
def test_weight_only_one_call_on_numbas_threads_keeps_the_callers_chunk_size(scheme, monkeypatch):
    """The GEMV's one call on numba's threads (and the batched kernel's, where this CPU runs one for these rows)
    sets its loop's chunk size inside the compiled call and puts the caller's back: the operator's bits, and
    numba's chunk size after the call is the one set before it."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(K, N)).to(torch.bfloat16)
    lowbit.quantize_(model, scheme)
    module = model[0]
    op, names = module.fused_kernel(torch.bfloat16)
    monkeypatch.setattr(cpu, "GEMV_ONE_THREAD_WEIGHTS", 0)  # a small weight on numba's threads
    rows = [1, GEMV_MAX_M] + ([GEMV_MAX_M + 1] if cpu._batch_max_m(N, K, torch.bfloat16) > GEMV_MAX_M else [])
    module(random_x((1, K), torch.bfloat16, 0))  # the full path: finds the fused kernel
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    chunksize = numba.set_parallel_chunksize(5)
    try:
        for m in rows:
            x = random_x((m, K), torch.bfloat16, m)
            want = op(x, *[module._buffers[name] for name in names], module.bias)
            assert torch.equal(bits(module(x)), bits(want)), m
            assert numba.get_parallel_chunksize() == 5, m
    finally:
        torch.set_num_threads(previous)
        numba.set_parallel_chunksize(chunksize)
    kernel = module._one_call[0].bound._parallel  # BoundGemv's parallel GEMV ran
    assert kernel.signatures


@pytest.mark.parametrize("scheme", ["hif8-wo", "fp8-wo", "mxfp4-wo", "hif4-wo"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_weight_only_layers_run_the_operator_in_one_call(scheme, dtype, threads, monkeypatch):
    """After a layer's first call (the full path, which finds its fused kernel), x of up to GEMV_MAX_M rows (the
    GEMV), and up to the batched kernel's or the AMX kernel's rows where one runs (cpu.one_call_max_rows), takes
    one kernel call with the operator's bits and records the operator's run; more rows take the PreparedCall."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(K, N)).to(dtype)
    lowbit.quantize_(model, scheme)
    module = model[0]
    op, names = module.fused_kernel(dtype)
    rows = cpu.one_call_max_rows(N, K, dtype)
    shapes = [(1, K), (K,), (2, 1, K), (GEMV_MAX_M, K)] + ([(GEMV_MAX_M + 1, K), (1, rows, K)] if rows > GEMV_MAX_M else [])
    xs = [random_x(shape, dtype, seed) for seed, shape in enumerate(shapes)]
    xs[0][0, 3] = float("nan")
    xs[-1].view(-1, K)[-1, 5] = float("nan")
    wants = [op(x.reshape(-1, K), *[module._buffers[name] for name in names], module.bias).reshape(
        *x.shape[:-1], N) for x in xs]
    module(xs[0])  # the full path: finds the fused kernel
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    monkeypatch.setattr(PreparedCall, "__call__", lambda self, x: pytest.fail("took the PreparedCall"))
    try:
        for x, want in zip(xs, wants):
            lowbit.backends._last_ran.pop(op.name, None)
            assert torch.equal(bits(module(x)), bits(want)), x.shape
            assert lowbit.last_backend(op.name) == "native"
    finally:
        torch.set_num_threads(previous)
    with pytest.raises(pytest.fail.Exception, match="took the PreparedCall"):
        module(random_x((rows + 1, K), dtype, 9))


def test_more_rows_than_the_one_call_takes_follow_a_change_of_the_layers_tensors():
    """A layer whose one call is bound sends x of more rows than it takes to the full path at once (before the
    one call's checks): that path sees a packed weight written in place since."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(K, N)).to(torch.bfloat16)
    lowbit.quantize_(model, "mxfp4-wo")
    module = model[0]
    op, names = module.fused_kernel(torch.bfloat16)
    rows = cpu.one_call_max_rows(N, K, torch.bfloat16)
    decode, prefill = random_x((1, K), torch.bfloat16, 1), random_x((rows + 1, K), torch.bfloat16, 2)
    module(decode), module(decode), module(prefill)  # the full path, the bound one call, the PreparedCall
    assert module._one_call[0] is not None
    with torch.no_grad():
        module._buffers[names[1]].bitwise_xor_(0x11)  # the codes, in place
    want = op(prefill, *[module._buffers[name] for name in names], module.bias)
    assert torch.equal(bits(module(prefill)), bits(want))
    int4 = layer(torch.bfloat16)
    int4(decode)
    with torch.no_grad():
        int4.weight.bitwise_xor_(0x11)
    x = random_x((int4_msd_max_rows(torch.bfloat16) + 1, K), torch.bfloat16, 3)
    assert torch.equal(bits(int4(x)), bits(full_path(int4, x)))


def _rounding_edge_values(dtype, count, seed):
    """float32 values around the rounding edges of ``dtype``: halfway ties (even and odd), just past them,
    subnormals of the dtype, its largest finite value and the first that rounds to Inf, zeros, infinities."""
    g = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)
    base = torch.randn(count, generator=g) * 10.0 ** torch.randint(-6, 5, (count,), generator=g).float()
    rounded = base.to(dtype).float()
    step = torch.nextafter(rounded.to(dtype), torch.full_like(rounded, float("inf")).to(dtype)).float() - rounded
    half = rounded + step / 2  # a tie: to even
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), info.max, -info.max, info.tiny, info.tiny / 3,
                             info.max * (1 + info.eps / 2), info.max * (1 + info.eps / 4), -info.max * (1 + info.eps / 2),
                             2.0 ** -25 if dtype == torch.float16 else 1e-40])
    return torch.cat([base, half, torch.nextafter(half, torch.zeros_like(half)), torch.nextafter(half, half * 2),
                      specials])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "no-bias"])
def test_the_rounding_and_bias_add_are_torchs(dtype, has_bias):
    """_round_and_add_bias against torch's ``y.to(dtype) + bias`` on rounding ties, overflow, subnormals,
    infinities (rows of them meet the bias's) and a NaN: the same bits wherever torch's result has no NaN,
    and False exactly where it has one."""
    from lowbit.kernels.cpu import wqbmm as cpu

    n = 70
    values = torch.cat([_rounding_edge_values(dtype, 400, 1), torch.full((n,), float("inf")),
                        torch.full((n,), float("-inf")), torch.tensor([float("nan")])])  # NaN with any bias
    m = -(-values.numel() // n)
    y = torch.cat([values, torch.zeros(m * n - values.numel())]).reshape(m, n)
    y = y[torch.randperm(m, generator=torch.Generator().manual_seed(2))]
    bias = (_rounding_edge_values(dtype, 60, 3)[:n].to(dtype) if has_bias else torch.zeros(n, dtype=dtype))
    want = y.to(dtype) + bias if has_bias else y.to(dtype)
    for row in range(m):
        y32 = torch.zeros(1, 96)  # N padded to the kernel's 32-column tiles
        y32[0, :n] = y[row]
        bias32 = torch.zeros(96)
        bias32[:n] = bias.float()
        out = torch.empty(1, n, dtype=dtype)
        no_nan = cpu._round_and_add_bias(y32.numpy(), bias32.numpy(), has_bias, dtype == torch.bfloat16,
                                         out.view(torch.int16).numpy())
        assert no_nan == (not want[row].isnan().any())
        if no_nan:
            assert torch.equal(bits(out[0]), bits(want[row])), row


def _prepared_calls(model: nn.Module) -> list[PreparedCall]:
    """The PreparedCall each quantized layer of ``model`` keeps (QuantizedLinearBase.prepared_call)."""
    return [m.__dict__["_prepared"][0] for m in model.modules() if "_prepared" in m.__dict__]


@pytest.mark.parametrize("scheme", ["int4-a16w4", "mxfp4-wo", "hif4-wo", "fp8-wo", "hif8-wo", "mxfp8-w8a8"])
def test_a_real_model_on_real_text_gives_the_full_paths_bits(scheme, minilm, monkeypatch):
    """all-MiniLM-L6-v2 in BF16, quantized, on short real text one item at a time (M = its tokens: int4
    layers take up to int4_msd_max_rows rows in one call, the weight-only GEMV up to GEMV_MAX_M): the same
    embeddings, bit for bit, with the one call and by the full path with the operator's own run (not the
    bound GEMV's: for FP8 and HiFloat8 on AVX2 CPUs the table decode instead of the prepared weight's
    columns), and the one call ran (for MXFP8 layers after the activation's fake quant, their prepared weight on
    AVX2 CPUs taking most rows by columns), and by the operator's own run (MXFP8: the table decode)."""
    from lowbit.evaluation.embeddings import sentence_embeddings
    from lowbit.evaluation.text import all_sentences
    from lowbit.quantize.modules import QuantizedLinearBase

    model = copy.deepcopy(minilm.model).to(torch.bfloat16)
    lowbit.quantize_(model, scheme)
    limit = int4_msd_max_rows(torch.bfloat16) if scheme == "int4-a16w4" else GEMV_MAX_M  # [CLS], [SEP] included
    words = 100 if scheme == "int4-a16w4" else 2  # weight-only: the sentences' first two words
    texts = dict.fromkeys(" ".join(s.split()[:words]) for s in all_sentences())
    sentences = [t for t in texts if len(minilm.tokenizer(t)["input_ids"]) <= limit][:4]
    assert len(sentences) == 4
    ran = []
    one_call = QuantizedLinearBase._run_one_call

    def counted(self, *args, **kwargs):
        y = one_call(self, *args, **kwargs)
        ran.append(y is not None)
        return y

    monkeypatch.setattr(QuantizedLinearBase, "_run_one_call", counted)
    sentence_embeddings(model, minilm.tokenizer, sentences[:1], batch_size=1)  # first calls: full path, binding
    with_one_call = sentence_embeddings(model, minilm.tokenizer, sentences, batch_size=1)
    assert ran and all(ran[-len(ran) // 2:])
    if scheme == "mxfp8-w8a8" and cpu.CODE8_COLUMNS:
        fast = [p._prepared[(torch.bfloat16, p.fixed[0].shape[1])][0][4] for p in _prepared_calls(model)]
        assert fast and all((f != 0).all() for f in fast)
    monkeypatch.setattr(QuantizedLinearBase, "_run_one_call", lambda self, *args, **kwargs: None)
    monkeypatch.setattr(PreparedCall, "__call__", lambda self, x: self.op(x, *self.fixed))  # the operator's run
    without = sentence_embeddings(model, minilm.tokenizer, sentences, batch_size=1)
    assert torch.equal(bits(with_one_call), bits(without))


def test_int4_inputs_the_full_path_refuses_are_refused_alike():
    """An x of another dtype than the layer's (a float32 layer computes in BF16: BF16 x is still the wrong
    dtype) and a bias given another shape under the same memory get the full path's errors; a bias that
    requires grad changes nothing."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(K, N, bias=False))
    lowbit.quantize_(model, "int4-a16w4")
    with pytest.raises(lowbit.DtypeError, match="does not match the weight dtype"):
        model[0](random_x((1, K), torch.bfloat16, 1))
    module = layer(torch.bfloat16)
    x = random_x((1, K), torch.bfloat16, 2)
    module.bias.requires_grad_(True)  # before the layer's first call, which binds the decode
    want = full_path(module, x)
    got = module(x)
    assert module._one_call[0] is not None
    assert not got.requires_grad and torch.equal(bits(got), bits(want))
    module.bias.requires_grad_(False)
    module.bias.data = module.bias.data[:35]  # the same address and version, another shape
    with pytest.raises((RuntimeError, ValueError)):
        module(x)


def test_int4_prefill_binds_nothing_and_old_pickles_pack_again():
    """x of more rows than the one call takes leaves no binding behind; a module pickled before the packed
    weight and its state were one attribute (a _packed_from tuple) packs its weight again."""
    module = layer(torch.bfloat16)
    x = random_x((INT4_MSD_MAX_ROWS + 1, K), torch.bfloat16, 3)
    module.__dict__["_one_call"] = None
    module(x)
    assert module._one_call is None
    x = random_x((2, K), torch.bfloat16, 4)
    want = full_path(module, x)
    old = pickle.loads(pickle.dumps(module))
    old.__dict__.pop("_packed_state")
    old.__dict__.update(_packed=module._packed, _packed_from=())
    assert torch.equal(bits(old(x)), bits(want)) and torch.equal(bits(PackedLinear.forward(old, x)), bits(want))


# ---- SVDQuantLinearDeploy ---------------------------------------------------------------------------------


def svd_layer(bias=True, k=K, n=N, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(k, n, bias=bias)).to(torch.bfloat16)
    lowbit.quantize_(model, "svdquant-r32")
    assert isinstance(model[0], SVDQuantLinearDeploy)
    return model[0]


def svd_full_path(module, x):
    return QuantizedLinearBase.forward(module, x)  # the input checks, then compute: the operator, torch's add


@pytest.mark.skipif(not svd_cpu.INTEGER_PRODUCTS, reason="the one call needs the integer products")
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("threads", [1, 2])
def test_svdquant_layer_decodes_and_adds_its_bias_in_one_call(has_bias, threads, monkeypatch):
    """A BF16 svdquant layer's decode (x of 1 to 4 rows, any leading shape, strided, with -0 and zero blocks)
    with its bias added in the numba call: the full path's bits (the operator, then torch's BF16 add), for K
    with a short last step of the products and large layers on numba's threads too."""
    layers = [svd_layer(has_bias), svd_layer(has_bias, k=288, n=33, seed=2),
              svd_layer(has_bias, k=2048, n=1600, seed=1)]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for module in layers:
            k = module.in_features
            xs = [random_x(shape, torch.bfloat16, seed) for seed, shape in enumerate([(1, k), (k,), (3, k), (2, 2, k)])]
            xs[2][1, :64] = 0  # zero blocks
            xs[2][2, 64:70] = -0.0
            xs.append(random_x((2, 2 * k), torch.bfloat16, 9)[:, ::2])  # not contiguous
            wants = [svd_full_path(module, x) for x in xs]
            with monkeypatch.context() as patch:
                patch.setattr(SVDQuantLinearDeploy, "compute", lambda self, x_q: pytest.fail("took the full path"))
                for x, want in zip(xs, wants):
                    got = module(x)
                    assert got.shape == want.shape and got.dtype == torch.bfloat16
                    assert torch.equal(bits(got), bits(want)), x.shape
    finally:
        torch.set_num_threads(previous)


@pytest.mark.skipif(not svd_cpu.INTEGER_PRODUCTS, reason="the one call needs the integer products")
def test_svdquant_inputs_the_one_call_leaves_to_the_full_path(monkeypatch):
    """NaN in x (rows left to the float32 kernel), a subnormal x (the low-rank branch left to torch), a weight
    block of NaN, a NaN bias (torch's NaN bits), five
    rows, an FP16 layer, a bias that requires grad, the reference backend: the full path is taken and its bits
    are the result; an infinite bias stays in the one call."""
    compute, taken = SVDQuantLinearDeploy.compute, []

    def spy(self, x_q):
        taken.append(True)
        return compute(self, x_q)

    monkeypatch.setattr(SVDQuantLinearDeploy, "compute", spy)

    def check(module, x, full_path_taken=True):
        want = svd_full_path(module, x)
        taken.clear()
        got = module(x)
        assert bool(taken) == full_path_taken and torch.equal(bits(got), bits(want))
        return got

    module = svd_layer()
    x = random_x((1, K), torch.bfloat16, 5)
    check(module, x, full_path_taken=False)
    nan_x = x.clone()
    nan_x[0, 3] = float("nan")
    assert check(module, nan_x).isnan().all()
    subnormal_x = x.clone()
    subnormal_x[0, 7] = 2.0**-130  # a subnormal product in the low-rank branch: torch's matmuls decide
    check(module, subnormal_x)
    check(module, random_x((5, K), torch.bfloat16, 7))
    with lowbit.use_backend("reference"):
        check(module, x)
    with torch.no_grad():
        module.bias[:2] = torch.tensor([float("inf"), float("-inf")])
    assert check(module, x, full_path_taken=False)[0, :2].isinf().all()
    with torch.no_grad():
        module.bias[2] = float("nan")
    assert check(module, x)[0, 2].isnan()
    module = svd_layer()
    module.s.view(torch.uint8).view(N, -1)[5, 0] = 0xFF  # a NaN block of the weight: its row falls back
    assert check(module, x)[0, 5].isnan()
    module = svd_layer()
    module.bias.requires_grad_(True)
    check(module, x)
    fp16 = nn.Sequential(nn.Linear(K, N)).to(torch.float16)
    lowbit.quantize_(fp16, "svdquant-r32")
    check(fp16[0], x.half())


def _converted(scheme, n=256, k=512, seed=0):
    from lowbit.cli.bench.model import quantized_layer

    g = torch.Generator().manual_seed(seed)
    return quantized_layer((torch.randn(n, k, generator=g) / k**0.5).bfloat16(), torch.randn(n, generator=g).bfloat16(),
                           scheme)[0]


def _fresh_result(module, x):
    """What a layer never called before gives (or raises) with ``module``'s tensors as they are now."""
    fresh = copy.deepcopy(module)  # deepcopy drops the bound calls
    try:
        return fresh(x)
    except (TypeError, ValueError, RuntimeError) as exc:
        return type(exc)


def _bound(scheme):
    """(a converted 256 x 512 layer of ``scheme``, an x of 3 rows, its output) after two calls: bound."""
    module = _converted(scheme)
    x = torch.randn(3, 512).bfloat16()
    y = module(x)
    module(x)
    return module, x, y


@pytest.mark.parametrize("scheme", ["mxfp4-wo", "hif8-wo", "int4-a16w4", "svdquant-r32", "mxfp8-w8a8"])
def test_a_layers_sizes_are_read_only(scheme):
    module, x, before = _bound(scheme)
    for name, value in (("out_features", 10), ("in_features", 1024), ("in_features", 256)):
        with pytest.raises(AttributeError, match=f"{name} is fixed by its packed weight"):
            setattr(module, name, value)
    assert (module.in_features, module.out_features) == (512, 256) and torch.equal(bits(module(x)), bits(before))


@pytest.mark.parametrize("scheme, name, change", [
    ("mxfp4-wo", "codes", lambda t: t.t()),  # (256, 256): a transposed view at the same address
    ("hif8-wo", "scale", lambda t: t.as_strided(t.shape, (0,))),  # one value broadcast
    ("hif8-wo", "bias", lambda t: t.view(torch.float16)),
    ("mxfp4-wo", "codes", lambda t: t.view(torch.int8)),
])
def test_a_view_at_the_same_address_is_seen(scheme, name, change):
    module = _converted(scheme)
    x = torch.randn(2, 512).bfloat16()
    module(x), module(x)
    tensor = getattr(module, name)
    tensor.data = change(tensor.data)
    expected = _fresh_result(module, x)
    if isinstance(expected, type):
        with pytest.raises(expected):
            module(x)
    else:
        assert torch.equal(bits(module(x)), bits(expected))


@pytest.mark.parametrize("scheme, name", [("hif8-wo", "scale"), ("int4-a16w4", "antiquant_scale"),
                                          ("int4-a16w4", "bias"), ("hif4-wo", "value"), ("mxfp4-wo", "scales")])
def test_writes_under_inference_mode_are_seen(scheme, name):
    x = torch.randn(2, 512).bfloat16()
    with torch.inference_mode():
        module = _converted(scheme)  # made under inference mode, as `lowbit bench model` makes them
        assert not any(t.is_inference() for t in [*module.buffers(), *module.parameters()])
        before = module(x)
        module(x)
        tensor = getattr(module, name)
        if tensor.is_floating_point():
            tensor.mul_(2)
        else:
            tensor.copy_(tensor.roll(1, 0))
        after = module(x)
    assert not torch.equal(bits(after), bits(before))
    assert torch.equal(bits(after), bits(_fresh_result(module, x)))


@pytest.mark.parametrize("scheme, name", [("hif4-wo", "value"), ("hif8-wo", "scale"), ("hif8-wo", "codes"),
                                          ("int4-a16w4", "weight")])
def test_a_write_that_ends_while_a_cache_is_made_is_seen_at_the_next_call(scheme, name, monkeypatch):
    """Another thread's in-place write ending while a call copies or packs the tensors (hif4's indexed codes,
    hif8's scales and codes, int4's PackedWeight): the caches record the versions before they read, so the
    next call makes them again, not the copy of a half-written tensor for good."""
    module = _converted(scheme)
    x = torch.randn(1, 512).bfloat16()
    tensor = getattr(module, name)
    owner, method = (lowbit.WqbmmPlan, "pack_weight") if scheme == "int4-a16w4" else (PreparedCall, "_bound_gemv")
    original, written = getattr(owner, method), []

    def then_written(*args, **kwargs):
        result = original(*args, **kwargs)
        if not written:  # the write ends after the cache read the tensor
            written.append(True)
            with torch.no_grad():
                tensor.copy_(tensor.roll(1, 0))
        return result

    monkeypatch.setattr(owner, method, then_written)
    if scheme == "int4-a16w4":
        module.prepack()  # (load_quantized's call; the layer packed its weight when it was made)
    module(x), module(x)
    assert written
    expected = _fresh_result(module, x)
    assert torch.equal(bits(module(x)), bits(expected)) and torch.equal(bits(module(x)), bits(expected))


def test_an_int4_scale_of_another_dtype_is_named():
    module = _converted("int4-a16w4")
    x = torch.randn(2, 512).bfloat16()
    module(x), module(x)
    module.antiquant_scale.data = module.antiquant_scale.data.double()
    with pytest.raises(lowbit.DtypeError, match="layer '0': tensor 'antiquant_scale' is float64 \\(4, 256\\); it "
                                                "was made bfloat16 \\(4, 256\\)"):
        module(x)


def test_a_state_dict_assigned_under_inference_mode_is_owned_and_a_trainable_bias_stays_trainable():
    x = torch.randn(2, 512).bfloat16()
    module, other = _converted("hif8-wo", seed=0), _converted("hif8-wo", seed=1)
    module(x), module(x)
    with torch.inference_mode():
        state = {k: v.clone() for k, v in other.state_dict().items()}  # inference tensors
        module.load_state_dict(state, assign=True)
        assert not any(t.is_inference() for t in [*module.buffers(), *module.parameters()])
        assert torch.equal(bits(module(x)), bits(other(x)))
        module.scale.mul_(2)
        assert torch.equal(bits(module(x)), bits(_fresh_result(module, x)))
    module.bias.requires_grad_(True)
    bias = module.bias
    with torch.inference_mode():  # a cast there and back makes new tensors: normal ones, the same Parameter
        module.to(torch.float32).to(torch.bfloat16)
    assert module.bias is bias and module.bias.requires_grad
    assert not any(t.is_inference() for t in [*module.buffers(), *module.parameters()])


@pytest.mark.parametrize("scheme", ["hif8-wo", "mxfp4-wo", "int4-a16w4", "svdquant-r32", "fp8-wo"])
def test_functional_call_with_a_packed_tensor_of_another_shape_is_named(scheme):
    """(A 0-d scale was broadcast silently, or failed with an IndexError or torch's own errors.)"""
    module, x, expected = _bound(scheme)
    for name, t in module.packed_tensors().items():
        with pytest.raises(lowbit.ShapeError, match=f"layer '0': tensor '{name}' is .* \\(\\); it was made"):
            torch.func.functional_call(module, {name: t.reshape(-1)[:1].reshape(())}, (x,))
    assert torch.equal(bits(module(x)), bits(expected))
