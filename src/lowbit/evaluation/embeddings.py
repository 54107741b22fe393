"""Sentence embeddings as sentence-transformers computes them for all-MiniLM-L6-v2, and how close two sets are.

Embedding: the encoder's last hidden state, averaged over the sentence's real tokens (attention mask 1),
then divided by its L2 norm. Tokens beyond ``max_length`` (256 for all-MiniLM-L6-v2) are cut.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from lowbit.errors import ShapeError


def batches(items: list, size: int) -> Iterable[list]:
    """Consecutive slices of ``items`` of at most ``size`` (> 0) elements."""
    if size <= 0:
        raise ValueError(f"batch size must be > 0, got {size}")
    return (items[i:i + size] for i in range(0, len(items), size))


def run_text(model: nn.Module, tokenizer, sentences: list[str], *, batch_size: int = 32, max_length: int = 256,
             progress=None) -> Iterable[tuple[dict, object]]:
    """Run ``model`` on ``sentences`` in padded batches without gradient; yields (tokenizer output, model output).

    ``progress``: an optional tqdm-like object whose ``update(n)`` is called with each batch's size."""
    with torch.no_grad():
        for chunk in batches(sentences, batch_size):
            encoded = tokenizer(chunk, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
            yield encoded, model(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"])
            if progress is not None:
                progress.update(len(chunk))


def sentence_embeddings(model: nn.Module, tokenizer, sentences: list[str], *, batch_size: int = 32,
                        max_length: int = 256) -> torch.Tensor:
    """(len(sentences), hidden) float32 CPU tensor of unit-norm mean-pooled embeddings of an encoder whose
    output has ``last_hidden_state`` (or is a tuple starting with it); no gradient."""
    rows = []
    for encoded, out in run_text(model, tokenizer, sentences, batch_size=batch_size, max_length=max_length):
        hidden = (out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]).to(torch.float32)
        mask = encoded["attention_mask"].unsqueeze(-1).to(torch.float32)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        rows.append(F.normalize(pooled, p=2, dim=1))
    return torch.cat(rows).cpu()


def nearest_neighbours(embeddings: torch.Tensor) -> torch.Tensor:
    """For each row, the index of the most cosine-similar *other* row (ties: the lowest index)."""
    unit = F.normalize(embeddings.to(torch.float64), dim=1)
    similarity = unit @ unit.T
    similarity.fill_diagonal_(-math.inf)
    return similarity.argmax(dim=1)


def sqnr_db(reference: torch.Tensor, test: torch.Tensor) -> float:
    """10 log10(Σ reference² / Σ (test − reference)²) in float64; ``inf`` when they are equal."""
    ref = reference.to(torch.float64)
    noise = float((test.to(torch.float64) - ref).pow(2).sum())
    signal = float(ref.pow(2).sum())
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def compare_embeddings(reference: torch.Tensor, test: torch.Tensor) -> dict:
    """How well ``test`` (n, d) reproduces ``reference`` (n, d), n >= 2: ``mean_cosine`` (mean over rows of
    the cosine similarity of matching rows), ``nn_agreement`` (fraction of rows whose nearest other row is
    the same in both) and ``sqnr_db``, and ``nonfinite_outputs``: whether either holds a NaN or an infinity,
    when the three are NaN (argmax takes a NaN for the largest similarity: the agreement meant nothing).
    ShapeError when the shapes differ or n < 2."""
    if reference.shape != test.shape or reference.dim() != 2 or reference.shape[0] < 2:
        raise ShapeError(f"need two (n >= 2, d) tensors of one shape, got {tuple(reference.shape)} "
                         f"and {tuple(test.shape)}")
    if not (torch.isfinite(reference).all() and torch.isfinite(test).all()):
        return {"mean_cosine": math.nan, "nn_agreement": math.nan, "sqnr_db": math.nan, "nonfinite_outputs": True}
    cosine = F.cosine_similarity(reference.to(torch.float64), test.to(torch.float64), dim=1)
    agreement = (nearest_neighbours(reference) == nearest_neighbours(test)).to(torch.float64).mean()
    return {"mean_cosine": float(cosine.mean()), "nn_agreement": float(agreement),
            "sqnr_db": sqnr_db(reference, test), "nonfinite_outputs": False}
