"""Perplexity of a causal LM on a text, computed exactly as AMCT's examples compute it (docs/evaluation.md,
"Perplexity").

The text is tokenized once as one sequence (the tokenizer's special tokens included, as a plain
``tokenizer(text)`` call adds them) and cut into ``n = len // seqlen`` non-overlapping windows of
``seqlen`` tokens; the remainder is dropped. For window i the model's logits at positions 0 … seqlen−2,
in float32, predict tokens 1 … seqlen−1; the window's loss is the mean cross entropy over those
seqlen−1 targets, and it is counted as ``nll_i = loss_i · seqlen``. Then
``ppl = exp(Σ nll_i / (n · seqlen))``, i.e. exp of the mean over windows of the per-window mean NLL.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

AMCT_SEQLEN = 2048


def tokenize_text(tokenizer, text: str) -> torch.Tensor:
    """``text`` as one int64 token sequence (1-D)."""
    return torch.as_tensor(tokenizer(text, return_tensors="pt")["input_ids"][0], dtype=torch.int64)


def tokenize_text_file(tokenizer, path: str | Path) -> torch.Tensor:
    """The whole UTF-8 file as one int64 token sequence (1-D). FileNotFoundError / UnicodeDecodeError name it."""
    return tokenize_text(tokenizer, Path(path).read_text(encoding="utf-8"))


def perplexity(model: nn.Module, tokens: torch.Tensor, seqlen: int = AMCT_SEQLEN, progress=None) -> float:
    """AMCT's PPL of ``model`` (called as ``model(input_ids)``, output with ``.logits``) on ``tokens`` (1-D
    int64). ValueError when ``seqlen < 2`` or ``tokens`` holds fewer than ``seqlen`` tokens.
    ``progress``: an optional tqdm-like object whose ``update(1)`` is called after each window."""
    if seqlen < 2:
        raise ValueError(f"seqlen must be >= 2, got {seqlen}")
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
    windows = tokens.numel() // seqlen
    if windows == 0:
        raise ValueError(f"the text has {tokens.numel()} tokens, fewer than one window of seqlen={seqlen}")
    loss_fn = nn.CrossEntropyLoss()
    nlls = []
    with torch.no_grad():
        for i in range(windows):
            window = tokens[i * seqlen:(i + 1) * seqlen].unsqueeze(0)
            logits = model(window).logits
            shift_logits = logits[:, :-1, :].to(torch.float32)
            shift_labels = window[:, 1:]
            loss = loss_fn(shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1))
            nlls.append(loss.to(torch.float32) * seqlen)
            if progress is not None:
                progress.update(1)
    return float(torch.exp(torch.stack(nlls).sum() / (windows * seqlen)))  # float32 throughout, as AMCT
