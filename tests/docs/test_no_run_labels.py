"""The repository speaks of the product, not of the work periods that made it.

A measurement is cited by its page and date ("docs/performance.md, H200, 2026-11-28"), never by a run-history
label: an ordinal followed by "session" or "wave" (an ordinal from "third" up followed by "run": "the first run
of a process" and "a second run" are ordinary product text), in words or digits, or a numbered run folder
(``session20``, ``run_07``) in a path or in a file's text. Checked over every git-tracked file (this file
excepted: it has to spell the patterns), paths and contents.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from doc_blocks import ROOT

_UNITS = ["", "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth"]
_TEENS = ["tenth", "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth", "seventeenth",
          "eighteenth", "nineteenth"]
_TENS = ["twent", "thirt", "fort", "fift", "sixt", "sevent", "eight", "ninet"]  # + "ieth" or "y-<unit>"
_ORDINAL_WORDS = _UNITS[1:] + _TEENS + [t + "ieth" for t in _TENS] + [f"{t}y[- ]{u}" for t in _TENS for u in _UNITS[1:]]
_ORDINAL = rf"(?:{'|'.join(_ORDINAL_WORDS)}|\d+(?:st|nd|rd|th))"
#: "first"/"second" (and 1st/2nd) before "run" are ordinary English about a process's runs.
_RUN_ORDINAL = rf"(?:{'|'.join(w for w in _ORDINAL_WORDS if w not in ('first', 'second'))}|\d*(?:[3-9]|1\d)(?:st|nd|rd|th))"

LABEL = re.compile(
    rf"\b{_ORDINAL}[\s-]+(?:sessions?|waves?)\b(?!\s+of\b)"  # "wave of tiles/blocks" is GPU vocabulary
    rf"|\b{_RUN_ORDINAL}[\s-]+runs?\b"
    r"|\b(?:session|run|wave)[_-]?\d+\b",
    re.IGNORECASE,
)
#: A path component that is a numbered run folder or file: session20, run_07, wave-3.
RUN_PATH = re.compile(r"(?:^|/)(?:session|run|wave)[_-]?\d+(?:[/._]|$)", re.IGNORECASE)

SELF = "tests/docs/test_no_run_labels.py"


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p and p != SELF]


def _findings() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in _tracked():
        if RUN_PATH.search(path):
            found.setdefault(path, []).append("numbered run folder in the path")
        file = ROOT / path
        if not file.is_file():
            continue  # tracked but deleted in the working tree
        data = file.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary (images)
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            for match in LABEL.finditer(line):
                found.setdefault(path, []).append(f"line {number}: {match.group(0)!r}")
    return found


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_no_run_history_labels_in_tracked_files():
    found = _findings()
    report = "\n".join(f"{path}: {', '.join(hits[:5])}{' …' if len(hits) > 5 else ''}" for path, hits in found.items())
    assert not found, ("run-history labels (cite a measurement by page and date instead, e.g. "
                       f"'docs/performance.md, H200, 2026-11-28'):\n{report}")


@pytest.mark.parametrize("text", [
    "docs/gpu_results.md, thirteenth session", "the Sixth Session", "the twentieth-session run",
    "twenty-first session", "the 14th session", "the sixth run", "Lessons of the first wave",
    "docs/bench/h100/session6/ce.png", "out/run_07/", "wave3",
])
def test_the_pattern_catches_labels(text):
    assert LABEL.search(text) or RUN_PATH.search(text), text


@pytest.mark.parametrize("text", [
    "the first pass", "the first run of a process compiles the kernels", "a second run reads the cache",
    "the last wave that fills part of the GPU", "the first wave of tiles", "runs/", "session state",
    "run_step(trainer, case)", "a distributed session over NCCL",
])
def test_the_pattern_lets_product_text_pass(text):
    assert not LABEL.search(text) and not RUN_PATH.search(text), text
