"""FusedGRPOTrainer computes the head's gradients in the forward's one pass for every TRL 1.16 loss type and option
that is token-separable given per-batch constants (on- and off-policy, KL, entropy bonus, vLLM importance sampling),
and still gives exactly TRL's loss, every gradient and every logged metric.

Each case runs ``trl.GRPOTrainer`` and ``hf_fused.FusedGRPOTrainer`` on identical tiny models through TRL's own
``_generate_and_score_completions`` + ``_compute_loss`` + backward (tests/grpo_harness.py), compares everything
(fp32, 1e-5), and counts the torch backend's calls: one one-pass forward with gradients per micro-batch and no
recompute backward. A prediction of TRL's gradient that missed would raise (HintMissedWarning is an error in the
test configuration). Non-separable options keep the two-pass path and stay exact.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_harness import (  # noqa: E402
    DEVICE, Case, assert_same_step, build_trainer, count_backend_calls, max_grad_relerr, run_step, train_and_log,
)
from trl import GRPOTrainer  # noqa: E402

from hf_fused.trainers.grpo import FusedGRPOTrainer  # noqa: E402
from hf_fused.trainers.grpo_objective import not_separable_reason  # noqa: E402

OFF = 0.3  # std of the noise that moves old log-probs off-policy (ratios cross the clip range)
IS = dict(sampling_logps=True, vllm_is=True)
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)

ONE_PASS = {
    **{f"{lt}-offpolicy": Case(config=dict(loss_type=lt), off_policy_noise=OFF)
       for lt in ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo"]},
    **{f"{lt}-offpolicy-beta": Case(config=dict(loss_type=lt, beta=0.1), off_policy_noise=OFF)
       for lt in ["grpo", "dapo", "cispo", "sapo"]},
    "beta-onpolicy": Case(config=dict(beta=0.1)),
    "beta-nobiascorr": Case(config=dict(beta=0.1, use_bias_correction_kl=False), off_policy_noise=OFF),
    "delta": Case(config=dict(loss_type="grpo", delta=1.1, epsilon=0.1), off_policy_noise=0.5),
    "epsilon_high": Case(config=dict(epsilon=0.1, epsilon_high=0.28), off_policy_noise=OFF),
    "cispo-eps": Case(config=dict(loss_type="cispo", epsilon_high=1.2), off_policy_noise=OFF),
    "sapo-temps": Case(config=dict(loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0),
                       off_policy_noise=OFF),
    "entropy_bonus-onpolicy": Case(config=dict(entropy_coef=0.05)),
    "entropy_bonus-offpolicy-beta": Case(config=dict(entropy_coef=0.05, beta=0.1, loss_type="bnpo"),
                                         off_policy_noise=OFF),
    "adaptive_entropy": Case(config=dict(use_adaptive_entropy=True, entropy_coef=0.02, entropy_target=10.0)),
    "is-token_truncate": Case(config=dict(vllm_importance_sampling_mode="token_truncate",
                                          vllm_importance_sampling_clip_max=1.2), **IS),
    "is-token_mask-beta": Case(config=dict(beta=0.1, vllm_importance_sampling_mode="token_mask",
                                           vllm_importance_sampling_clip_max=1.3,
                                           vllm_importance_sampling_clip_min=0.7), **IS),
    "is-sequence_truncate": Case(config=dict(vllm_importance_sampling_mode="sequence_truncate",
                                             vllm_importance_sampling_clip_max=1.5), **IS),
    "is-sequence_mask-nan": Case(config=dict(vllm_importance_sampling_mode="sequence_mask"), nan_token=True, **IS),
    "temperature": Case(config=dict(temperature=0.7, beta=0.1), off_policy_noise=OFF),
    "mask_truncated": Case(config=dict(mask_truncated_completions=True), off_policy_noise=OFF),
    "num_iterations": Case(config=dict(num_iterations=2)),
    "grad_accum": Case(config=dict(gradient_accumulation_steps=2, per_device_train_batch_size=4),
                       off_policy_noise=OFF),
    "steps_per_generation-dapo-entropy": Case(config=dict(steps_per_generation=2, per_device_train_batch_size=4,
                                                          loss_type="dapo", entropy_coef=0.01), off_policy_noise=OFF),
    "tied_embeddings": Case(config=dict(beta=0.1), off_policy_noise=OFF, tie=True),
    "gradient_checkpointing-qwen3": Case(config=dict(gradient_checkpointing=True), off_policy_noise=OFF,
                                         arch="qwen3"),
    "moe-aux_loss": Case(config=dict(beta=0.1), arch="qwen3moe", off_policy_noise=OFF),
    "cast_lm_head_to_fp32": Case(config=dict(cast_lm_head_to_fp32=True), off_policy_noise=OFF),
    "peft-lora-beta": Case(config=dict(beta=0.1), peft=LORA, off_policy_noise=OFF),
}

TWO_PASSES = {
    "vespo": Case(config=dict(loss_type="vespo"), off_policy_noise=OFF),
    "grpo-sequence": Case(config=dict(loss_type="grpo", importance_sampling_level="sequence"), off_policy_noise=OFF),
    "top_entropy": Case(config=dict(top_entropy_quantile=0.4, beta=0.1), off_policy_noise=OFF),
    "opsm": Case(config=dict(off_policy_mask_threshold=0.02), off_policy_noise=0.5),
}


def _run_pair(case, tmp_path, monkeypatch):
    if DEVICE != "cpu":
        pytest.skip("counts the CPU backend's calls")
    ref = run_step(build_trainer(GRPOTrainer, case, tmp_path), case)
    calls, _ = count_backend_calls(monkeypatch)
    trainer = build_trainer(FusedGRPOTrainer, case, tmp_path)
    fused = run_step(trainer, case)
    return ref, fused, calls, trainer


@pytest.mark.parametrize("name", list(ONE_PASS))
def test_one_pass_matches_trl(name, tmp_path, monkeypatch):
    case = ONE_PASS[name]
    ref, fused, calls, trainer = _run_pair(case, tmp_path, monkeypatch)
    assert not_separable_reason(trainer) is None
    assert calls == {"one_pass": trainer.args.steps_per_generation, "logprobs_backward": 0}
    assert_same_step(fused, ref, rtol=1e-5)


@pytest.mark.parametrize("name", list(TWO_PASSES))
def test_non_separable_options_recompute_and_match_trl(name, tmp_path, monkeypatch):
    case = TWO_PASSES[name]
    ref, fused, calls, trainer = _run_pair(case, tmp_path, monkeypatch)
    assert not_separable_reason(trainer) is not None
    assert calls == {"one_pass": 0, "logprobs_backward": trainer.args.steps_per_generation}
    assert_same_step(fused, ref, rtol=1e-5)


def test_cases_exercise_clipping_and_the_entropy_bonus(tmp_path):
    """The off-policy cases really clip (the ratio matters) and the entropy bonus changes the gradient."""
    case = ONE_PASS["dapo-offpolicy-beta"]
    ref = run_step(build_trainer(GRPOTrainer, case, tmp_path), case)
    assert 0 < ref.metrics["clip_ratio/region_mean"][0] and ref.metrics["kl"][0] > 0
    plain = Case(config=dict(loss_type="bnpo", beta=0.1), off_policy_noise=OFF)
    with_bonus = ONE_PASS["entropy_bonus-offpolicy-beta"]
    a = run_step(build_trainer(GRPOTrainer, plain, tmp_path), plain)
    b = run_step(build_trainer(GRPOTrainer, with_bonus, tmp_path), with_bonus)
    assert max_grad_relerr(a, b) > 1e-3


# Under TRL's default bf16=True (accelerate autocasts the model's forward, on CPU too) the one pass and the
# recompute compute the head from the same bf16 operands in fp32 and round the head's gradients once to bf16 at
# the autocast cast: the two can differ by at most one bf16 rounding (2^-8 relative) of those gradients, carried
# linearly into the body's gradients (observed: bit-identical, the upstream factor being 1).
BF16_TWIN_TOL = 2**-8


def test_bf16_one_pass_matches_the_recompute(tmp_path, monkeypatch):
    case = Case(config=dict(bf16=True, beta=0.1, loss_type="dapo", entropy_coef=0.05), off_policy_noise=OFF)
    if DEVICE != "cpu":
        pytest.skip("counts the CPU backend's calls")
    calls, dtypes = count_backend_calls(monkeypatch)
    one_pass = run_step(build_trainer(FusedGRPOTrainer, case, tmp_path), case)
    assert calls == {"one_pass": 1, "logprobs_backward": 0}
    assert dtypes == {torch.bfloat16}  # the head really ran under autocast
    monkeypatch.setattr("hf_fused.trainers.grpo.trl_token_loss_hint", lambda trainer, inputs: None)
    recompute = run_step(build_trainer(FusedGRPOTrainer, case, tmp_path), case)
    assert calls == {"one_pass": 1, "logprobs_backward": 1}
    assert_same_step(one_pass, recompute, rtol=BF16_TWIN_TOL, loss_atol=1e-6)


E2E = Case(
    config=dict(max_steps=3, num_iterations=2, gradient_accumulation_steps=2, per_device_train_batch_size=4,
                beta=0.1, loss_type="dapo", entropy_coef=0.01, learning_rate=3e-3),
    scripted=False,
)


def _train(cls, tmp_path):
    return train_and_log(cls, E2E, tmp_path)


def test_train_end_to_end_in_one_pass_matches_trl(tmp_path, monkeypatch):
    """``trainer.train()``: three optimizer steps with real generation, 2 iterations per batch (off-policy on the
    second), 2 accumulation steps, KL and entropy bonus; every policy micro-batch in one pass, and the same logged
    losses/metrics and parameter updates as GRPOTrainer."""
    if DEVICE != "cpu":
        pytest.skip("counts the CPU backend's calls")
    ref_logs, ref_updates = _train(GRPOTrainer, tmp_path)
    calls, _ = count_backend_calls(monkeypatch)
    logs, updates = _train(FusedGRPOTrainer, tmp_path)
    assert calls == {"one_pass": 3 * 2, "logprobs_backward": 0}  # steps × accumulation micro-batches
    assert len(logs) == len(ref_logs) == E2E.config["max_steps"] + 1
    for got, want in zip(logs, ref_logs):
        assert set(got) == set(want)
        for key in want:
            assert math.isclose(got[key], want[key], rel_tol=1e-4, abs_tol=1e-6), (key, got[key], want[key])
    # Adam's update lr·m/(√v+ε) is ill-conditioned where a gradient is ~ε: compare each tensor's update as a whole
    # (the bound of test_grpo_parity's end-to-end test).
    for n, want in ref_updates.items():
        assert (updates[n] - want).norm() <= 1e-3 * want.norm() or want.abs().max() == updates[n].abs().max() == 0, n
