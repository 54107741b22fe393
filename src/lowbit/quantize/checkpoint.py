"""Saving and loading quantized models (docs/quantize.md, "Checkpoints").

A checkpoint is a directory with ``model.safetensors`` (every tensor of the model's state_dict: packed
tensors as stored, no float copy of a quantized weight; other parameters and buffers as they are) and
``quantization.json`` (format version, lowbit's version, and for every quantized layer its module kind,
sizes, config and the shape/dtype of each packed tensor). Needs the ``safetensors`` package (the
``models`` extra), imported only when called.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator, Union

import torch
from torch import nn

from lowbit.quantize.activations import STATIC_KINDS, act_kind
from lowbit.quantize.layer_ops import channel_axis, geometry_mismatch
from lowbit.quantize.modules import (DEPLOY_CLASSES, CalibrationModule, Int4Linear, QuantizedLinearBase,
                                     deploy_class, replace_layer)
from lowbit.quantize.selection import unreplaceable_reason
from lowbit.toolchain.files import named_after

FORMAT_VERSION = 1
TENSORS_FILE = "model.safetensors"
META_FILE = "quantization.json"
PathLike = Union[str, os.PathLike]


class CheckpointError(ValueError, RuntimeError):
    """A quantized checkpoint is missing, corrupt, of an unknown version, or does not fit the model; the
    message names the file and the tensor or layer. Raised before the model is changed."""


def safetensors_torch():
    """safetensors.torch; ModuleNotFoundError naming the extra that installs it."""
    try:
        import safetensors.torch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ModuleNotFoundError(
            "lowbit quantized checkpoints need the 'safetensors' package: pip install 'lowbit[models]'") from exc
    return safetensors.torch


def _lowbit_version() -> str:
    import lowbit

    return lowbit.__version__


def _state_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state_dict as contiguous CPU tensors; tensors sharing storage are copied (safetensors
    stores no aliases), so tied weights load untied."""
    out, seen = {}, set()
    for key, t in model.state_dict().items():
        if t.device.type == "meta":
            raise ValueError(f"save_quantized: tensor {key!r} is on the meta device (nothing to save)")
        t = t.detach().cpu().contiguous()
        ptr = (t.untyped_storage().data_ptr(), t.storage_offset())
        out[key] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


def save_quantized(model: nn.Module, directory: PathLike) -> Path:
    """Write ``directory``/model.safetensors and ``directory``/quantization.json atomically (built in a
    temporary directory beside it, then renamed into place; files 0644, the directory 0755). An existing
    directory is replaced only when it is empty or holds just such a checkpoint: ValueError for any other
    (a model's own directory, a folder of other files), which is left as it was.

    The model must be converted (RuntimeError naming the layers still calibrating) and hold at least one
    quantized layer (ValueError: a float checkpoint is not what this function is for). Returns the path."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"save_quantized: model must be an nn.Module, got {type(model).__name__}")
    st = safetensors_torch()
    calibrating = [n for n, m in model.named_modules() if isinstance(m, CalibrationModule)]
    if calibrating:
        raise RuntimeError(f"save_quantized: call lowbit.convert(model) first; calibration modules: {calibrating}")
    layers = {n: m.quant_meta() for n, m in model.named_modules() if isinstance(m, QuantizedLinearBase)}
    if not layers:
        raise ValueError("save_quantized: the model has no layer quantized by lowbit (quantize and convert it "
                         "first; a quantize report that skipped every layer says why)")
    meta = {"format_version": FORMAT_VERSION, "lowbit_version": _lowbit_version(), "layers": layers}
    tensors = _state_tensors(model)
    target = Path(directory)
    check_replaceable(target)
    with named_after(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        with named_after(target, tmp):
            _write_checkpoint(st, tensors, meta, tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return target


def _write_checkpoint(st, tensors: dict, meta: dict, tmp: Path, target: Path) -> None:
    """save_quantized's files into the new folder ``tmp``, then ``tmp`` renamed to ``target`` (an old checkpoint
    there renamed aside first, then deleted)."""
    st.save_file(tensors, str(tmp / TENSORS_FILE), metadata={"format": "pt"})
    (tmp / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))
    for name in (TENSORS_FILE, META_FILE):
        os.chmod(tmp / name, 0o644)  # as any file lowbit writes (mkdtemp and safetensors make them private)
    os.chmod(tmp, 0o755)
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
        os.replace(target, old / "checkpoint")
        os.replace(tmp, target)
        shutil.rmtree(old)
    else:
        os.replace(tmp, target)


def check_replaceable(target: Path, what: str = "save_quantized") -> None:
    """ValueError (its message starting with ``what``) unless ``target`` is missing, an empty directory or a
    directory holding only a checkpoint of :func:`save_quantized` (its two files): nothing else is ever
    deleted by replacing it; nor the working directory, which a rename cannot replace (it stays in use)."""
    try:
        here = Path.cwd().resolve()
    except OSError:  # the working directory was deleted: the target cannot be it
        here = None
    if here is not None and target.resolve() in (here, *here.parents):
        raise ValueError(f"{what}: {target} is the working directory (or holds it), which cannot be replaced; "
                         "name a directory inside it, such as ./checkpoint")
    if not target.exists():
        return
    if not target.is_dir():
        raise ValueError(f"{what}: {target} exists and is not a directory")
    entries = sorted(p.name for p in target.iterdir())
    if entries and (META_FILE not in entries or not set(entries) <= {TENSORS_FILE, META_FILE}):
        shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        raise ValueError(f"{what}: {target} is not empty ({shown}) and is not a checkpoint written by "
                         "save_quantized; write to a new or empty directory")


def _read_meta(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"load_quantized: missing file {path}")
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:  # (JSONDecodeError, UnicodeDecodeError, integer digits)
        raise CheckpointError(f"load_quantized: {path} is not valid JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(meta, dict) or "format_version" not in meta or not isinstance(meta.get("layers"), dict):
        raise CheckpointError(f"load_quantized: {path} is not a lowbit quantization file")
    if type(meta["format_version"]) is not int or meta["format_version"] != FORMAT_VERSION:  # not true, 1.0
        raise CheckpointError(f"load_quantized: {path} has format_version {meta['format_version']!r}; this lowbit "
                              f"reads version {FORMAT_VERSION}")
    return meta


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"load_quantized: missing file {path}")
    st = safetensors_torch()  # (a missing package is not a corrupt file)
    try:
        return st.load_file(str(path))
    except Exception as exc:  # safetensors raises its own SafetensorError (not exported as a stable type)
        raise CheckpointError(f"load_quantized: cannot read {path} (truncated or corrupt?): {exc}") from None


def _read_checkpoint_tensors(root: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """All tensors of ``root``: model.safetensors, or the shards model.safetensors.index.json lists (checked
    against it: docs/quantize_checkpoint.md, "Output"); also the path to name in errors."""
    from lowbit.quantize.shard_io import INDEX_FILE, model_shards  # shard_io imports this module

    if not (root / INDEX_FILE).is_file():
        return _read_tensors(root / TENSORS_FILE), root / TENSORS_FILE
    tensors = {}
    for shard in model_shards(root)[0]:
        tensors.update(_read_tensors(shard.path))
    return tensors, root / INDEX_FILE


def _drop_non_persistent_buffers(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Ignore stored tensors that are non-persistent buffers of ``model`` (older Hugging Face checkpoints
    hold e.g. ``embeddings.position_ids``), as transformers does; the model keeps its own."""
    for prefix, module in model.named_modules():
        for buffer in module._non_persistent_buffers_set:
            tensors.pop(f"{prefix}.{buffer}" if prefix else buffer, None)


def _deploy_modules(model: nn.Module, layers: dict, meta_path: Path,
                    tensors: dict[str, torch.Tensor]) -> dict[str, QuantizedLinearBase]:
    """The deploy module of each layer ``layers`` describes, each description checked against the model, the
    stored ``tensors`` and a dry run on the meta device (CheckpointError naming the file and layer)."""
    modules = dict(model.named_modules())
    built = {}
    for name, layer in layers.items():
        try:
            cls, geometry, has_bias = DEPLOY_CLASSES[layer["kind"]], layer["geometry"], layer["bias"]
        except (KeyError, TypeError):
            raise CheckpointError(f"load_quantized: {meta_path}: layer {name!r} has an unknown or incomplete "
                                  "description") from None
        target = modules.get(name)
        problem = "is missing" if target is None else geometry_mismatch(geometry, target, has_bias)
        if not problem and (reason := unreplaceable_reason(target)) is not None:
            problem = f"cannot be replaced: {reason}"
        if problem:
            raise CheckpointError(f"load_quantized: {meta_path} lists layer {name!r}, which in the model {problem}")
        try:
            _check_description(name, layer, geometry, tensors)
            _dry_run(cls.from_meta(name, layer, device="meta"), geometry)
            built[name] = cls.from_meta(name, layer)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, RecursionError, RuntimeError) as exc:
            raise CheckpointError(f"load_quantized: {meta_path}: layer {name!r} has an invalid description "
                                  f"({type(exc).__name__}: {exc})") from None
    return built


def _check_description(name: str, layer: dict, geometry: dict, tensors: dict[str, torch.Tensor]) -> None:
    """ValueError where a layer's description disagrees with itself or with the stored tensors: its sizes with
    its geometry, its format line with its weight format, its packed tensors' shapes and dtypes with the file's
    (so nothing is allocated from a size the file does not hold)."""
    n, *rest = geometry["weight_shape"]
    if not all(type(layer[key]) is int for key in ("in_features", "out_features")):  # not 384.0 or true
        raise ValueError(f"in_features / out_features must be integers, got {layer['in_features']!r} / "
                         f"{layer['out_features']!r}")
    if [layer["out_features"], layer["in_features"]] != [n, math.prod(rest)]:
        raise ValueError(f"in_features / out_features {layer['in_features']} / {layer['out_features']} do not fit "
                         f"the weight shape {geometry['weight_shape']}")
    _check_settings(layer)
    for key, spec in layer["tensors"].items():
        stored = tensors.get(f"{name}.{key}")
        if stored is None or list(stored.shape) != spec["shape"] or str(stored.dtype) != f"torch.{spec['dtype']}":
            held = "nothing" if stored is None else f"{str(stored.dtype).removeprefix('torch.')} {list(stored.shape)}"
            raise ValueError(f"tensor {key!r} is described as {spec['dtype']} {spec['shape']}, the file holds {held}")


# A layer's format line (LayerConfig.describe), e.g. "int4 w group 32 / weight-only (minmax)".
_FORMAT = re.compile(r"(?P<weights>\S+) w \S+(?: (?P<group>\d+))? / (?:weight-only|(?P<inputs>\S+) a (?P<strategy>\S+)) "
                     r"\((?P<algorithm>\S+)\)")


def _check_settings(layer: dict) -> None:
    """ValueError where a layer's settings contradict its format line or one another: its kind, weight type,
    group size, algorithm and activation kinds, and an activation scale stored for a layer that reads none."""
    algorithm, weight_type = layer.get("algorithm"), layer["weight_type"]
    kind = deploy_class(weight_type, algorithm).kind
    if layer["kind"] != kind:
        raise ValueError(f"kind {layer['kind']!r} contradicts weight_type {weight_type!r} and algorithm "
                         f"{algorithm!r} (kind {kind!r})")
    deploy_kind, fake_kind = layer.get("act_kind"), layer.get("fake_act_kind", layer.get("act_kind"))
    if "format" in layer:
        match = _FORMAT.fullmatch(str(layer["format"]))
        if match is None:
            raise ValueError(f"format {layer['format']!r} is not a layer format of lowbit")
        inputs = match["inputs"]
        described = {"weight_type": match["weights"], "group_size": int(match["group"]) if match["group"] else None,
                     "algorithm": match["algorithm"],
                     "act_kind": "none" if inputs is None else act_kind(inputs, match["strategy"], None, algorithm)}
        for key, value in described.items():
            if layer.get(key) != value:
                raise ValueError(f"{key} {layer.get(key)!r} contradicts its format {layer['format']!r}")
        position = (deploy_kind, fake_kind, layer.get("amct_compat"), algorithm) == (
            "hif8_token", "hif8_position", True, "quantile")  # AMCT's static per-position fake quant
        if fake_kind != deploy_kind and not position:
            raise ValueError(f"fake_act_kind {fake_kind!r} contradicts its format {layer['format']!r}")
    scaled = deploy_kind in STATIC_KINDS or fake_kind in (*STATIC_KINDS, "hif8_position")
    if "act_scale" in layer["tensors"] and not scaled:
        raise ValueError(f"it stores an act_scale, which activation kind {deploy_kind!r} does not read")


def _dry_run(module: QuantizedLinearBase, geometry: dict) -> None:
    """Run ``module`` (built on the meta device) on a meta input of its geometry: a description the module
    cannot compute with (a missing tensor, setting or activation scale) fails here, before the model changes."""
    dtype = module.weight_dtype
    if geometry["type"] == "Linear":
        x = torch.empty(2, geometry["weight_shape"][1], device="meta", dtype=dtype)
    else:  # Conv2d: the smallest image every output pixel of the kernel fits in
        _, per_group, kh, kw = geometry["weight_shape"]
        dilation = geometry["dilation"]
        x = torch.empty(1, per_group * geometry["groups"], dilation[0] * (kh - 1) + 1, dilation[1] * (kw - 1) + 1,
                        device="meta", dtype=dtype)
    y = module(x)
    if y.dim() != x.dim() or y.shape[0] != x.shape[0] or y.shape[channel_axis(geometry)] != geometry["weight_shape"][0]:
        raise ValueError(f"the layer computes {tuple(y.shape)} from {tuple(x.shape)}")


def _expected_tensors(model: nn.Module, built: dict[str, QuantizedLinearBase]) -> dict[str, torch.Tensor]:
    """Name -> tensor (for shape and dtype) the model will hold after the layers are replaced."""
    expected = {}
    replaced = tuple(f"{n}." for n in built)
    for key, t in model.state_dict(keep_vars=True).items():
        if not key.startswith(replaced):
            expected[key] = t
    for name, module in built.items():
        for key, t in module.state_dict(keep_vars=True).items():
            expected[f"{name}.{key}"] = t
    return expected


def _check_tensors(expected: dict, tensors: dict, path: Path) -> None:
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"load_quantized: {path} does not fit the model (another model?): missing tensors "
                              f"{missing[:10]}, unexpected tensors {unexpected[:10]}")
    for key, want in expected.items():
        got = tensors[key]
        if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            raise CheckpointError(f"load_quantized: {path}: tensor {key!r} is {got.dtype} {tuple(got.shape)}, the "
                                  f"model needs {want.dtype} {tuple(want.shape)}")


def _check_no_meta_left(model: nn.Module, expected: dict, built: dict) -> None:
    replaced = tuple(f"{n}." for n in built)
    for key, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.device.type == "meta" and key not in expected and not key.startswith(replaced):
            raise CheckpointError(f"load_quantized: {key!r} is on the meta device and not in the checkpoint "
                                  "(a non-persistent buffer? build the skeleton under lowbit.parameters_on_meta(), "
                                  "which keeps buffers real)")


_on_meta = threading.local()  # .depth: how many parameters_on_meta blocks this thread is in
_patch = {"blocks": 0, "register": None}  # blocks open in all threads; nn.Module's own register_parameter
_patch_lock = threading.Lock()


def _register_on_meta(module, name, param):
    """nn.Module.register_parameter while a parameters_on_meta block is open somewhere: in a thread inside
    one, the parameter is moved to the meta device first."""
    if getattr(_on_meta, "depth", 0) and param is not None and param.device.type != "meta":
        param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
    _patch["register"](module, name, param)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """While active, each parameter a module registers in this thread is moved to the meta device as it is
    registered, so at most one parameter is ever materialized; buffers stay real (a model computes
    non-persistent ones, such as rotary frequencies or position ids, in its constructor, and a checkpoint does
    not hold them). Build the skeleton for :func:`load_quantized` under it. Patches
    ``nn.Module.register_parameter`` while any thread has a block open (other threads' modules are left as
    they are); blocks may nest and overlap across threads, and the last to end puts it back."""
    with _patch_lock:
        if _patch["blocks"] == 0:
            _patch["register"] = nn.Module.register_parameter
            nn.Module.register_parameter = _register_on_meta
        _patch["blocks"] += 1
    _on_meta.depth = getattr(_on_meta, "depth", 0) + 1
    try:
        yield
    finally:
        _on_meta.depth -= 1
        with _patch_lock:
            _patch["blocks"] -= 1
            if _patch["blocks"] == 0:
                nn.Module.register_parameter = _patch["register"]


def load_quantized(directory: PathLike, model: nn.Module) -> nn.Module:
    """Load a :func:`save_quantized` checkpoint into the float skeleton ``model`` and return it.

    ``model`` has the original architecture (``nn.Linear`` where quantized layers were), possibly built under
    ``torch.device("meta")``: the listed layers are replaced by deploy modules built from the stored packed
    tensors, every other tensor is assigned from the file (``load_state_dict(..., assign=True)``), so no float
    copy of a quantized weight is ever made. Tensors come back on the CPU. CheckpointError (a ValueError and
    RuntimeError) naming the file and tensor for a missing/truncated/corrupt file, an unknown format version
    or a checkpoint of another model; the model is then unchanged."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_quantized: model must be torch.nn.Module, got {type(model).__name__}")
    root = Path(directory)
    meta_path = root / META_FILE
    meta = _read_meta(meta_path)
    tensors, tensor_path = _read_checkpoint_tensors(root)
    _drop_non_persistent_buffers(model, tensors)
    built = _deploy_modules(model, meta["layers"], meta_path, tensors)
    expected = _expected_tensors(model, built)
    _check_tensors(expected, tensors, tensor_path)
    _check_no_meta_left(model, expected, built)
    for name, module in built.items():
        replace_layer(model, name, module)
    model.load_state_dict(tensors, strict=True, assign=True)
    for name, module in built.items():
        for key in [k for k in tensors if k.startswith(f"{name}.")]:
            del tensors[key]  # the module holds them: its copies replace the last reference, layer by layer
        module.use_huge_pages()
        if isinstance(module, Int4Linear):
            module.prepack()
    return model
