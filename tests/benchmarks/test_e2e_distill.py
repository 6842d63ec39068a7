"""Smoke test of ``python -m benchmarks.e2e --tiny --parts distill`` on CPU: TRL's ``DistillationTrainer`` stock and
on an hf_fused student run end to end; the patched run's every loss call goes through hf_fused's op, the stock run's
none, and both give the same loss, entropy and gradient norm."""

from __future__ import annotations

import json
import math

from benchmarks.e2e.__main__ import main


def test_e2e_tiny_distillation_trainer(tmp_path, capsys):
    out = tmp_path / "e2e"
    argv = ["--tiny", "--device", "cpu", "--parts", "distill", "--steps", "1", "--distill-completions", "2",
            "--grpo-completion-len", "8", "--distill-beta", "0.5", "--out", str(out)]
    assert main(argv) == 0
    doc = json.loads((out / "e2e.json").read_text())
    table = (out / "e2e.txt").read_text()
    assert table.strip() in capsys.readouterr().out and "Distillation" in table and "beta 0.5" in table
    runs = {r["variant"]: r for r in doc["distill"]["runs"]}
    assert set(runs) == {"trl", "hf_fused"}
    assert all(r["status"] == "ok" and r["checkpointing"] for r in runs.values()), runs
    assert runs["trl"]["hf_fused_op_calls"] == 0 and runs["hf_fused"]["hf_fused_op_calls"] == 2  # warm-up + step
    for key in ("entropy_last", "grad_norm_last"):
        assert math.isclose(runs["trl"][key], runs["hf_fused"][key], rel_tol=1e-4), key
    assert math.isclose(runs["trl"]["losses"][0], runs["hf_fused"]["losses"][0], rel_tol=1e-4, abs_tol=1e-7)
    assert runs["trl"]["losses"][0] > 0
