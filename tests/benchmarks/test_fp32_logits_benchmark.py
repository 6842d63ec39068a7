"""Smoke test of ``python -m benchmarks.fp32_logits`` on CPU (the GPU backend's kernels under Triton's interpreter):
every column is timed, the fp32 statistics' log-probs are float64's to fp32 rounding where eager bf16 logits are
not, and the cross-entropy's errors come out for the three modes."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from benchmarks import fp32_logits  # noqa: E402
from benchmarks.fp32_logits import COLUMNS, MODES, main  # noqa: E402


def test_every_column_runs_and_the_fp32_statistics_are_float64s(capsys, monkeypatch):
    import torch

    # the row the CLI measures and prints, read on its way (measuring another shape beside it ran every column
    # twice under the interpreter)
    rows, real = [], fp32_logits.measure
    monkeypatch.setattr(fp32_logits, "measure", lambda *a: rows.append((a, real(*a))) or rows[-1][1])
    assert main(["--device", "cpu", "--shapes", "24x32x300", "--repeats", "1", "--error-rows", "24",
                 "--gradient-shape", "16x16x130"]) == 0
    [(args, row)] = rows
    assert args == (torch.device("cpu"), (24, 32, 300), 1, 24)
    assert set(row["ms"]) == set(COLUMNS) and all(ms > 0 for ms in row["ms"].values())
    assert row["errors"]["on"][0] <= 1e-5 and row["errors"]["eager"][0] >= 1e-3, row["errors"]
    printed = capsys.readouterr().out
    assert "ce rec" in printed and all(f"  {name}: " in printed for name, _, _ in MODES)
