"""``python -m benchmarks.rl_parity`` on CPU at a tiny shape: every row is there and says what it should. On CPU
hf_fused's tiles compute the bf16 operands' products in fp32 (the torch backend), so FusedGRPOTrainer's log-probs
are the fp32 head's to fp32 rounding, while TRL's chunked head and eager logits round the logits to bf16 (~1e-2
nats at logits of standard deviation 4); with fp32 weights TRL's head computes fp32 products too, and the two
trainers' log-probs agree to fp32 rounding."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("trl")

from benchmarks import rl_parity  # noqa: E402

SHAPE = (2, 5, 8, 32, 300)
FP32_NOISE = 1e-5  # nats: log-probs of ~-6 from fp32 logits of std 4 summed in another order


def _rows(record):
    return {r["name"]: r for r in record["rows"]}


def test_every_row_on_cpu_bf16():
    record = rl_parity.measure(torch.device("cpu"), SHAPE)
    rows = _rows(record)
    eager = "eager bf16 logits"
    assert list(rows) == [rl_parity.REFERENCE, eager, *rl_parity.TRAINER_ROWS]
    assert record["tokens"] >= SHAPE[0] * SHAPE[2] // 2 and 3 < record["logit_std"] < 5, record
    for r in rows.values():
        values = [r[k][s] for k in ("vs_fp32", "vs_float64") for s in ("rms", "max")]
        assert all(math.isfinite(v) for v in values) and r["vs_fp32"]["rms"] <= r["vs_fp32"]["max"], r
        assert r["hidden_max_diff"] == 0, r  # every variant saw the reference's hidden states
    ref = rows[rl_parity.REFERENCE]
    assert ref["vs_fp32"] == {"rms": 0.0, "max": 0.0} and ref["vs_float64"]["max"] < FP32_NOISE, ref
    fused = [name for name in rl_parity.TRAINER_ROWS if name.startswith("FusedGRPOTrainer")]
    for name in fused + ["GRPOTrainer cast_lm_head_to_fp32"]:
        assert rows[name]["vs_fp32"]["max"] < FP32_NOISE, rows[name]
    for name in (eager, "GRPOTrainer (TRL)"):  # bf16 logits: |z|·2⁻⁹ per logit
        assert rows[name]["vs_fp32"]["max"] > 1e-3, rows[name]
    assert rows["FusedGRPOTrainer (default)"]["schedule"] == "one pass"  # the call the loss makes, hinted
    assert rows["GRPOTrainer (TRL)"]["schedule"] == "TRL chunked head"
    assert rows["GRPOTrainer (TRL) old/ref log-probs (no grad)"]["schedule"] == "no grad: TRL chunked head"
    ratios = {r["policy"]: r for r in record["log_ratio_same_weights"]}
    assert set(ratios) == {"FusedGRPOTrainer (default)", "GRPOTrainer (TRL)"}, ratios
    assert ratios["GRPOTrainer (TRL)"]["max"] == 0  # one computation, with and without gradient
    assert all(r["max"] < FP32_NOISE for r in ratios.values()), ratios  # CPU: fp32 products in both calls


def test_fused_equals_trl_with_fp32_products(tmp_path, capsys):
    names = ["FusedGRPOTrainer (default)", "GRPOTrainer (TRL)"]
    assert rl_parity.main(["--device", "cpu", "--shape", "x".join(map(str, SHAPE)), "--dtype", "fp32", "--variants",
                           ",".join(names), "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "rl_parity.json").read_text())
    rows = _rows(record)
    assert list(rows) == [rl_parity.REFERENCE, "eager fp32 logits", *names]
    for name in names:  # both within fp32 rounding of float64, so of each other
        assert rows[name]["vs_float64"]["max"] < FP32_NOISE and rows[name]["vs_fp32"]["max"] < FP32_NOISE, rows
    assert "GRPOTrainer (TRL)" in capsys.readouterr().out and (tmp_path / "rl_parity.txt").exists()
    with pytest.raises(ValueError, match="unknown variants"):
        rl_parity.measure(torch.device("cpu"), SHAPE, variants=["no such row"])


def test_fp32_statistics_rows_under_the_interpreter():
    """FusedGRPOTrainer on the GPU backend's kernels (Triton's interpreter): with the fp32 statistics its log-probs
    are the fp32 head's to fp32 rounding; from the stored bf16 tiles (forced, and the default on CPU tensors, which
    keep the stored tiles' results) they are as far off as TRL's head (tests/ops/test_fp32_logprobs_default.py: the
    default on a CUDA device)."""
    pytest.importorskip("triton")
    faithful, *bf16 = ("FusedGRPOTrainer fp32 statistics (dz recompute)",
                       "FusedGRPOTrainer bf16 tiles (HF_FUSED_FP32_LOGITS=0)", "FusedGRPOTrainer (default)")
    rows = _rows(rl_parity.measure(torch.device("cpu"), SHAPE, backend="triton", variants=[faithful, *bf16]))
    assert rows[faithful]["schedule"] == "one pass" and rows[faithful]["vs_fp32"]["max"] < FP32_NOISE, rows[faithful]
    for name in bf16:
        assert rows[name]["schedule"] == "one pass" and rows[name]["vs_fp32"]["max"] > 1e-3, rows[name]
