"""lowbit from several Python threads at once, as a server calls it: calibration, the meta-device skeleton."""

import copy
import threading

import pytest
import torch
from torch import nn

import lowbit
from helpers import bits


def test_calibration_calls_from_several_threads_are_each_counted_once():
    """A server calibrating on live traffic: more calls than batch_num from several threads. Each call is a
    calibration call or a fake-quant one, none fails, and the layer calibrates as on one thread."""
    for trial in range(10):  # one layer: the next layer's calibration data would depend on the threads' order
        torch.manual_seed(trial)
        model = nn.Sequential(nn.Linear(256, 256, dtype=torch.bfloat16))
        reference = copy.deepcopy(model)
        config = "hif8-w8a8-minmax"  # batch_num 1
        lowbit.quantize(model, config)
        lowbit.quantize(reference, config)
        x = torch.randn(8, 256, dtype=torch.bfloat16)
        errors = []

        def calls():
            try:
                for _ in range(3):
                    model(x)
            except Exception as exc:  # noqa: BLE001 (collected for the assertion)
                errors.append(exc)

        threads = [threading.Thread(target=calls) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        reference(x)
        assert errors == [] and model[0].calls == reference[0].calls == 1
        assert torch.equal(bits(model(x)), bits(reference(x)))


def test_parameters_on_meta_is_per_thread_and_overlapping_blocks_put_torch_back():
    """Thread A opens a block, B opens one, A ends, B ends: modules made inside a block (in its thread) have
    meta parameters, those made outside (any thread) real ones, during and after; nn.Module is torch's again."""
    original = nn.Module.register_parameter
    steps = [threading.Event() for _ in range(4)]
    made = {}

    def block(name, enter_after, entered, leave_after, left):
        if enter_after is not None:
            steps[enter_after].wait(10)
        with lowbit.parameters_on_meta():
            made[name] = nn.Linear(4, 4)
            steps[entered].set()
            steps[leave_after].wait(10)
        steps[left].set()

    a = threading.Thread(target=block, args=("a", None, 0, 1, 2))
    b = threading.Thread(target=block, args=("b", 0, 1, 2, 3))
    a.start(), b.start()
    steps[0].wait(10)
    made["outside, during"] = nn.Linear(4, 4)
    a.join(10), b.join(10)
    steps[3].wait(10)
    made["after"] = nn.Linear(4, 4)
    assert {name: m.weight.device.type for name, m in made.items()} == {
        "a": "meta", "b": "meta", "outside, during": "cpu", "after": "cpu"}
    assert nn.Module.register_parameter is original


def test_a_layer_cast_and_cast_back_by_another_thread_meanwhile_computes():
    """The moment another thread's ``layer.float(); layer.bfloat16()`` has cast the tensors back but not yet
    forgotten the cast (QuantizedLinearBase._apply): a call computes, not a DtypeError that names no tensor."""
    from lowbit.cli.bench.model import quantized_layer

    layer = quantized_layer(torch.randn(32, 64).bfloat16(), torch.randn(32).bfloat16(), "hif8-wo")[0]
    x = torch.randn(2, 64).bfloat16()
    want = layer(x)
    layer.__dict__["_dtypes_made"] = layer._floating_dtypes()  # remembered, and every dtype as made again
    assert torch.equal(bits(layer(x)), bits(want))
    layer.float()
    with pytest.raises(lowbit.DtypeError, match=r"\(bias torch.bfloat16 -> torch.float32\)"):
        layer(x)


def test_the_fp16_check_looks_again_after_a_write_that_ends_while_it_decodes(monkeypatch):
    """An FP16 4-bit layer's check that its weights are FP16 values (PackedLinear._weights_are_fp16_values)
    records the buffers' versions before it decodes them: a write that ends meanwhile is looked at again."""
    from lowbit.cli.bench.model import quantized_layer
    from lowbit.quantize.modules import PackedLinear

    layer = quantized_layer(torch.randn(32, 64).half(), torch.randn(32).half(), "mxfp4-wo")[0]
    decoded, original = [], PackedLinear._decoded_weight

    def decode_then_written(self, dtype):
        weights = original(self, dtype)
        decoded.append(dtype)
        if len(decoded) == 1:  # another thread's write ends after the decode read the scales
            with torch.no_grad():
                self.scales.add_(0)
        return weights

    monkeypatch.setattr(PackedLinear, "_decoded_weight", decode_then_written)
    layer._weights_are_fp16_values(), layer._weights_are_fp16_values(), layer._weights_are_fp16_values()
    assert len(decoded) == 2


def test_warm_up_workers_forked_on_numbas_workqueue_run_parallel_loops(monkeypatch):
    """A child forked after import runs every kernel on its thread (lowbit.kernels.cpu.parallel_loops), but the
    warm-up's workers, forked before numba's threads start and switched to its workqueue layer, may run
    parallel loops: their probes compile the parallel kernels the parent will load."""
    import numba

    import lowbit.kernels.cpu as cpu_package
    from lowbit.kernels.cpu import warm

    monkeypatch.setattr(cpu_package, "parallel_loops", False)  # as in a forked child
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(numba.config, "THREADING_LAYER", numba.config.THREADING_LAYER)
    monkeypatch.setattr(warm.COMPILE_NOTICE, "quiet", warm.COMPILE_NOTICE.quiet)
    warm._worker_setup(True)
    assert cpu_package.parallel_loops and numba.config.THREADING_LAYER == "workqueue"
