"""Registration of :class:`lowbit.backends.Operator` objects as ``torch.ops.lowbit`` custom ops.

Every operator gets the same two custom ops (the one ``out=`` convention):

* ``torch.ops.lowbit.<name>(<params>, str? backend=None) -> <outputs>`` allocates and returns its outputs;
* ``torch.ops.lowbit.<name>_out(<params, none defaulted>, <outputs>!, str? backend=None) -> ()`` writes into
  given tensors
  (any strides; one that is not contiguous or shares memory with an input goes through a temporary).

Both have fake implementations (the operator's ``outputs``), so they trace under torch.compile. The
Python API of each operator calls :func:`call`, which picks one of the two, or calls the Operator itself
where the dispatcher would do nothing else (:func:`dispatches_plainly`: it saves the dispatcher's cost,
about 15 us a call).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch.autograd import forward_ad

from lowbit import backends
from lowbit.backends import Kernel, Operator, same_bits
from lowbit.kernels.cpu.memory import output_empty

_LIB = torch.library.Library("lowbit", "FRAGMENT")
_ARGUMENTS: dict[str, list] = {}  # custom op name -> its schema's arguments (read once, at definition)
_OUTPUT_COUNT: dict[str, int] = {}  # operator name -> number of output tensors
_KINDS: dict[str, tuple[tuple[str, str], ...]] = {}  # operator name -> (argument name, schema type) each
_PARAMETER_KINDS: dict[str, tuple[str, ...]] = {}  # operator name -> its parameters' schema types (not backend)
# Schema types of scalar parameters -> the Python type an argument must have exactly to be passed through as
# it is: the dispatcher hands such a value to the operator unchanged (others it converts or rejects).
_PLAIN_SCALARS = {"int": int, "str": str, "bool": bool, "float": float}
_KEY = torch._C.DispatchKey
# The dispatch keys of a dense CPU tensor with no conjugate / negative bit: any other key (a subclass's,
# functorch's wrappers, functionalization's, another device) changes a call.
_PLAIN_CPU_KEYS = (torch._C.DispatchKeySet(_KEY.CPU).add(_KEY.ADInplaceOrView).add(_KEY.AutogradCPU)
                   .add(_KEY.AutocastCPU))
_INFERENCE_CPU_KEYS = torch._C.DispatchKeySet(_KEY.CPU).add(_KEY.AutocastCPU)  # made under inference_mode
# Tensors the dispatcher treats alike: nn.Parameter disables __torch_function__ (a deploy module's bias).
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


# The backward of the inference operators (define's differentiable=True): an op that raises when it runs and
# whose fake gives the gradient's shape, so torch.compile can trace a graph that requires grad (its backward
# fails only if it runs) and eager backward fails at once; gradients are never silently None.
_LIB.define("no_backward(str op, SymInt[] shape, ScalarType dtype, Device device) -> Tensor")


def _no_backward(op, shape, dtype, device):
    raise RuntimeError(f"lowbit::{op} has no backward (an inference operator): run it on tensors that do not "
                       "require grad, e.g. under torch.no_grad(), or detach them")


_LIB.impl("no_backward", _no_backward, "CompositeExplicitAutograd")
torch.library.register_fake("lowbit::no_backward", lambda op, shape, dtype, device: torch.empty(
    shape, dtype=dtype, device=device), lib=_LIB)


def _complete(name: str, args: tuple, kwargs: dict) -> list:
    """All arguments of ``lowbit::<name>`` in schema order (the dispatcher leaves out trailing defaults)."""
    full = list(args)
    for argument in _ARGUMENTS[name][len(args):]:
        full.append(kwargs[argument.name] if argument.name in kwargs else argument.default_value)
    return full


def define(
    name: str,
    params: str,
    outputs: Callable,
    reference: Kernel,
    probes: Callable,
    native: Mapping[str, Callable[[], Kernel]],
    *,
    output_names: Sequence[str] = ("out",),
    differentiable: bool = True,
    agrees: Callable[[torch.Tensor, torch.Tensor, Sequence], bool] = same_bits,
    scratch: tuple[int, ...] = (),
) -> Operator:
    """Create and register the :class:`Operator` ``name`` (the other arguments are its fields), and register
    it as the custom ops ``lowbit::<name>`` and ``lowbit::<name>_out``.

    ``params``: the schema of its arguments (e.g. ``"Tensor input, int qdim=-1"``); ``output_names``: the
    names of its output tensors. ``differentiable=False`` gives the functional op a backward that returns no
    gradient (quantizers with no straight-through estimator); otherwise backward raises RuntimeError (no
    gradient is silently dropped).
    """
    op = backends.register(Operator(name=name, outputs=outputs, reference=reference, native=native,
                                    probes=probes, agrees=agrees, scratch=scratch))
    n_outs = _OUTPUT_COUNT[name] = len(output_names)
    returns = "Tensor" if n_outs == 1 else "(" + ", ".join(["Tensor"] * n_outs) + ")"
    mutated = ", ".join(f"Tensor({chr(ord('a') + i)}!) {out}" for i, out in enumerate(output_names))
    _LIB.define(f"{name}({params}, str? backend=None) -> {returns}")
    required = re.sub(r"=[^,]*", "", params)  # the _out op takes every parameter, then the outputs
    _LIB.define(f"{name}_out({required}, {mutated}, str? backend=None) -> ()")
    for op_name in (name, name + "_out"):
        _ARGUMENTS[op_name] = list(getattr(torch.ops.lowbit, op_name).default._schema.arguments)
    _KINDS[name] = tuple((argument.name, str(argument.type)) for argument in _ARGUMENTS[name])
    _PARAMETER_KINDS[name] = tuple(kind for _, kind in _KINDS[name][:-1])

    def functional(*args, **kwargs):
        *args, backend = _complete(op.name, args, kwargs)
        return op(*args, backend=backend)

    def fake(*args, **kwargs):
        return op.new_outputs(*_complete(op.name, args, kwargs)[:-1])

    def into(*args, **kwargs):
        *args, backend = _complete(op.name + "_out", args, kwargs)
        params_, outs = args[:-n_outs], tuple(args[-n_outs:])
        op(*params_, out=outs if n_outs > 1 else outs[0], backend=backend)

    def fake_into(*args, **kwargs):
        args = _complete(op.name + "_out", args, kwargs)[:-1]
        op.check_out(args[:-n_outs], tuple(args[-n_outs:]) if n_outs > 1 else args[-1])

    _LIB.impl(op.name, functional, "CompositeExplicitAutograd")
    _LIB.impl(op.name + "_out", into, "CompositeExplicitAutograd")
    torch.library.register_fake(f"lowbit::{op.name}", fake, lib=_LIB)
    torch.library.register_fake(f"lowbit::{op.name}_out", fake_into, lib=_LIB)
    n_inputs = len(params.split(",")) + 1  # the parameters and backend

    def no_gradient(ctx, *grads):
        return (None,) * n_inputs

    def remember_inputs(ctx, inputs, output):
        ctx.inputs = [(tuple(a.shape), a.dtype, a.device) if isinstance(a, torch.Tensor) else None for a in inputs]

    def no_backward(ctx, *grads):
        first = next(i for i, needed in enumerate(ctx.needs_input_grad) if needed)
        return tuple(torch.ops.lowbit.no_backward(name, *ctx.inputs[i]) if i == first else None
                     for i in range(n_inputs))

    if differentiable:
        torch.library.register_autograd(f"lowbit::{op.name}", no_backward, setup_context=remember_inputs, lib=_LIB)
    else:
        torch.library.register_autograd(f"lowbit::{op.name}", no_gradient, lib=_LIB)
    return op


def dispatches_plainly(name: str, args: Sequence[Any], backend: Optional[str]) -> bool:
    """Whether ``torch.ops.lowbit.<name>(*args, backend)`` would only call the Operator ``name`` with these
    arguments: one per parameter, each tensor argument a plain one (:func:`plain_tensor`), each scalar of
    exactly its parameter's Python type (int, str, bool, float), None for an optional one, and nothing
    intercepts or records the call (:func:`plain_context`)."""
    kinds = _PARAMETER_KINDS.get(name)
    if kinds is None or len(args) != len(kinds) or not (backend is None or type(backend) is str):
        return False
    return all(_plain_argument(arg, kind) for arg, kind in zip(args, kinds)) and plain_context()


def _plain_argument(arg: Any, kind: str) -> bool:
    if kind.startswith("Optional["):
        return arg is None or _plain_argument(arg, kind[len("Optional["):-1])
    if kind == "Tensor":
        return plain_tensor(arg)
    return type(arg) is _PLAIN_SCALARS.get(kind)


def plain_context() -> bool:
    """Whether nothing would intercept or record a custom op's call here: torch.compile, torch.jit tracing,
    the profiler, a TorchFunctionMode or TorchDispatchMode (user modes and torch's own: fake tensors,
    functionalization, proxy tracing), functorch transforms (vmap, grad, functionalize), a forward-mode AD
    level (torch.autograd.forward_ad.dual_level: x may carry a tangent). Seven flag reads: this
    runs on every direct call, where reading the thread-local dispatch key set (a new Python object) cost
    about 30 us more after other work had evicted the caches (docs/weight_only.md, 'One call'). Not seen:
    torch's Python dispatcher and functionalization switched on without a mode, machinery of torch.compile
    and torch.export that runs under the modes above (lowbit's ops have no Python kernels, so a direct call
    gives the dispatcher's result)."""
    return not (torch.compiler.is_compiling() or torch._C._is_torch_function_mode_enabled()
                or torch._C._get_tracing_state() is not None or torch._C._autograd._profiler_enabled()
                or torch._C._len_torch_dispatch_stack() or torch._C._are_functorch_transforms_active()
                or forward_ad._current_level >= 0)


def plain_tensor(arg: Any) -> bool:
    """Whether ``arg`` is a plain tensor: type torch.Tensor or nn.Parameter, dense on the CPU, no conjugate
    or negative bit, not requiring grad (an inference tensor is plain too)."""
    if type(arg) not in _PLAIN_TYPES or arg.requires_grad:
        return False
    keys = torch._C._dispatch_keys(arg)
    return keys == _PLAIN_CPU_KEYS or keys == _INFERENCE_CPU_KEYS


def direct_cpu_kernel(op: Operator, args: Sequence) -> Optional[Kernel]:
    """``op``'s native CPU kernel where a caller may run it on ``args`` itself, skipping the operator (the
    operator's bits without its dispatch and checks, which cost tens of microseconds a call after other work),
    else None (the caller calls the operator): every tensor argument a plain CPU tensor (:func:`plain_tensor`)
    in a plain context (:func:`plain_context`), the backend setting not "reference", and the kernel passing
    auto's self-check for the arguments' dtypes (one that fails it or cannot load leaves the call to the
    operator, whatever the setting). The caller checks the arguments as the operator would, passes them dense
    and aligned with fresh outputs, and records the run (``op.record("native")``): :func:`run_direct` does."""
    if not (plain_context() and all(plain_tensor(a) for a in args if isinstance(a, torch.Tensor))):
        return None
    setting = backends.get_backend()
    if setting == "reference":
        return None
    key = (op, setting, backends.dtype_signature(args))
    if key not in _DIRECT:  # the self-check's answer, kept by the operator too, read here with one look-up
        _DIRECT[key] = op.native_kernel("cpu") if op.auto_check_error("cpu", args) is None else None
    return _DIRECT[key]


_DIRECT: dict = {}  # (operator, backend setting, dtype signature) -> direct_cpu_kernel's answer


def run_direct(op: Operator, args: tuple, shape: Sequence[int], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``op(*args)``, its one output of ``shape`` and ``dtype`` (the caller's checks: those the operator makes),
    computed by its native CPU kernel where :func:`direct_cpu_kernel` allows, the inputs made dense and aligned
    and the run recorded; None elsewhere (the caller calls the operator)."""
    kernel = direct_cpu_kernel(op, args)
    if kernel is None:
        return None
    out = output_empty(shape, dtype)
    if out.numel():
        kernel.run(*(backends.dense_aligned(a) if isinstance(a, torch.Tensor) else a for a in args), out=out)
    op.record("native")
    return out


_INT64 = (-(2**63), 2**63 - 1)


def check_argument_types(name: str, args: Sequence[Any]) -> None:
    """TypeError naming the argument of ``lowbit::<name>`` that is not a tensor where the schema takes one
    (None allowed for an optional one) or a sparse one; ValueError for an int outside int64 (what the schema
    can carry)."""
    for (argument, kind), value in zip(_KINDS[name], args):
        if kind in ("Tensor", "Optional[Tensor]") and not isinstance(value, torch.Tensor) and not (
                value is None and kind == "Optional[Tensor]"):
            raise TypeError(f"{name}: {argument} must be a tensor, got {type(value).__name__}")
        if isinstance(value, torch.Tensor) and value.layout != torch.strided:
            raise TypeError(f"{name}: {argument} must be a dense (strided) tensor, got layout {value.layout}")
        if kind == "int" and isinstance(value, int) and not _INT64[0] <= value <= _INT64[1]:
            raise ValueError(f"{name}: {argument} = {value} is outside the int64 range")


def call(op: Operator, args: Sequence[Any], out: Any = None, backend: Optional[str] = None) -> Any:
    """Run ``op`` through its custom op: the functional one, or ``_out`` when ``out`` is given (a tensor,
    or a tuple of tensors for several outputs; the op validates it, then it is returned). TypeError here
    for an ``out`` of the wrong structure, which the custom op's schema could not name. Without ``out``,
    the Operator is called directly where that is all the custom op would do (:func:`dispatches_plainly`).
    Arguments of the wrong kind are a TypeError / ValueError naming them (:func:`check_argument_types`), a
    ``backend`` that is not a str or None a TypeError (the dispatcher's error would be a RuntimeError)."""
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"{op.name}: backend must be a str (native, reference, auto) or None, got "
                        f"{type(backend).__name__}")
    check_argument_types(op.name, args)
    if forward_ad._current_level >= 0 and any(isinstance(a, torch.Tensor) and forward_ad.unpack_dual(a).tangent
                                              is not None for a in args):
        raise RuntimeError(f"{op.name} has no forward-mode derivative (a tangent of its input would be dropped)")
    if out is None:
        if dispatches_plainly(op.name, args, backend):
            return op(*args, backend=backend)
        return getattr(torch.ops.lowbit, op.name)(*args, backend)
    n_outs = _OUTPUT_COUNT[op.name]
    outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    if len(outs) != n_outs or not all(isinstance(t, torch.Tensor) for t in outs):
        want = "a tensor" if n_outs == 1 else f"a tuple of {n_outs} tensors"
        raise TypeError(f"{op.name}: out must be {want}, got {type(out).__name__}"
                        + (f" of length {len(outs)}" if isinstance(out, (tuple, list)) else ""))
    for i, t in enumerate(outs):  # (torch's dispatcher would fail on a negative bit without naming out)
        backends.check_writable(op.name, "out" if n_outs == 1 else f"out[{i}]", t)
    getattr(torch.ops.lowbit, op.name + "_out")(*args, *outs, backend)
    return tuple(out) if isinstance(out, list) else out


_MAX_PLANS = 64  # PreparedCall's plans kept per bound operator


class RecordedCall:
    """A kernel's bound call ``bound(*args) -> bool`` (with its ``max_rows``) that records each run as one of
    ``op`` by the kernel ``name`` (for :func:`lowbit.backends.last_backend`)."""

    def __init__(self, bound: Callable[..., bool], op: Operator, name: str) -> None:
        self.bound, self.op, self.name, self.max_rows = bound, op, name, bound.max_rows

    def __call__(self, *args) -> bool:
        done = self.bound(*args)
        self.op.record(self.name)
        return done


class PreparedCall:
    """An operator with every argument after the first fixed, for arguments that stay as they are (a deploy
    module's packed weight, factors and bias): ``prepared(x)`` is ``op(x, *fixed)``, the same result, with
    less work per call. On a plain CPU call (:func:`plain_context`, :func:`plain_tensor`) whose kernel can
    prepare (``kernel.prepare(dtype, k, *fixed)`` and ``kernel.run_prepared(x, prepared, out=...)``), the
    kernel's operands of the fixed arguments (numpy views of them, derived scales) are made once per x dtype
    and K instead of on every call: tens of microseconds of a small layer's call. So are the operator's
    checks and its kernel choice, once per x dtype, x shape and backend (up to _MAX_PLANS kinds of x kept;
    a bad x is checked, and fails, every time; 55 -> 40 us per call of a 64 x 64 MXFP4 layer on an AMD Zen 3,
    37 us without a torch.no_grad() block, which a plain call does not need). Any other call goes
    through the operator (:func:`call`).

    ``fixed``: tensors (or None), used as they are if contiguous and aligned, else copied. The caller must
    make a new PreparedCall whenever one of them is replaced or written; lowbit.quantize's deploy modules do
    that."""

    def __init__(self, op: Operator, fixed: Sequence[Optional[torch.Tensor]]) -> None:
        self.op = op
        self._plain = not torch.compiler.is_compiling() and all(t is None or plain_tensor(t) for t in fixed)
        # (aligned where the kernels read them: fake tensors under torch.export have no data to align)
        aligned = (None if t is None else backends.dense_aligned(t) for t in fixed) if self._plain else fixed
        self.fixed = tuple(aligned)
        self._prepared: dict[tuple, Any] = {}  # (x dtype, K) -> the kernel's prepare() result
        # (x dtype, x shape, backend) -> (output spec, backend name, kernel, prepared or None): the operator's
        # checks and its kernel choice for an x of that kind, made once (the fixed arguments do not change)
        self._plans: dict[tuple, tuple] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not (self._plain and plain_context() and plain_tensor(x)):
            return call(self.op, (x, *self.fixed))
        kind = (x.dtype, x.shape, backends.get_backend())
        plan = self._plans.get(kind)
        x = backends.dense_aligned(x)
        if plan is None:
            (spec,) = self.op.outputs(x, *self.fixed)  # the operator's errors for a bad x
            if 0 in spec.shape:
                return torch.empty(spec.shape, dtype=spec.dtype)
            plan = self._plan(kind, spec, x)
        spec, name, kernel, prepared = plan
        out = output_empty(spec.shape, spec.dtype)
        # No torch.no_grad() (2-4 us): nothing here requires grad (plain_tensor), so no op records a graph.
        if prepared is not None:
            kernel.run_prepared(x, prepared, out=out)
        else:
            kernel.run(x, *self.fixed, out=out)
        self.op.record(name)
        return out

    def _bound_gemv(self, dtype: torch.dtype, k: int, *extra) -> Optional[RecordedCall]:
        """``f(x, m, out) -> bool``: the operator on an x of ``dtype`` (FP16 / BF16) and K = ``k`` with at most
        ``f.max_rows`` rows in one call of its kernel (``kernel.bind_gemv(prepared, N, k, dtype, *extra)``;
        svd_quant's takes a bias added after it, and returns False where its caller must take its full path),
        on x (..., K) with M = ``m`` rows and out (..., N) of x's dtype, C-contiguous CPU tensors, recorded as a run of
        the kernel chosen under the current backend setting. Internal: for a caller that checks x itself
        (plain_tensor, plain_context, dtype, K, rows; f checks neither array) and keeps the result while the
        fixed arguments and the backend setting stay as they are (lowbit.quantize's deploy modules). None
        where that kernel has no such call or declines these arguments, or a fixed argument is not plain; the
        operator's errors for an x of that dtype and K."""
        if not self._plain:
            return None
        x = torch.zeros(1, k, dtype=dtype)
        kind = (dtype, x.shape, backends.get_backend())
        plan = self._plans.get(kind)
        if plan is None:
            (spec,) = self.op.outputs(x, *self.fixed)
            plan = self._plan(kind, spec, x)
        spec, name, kernel, prepared = plan
        if prepared is None or not hasattr(kernel, "bind_gemv"):
            return None
        bound = kernel.bind_gemv(prepared, spec.shape[-1], k, dtype, *extra)
        return None if bound is None else RecordedCall(bound, self.op, name)

    def _plan(self, kind: tuple, spec, x: torch.Tensor) -> tuple:
        """(output spec, backend name, kernel, the kernel's prepare() result for x's dtype and K or None) for
        x of ``kind``, kept (the prepared operands are shared by every x shape of one dtype and K)."""
        name, kernel = self.op.kernel(torch.device("cpu"), None, (x, *self.fixed))
        prepared = None
        if hasattr(kernel, "run_prepared"):
            key = (x.dtype, x.shape[-1])
            prepared = self._prepared.get(key)
            if prepared is None:
                prepared = self._prepared[key] = kernel.prepare(x.dtype, x.shape[-1], *self.fixed)
        if len(self._plans) >= _MAX_PLANS:  # many x shapes (prefill lengths): start over, do not grow
            self._plans.clear()
        plan = self._plans[kind] = (spec, name, kernel, prepared)
        return plan
