"""Real English sentences for evaluation and calibration, from CPython's bundled documentation.

``pydoc_data.topics.topics`` (the text behind ``help('assert')`` etc.) ships with every CPython, so the
sentences need no download. The split is deterministic for a given Python version: prose paragraphs
(unindented, not headings) are joined into lines, cut after ``.``, ``!`` or ``?`` followed by a capital
letter, kept when 30 to 300 characters long, de-duplicated, then shuffled with a fixed seed so that any
prefix mixes many topics.
"""

from __future__ import annotations

import random
import re

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"(])")
_MIN_CHARS, _MAX_CHARS = 30, 300


def _prose_paragraphs(text: str) -> list[str]:
    """Unindented paragraphs of ``text`` that are not headings (underlined with ``*``, ``=`` or ``-``)."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.split("\n")
        if not lines or any(line.startswith((" ", "\t")) for line in lines):
            continue  # code, grammar or an indented list
        if len(lines) > 1 and re.fullmatch(r"[*=\-~^]+", lines[1].strip()):
            continue  # a heading
        paragraphs.append(" ".join(line.strip() for line in lines))
    return paragraphs


def all_sentences() -> list[str]:
    """Every usable sentence, in a fixed shuffled order (see the module docstring)."""
    from pydoc_data.topics import topics

    seen: dict[str, None] = {}
    for key in sorted(topics):
        for paragraph in _prose_paragraphs(topics[key]):
            for sentence in _SENTENCE_END.split(paragraph):
                sentence = " ".join(sentence.split())
                if _MIN_CHARS <= len(sentence) <= _MAX_CHARS and sentence[-1] in ".!?":
                    seen.setdefault(sentence)
    sentences = list(seen)
    random.Random(0).shuffle(sentences)
    return sentences


def evaluation_and_calibration_sentences(n_eval: int, n_calib: int) -> tuple[list[str], list[str]]:
    """Two disjoint lists: ``n_eval`` sentences to evaluate on, the next ``n_calib`` to calibrate with.

    Raises ValueError when a count is negative or the two together exceed what the text holds.
    """
    if n_eval < 0 or n_calib < 0:
        raise ValueError(f"sentence counts must be >= 0, got {n_eval} and {n_calib}")
    sentences = all_sentences()
    if n_eval + n_calib > len(sentences):
        raise ValueError(f"asked for {n_eval} + {n_calib} sentences; the bundled text has {len(sentences)}")
    return sentences[:n_eval], sentences[n_eval:n_eval + n_calib]
