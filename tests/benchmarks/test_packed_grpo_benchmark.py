"""``python -m benchmarks.packed_grpo`` on CPU at toy sizes: TRL's packing, the three variants of the
``AsyncGRPOTrainer`` head, the hint's result equal to the unhinted op's."""

from __future__ import annotations

import json

import pytest

from benchmarks.packed_grpo import main

TOY = ["--device", "cpu", "--prompt", "8", "--completion", "24", "--group", "3", "--groups", "2", "--shared", "3",
       "--hidden", "32", "--vocab", "500", "--repeats", "1"]


def test_packed_row_variants_agree(tmp_path, capsys):
    assert main([*TOY, "--out", str(tmp_path / "out.json")]) == 0
    out = capsys.readouterr().out
    assert "at most 3 per position" in out  # the shared first completion tokens serve the group's three samples
    records = {r["variant"]: r for r in json.loads((tmp_path / "out.json").read_text())["records"]}
    assert set(records) == {"trl", "hf_fused", "hf_fused_hint"}
    assert all(r["ms"] > 0 and "note" not in r for r in records.values())
    # the same bf16 operands and fp32 statistics: the one pass's gradients are the recompute's up to one bf16
    # rounding of the head's gradients (tests/trainers/test_grpo_one_pass.py's bound)
    hinted = records["hf_fused_hint"]
    assert hinted["loss_diff"] <= 1e-6 and max(hinted["grad_hidden_diff"], hinted["grad_weight_diff"]) <= 2**-8
    # TRL's head rounds each logit to bf16 on CPU: close, not equal
    assert records["trl"]["loss_diff"] < 3e-2


def test_shared_longer_than_the_completion_is_refused(capsys):
    with pytest.raises(SystemExit):
        main([*TOY, "--shared", "30"])
    assert "--shared must be between 0 and --completion (24), got 30" in capsys.readouterr().err
