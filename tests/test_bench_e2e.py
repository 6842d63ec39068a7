"""Smoke test of ``python -m benchmarks.e2e --tiny`` on CPU: both parts run end to end, the JSON and
table are written, Liger is skipped with a note, and the variants agree on the first loss."""

from __future__ import annotations

import json
import math

from benchmarks.e2e.__main__ import main


def test_e2e_tiny_cpu(tmp_path, capsys):
    out = tmp_path / "e2e"
    argv = ["--tiny", "--device", "cpu", "--seq-lens", "32,48", "--steps", "1", "--grpo-completions", "2",
            "--grpo-completion-len", "8", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    doc = json.loads((out / "e2e.json").read_text())
    table = (out / "e2e.txt").read_text()
    assert "longest fit" in table and table.strip() in printed

    sft = {(r["variant"], r["seq_len"]): r for r in doc["sft"]["runs"]}
    assert set(sft) == {(v, n) for v in ("plain", "liger", "hf_fused") for n in (32, 48)}
    for n in (32, 48):
        assert sft[("liger", n)]["status"] == "skipped" and sft[("liger", n)]["note"]
        plain, fused = sft[("plain", n)], sft[("hf_fused", n)]
        assert plain["status"] == fused["status"] == "ok", (plain, fused)
        assert plain["checkpointing"] and fused["checkpointing"]
        assert len(plain["step_s"]) == 1 and plain["tokens_per_s"] > 0
        assert math.isclose(plain["losses"][0], fused["losses"][0], rel_tol=1e-4)

    grpo = {r["variant"]: r for r in doc["grpo"]["runs"]}
    assert set(grpo) == {"trl", "hf_fused", "hf_fused_one_pass"}
    assert all(r["status"] == "ok" and r["checkpointing"] for r in grpo.values()), grpo
    for variant in ("hf_fused", "hf_fused_one_pass"):
        assert math.isclose(grpo["trl"]["losses"][0], grpo[variant]["losses"][0], rel_tol=1e-4, abs_tol=1e-6)
        assert math.isclose(grpo["trl"]["grad_norm_last"], grpo[variant]["grad_norm_last"], rel_tol=1e-3)
