"""FusedGRPOTrainer gives exactly TRL 1.16's GRPO objective, gradients and logged metrics.

Each case builds a ``trl.GRPOTrainer`` and a ``hf_fused.FusedGRPOTrainer`` on identical tiny models, runs
TRL's own ``_generate_and_score_completions`` (scripted rollout) and ``_compute_loss`` + backward on every
micro-batch, and compares loss values, every parameter gradient, every logged metric and the
generation-time tensors (old / reference log-probs, importance-sampling ratios). On-policy GRPO has
ratio ≡ 1, so most cases also force off-policy old log-probs (``off_policy_noise``) so that clipping,
masks and ratios depend on the log-probs being compared.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from grpo_helpers import (  # noqa: E402
    VOCAB_SIZE,
    Case,
    assert_same_step,
    build_trainer,
    dense_logps,
    make_model,
    run_step,
)
from trl import GRPOTrainer  # noqa: E402

from hf_fused.trainers.grpo import FusedGRPOTrainer  # noqa: E402

OFF = 0.3  # std of the noise that moves old log-probs off-policy
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
IS = dict(sampling_logps=True, vllm_is=True)

CASES = {
    # every loss type, off-policy so the ratio is not 1
    **{f"{lt}-offpolicy": Case(config=dict(loss_type=lt), off_policy_noise=OFF)
       for lt in ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]},
    "dapo-onpolicy": Case(config=dict(loss_type="dapo")),
    "grpo-onpolicy-qwen3": Case(config=dict(loss_type="grpo"), arch="qwen3"),
    # sequence-level importance sampling (GSPO)
    "grpo-sequence": Case(config=dict(loss_type="grpo", importance_sampling_level="sequence"), off_policy_noise=OFF),
    "luspo-sequence": Case(config=dict(loss_type="luspo", importance_sampling_level="sequence"), off_policy_noise=OFF),
    "dapo-sequence": Case(config=dict(loss_type="dapo", importance_sampling_level="sequence"), off_policy_noise=OFF),
    # KL to a reference model (reloaded from disk), with and without the importance-sampled KL
    "beta-biascorr": Case(config=dict(beta=0.1), off_policy_noise=OFF),
    "beta-nobiascorr": Case(config=dict(beta=0.1, use_bias_correction_kl=False), off_policy_noise=OFF),
    "beta-sequence-grpo": Case(config=dict(beta=0.05, loss_type="grpo", importance_sampling_level="sequence"),
                               off_policy_noise=OFF),
    # clipping variants
    "delta": Case(config=dict(loss_type="grpo", delta=1.1, epsilon=0.1), off_policy_noise=0.5),
    "epsilon_high": Case(config=dict(epsilon=0.1, epsilon_high=0.28), off_policy_noise=OFF),
    "cispo-eps": Case(config=dict(loss_type="cispo", epsilon_high=1.2), off_policy_noise=OFF),
    "sapo-temps": Case(config=dict(loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0),
                       off_policy_noise=OFF),
    # high-entropy token mask, entropy bonus (static and adaptive)
    "top_entropy": Case(config=dict(top_entropy_quantile=0.4), off_policy_noise=OFF),
    "entropy_bonus": Case(config=dict(entropy_coef=0.05), off_policy_noise=OFF),
    "entropy_bonus-top_entropy-grpo": Case(config=dict(entropy_coef=0.05, top_entropy_quantile=0.5, loss_type="grpo")),
    "adaptive_entropy": Case(config=dict(use_adaptive_entropy=True, entropy_coef=0.02, entropy_target=10.0)),
    # off-policy sequence mask, from old log-probs and from sampling log-probs
    "opsm": Case(config=dict(off_policy_mask_threshold=0.02), off_policy_noise=0.5),
    "opsm-sampling": Case(config=dict(off_policy_mask_threshold=0.02), sampling_logps=True, nan_token=True),
    # vLLM importance-sampling correction, every mode (old log-probs are recomputed at generation)
    "is-token_truncate": Case(config=dict(vllm_importance_sampling_mode="token_truncate",
                                          vllm_importance_sampling_clip_max=1.5), **IS),
    "is-token_mask": Case(config=dict(vllm_importance_sampling_mode="token_mask",
                                      vllm_importance_sampling_clip_max=1.5, vllm_importance_sampling_clip_min=0.5),
                          **IS),
    "is-sequence_truncate": Case(config=dict(vllm_importance_sampling_mode="sequence_truncate",
                                             vllm_importance_sampling_clip_max=2.0), **IS),
    "is-sequence_mask": Case(config=dict(vllm_importance_sampling_mode="sequence_mask"), nan_token=True, **IS),
    "is-vespo-token_mask": Case(config=dict(loss_type="vespo", vllm_importance_sampling_mode="token_mask"), **IS),
    "is-off_policy-beta-opsm": Case(config=dict(beta=0.1, off_policy_mask_threshold=0.05,
                                                vllm_importance_sampling_mode="token_truncate"),
                                    off_policy_noise=OFF, **IS),
    # sampling details
    "mask_truncated": Case(config=dict(mask_truncated_completions=True), off_policy_noise=OFF),
    "temperature": Case(config=dict(temperature=0.7, beta=0.1), off_policy_noise=OFF),
    # multi-step: old log-probs computed at generation, several micro-batches accumulated
    "num_iterations": Case(config=dict(num_iterations=2)),
    "grad_accum": Case(config=dict(gradient_accumulation_steps=2, per_device_train_batch_size=4),
                       off_policy_noise=OFF),
    "steps_per_generation": Case(config=dict(steps_per_generation=2, per_device_train_batch_size=4, loss_type="dapo",
                                             entropy_coef=0.01)),
    # model variants
    "tied_embeddings": Case(config=dict(beta=0.1), off_policy_noise=OFF, tie=True),
    "gradient_checkpointing": Case(config=dict(gradient_checkpointing=True), off_policy_noise=OFF, arch="qwen3"),
    "cast_lm_head_to_fp32": Case(config=dict(cast_lm_head_to_fp32=True), off_policy_noise=OFF),
    # PEFT: the reference is the base model (adapter disabled)
    "peft-lora": Case(config=dict(beta=0.1), peft=LORA, off_policy_noise=OFF),
    "peft-lora-is-sequence": Case(config=dict(beta=0.1, loss_type="grpo", importance_sampling_level="sequence",
                                              vllm_importance_sampling_mode="sequence_truncate"),
                                  peft=LORA, off_policy_noise=OFF, **IS),
}


def _pair(case, tmp_path):
    ref = run_step(build_trainer(GRPOTrainer, case, tmp_path), case)
    fused = run_step(build_trainer(FusedGRPOTrainer, case, tmp_path), case)
    return ref, fused


def test_harness_is_deterministic(tmp_path):
    """GRPOTrainer against itself on two identical models: bit-identical, so any later difference is ours."""
    case = CASES["is-off_policy-beta-opsm"]
    a = run_step(build_trainer(GRPOTrainer, case, tmp_path), case)
    b = run_step(build_trainer(GRPOTrainer, case, tmp_path), case)
    assert_same_step(a, b, rtol=0.0, atol=0.0)


@pytest.mark.parametrize("name", list(CASES))
def test_fused_matches_trl(name, tmp_path):
    case = CASES[name]
    ref, fused = _pair(case, tmp_path)
    assert_same_step(fused, ref, rtol=1e-5)


def test_cases_exercise_the_branches(tmp_path):
    """The off-policy noise really moves the ratio: clipping happens and the gradient depends on it."""
    case = CASES["grpo-offpolicy"]
    ref = run_step(build_trainer(GRPOTrainer, case, tmp_path), case)
    assert ref.metrics["clip_ratio/region_mean"][0] > 0
    onp = run_step(build_trainer(GRPOTrainer, CASES["dapo-onpolicy"], tmp_path), CASES["dapo-onpolicy"])
    assert onp.metrics["clip_ratio/region_mean"][0] == 0


def test_generation_logprobs_match_dense_float64(tmp_path):
    """Old-policy and reference log-probs computed by hf_fused at generation time equal float64 dense ones."""
    case = Case(config=dict(beta=0.1, num_iterations=2, temperature=0.8))
    trainer = build_trainer(FusedGRPOTrainer, case, tmp_path)
    step = run_step(trainer, case)
    ids = torch.cat([step.inputs["prompt_ids"], step.inputs["completion_ids"]], 1)
    am = torch.cat([step.inputs["prompt_mask"], step.inputs["completion_mask"]], 1)
    k = step.inputs["completion_ids"].size(1)
    policy = make_model("llama").double()
    old, _ = dense_logps(policy, ids, am, k, 0.8)
    torch.testing.assert_close(step.inputs["old_per_token_logps"].double(), old, rtol=1e-5, atol=1e-5)
    ref_model = trainer.ref_model
    ref, _ = dense_logps(ref_model.double(), ids, am, k, 0.8)
    torch.testing.assert_close(step.inputs["ref_per_token_logps"].double(), ref, rtol=1e-5, atol=1e-5)
