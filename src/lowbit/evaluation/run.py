"""Evaluate quantization schemes on a real model: one row per scheme, each a quantized copy against float.

Encoders (``minilm`` or an ``AutoModel`` directory): sentence embeddings of ``sentences`` real sentences
(:mod:`lowbit.evaluation.text`) compared with the float model's (:func:`compare_embeddings`); schemes that
calibrate see ``calib_sentences`` *other* sentences first. Causal LMs: AMCT's perplexity on the given
token sequence, calibration on the sentences. ``module:function`` models: the outputs on the returned
input batch, flattened per sample, compared like embeddings (calibration on the same batch: the function
provides no other data). Definitions: docs/evaluation.md.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from lowbit.evaluation import schemes as scheme_api
from lowbit.evaluation.embeddings import compare_embeddings, run_text, sentence_embeddings
from lowbit.evaluation.models import LoadedModel
from lowbit.evaluation.ppl import AMCT_SEQLEN, perplexity
from lowbit.evaluation.text import evaluation_and_calibration_sentences


class NothingQuantized(ValueError):
    """A scheme quantized no layer of the model, so comparing it with float would measure nothing."""


def checkpoint_bytes(model: nn.Module) -> int:
    """Total size in bytes of the files :func:`lowbit.save_quantized` writes for ``model``."""
    with tempfile.TemporaryDirectory(prefix="lowbit-eval-") as tmp:
        out = Path(tmp) / "checkpoint"
        scheme_api.save(model, out)
        return scheme_api.directory_bytes(out)


def calibrator(loaded: LoadedModel, sentences: list[str], batch_size: int = 1,
               progress=None) -> scheme_api.Calibration:
    """The forward passes that feed a model in calibration mode (:class:`schemes.Calibration`, which counts
    them): over ``sentences``, ``batch_size`` at a time (default one: no padding reaches the activation
    observers; larger batches are padded, a causal LM without a pad token with its EOS token), or for a
    ``module:function`` model over its input batch. ``progress``: optional tqdm-like, ``update(n)`` per batch
    of n sentences."""
    if loaded.kind == "callable":
        def calibrate_on_inputs(model: nn.Module) -> None:
            with torch.no_grad():
                model(loaded.inputs)

        return scheme_api.Calibration(calibrate_on_inputs, 1)
    if loaded.tokenizer.pad_token is None:
        loaded.tokenizer.pad_token = loaded.tokenizer.eos_token

    def calibrate(model: nn.Module) -> None:
        for _ in run_text(model, loaded.tokenizer, sentences, batch_size=batch_size, progress=progress):
            pass

    return scheme_api.Calibration(calibrate, -(-len(sentences) // batch_size))


def _outputs(loaded: LoadedModel, model: nn.Module, sentences: list[str], batch_size: int) -> torch.Tensor:
    """What is compared with float: sentence embeddings, or a callable model's outputs flattened per sample."""
    if loaded.kind == "callable":
        with torch.no_grad():
            out = model(loaded.inputs)
        if not isinstance(out, torch.Tensor) and hasattr(out, "to_tuple"):  # a Hugging Face ModelOutput
            out = out.to_tuple()
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
            out = out[0]
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{loaded.source}: the model returned {type(out).__name__}; lowbit compares a tensor "
                            "(or the first tensor of a tuple)")
        return out.reshape(loaded.inputs.shape[0], -1).to(torch.float32)
    return sentence_embeddings(model, loaded.tokenizer, sentences, batch_size=batch_size)


DEFAULT_SENTENCES = 256  # an encoder's evaluation sentences (``lowbit eval --sentences``)


def _check_seqlen(loaded: LoadedModel, seqlen: int) -> None:
    """ValueError where a perplexity window is longer than the positions the model was made for (learned
    positions fail with an IndexError; rotary ones compute past the trained context)."""
    config = getattr(loaded.model, "config", None)
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if isinstance(limit, int) and seqlen > limit:
        raise ValueError(f"--seqlen {seqlen} exceeds the {limit} positions of {loaded.source} "
                         f"(max_position_embeddings); give --seqlen {limit} or less")


def evaluate_schemes(loaded: LoadedModel, schemes: list[str], *, sentences: int = DEFAULT_SENTENCES,
                     calib_sentences: int = 64,
                     tokens: torch.Tensor | None = None, seqlen: int = AMCT_SEQLEN, batch_size: int = 32,
                     progress: Callable[[str], object] | None = None) -> list[dict]:
    """One row per scheme (see docs/evaluation.md for every key), quantizing a deep copy of ``loaded.model``.

    Causal LMs need ``tokens`` (1-D int64, e.g. :func:`tokenize_text_file`); their first row is the float
    model ("float32"). ``progress(scheme)``, if given, is called before each scheme. Raises ValueError for an
    unknown scheme or a causal LM without tokens, :class:`NothingQuantized` when a scheme quantizes no layer.
    """
    scheme_api.check_names(schemes)
    if loaded.kind == "causal-lm" and tokens is None:
        raise ValueError(f"{loaded.source} is a causal LM: give a text file to measure perplexity on")
    if loaded.kind == "causal-lm":
        _check_seqlen(loaded, seqlen)
    evaluation, calib = evaluation_and_calibration_sentences(
        0 if loaded.kind != "encoder" else sentences, calib_sentences)
    calibrate = calibrator(loaded, calib)  # a sentence a pass: --batch-size is the evaluation's only
    rows = []
    if loaded.kind == "causal-lm":
        reference = None
        rows.append({"scheme": "float32", "bits_per_weight": 32.0, "layers_quantized": 0, "layers_skipped": 0,
                     "perplexity": perplexity(loaded.model, tokens, seqlen),
                     "weight_bytes": None, "checkpoint_bytes": scheme_api.float_bytes(loaded.model)})
    else:
        reference = _outputs(loaded, loaded.model, evaluation, batch_size)
    for name in schemes:
        if progress is not None:
            progress(name)
        model = copy.deepcopy(loaded.model)
        report = scheme_api.quantize_model(model, scheme=name, calibrate=calibrate)
        if not report.quantized:
            raise NothingQuantized(f"scheme {name} quantized no layer of {loaded.source} "
                                   f"({len(report.skipped)} skipped); nothing to compare")
        row = {"scheme": name, "bits_per_weight": scheme_api.bits_per_weight(name),
               "layers_quantized": len(report.quantized), "layers_skipped": len(report.skipped)}
        if reference is None:
            row["perplexity"] = perplexity(model, tokens, seqlen)
        else:
            row.update(compare_embeddings(reference, _outputs(loaded, model, evaluation, batch_size)))
        row["weight_bytes"] = report.bytes_after
        row["checkpoint_bytes"] = checkpoint_bytes(model)
        rows.append(row)
        del model
    return rows
