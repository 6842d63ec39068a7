"""FusedGRPOTrainer's per-token log-probs against what a sampler with an fp32 head returns, on the GPU.

On bf16 operands the exact products sit in the logits matmul's fp32 accumulator: by default on CUDA the log-probs
the trainer's loss sees (the one pass) and the old / reference log-probs (the statistics pass) take their statistics
from it (:mod:`hf_fused.ops.backends.triton_cublas.fp32_logits_rule`), so both are within 1e-4 nats of an fp32 head
on the same weights and hidden states (also with the one pass's ``dz`` recomputed from the accumulator), at a
Qwen3-1.7B head (H 2048, V 151,936) on completions the model sampled itself, and they agree with each other at the
same weights: the first off-policy iteration's ratio is 1 (to fp32 rounding: the statistics kernel's launch shape is
tuned apart for the pass that also stores the tile, measured 0; where QuACK is installed both run its scaled-exp
matmul, the statistics pass with nothing stored: 1.9e-6 at most, H200, 2026-11-30, measured while the statistics pass
still ran the fused matmul). The stored bf16 tiles' and TRL's head's distances
are reported beside them, not pinned. ``python -m benchmarks.rl_parity`` measures the same rows at the documented
shape (docs/grpo.md).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from benchmarks import rl_parity  # noqa: E402

SHAPE = (4, 128, 512, 2048, 151936)  # B, prompt, completion, H, V
FP32_FAITHFUL_NATS = 1e-4
SAME_WEIGHTS_NATS = 2e-5  # a few ulps of a log-sum-exp of ~16 (1.9e-6 each)
FAITHFUL = ("FusedGRPOTrainer (default)", "FusedGRPOTrainer fp32 statistics (dz recompute)",
            "FusedGRPOTrainer old/ref log-probs (no grad)")
REPORTED = ("FusedGRPOTrainer bf16 tiles (HF_FUSED_FP32_LOGITS=0)", "GRPOTrainer (TRL)")


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_default_logprobs_match_an_fp32_head_and_each_other(temperature):
    """At TRL's default temperature and at a sampling temperature (completions sampled at it, the trainer's logits
    divided by it): a temperature divides the logits and with them the two accumulations' difference, so the
    bounds are in nats of ``z / T``."""
    record = rl_parity.measure(torch.device("cuda"), SHAPE, layers=1, temperature=temperature,
                               variants=[*FAITHFUL, *REPORTED])
    rows = {r["name"]: r for r in record["rows"]}
    print("\n".join(rl_parity.report(record)))
    assert 3 < record["logit_std"] < 5, record["logit_std"]
    for name in FAITHFUL:  # on the hidden states it computed
        assert rows[name]["vs_fp32"]["max"] <= FP32_FAITHFUL_NATS / temperature, rows[name]
    for name in FAITHFUL[:2]:
        assert rows[name]["schedule"] == "one pass", rows[name]  # the loss's call, gradients in the forward
    ratios = {r["policy"]: r for r in record["log_ratio_same_weights"]}
    assert ratios[FAITHFUL[0]]["max"] <= SAME_WEIGHTS_NATS / temperature, ratios
    for name in REPORTED:  # bf16 tiles: |z|·2⁻⁹ per logit
        assert 0 < rows[name]["vs_fp32"]["max"] < 1, rows[name]
