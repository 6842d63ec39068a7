"""The documentation site builds with every warning an error, and docs/ stays small.

``mkdocs build --strict`` (what ``make docs`` runs) fails on a broken link or anchor, an unresolved reference, a
public name without a docstring or missing from the API reference, or a reference page naming something that is
not public (docs/hooks/api_check.py). The size rules: docs/ under 2 MB in at most 80 files, the performance page
at most 15 KB, the data behind its tables at most 400 KB.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from doc_blocks import ROOT

DOCS = ROOT / "docs"


def _files(folder):
    return [p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts]


def test_strict_build(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install -e '.[docs]' (the test extra has it)")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed: pip install -e '.[docs]'")
    pytest.importorskip("material", reason="mkdocs-material is not installed: pip install -e '.[docs]'")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    mkdocs = [sys.executable, "-m", "mkdocs"]
    result = subprocess.run([*mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                            capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    for page in ("index.html", "reference/ops/index.html", "design/index.html", "performance/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    ops = (tmp_path / "site" / "reference" / "ops" / "index.html").read_text()
    assert 'id="hf_fused.ops.linear_logprobs"' in ops and ":func:" not in ops


def test_docs_folder_is_small():
    files = _files(DOCS)
    size = sum(p.stat().st_size for p in files)
    assert len(files) <= 80, f"docs/ holds {len(files)} files"
    assert size < 2 * 2**20, f"docs/ holds {size / 2**20:.2f} MiB"


def test_performance_page_and_data_are_small():
    assert (DOCS / "performance.md").stat().st_size <= 15 * 1024
    data = sum(p.stat().st_size for p in _files(DOCS / "performance"))
    assert data <= 400 * 1024, f"docs/performance/ holds {data / 1024:.0f} KiB"


def test_mkdocs_nav_names_every_page():
    """Every page of docs/ is in mkdocs.yml's nav (MkDocs would only log it); the hooks folder is excluded."""
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in DOCS.rglob("*.md"):
        rel = page.relative_to(DOCS).as_posix()
        if rel.startswith(("hooks/", "design/")):
            continue
        assert f" {rel}" in nav, f"{rel} is not in mkdocs.yml's nav"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_no_page_cites_a_file_outside_the_repository():
    """The design notes live in docs/design.md: no tracked file cites a DESIGN.md (there is none)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert not any(path.endswith("DESIGN.md") for path in tracked)
    for path in ("README.md", *[p for p in tracked if p.startswith("docs/") and p.endswith(".md")]):
        assert "DESIGN.md" not in (ROOT / path).read_text(), path
