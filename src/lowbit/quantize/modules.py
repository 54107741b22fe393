"""Quantized Linear modules: the calibration (fake-quant) module and the deployable packed modules.

* :class:`CalibrationModule` replaces an ``nn.Linear`` (or, for OFMR, an ``nn.Conv2d``) at
  :func:`lowbit.quantize`. It keeps the original
  weight and bias Parameters (no copy). Data-dependent algorithms count its own forward calls: calls
  1..batch_num return the float output and record statistics, the scales are fixed at call batch_num, and
  later calls return the fake-quant output. Data-free algorithms fake-quantize from the first call.
* :class:`PackedLinear` (dequantize then ``F.linear``), :class:`Int4Linear` (``weight_quant_batch_matmul``
  with a prepacked ``PackedWeight``) and :class:`SVDQuantLinearDeploy` (``svd_quant``) hold only packed
  tensors (buffers) and compute with lowbit's operators; :meth:`compute` is the one weight -> output step.

Inputs: (..., K) in the weight's dtype; outputs (..., N) in x's dtype. No gradient flows (all forwards run
under ``torch.no_grad``, as AMCT's; where x requires grad in grad mode, the output's backward raises:
run_without_derivative). Fake quant equals deploy bit for bit except Int4Linear (MSD numerics
vs the dequantized weight; docs/quantize.md, "Fake quant vs deploy").
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.autograd import forward_ad

from lowbit.backends import get_backend
from lowbit.errors import DtypeError, ShapeError
from lowbit.kernels.cpu.memory import huge_page_copy
from lowbit.nn.svd_quant import svd_quant_decompose
from lowbit.ops import weight_only
from lowbit.ops.library import PreparedCall, plain_context, plain_tensor
from lowbit.ops.svd_quant import SVD_QUANT
from lowbit.ops.wqbmm import PackedWeight, plan_weight_quant_batch_matmul, weight_quant_batch_matmul
from lowbit.quantize.activations import (ACT_KINDS, SCALELESS_KINDS, STATIC_KINDS, deploy_static_input,
                                        fake_quant_input, fake_quant_input_call)
from lowbit.quantize.calibration import QuantParams, fake_act_kind, layer_act_kind, make_calibrator, smoothed_weight
from lowbit.quantize.config import LayerConfig
from lowbit.quantize.layer_ops import check_layer_input, layer_geometry, run_layer
from lowbit.quantize.weight_formats import WEIGHT_FORMATS

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


def int4_compute_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """weight_quant_batch_matmul runs in FP16/BF16: the weight's dtype if it is one, else BF16."""
    return weight_dtype if weight_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


# A deploy module's caches in its __dict__ (not module attributes: absent from modules pickled before them), dropped
# by load_state_dict and left out of pickles and copies: its PreparedCall and its bound kernel calls
_CALL_SLOTS = ("_prepared", "_one_call", "_prefill_call")


def _storage_backed(tensors: tuple) -> bool:
    """Whether each of ``tensors`` (or None) has data a cache can read: not one of torch.export's fake tensors
    (or a functional wrapper of one)."""
    return not any(t is not None and is_fake(t) for t in tensors)


def refuse_unsupported_transforms(layer_name: str, x: torch.Tensor) -> None:
    """RuntimeError naming the layer under a transform that would record or differentiate it wrongly without
    an error: torch.jit.trace (its graph would keep the path and kernel chosen for the example's rows and
    values, and calibration would run on the example), and a derivative through the layer by torch.func
    (grad, vjp, jvp, jacrev of x; torch.func wraps every argument, so an x it does not differentiate passes)
    or forward-mode AD (the layer has none: they came out as zeros or None). Called
    where a layer's call leaves its one-call path (which these never take: plain_context, plain_tensor)."""
    if torch._C._get_tracing_state() is not None:
        raise RuntimeError(f"layer {layer_name!r}: torch.jit.trace cannot record a lowbit layer (its path "
                           "depends on the rows and values of x); use torch.compile or torch.export")
    if not isinstance(x, torch.Tensor) or torch.compiler.is_compiling():
        return  # (the layer's input check names it; dynamo traces no functorch or forward-AD state)
    differentiated = x.requires_grad and torch._C._functorch.is_gradtrackingtensor(x)
    if (torch._C._are_functorch_transforms_active() and differentiated
            or forward_ad._current_level >= 0 and forward_ad.unpack_dual(x).tangent is not None):
        raise RuntimeError(f"layer {layer_name!r}: a quantized layer has no derivative (torch.func's grad, vjp "
                           "and jvp and forward-mode AD through it would give zeros)")


class _NoDerivative(torch.autograd.Function):
    """A layer's output in x's autograd graph with a backward that raises: the layer has no derivative, and an
    output computed under torch.no_grad cut the gradients of everything before the layer without an error."""

    @staticmethod
    def forward(ctx, run, layer_name, x):
        ctx.layer_name = layer_name
        return run()

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"layer {ctx.layer_name!r}: a quantized layer has no derivative, so no gradient reaches "
                           "the tensors its input was computed from (freeze them with requires_grad_(False), run "
                           "the model under torch.no_grad(), or keep that layer in floating point)")


def run_without_derivative(layer_name: str, run: Callable[[], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``run()`` under torch.no_grad (the layer's own parameters get no gradient, as AMCT's layers); where grad
    mode is on and x requires grad, the output joins x's graph with a backward that raises (_NoDerivative).
    No graph under torch.func's transforms (whose derivatives of x refuse_unsupported_transforms refuses) and
    while torch.compile traces (dynamo would trace the raising backward: the output is detached there)."""
    if (x.requires_grad and torch.is_grad_enabled() and not torch._C._are_functorch_transforms_active()
            and not torch.compiler.is_compiling()):
        return _NoDerivative.apply(run, layer_name, x)
    with torch.no_grad():
        return run()


def _fixed_size(index: int, name: str, letter: str) -> property:
    """A read-only size of a deploy layer, item ``index`` of its ``_features``: fixed by the packed weight (the
    kernels bound to the layer size x and y by it); setting it is an AttributeError naming the layer."""

    def refuse(self, value) -> None:
        raise AttributeError(f"layer {self.layer_name!r}: {name} is fixed by its packed weight "
                             f"({self._features[index]}), cannot set it to {value!r}; quantize a new layer instead")

    return property(lambda self: self._features[index], refuse, doc=f"{letter}, fixed by the packed weight (read-only)")


class QuantizedLinearBase(nn.Module):
    """Packed tensors as buffers (names as in the checkpoint), the original bias Parameter, and the
    metadata to rebuild the module from a checkpoint (:meth:`quant_meta`, :meth:`from_meta`)."""

    kind = ""

    def __init__(self, name: str, in_features: int, out_features: int, weight_dtype: torch.dtype,
                 cfg_meta: dict, tensors: dict[str, torch.Tensor], bias: Optional[torch.Tensor],
                 huge_pages: bool = True):
        super().__init__()
        self.layer_name, self._features = name, (in_features, out_features)
        self.weight_dtype, self.cfg_meta = weight_dtype, dict(cfg_meta)
        for key, value in tensors.items():
            self.register_buffer(key, value)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        if huge_pages:
            self.use_huge_pages()
        else:
            self._own_versioned_tensors()
        self._record_tensors()

    in_features = _fixed_size(0, "in_features", "K")
    out_features = _fixed_size(1, "out_features", "N")

    def __setstate__(self, state: dict) -> None:
        if "in_features" in state:  # pickled while the sizes were plain attributes
            state = dict(state)
            state["_features"] = (state.pop("in_features"), state.pop("out_features"))
        super().__setstate__(state)

    def _floating_dtypes(self) -> dict[str, torch.dtype]:
        """The dtype of each floating-point buffer and of the bias, by name."""
        tensors = {**self._buffers, **self._parameters}
        return {name: t.dtype for name, t in tensors.items() if t is not None and t.is_floating_point()}

    def _apply(self, fn, *args, **kwargs):
        # model.half() / .to(dtype) cast this layer's floating tensors (its scales, factors, bias) but not what
        # it was quantized for: such a cast is remembered (the dtypes as made) and refused at the next call
        # (_check_not_cast); casting back forgets it. A device move keeps the dtypes.
        made = self.__dict__.get("_dtypes_made") or self._floating_dtypes()
        with torch.inference_mode(False):  # the new tensors normal ones (_own_versioned_tensors), not copied twice
            module = super()._apply(fn, *args, **kwargs)
        if self._floating_dtypes() != made:
            self.__dict__["_dtypes_made"] = made
        else:
            self.__dict__.pop("_dtypes_made", None)
        return module

    def _check_not_cast(self) -> None:
        """DtypeError naming this layer if its floating tensors were cast after it was made (:meth:`_apply`)."""
        made = self.__dict__.get("_dtypes_made")
        if made is not None:
            now = self._floating_dtypes()
            cast = ", ".join(f"{name} {made[name]} -> {now[name]}" for name in made if now.get(name) != made[name])
            if not cast:  # cast back meanwhile (another thread): nothing to refuse
                return
            raise DtypeError(f"layer {self.layer_name!r}: its tensors were cast after quantization ({cast}): "
                             "model.half(), .float() or .to(dtype) cast a converted layer's scales and factors "
                             f"too; it takes {self.weight_dtype} inputs: cast the model before quantizing it")

    def use_huge_pages(self) -> None:
        """Move the packed buffers of at least 2 MiB on the CPU into memory backed by huge pages where the
        OS offers them (lowbit.kernels.cpu.memory): the decode kernels stream them faster. Done at
        construction (unless ``huge_pages=False``: :meth:`from_meta`'s placeholders) and by load_quantized
        after it assigns the checkpoint's tensors."""
        with torch.inference_mode(False):  # normal tensors, with version counters (_own_versioned_tensors)
            for key, value in self.packed_tensors().items():
                self._buffers[key] = huge_page_copy(value)
        self._own_versioned_tensors()

    def _own_versioned_tensors(self) -> None:
        """Replace each buffer or parameter that is an inference tensor (one made under torch.inference_mode,
        which has no version counter, so that SourcesSeen could not see it written in place and the kernels
        bound to it would go on reading the old values) by a normal copy."""
        with torch.inference_mode(False):
            for key, value in self._buffers.items():
                if value is not None and value.is_inference():
                    self._buffers[key] = value.clone()
            for key, value in self._parameters.items():  # (a new Parameter: an inference one's data cannot be set)
                if value is not None and value.is_inference():
                    self._parameters[key] = nn.Parameter(value.clone(), requires_grad=value.requires_grad)

    def packed_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.named_buffers(recurse=False))

    def prepared_call(self, op, sources: tuple, arguments=None) -> PreparedCall:
        """``op`` bound to its arguments after x, made from ``sources`` (this module's tensors or None) by
        ``arguments(*sources)`` (default: the sources themselves): kept between calls, made again after any
        source is replaced or written (load_state_dict, a device move, huge pages)."""
        if torch.compiler.is_compiling() or not _storage_backed(sources):  # the operator as traced, not kept
            return PreparedCall(op, sources if arguments is None else arguments(*sources))
        kept = self.__dict__.get("_prepared")  # not an nn.Module attribute: absent from older pickled modules
        if kept is not None:
            prepared, seen = kept
            if prepared.op is op and seen.unchanged(sources):
                return prepared
        self._check_tensors()
        seen = SourcesSeen(sources)  # before the copies: a write meanwhile makes the next call prepare again
        prepared = PreparedCall(op, sources if arguments is None else arguments(*sources))
        self.__dict__["_prepared"] = (prepared, seen)
        return prepared

    def _record_tensors(self) -> None:
        """Remember each packed buffer's shape and dtype as made, for :meth:`_check_tensors`."""
        self.__dict__["_made_as"] = {k: (tuple(t.shape), t.dtype) for k, t in self.packed_tensors().items()}

    def _check_tensors(self) -> None:
        """ShapeError / DtypeError naming the layer and the tensor where a packed buffer no longer has the shape
        or dtype it was made with (a ``.data`` assignment, torch.func.functional_call with other tensors): the
        kernels would read it in its old layout, or broadcast it. (Casts are refused before: _check_not_cast;
        the bias may be replaced by one that broadcasts, which the full path adds as torch does.)"""
        for name, (shape, dtype) in self.__dict__.get("_made_as", {}).items():
            t = self._buffers.get(name)
            if t is None or tuple(t.shape) != shape or t.dtype != dtype:
                held = "missing" if t is None else f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"
                error = DtypeError if t is not None and tuple(t.shape) == shape else ShapeError
                raise error(f"layer {self.layer_name!r}: tensor {name!r} is {held}; it was made "
                            f"{str(dtype).removeprefix('torch.')} {shape}")

    def _run_one_call(self, x: torch.Tensor, sources: tuple, bind: Callable[..., Any], bind_argument: Any,
                      max_rows: Optional[int] = None, slot: str = "_one_call") -> Optional[torch.Tensor]:
        """This layer's output for ``x`` (..., K) of FP16 / BF16 (dtype and K checked by the caller) by a bound
        kernel call ``f(x, m, out) -> bool`` on x made C-contiguous, its M = ``m`` rows and a new out (..., N), made
        by ``bind(x, sources, bind_argument)`` (None: there is none) and kept while the sources, x's dtype and
        the backend setting stay as they are (SourcesSeen; no function is made per call). One numba call: the
        full path's torch, Python and numba calls cost tens of microseconds each after a model's previous layer
        (docs/weight_only.md, 'One call'). None
        (the caller's full path) where x is not plain (plain_tensor, plain_context: no grad, no mode, CPU),
        has no rows or more than ``max_rows`` and ``f.max_rows``, or f returned False. ``slot``: the attribute
        that keeps the bound call (one of _CALL_SLOTS; Int4Linear keeps its prefill's apart from its decode's)."""
        if "_dtypes_made" in self.__dict__:
            self._check_not_cast()
        k, n = self._features  # (not the properties: this runs on every decode call)
        m = x.numel() // k
        if not 0 < m <= (max_rows or m):
            return None
        if not (plain_context() and plain_tensor(x)):  # (first: torch.compile traces none of what follows)
            return None
        setting = (x.dtype, get_backend())
        kept = self.__dict__.get(slot)  # (bound call, SourcesSeen, (x dtype, backend setting))
        # More rows than the kept call takes (a bound call's rows depend on N, K and x's dtype only): the full path
        if kept is not None and kept[2] == setting and kept[0] is not None and m > kept[0].max_rows:
            return None
        if kept is None or kept[2] != setting or not kept[1].unchanged(sources):
            self._check_tensors()
            seen = SourcesSeen(sources)  # before bind reads (and may copy) them: see SourcesSeen
            kept = self.__dict__[slot] = (bind(x, sources, bind_argument), seen, setting)
        call = kept[0]
        if call is None or m > call.max_rows:
            return None
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype)
        return out if call(x.contiguous(), m, out) else None

    def _records_no_graph(self, x: torch.Tensor) -> bool:
        """Whether no op of this layer's call on ``x`` would record an autograd graph: neither x nor the bias
        requires grad (the packed buffers are made without)."""
        bias = self._parameters.get("bias")
        return not x.requires_grad and (bias is None or not bias.requires_grad)

    def _load_from_state_dict(self, *args, **kwargs):
        # written in place: SourcesSeen misses it for inference tensors; with assign=True under inference_mode
        # the state dict's inference tensors become the buffers
        self.__dict__.update(dict.fromkeys(_CALL_SLOTS))
        super()._load_from_state_dict(*args, **kwargs)
        self._own_versioned_tensors()

    def __getstate__(self) -> dict:
        """Pickling and copying leave out the prepared and the bound calls (views and copies of this module's
        tensors) and the fused kernel's input kind (PackedLinear.forward)."""
        return {**self.__dict__, **dict.fromkeys(_CALL_SLOTS), "_fused_input": None, "_fp16_values": None}

    def packed_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.packed_tensors().values())

    def quant_meta(self) -> dict[str, Any]:
        """JSON-able description: kind, sizes, dtype, config, and each packed tensor's shape and dtype."""
        return {
            "kind": self.kind, "in_features": self.in_features, "out_features": self.out_features,
            "weight_dtype": DTYPE_NAMES[self.weight_dtype], "bias": self.bias is not None, **self.cfg_meta,
            "tensors": {k: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                        for k, t in self.packed_tensors().items()},
        }

    @classmethod
    def from_meta(cls, name: str, meta: dict, device: torch.device | str = "cpu") -> "QuantizedLinearBase":
        """An empty module (uninitialised buffers on ``device``, in ordinary memory: placeholders that
        load_quantized replaces) of the layout ``meta`` describes. ValueError for an unknown weight format or
        activation kind (the caller names the file)."""
        if meta.get("weight_type") not in WEIGHT_FORMATS:
            raise ValueError(f"weight_type {meta.get('weight_type')!r} is not one of {sorted(WEIGHT_FORMATS)}")
        for key in ("act_kind", "fake_act_kind"):
            if key in meta and meta[key] not in ACT_KINDS:
                raise ValueError(f"{key} {meta[key]!r} is not one of {ACT_KINDS}")
        tensors = {k: torch.empty(v["shape"], dtype=getattr(torch, v["dtype"]), device=device)
                   for k, v in meta["tensors"].items()}
        dtype = DTYPES[meta["weight_dtype"]]
        bias = torch.empty(meta["out_features"], dtype=dtype, device=device) if meta["bias"] else None
        cfg_meta = {k: v for k, v in meta.items()
                    if k not in ("kind", "in_features", "out_features", "weight_dtype", "bias", "tensors")}
        return cls(name, meta["in_features"], meta["out_features"], dtype, cfg_meta, tensors, bias, huge_pages=False)

    def quantize_input(self, x: torch.Tensor, deploy: bool = True) -> torch.Tensor:
        """Smoothing then activation fake quant; result in x's dtype. Fake quant divides by sigma and s_d;
        the deploy path of an ``amct_compat`` layer multiplies by their reciprocals rounded to the weight /
        output dtype, as AMCT's deploy ops (docs/quantize.md, "Fake quant vs deploy")."""
        kind = self.cfg_meta["act_kind"] if deploy else self.cfg_meta.get("fake_act_kind", self.cfg_meta["act_kind"])
        if kind == "none" and "smooth" not in self._buffers:  # weight-only: x as it is
            return x
        npu_rounding = deploy and self.cfg_meta.get("amct_compat", False)
        xs = x
        if "smooth" in self._buffers:
            xs = x * (1 / self.smooth) if npu_rounding else x / self.smooth
        scale = self._buffers.get("act_scale")
        if npu_rounding and kind in STATIC_KINDS:
            return deploy_static_input(xs, kind, scale, x.dtype)
        try:
            return fake_quant_input(xs, kind, scale).to(x.dtype)
        except ShapeError as exc:  # (per-position scales of another sequence length)
            raise ShapeError(f"layer {self.layer_name!r}: {exc}") from None

    def compute(self, x_q: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __prepare_scriptable__(self):
        raise RuntimeError(f"layer {self.layer_name!r}: torch.jit.script cannot compile a lowbit layer; use "
                           "torch.compile or torch.export")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        refuse_unsupported_transforms(self.layer_name, x)
        self._check_not_cast()
        if not self._buffers:  # (a checkpoint's description without tensors)
            raise ValueError(f"layer {self.layer_name!r} has no packed tensors")
        self._check_tensors()
        check_layer_input(self.layer_name, self.cfg_meta["geometry"], x, self.weight_dtype,
                          next(iter(self._buffers.values())).device)
        if self._records_no_graph(x):  # no torch.no_grad(): its grad-mode switches cost tens of microseconds
            return self.compute(self.quantize_input(x))  # after other ops (docs/weight_only.md, 'One call')
        return run_without_derivative(self.layer_name, lambda: self.compute(self.quantize_input(x)), x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.cfg_meta.get('format', '')}"


# Weight formats with a fused weight-only kernel (lowbit.ops.weight_only): the operator and its packed buffers.
FUSED_LINEAR = {
    "hifloat8": (weight_only.HIFLOAT8_LINEAR, ("codes", "scale")),
    "float8_e4m3fn": (weight_only.FLOAT8_E4M3FN_LINEAR, ("codes", "scale")),
    "mxfp8_e4m3fn": (weight_only.MXFP8_LINEAR, ("codes", "scales")),
    "mxfp4_e2m1": (weight_only.MXFP4_LINEAR, ("codes", "scales")),
    "hifloat4": (weight_only.HIFLOAT4_LINEAR, ("block_scale", "value")),
}


class SourcesSeen:
    """What a cache made from ``tensors`` (each a tensor or None) depends on, cheap to check on every call
    (a few attribute reads a tensor: each read costs microseconds after other work has evicted the caches,
    docs/weight_only.md, 'One call'): each the same object, at the same address, of the same shape and dtype
    and still contiguous (a device move, ``.data =`` or share_memory_ changes them; ``.data =`` a transposed,
    broadcast or reinterpreted view at the same address too), with the same version counter (bumped by every
    in-place write, such as load_state_dict's copy). An inference tensor has no version counter: the deploy
    modules keep none (QuantizedLinearBase._own_versioned_tensors), and load_state_dict drops their caches
    itself. Made before the cache is built from the tensors: torch bumps a version when a write ends, so a
    write in another thread while the cache reads them is seen at the next call, not recorded as current.
    Not seen: writes through ``t.data`` (an alias with a version counter of its own)."""

    def __init__(self, tensors: tuple) -> None:
        self.tensors = tensors
        self._places = self._read_places(tensors)
        self._versioned = tuple(t for t in tensors if t is not None and not t.is_inference())
        self._versions = tuple(t._version for t in self._versioned)

    @staticmethod
    def _read_places(tensors: tuple) -> tuple:
        return tuple(None if t is None else (t.data_ptr(), t.shape, t.dtype, t.is_contiguous()) for t in tensors)

    def unchanged(self, tensors: tuple) -> bool:
        """Whether ``tensors`` are the ones seen, at the same addresses and shapes, unwritten since. One loop,
        no generator: each code object a call touches comes from memory after other work."""
        if len(tensors) != len(self.tensors):
            return False
        for t, seen, place in zip(tensors, self.tensors, self._places):
            if t is not seen or (t is not None and (t.data_ptr(), t.shape, t.dtype, t.is_contiguous()) != place):
                return False
        for t, version in zip(self._versioned, self._versions):
            if t._version != version:
                return False
        return True


_FOUR_BIT = ("mxfp4_e2m1", "hifloat4")  # fused formats whose weights an FP16 layer may not hold exactly
_ROW_SCALED = ("hifloat8", "float8_e4m3fn")  # 8-bit codes with a per-row (or per-tensor) FP32 scale
_IN_WEIGHT_DTYPE = (*_ROW_SCALED, "mxfp8_e4m3fn")  # fake quant rounds these weights to the weight's dtype


class PackedLinear(QuantizedLinearBase):
    """Deploy module for HiF8 / FP8 / INT8 / MXFP8 / MXFP4 / HiF4 weights: dequantize, then ``F.linear``
    (or ``F.conv2d`` for a Conv2d layer's geometry, see lowbit.quantize.layer_ops). A Linear layer with
    MXFP4 or HiFloat4 weights and FP16/BF16 inputs, or HiFloat8 / FP8 / MXFP8 weights and inputs of the
    weight's dtype (not ``amct_compat``) runs the fused weight-only kernel instead, which reads the packed
    weight and never builds the dense one: the same weight values, summed in another order
    (docs/weight_only.md; docs/quantize.md, "Fake quant vs deploy")."""

    kind = "packed"

    def fused_kernel(self, dtype: torch.dtype) -> Optional[tuple]:
        """(operator, names of its packed buffers) of the fused kernel for inputs of ``dtype``, or None where
        this layer has none (see the class docstring)."""
        if (self.cfg_meta["geometry"]["type"] != "Linear" or self.cfg_meta.get("amct_compat")
                or dtype not in (torch.float16, torch.bfloat16)):
            return None
        if self.cfg_meta["weight_type"] in _IN_WEIGHT_DTYPE and dtype != self.weight_dtype:
            return None  # the kernel dequantizes in x's dtype, fake quant in the weight's
        if self._weights_may_leave_fp16() and not self._weights_are_fp16_values():
            return None
        return FUSED_LINEAR.get(self.cfg_meta["weight_type"])

    def _weights_may_leave_fp16(self) -> bool:
        """Whether this is an FP16 layer with MXFP4 or HiFloat4 weights, which need not be FP16 values: near the
        FP16 maximum a block scale that rounds up makes them overflow (60000 -> 65536), below 2^-24 they fall
        under FP16's subnormals. Fake quant rounds such weights to FP16 (Inf, or another value); the fused
        kernel would sum them exactly in float32 (docs/quantize.md, "Fake quant vs deploy")."""
        return self.weight_dtype is torch.float16 and self.cfg_meta["weight_type"] in _FOUR_BIT

    def _weights_are_fp16_values(self) -> bool:
        """Whether every weight decodes to an FP16 value (NaN included), decoding them in float32 once per
        state of the fused kernel's two weight buffers (kept with a SourcesSeen of them: a check per call)."""
        sources = tuple(self._buffers[name] for name in FUSED_LINEAR[self.cfg_meta["weight_type"]][1])
        if torch.compiler.is_compiling() or not _storage_backed(sources):  # values not read: the dequantize path
            return False
        kept = self.__dict__.get("_fp16_values")
        if kept is None or not kept[0].unchanged(sources):
            seen = SourcesSeen(sources)  # before reading them: a write meanwhile makes the next call look again
            w32 = self._decoded_weight(torch.float32)
            exact = bool(((w32.half().float() == w32) | w32.isnan()).all())
            kept = self.__dict__["_fp16_values"] = (seen, exact)
        return kept[1]

    def _decoded_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as its format decodes it from the packed buffers into ``dtype``, (N, K) (not cached)."""
        fmt = WEIGHT_FORMATS[self.cfg_meta["weight_type"]]
        tensors = {k: v for k, v in self.packed_tensors().items() if k not in ("smooth", "act_scale")}
        return fmt.decode(tensors, dtype, self.cfg_meta.get("group_size"))

    def dequantized_weight(self) -> torch.Tensor:
        """The weight (its original shape and dtype), decoded from the packed buffers (not cached)."""
        return self._decoded_weight(self.weight_dtype).reshape(self.cfg_meta["geometry"]["weight_shape"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A layer whose fused kernel took x as it is (weight-only) or fake-quantized without a scale (act kinds
        # "hif8_cast", "mxfp4" and "mxfp8"): an x of the same dtype and K goes straight to it (the input check,
        # the input transform and the kernel choice passed for that dtype and K; each costs tens of microseconds
        # after other work: docs/weight_only.md, 'One call'), in one kernel call for a GEMV's rows
        # (_run_one_call; after the fake quant's own call), else, weight-only, by the PreparedCall where it
        # requires no grad. Anything else takes the full path, which also sets this.
        fast = self.__dict__.get("_fused_input")  # (x dtype, (K,), operator, buffers' names, act kind, FP16 check)
        if fast is not None and fast[5] and not self._weights_are_fp16_values():  # (the buffers changed)
            fast = self.__dict__["_fused_input"] = None
        if fast is not None and x.dtype is fast[0] and x.shape[-1:] == fast[1]:
            buffers, (first, second) = self._buffers, fast[3]
            sources = (buffers[first], buffers[second], self._parameters.get("bias"))
            y = self._run_one_call(x, sources, self._bind_fused, (fast[2], fast[4]))
            if y is not None:
                return y
            if fast[4] == "none" and self._records_no_graph(x) and x.device == sources[0].device:
                refuse_unsupported_transforms(self.layer_name, x)
                return self.prepared_call(fast[2], sources, self._fused_arguments)(x)  # (else the layer's error)
        return super().forward(x)

    def _bind_fused(self, x: torch.Tensor, sources: tuple, op_and_act: tuple) -> Any:
        """The fused operator's bound GEMV for x's dtype, after x's fake quant for the act kinds "hif8_cast",
        "mxfp4" and "mxfp8" (activations.fake_quant_input_call): _run_one_call's ``bind``."""
        op, act = op_and_act
        gemv = self.prepared_call(op, sources, self._fused_arguments)._bound_gemv(x.dtype, self.in_features)
        if gemv is None or act == "none":
            return gemv
        return fake_quant_input_call(gemv, act, x.dtype, self.in_features)

    def compute(self, x_q):
        fused = self.fused_kernel(x_q.dtype)
        if fused is not None:
            op, names = fused
            act = self.cfg_meta["act_kind"]
            if (act == "none" or act in SCALELESS_KINDS) and "smooth" not in self._buffers:  # x_q: x's own
                self.__dict__["_fused_input"] = (x_q.dtype, (self.in_features,), op, names, act,
                                                 self._weights_may_leave_fp16())
            buffers = tuple(self._buffers[name] for name in names)
            return self.prepared_call(op, (*buffers, self.bias), self._fused_arguments)(x_q)
        return run_layer(self.cfg_meta["geometry"], x_q, self.dequantized_weight(), self.bias)

    def _fused_arguments(self, codes, scale, bias) -> tuple:
        """The fused operator's arguments after x from the packed buffers and the bias: a per-tensor scale (1,)
        of HiFloat8 / FP8 expanded to the operator's (N,)."""
        if self.cfg_meta["weight_type"] in _ROW_SCALED and scale.shape[0] == 1:
            scale = scale.expand(self.out_features)
        return codes, scale, bias


# Int4Linear on the CPU: rows of x up to which it runs MSD; above, the "dequant" algorithm (the weight decoded
# tile by tile, torch's GEMM), faster from about 64 rows on (docs/quantize.md, 'Packed layouts'). On CPUs with
# AMX-BF16, BF16 x on the PackedWeight, where the dequant algorithm runs on lowbit's AMX kernel: from about 13
# rows on (Intel Xeon Emerald Rapids, time over BF16 nn.Linear's, MSD / dequant: N = K = 4096 at M = 12 1.09 /
# 0.96x, M = 16 1.24 / 0.86x; 1536 x 384 at M = 12 1.43 / 1.73x, M = 16 1.68 / 1.40x; 384 x 1536 at M = 12 1.50 /
# 1.51x; before that kernel, torch's GEMM took over from about 22 rows).
INT4_MSD_MAX_ROWS = 48
INT4_MSD_MAX_ROWS_AMX = 12


def int4_msd_max_rows(dtype: torch.dtype) -> int:
    """Rows of x of ``dtype`` up to which Int4Linear runs MSD on the CPU."""
    from lowbit.kernels.cpu import _simd, wqbmm_dequant  # numba: imported on first use, not with lowbit

    return INT4_MSD_MAX_ROWS_AMX if _simd.HAS_AMX_BF16 and wqbmm_dequant.packed_is_faster(dtype) else INT4_MSD_MAX_ROWS


def _plus_bias(y: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``y + bias`` for a layer's output ``y`` (a tensor of this call's own, not recorded by autograd), added into
    y where that gives y's shape and dtype in a plain context (the same bits): a second output of M x N costs its
    page faults, 1.5 ms of an int4-a16w4 layer's 2.6 ms at M = 1888, N = 1536, K = 384 on an Intel Xeon under
    KVM. Elsewhere (another dtype; a bias of another shape, as torch.func.functional_call may pass; a
    functorch transform) a new tensor, as before."""
    if bias is None:
        return y
    if bias.dtype == y.dtype and bias.shape == y.shape[-1:] and plain_context():
        return y.add_(bias)
    return y + bias


def _dequant_reads_packed(dtype: torch.dtype) -> bool:
    """Whether Int4Linear's dequant product reads its PackedWeight (wqbmm_dequant.packed_is_faster)."""
    from lowbit.kernels.cpu import wqbmm_dequant

    return wqbmm_dequant.packed_is_faster(dtype)


class Int4Linear(PackedLinear):
    """Deploy module for int4 per-group weights: ``weight_quant_batch_matmul`` with MSD (a PackedWeight made
    once, at convert / load, again after a change of the weight, a device move or another backend setting),
    or on the CPU for more than int4_msd_max_rows rows of x its "dequant" algorithm (on the PackedWeight where
    packed_is_faster, else on the raw weight). x is cast to the 16-bit compute dtype and back."""

    kind = "int4"

    _PLANS_KEPT = 64  # plans (one per row count and device) kept between calls

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # (PackedWeight, SourcesSeen of the weight it was made from), set in one step: a thread reading it
        # never pairs one PackedWeight with another's state
        self._packed_state: Optional[tuple] = None
        self._plans: dict = {}

    @property
    def _packed(self) -> Optional[PackedWeight]:
        """The PackedWeight last made (None before the first call or after load_state_dict)."""
        state = self.__dict__.get("_packed_state")
        return None if state is None else state[0]

    def _plan(self, m: int, device: torch.device, algorithm: str = "msd"):
        """The prepacked plan of ``algorithm`` for m rows of x (kept per row count, device, dtype, algorithm and
        backend setting: planning validates and selects the kernel, about 80 us, more than a small layer's
        product)."""
        key = (m, device, self.antiquant_scale.dtype, algorithm, get_backend())
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= self._PLANS_KEPT:
                self._plans.clear()
            plan = self._plans[key] = plan_weight_quant_batch_matmul(
                m, self.in_features, self.out_features, group_size=self.cfg_meta["group_size"], device=device,
                dtype=self.antiquant_scale.dtype, algorithm=algorithm, prepacked=True)
        return plan

    def prepack(self, plan=None) -> PackedWeight:
        """(Re)build the kernel-layout PackedWeight from the ``weight`` buffer on its device with ``plan`` (by
        default the plan of one row under the current backend setting), in huge pages on the CPU as the
        buffers; returns it."""
        seen = SourcesSeen((self.weight,))  # before packing: a write meanwhile makes the next call pack again
        packed = (plan or self._plan(1, self.weight.device)).pack_weight(self.weight)
        packed = dataclasses.replace(packed, data=huge_page_copy(packed.data))
        self.__dict__["_packed_state"] = (packed, seen)
        return packed

    def _current_packed(self, plan) -> PackedWeight:
        """The PackedWeight for ``plan``, made again on the first call and after a change or a move of the
        weight, under another backend setting, or in a module pickled before _packed_state existed."""
        state = self.__dict__.get("_packed_state")
        if state is None or state[0].backend != plan.backend or not state[1].unchanged((self.weight,)):
            return self.prepack(plan)
        return state[0]

    def _load_from_state_dict(self, *args, **kwargs):
        self.__dict__["_packed_state"] = None  # written in place, as prepared_call's sources (QuantizedLinearBase)
        super()._load_from_state_dict(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # An x of the layer's own FP16 / BF16 dtype (its compute dtype) that no activation quantization changes:
        # the plan's bound decode, where the one call applies (_run_one_call), and past its rows the plan's bound
        # prefill where compute would run the dequant algorithm on the PackedWeight (the same bits without the
        # plan's per-call work: 0.1-0.2 ms of a small layer's call); anything else, and a NaN result of the
        # decode (torch's NaN bit patterns), takes the full path.
        scale = self._buffers["antiquant_scale"]
        k = self._features[0]  # (not the property: this runs on every decode call)
        if (x.dtype is self.weight_dtype and x.dtype is scale.dtype and x.shape[-1:] == (k,)
                and "smooth" not in self._buffers and self.cfg_meta["act_kind"] == "none"):
            sources = (self._buffers["weight"], scale, self._buffers.get("antiquant_offset"),
                       self._parameters.get("bias"))
            msd_rows = int4_msd_max_rows(x.dtype)
            y = self._run_one_call(x, sources, self._bind_decode, "msd", msd_rows)
            if y is None and x.numel() > msd_rows * k and _dequant_reads_packed(x.dtype):
                y = self._run_one_call(x, sources, self._bind_decode, "dequant", slot="_prefill_call")
            if y is not None:
                return y
        return super().forward(x)

    def _bind_decode(self, x, sources, algorithm: str):
        """The bound call of this layer's PackedWeight (made again where stale) for ``algorithm``: the plan's
        bound decode ("msd"), or its bound prefill ("dequant", WqbmmPlan._bound_dequant: compute's prefill on
        the PackedWeight without the plan's per-call checks and workspace); None where the plan has none
        (another backend or device) or the bias is not an (N,) tensor of the scale's dtype (_run_one_call's
        ``bind``: ``sources`` are the weight, scale, offset and bias; torch.func.functional_call may pass a bias
        that broadcasts to more dimensions, which the full path adds as torch does)."""
        _, scale, offset, bias = sources
        if self.cfg_meta["geometry"]["type"] != "Linear" or (
                bias is not None and (bias.dtype != scale.dtype or bias.shape != (self.out_features,))):
            return None
        plan = self._plan(1, self.weight.device, algorithm)
        bind = plan._bound_decode if algorithm == "msd" else plan._bound_dequant
        return bind(self._current_packed(plan), scale, offset, bias)

    def compute(self, x_q):
        x2 = x_q.reshape(-1, self.in_features).to(self.antiquant_scale.dtype)
        offset = self._buffers.get("antiquant_offset")
        dequant = x2.shape[0] > int4_msd_max_rows(x2.dtype) and x2.device.type == "cpu"
        # Prefill (dequant) on the PackedWeight where that is faster (BF16 x on CPUs with a BF16 GEMM and
        # AVX512-VBMI), else on the raw weight; the one-shot op on the raw weight under torch.compile, tracing
        # or a mode, which take the custom op whole (not the plan's Python and numpy): MSD's bits, as the
        # PackedWeight's; dequant's within the same interval (torch's GEMM in the other orientation: a few
        # outputs differ in the last bit from the PackedWeight's, docs/quantize.md)
        if plain_context() and plain_tensor(x2) and (not dequant or _dequant_reads_packed(x2.dtype)):
            plan = self._plan(x2.shape[0], self.weight.device, "dequant" if dequant else "msd")
            y = plan.run(x2, self._current_packed(plan), self.antiquant_scale, offset)
        else:
            y = weight_quant_batch_matmul(x2, self.weight, self.antiquant_scale, antiquant_offset=offset,
                                          group_size=self.cfg_meta["group_size"],
                                          algorithm="dequant" if dequant else "msd")
        return _plus_bias(y.reshape(*x_q.shape[:-1], self.out_features).to(x_q.dtype), self.bias)


class SVDQuantLinearDeploy(QuantizedLinearBase):
    """Deploy module for SVDQuant: ``svd_quant`` (MXFP4 residual, rank-r BF16 branch, MXFP4 activations inside
    the operator); x cast to BF16, output cast back to x's dtype, then the bias added."""

    kind = "svdquant"

    def quantize_input(self, x, deploy=True):
        return x  # the operator quantizes the activations itself

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A BF16 x of a BF16 Linear layer: the operator's decode and the bias add in one numba call, where it
        # gives the full path's bits (_run_one_call; BoundDecode); anything else takes the full path.
        if (x.dtype is torch.bfloat16 and self.weight_dtype is torch.bfloat16
                and x.shape[-1:] == self._features[:1] and self.cfg_meta["geometry"]["type"] == "Linear"):
            buffers = self._buffers
            sources = (buffers["w"], buffers["s"], buffers["down"], buffers["up"], self._parameters.get("bias"))
            y = self._run_one_call(x, sources, self._bind_decode, None)
            if y is not None:
                return y
        return super().forward(x)

    def _bind_decode(self, x, sources, _):
        """The svd_quant kernel's bound decode with this layer's bias (_run_one_call's ``bind``), or None where
        the kernel has none or the bias is not a plain (N,) tensor."""
        *factors, bias = sources
        if bias is not None and not (plain_tensor(bias) and bias.shape == (self.out_features,)):
            return None
        return self.prepared_call(SVD_QUANT, tuple(factors))._bound_gemv(x.dtype, self.in_features, bias)

    def compute(self, x_q):
        xb = x_q.to(torch.bfloat16)
        x3 = xb.reshape(-1, self.in_features) if xb.dim() == 1 else xb
        y = self.prepared_call(SVD_QUANT, (self.w, self.s, self.down, self.up))(x3)
        return _plus_bias(y.reshape(*x_q.shape[:-1], self.out_features).to(x_q.dtype), self.bias)


DEPLOY_CLASSES = {c.kind: c for c in (PackedLinear, Int4Linear, SVDQuantLinearDeploy)}


def deploy_class(weight_type: str, algorithm: str) -> type[QuantizedLinearBase]:
    """The deploy module of a layer of ``weight_type`` quantized by ``algorithm``: SVDQuantLinearDeploy for
    svdquant, Int4Linear for int4 weights, else PackedLinear."""
    if algorithm == "svdquant":
        return SVDQuantLinearDeploy
    return Int4Linear if weight_type == "int4" else PackedLinear


def _call_the_module(module, args):
    """A forward pre-hook that changes nothing (see :func:`replace_layer`)."""
    return None


# A module's forward hooks (with their handles' dictionaries) move to the module that replaces it.
_FORWARD_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                  "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def replace_layer(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` at ``name`` in ``model``. The module there hands ``new`` its forward hooks (the same
    dictionaries, so their handles still remove them; selection skips modules with other hooks). Inside an
    ``nn.TransformerEncoderLayer`` it gets a forward pre-hook that does nothing: torch's fused encoder path
    (eval mode) reads ``linear1.weight`` and the like directly and is not taken for a layer with hooks, so the
    quantized module's own forward runs; an enclosing ``nn.TransformerEncoder`` gets ``use_nested_tensor =
    False`` for the same reason (its padding-mask path)."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    old = getattr(parent, child)
    for attribute in _FORWARD_HOOKS:
        setattr(new, attribute, getattr(old, attribute))
    if isinstance(parent, nn.TransformerEncoderLayer) and _call_the_module not in new._forward_pre_hooks.values():
        new.register_forward_pre_hook(_call_the_module)
    parts = name.split(".")
    for depth in range(len(parts)):  # an encoder stack's nested-tensor path reads layers[0].linear1.weight too
        ancestor = model.get_submodule(".".join(parts[:depth]))
        if isinstance(ancestor, nn.TransformerEncoder):
            ancestor.use_nested_tensor = False
    setattr(parent, child, new)


def build_deploy(name: str, geometry: dict, weight: torch.Tensor, bias: Optional[torch.Tensor], cfg: LayerConfig,
                 params: QuantParams) -> QuantizedLinearBase:
    """Pack ``weight`` with the calibrated ``params`` into the deploy module of ``cfg``."""
    with torch.no_grad():
        w = weight.detach()
        w = w.reshape(w.shape[0], -1)  # one row per output channel
        n, k = w.shape
        spec = cfg.weights
        meta = {"scheme": cfg.scheme, "format": cfg.describe(), "weight_type": spec.type, "group_size": spec.group_size,
                "act_kind": layer_act_kind(cfg), "fake_act_kind": fake_act_kind(cfg), "algorithm": cfg.algorithm.name,
                "amct_compat": cfg.amct_compat,
                "geometry": geometry}
        cls = deploy_class(spec.type, cfg.algorithm.name)
        if cls is SVDQuantLinearDeploy:
            ws, s, d, u = svd_quant_decompose(w, cfg.algorithm.options.get("rank", 32))
            tensors = {"w": ws, "s": s, "down": d, "up": u}
            return cls(name, k, n, w.dtype, meta, tensors, bias)
        if params.smooth is not None:
            w = smoothed_weight(w, params.smooth)
        compute_dtype = int4_compute_dtype(weight.dtype)
        tensors = WEIGHT_FORMATS[spec.type].encode(w, params.weight_scale, params.weight_offset, spec.group_size,
                                                   compute_dtype)
        if params.smooth is not None:
            tensors["smooth"] = params.smooth
        if params.act_scale is not None:
            tensors["act_scale"] = params.act_scale
        module = cls(name, k, n, weight.dtype, meta, tensors, bias)
        if isinstance(module, Int4Linear):
            module.prepack()
        return module


_CALIBRATING = threading.RLock()  # a calibration call, and the first fake-quant module, one thread at a time


class CalibrationModule(nn.Module):
    """AMCT's quant op for a Linear (or, with OFMR, Conv2d) layer; see the module docstring. ``weight`` /
    ``bias`` are the original Parameters; ``calibrated`` tells whether the scales are fixed."""

    def __init__(self, name: str, layer: nn.Module, cfg: LayerConfig):
        super().__init__()
        self.layer_name, self.layer_config, self.layer_type = name, cfg, type(layer).__name__
        self.geometry = layer_geometry(layer)
        self.weight, self.bias = layer.weight, layer.bias
        self.calls = 0
        self._calibrator = make_calibrator(self.weight, self.bias, cfg, self.geometry)
        self._params: Optional[QuantParams] = None
        self.__dict__["_fake"] = None  # deploy-equivalent module, kept out of the module tree (no state_dict)
        self._fake_weight: Optional[torch.Tensor] = None
        self.__dict__["_weights_seen"] = SourcesSeen((self.weight, self.bias))  # (not pickled: __getstate__)
        if not self._calibrator.needs_data:
            self._finish()

    def _check_weights_unchanged(self) -> None:
        """RuntimeError naming the layer where its weight or bias changed after quantize (a load_state_dict, a
        write in place, a move or cast): the scales, and the packed weight the fake quant had already built,
        belong to the old one, and were used silently."""
        seen = self.__dict__.get("_weights_seen")
        if not _storage_backed((self.weight, self.bias)):  # torch.export's fake tensors stand for them
            if not self.calibrated:
                raise RuntimeError(f"layer {self.layer_name!r} is calibrating ({self.calls} of "
                                   f"{self.layer_config.batch_num} calls): trace or export the model after its "
                                   "calibration")
            return
        if seen is not None and not seen.unchanged((self.weight, self.bias)):
            raise RuntimeError(f"layer {self.layer_name!r}: its weight or bias changed after lowbit.quantize (a "
                               "load_state_dict, a write in place, a move or a cast), whose scales were made from "
                               "the old ones: load the weights, move or cast the model before quantizing it")

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_weights_seen"}  # (addresses: not copied)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.__dict__["_weights_seen"] = SourcesSeen((self.weight, self.bias))

    @property
    def calibrated(self) -> bool:
        return self._params is not None

    def _finish(self) -> None:
        try:
            self._params = self._calibrator.finalize()
        except (RuntimeError, ValueError) as exc:
            raise type(exc)(f"layer {self.layer_name!r}: {exc}") from exc
        self._calibrator = None

    def _finish_or_start_over(self) -> None:
        """_finish after the last calibration call; where it fails (a NaN in the data, no usable scale), the
        layer's calibration starts over with a new calibrator and the error says so: the layer was left with
        every call counted and no scales, calibrating for ever and returning float outputs."""
        try:
            self._finish()
        except (RuntimeError, ValueError) as exc:
            self._calibrator = make_calibrator(self.weight, self.bias, self.layer_config, self.geometry)
            self.calls = 0
            calls = self.layer_config.batch_num
            raise type(exc)(f"{exc}; the layer's calibration starts over ({calls} calls)") from exc

    def _calibration_call(self, x: torch.Tensor) -> torch.Tensor:
        """A calibration call: the float output, x and it observed, the call counted, the scales made at the
        last one (under _CALIBRATING)."""
        if x.numel() == 0:  # (the observers' reductions failed with torch's errors, or counted it)
            raise ShapeError(f"layer {self.layer_name!r}: a calibration batch needs elements, got shape "
                             f"{tuple(x.shape)}")
        y = run_layer(self.geometry, x, self.weight, self.bias)
        self._calibrator.observe(x, y)
        self.calls += 1
        if self.calls == self.layer_config.batch_num:
            self._finish_or_start_over()
        return y

    def _deploy_equivalent(self) -> QuantizedLinearBase:
        if self._fake is None:
            with _CALIBRATING:  # built once, reused by convert
                if self._fake is None:
                    fake = self.to_deploy()
                    if isinstance(fake, PackedLinear):
                        self._fake_weight = PackedLinear.dequantized_weight(fake)  # cached fake-quant weight
                    self.__dict__["_fake"] = fake
        return self._fake

    def to_deploy(self) -> QuantizedLinearBase:
        """The deployable module (packed weights) for the calibrated scales (the one the fake-quant forward
        already built, if any: packing runs once); RuntimeError if not calibrated."""
        if not self.calibrated:
            raise RuntimeError(f"layer {self.layer_name!r} is not calibrated ({self.calls} of "
                               f"{self.layer_config.batch_num} calibration calls)")
        self._check_weights_unchanged()
        if self._fake is not None:
            return self._fake
        return build_deploy(self.layer_name, self.geometry, self.weight, self.bias, self.layer_config, self._params)

    __prepare_scriptable__ = QuantizedLinearBase.__prepare_scriptable__

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        refuse_unsupported_transforms(self.layer_name, x)
        self._check_weights_unchanged()
        check_layer_input(self.layer_name, self.geometry, x, self.weight.dtype, self.weight.device)
        return run_without_derivative(self.layer_name, lambda: self._output(x), x)

    def _output(self, x: torch.Tensor) -> torch.Tensor:
        """A calibration call's float output, or after calibration the fake quant's."""
        if not self.calibrated:
            with _CALIBRATING:  # calls from several threads: each counted once, none past the last
                if not self.calibrated:
                    return self._calibration_call(x)
        fake = self._deploy_equivalent()
        if self._fake_weight is None:  # svdquant: the operator is the fake quant
            return fake.compute(fake.quantize_input(x, deploy=False))
        return run_layer(self.geometry, fake.quantize_input(x, deploy=False), self._fake_weight, self.bias)

    def extra_repr(self) -> str:
        state = "calibrated" if self.calibrated else f"calibrating {self.calls}/{self.layer_config.batch_num}"
        return f"{self.layer_name!r}, {self.layer_config.describe()}, {state}"
