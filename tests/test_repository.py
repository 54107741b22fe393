"""The repository stands on its own: no text cites a document outside it, and every cited doc exists."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXT_FILES = sorted(
    p for pattern in ("src/**/*.py", "tests/**/*.py", "benchmarks/**/*.py", "benchmarks/**/*.md", "docs/**/*.md",
                      "scripts/*", ".ci/*", "README.md")
    for p in ROOT.glob(pattern) if p.is_file() and "__pycache__" not in p.parts
)
# Documents and trackers that live outside the repository.
OUTSIDE = re.compile(
    r"formats\.md|design\.md|amct_quantize\.md|baselines\.md|peers\.md|style\.md|\.\./shared|shared/spec|"
    r"\bspec/|\bgotcha\b|\bissue \d+|\bissues? #\d+",
    re.IGNORECASE,
)
DOC_LINK = re.compile(r"docs/[\w./-]+\.md")


def _lines(path: Path):
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        yield number, line


@pytest.mark.parametrize("path", TEXT_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_reference_to_documents_outside_the_repository(path):
    if path == Path(__file__).resolve():
        return
    found = [f"{n}: {line.strip()}" for n, line in _lines(path) if OUTSIDE.search(line)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("path", TEXT_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_doc_exists(path):
    missing = [f"{n}: {m}" for n, line in _lines(path) for m in DOC_LINK.findall(line) if not (ROOT / m).is_file()]
    assert not missing, "\n".join(missing)
