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

import pytest
import torch

from grpo_harness import (  # noqa: E402
    DEVICE,
    Case,
    VocabRows,
    assert_same_step,
    build_trainer,
    copy_weights,
    count_backend_calls,
    dense_trainer_class,
    run_step,
    train_and_log,
)
from grpo_harness import count_heads as _count_heads  # noqa: E402
from models import WORD_VOCAB as VOCAB_SIZE  # noqa: E402
from models import make_word_model as make_model  # noqa: E402
from references import dense_logps  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from hf_fused.trainers.grpo import FusedGRPOTrainer  # noqa: E402

OFF = 0.3  # std of the noise that moves old log-probs off-policy
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
IS = dict(sampling_logps=True, vllm_is=True)

CASES = {
    # every loss type, off-policy so the ratio is not 1
    **{f"{lt}-offpolicy": Case(config=dict(loss_type=lt), off_policy_noise=OFF)
       for lt in ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]},
    # on-policy: the policy log-probs get a gradient hint (one pass on the head), see test_grad_hint_*
    **{f"{lt}-onpolicy": Case(config=dict(loss_type=lt))
       for lt in ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]},
    "sapo-onpolicy-temps": Case(config=dict(loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0)),
    "dapo-onpolicy-grad_accum": Case(config=dict(loss_type="dapo", gradient_accumulation_steps=2,
                                                 per_device_train_batch_size=4, steps_per_generation=2)),
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
                                          vllm_importance_sampling_clip_max=1.2), **IS),
    "is-token_mask": Case(config=dict(vllm_importance_sampling_mode="token_mask",
                                      vllm_importance_sampling_clip_max=1.3, vllm_importance_sampling_clip_min=0.7),
                          **IS),
    "is-sequence_truncate": Case(config=dict(vllm_importance_sampling_mode="sequence_truncate",
                                             vllm_importance_sampling_clip_max=1.5), **IS),
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
    "moe-aux_loss": Case(config=dict(beta=0.1), arch="qwen3moe", off_policy_noise=OFF),
    "cast_lm_head_to_fp32": Case(config=dict(cast_lm_head_to_fp32=True), off_policy_noise=OFF),
    # PEFT: the reference is the base model (adapter disabled)
    "peft-lora": Case(config=dict(beta=0.1), peft=LORA, off_policy_noise=OFF),
    "peft-lora-is-sequence": Case(config=dict(beta=0.1, loss_type="grpo", importance_sampling_level="sequence",
                                              vllm_importance_sampling_mode="sequence_truncate"),
                                  peft=LORA, off_policy_noise=OFF, **IS),
    # PEFT modules_to_save=["lm_head"]: a trainable copy of the head (TRL supports this one)
    "peft-modules_to_save-lm_head": Case(config=dict(beta=0.1), off_policy_noise=OFF,
                                         peft=dict(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                   modules_to_save=["lm_head"], init_lora_weights=False)),
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
    assert_same_step(a, b, rtol=0.0, atol=0.0, loss_atol=0.0)


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


def _step_counting_backend_calls(case, tmp_path, monkeypatch):
    """One ``run_step`` of FusedGRPOTrainer, counting the torch backend's one-pass forwards that compute
    gradients and its recompute backwards."""
    if DEVICE != "cpu":
        pytest.skip("counts the CPU backend's calls")
    calls, _ = count_backend_calls(monkeypatch)
    trainer = build_trainer(FusedGRPOTrainer, case, tmp_path)
    run_step(trainer, case)
    return calls, trainer


@pytest.mark.parametrize("name", ["grpo-onpolicy-qwen3", "dapo-onpolicy", "cispo-onpolicy", "sapo-onpolicy",
                                  "luspo-onpolicy", "dapo-onpolicy-grad_accum"])
def test_grad_hint_gives_the_head_gradients_in_the_forward(name, tmp_path, monkeypatch):
    """On-policy without KL/entropy terms: every policy forward takes the hinted one pass and no backward
    recomputes (a wrong hint would warn, which the test configuration turns into an error)."""
    calls, trainer = _step_counting_backend_calls(CASES[name], tmp_path, monkeypatch)
    assert calls == {"one_pass": trainer.args.steps_per_generation, "logprobs_backward": 0}


# Off-policy, KL, entropy-bonus and IS-corrected losses take the one pass through a TokenLossHint instead
# (tests/test_grpo_one_pass.py); these options are not token-separable.
@pytest.mark.parametrize("name", ["vespo-onpolicy", "entropy_bonus-top_entropy-grpo", "opsm-sampling",
                                  "grpo-sequence"])
def test_no_grad_hint_where_the_loss_gradient_is_not_known_before_the_forward(name, tmp_path, monkeypatch):
    calls, trainer = _step_counting_backend_calls(CASES[name], tmp_path, monkeypatch)
    assert calls == {"one_pass": 0, "logprobs_backward": trainer.args.steps_per_generation}


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
    ref, _ = dense_logps(ref_model.double().cpu(), ids, am, k, 0.8)
    torch.testing.assert_close(step.inputs["ref_per_token_logps"].double(), ref, rtol=1e-5, atol=1e-5)


# --- LoRA on lm_head: TRL refuses it; hf_fused trains it. Reference: float64 dense logits. -----------------------

LORA_HEAD = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False)


def test_trl_refuses_lora_on_lm_head(tmp_path):
    with pytest.raises(ValueError, match="lm_head"):
        build_trainer(GRPOTrainer, Case(peft=LORA_HEAD), tmp_path)


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_lora_on_lm_head_matches_dense_float64(beta, tmp_path):
    case = Case(config=dict(beta=beta, temperature=0.9, entropy_coef=0.02), peft=LORA_HEAD, off_policy_noise=OFF)
    fused = build_trainer(FusedGRPOTrainer, case, tmp_path)
    case64 = Case(**{**case.__dict__, "dtype": torch.float64})
    oracle = build_trainer(dense_trainer_class(FusedGRPOTrainer), case64, tmp_path)
    copy_weights(fused.model, oracle.model)
    head_lora = [n for n, _ in fused.model.named_parameters() if "lm_head.lora_" in n]
    assert len(head_lora) == 2
    got, want = run_step(fused, case), run_step(oracle, case64)
    assert_same_step(got, want, rtol=1e-5, atol=1e-7)
    for n in head_lora:
        assert got.grads[n].abs().max() > 0
    # the adapter is really in the head: switching it off changes the log-probs the trainer computes
    device = next(fused.model.parameters()).device
    ids = torch.cat([got.inputs["prompt_ids"], got.inputs["completion_ids"]], 1).to(device)
    am = torch.cat([got.inputs["prompt_mask"], got.inputs["completion_mask"]], 1).to(device)
    k = got.inputs["completion_ids"].size(1)
    with torch.no_grad():
        on, _, _ = fused._get_per_token_logps_and_entropies(fused.model, ids, am, k)
        with fused.model.disable_adapter():
            off, _, _ = fused._get_per_token_logps_and_entropies(fused.model, ids, am, k)
        lm_head = fused.model.get_output_embeddings()
        with _only_head_off(lm_head):
            body_only, _, _ = fused._get_per_token_logps_and_entropies(fused.model, ids, am, k)
    assert (on - off).abs().max() > 1e-3
    assert (on - body_only).abs().max() > 1e-3


class _only_head_off:
    """Disable the LoRA adapter of one layer only (to show the lm_head adapter itself changes the log-probs)."""

    def __init__(self, layer):
        self.layer = layer

    def __enter__(self):
        self.layer.enable_adapters(False)

    def __exit__(self, *exc):
        self.layer.enable_adapters(True)


def test_lora_on_lm_head_prewrapped_peft_model_with_ref_adapter(tmp_path):
    """A PeftModel passed in (adapter on lm_head) with beta > 0: TRL copies the adapter as "ref" and switches to
    it for the reference log-probs; hf_fused must follow the active adapter of the head."""
    from peft import LoraConfig, get_peft_model

    case = Case(config=dict(beta=0.1), off_policy_noise=OFF)
    lora = LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **LORA_HEAD)
    torch.manual_seed(3)
    fused = build_trainer(FusedGRPOTrainer, case, tmp_path, model=get_peft_model(make_model(), lora))
    assert "ref" in fused.model.peft_config
    torch.manual_seed(3)
    oracle = build_trainer(dense_trainer_class(FusedGRPOTrainer), Case(**{**case.__dict__, "dtype": torch.float64}),
                           tmp_path, model=get_peft_model(make_model(dtype=torch.float64), lora))
    copy_weights(fused.model, oracle.model)
    with torch.no_grad():  # move the trained adapter away from the "ref" copy so the KL is not zero
        for n, p in fused.model.named_parameters():
            if ".default." in n:
                p.mul_(1.5)
    copy_weights(fused.model, oracle.model)
    got, want = run_step(fused, case), run_step(oracle, case)
    assert got.metrics["kl"][0] > 1e-3
    assert_same_step(got, want, rtol=1e-5, atol=1e-7)


def test_lora_on_lm_head_from_model_path(tmp_path):
    make_model().save_pretrained(tmp_path / "m")
    from peft import LoraConfig

    from grpo_harness import PROMPTS, grpo_config as make_config, length_reward
    from models import make_tokenizer
    from datasets import Dataset

    trainer = FusedGRPOTrainer(
        str(tmp_path / "m"), length_reward, make_config(tmp_path),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=make_tokenizer(),
        peft_config=LoraConfig(task_type="CAUSAL_LM", **LORA_HEAD),
    )
    assert any("lm_head.lora_A" in n and p.requires_grad for n, p in trainer.model.named_parameters())


def test_lora_on_lm_head_trains_end_to_end(tmp_path):
    case = Case(config=dict(max_steps=2, beta=0.1), peft=LORA_HEAD, scripted=False)
    trainer = build_trainer(FusedGRPOTrainer, case, tmp_path)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lm_head.lora_" in n}
    trainer.train()
    for n, p in trainer.model.named_parameters():
        if n in before:
            assert not torch.equal(p, before[n]), n


# --- end to end: trainer.train() with both classes, real generation ----------------------------------------------

E2E = Case(
    config=dict(max_steps=3, num_iterations=2, gradient_accumulation_steps=2, per_device_train_batch_size=4,
                beta=0.1, loss_type="dapo", entropy_coef=0.01, top_entropy_quantile=0.8, learning_rate=3e-3),
    scripted=False,
)


def _train(cls, tmp_path):
    return train_and_log(cls, E2E, tmp_path)


def test_train_end_to_end_matches_trl(tmp_path):
    """Three optimizer steps (real generation, 2 iterations per batch, 2 accumulation steps, KL, entropy bonus and
    mask): the same logged losses and metrics at every step, and the same parameter updates."""
    ref_logs, ref_updates = _train(GRPOTrainer, tmp_path)
    logs, updates = _train(FusedGRPOTrainer, tmp_path)
    assert len(logs) == len(ref_logs) == E2E.config["max_steps"] + 1  # + the final train summary
    for got, want in zip(logs, ref_logs):
        assert set(got) == set(want)
        for key in want:
            assert math.isclose(got[key], want[key], rel_tol=1e-4, abs_tol=1e-6), (key, got[key], want[key])
    assert all(entry["loss"] != 0.0 for entry in ref_logs[:-1])
    # Adam's update lr·m/(√v+ε) is ill-conditioned for elements whose gradient is ~ε (a 1e-12 difference in a
    # 1e-9 gradient moves them by ~lr/10), so compare each tensor's update as a whole.
    for n, want in ref_updates.items():
        if want.abs().max() == 0:
            assert updates[n].abs().max() == 0, n
            continue
        assert (updates[n] - want).norm() <= 1e-3 * want.norm(), (n, ((updates[n] - want).norm() / want.norm()).item())


# --- memory: no vocabulary-sized activation beyond one tile --------------------------------------------------------

def _largest_vocab_activation(trainer, case):
    """Largest number of rows of any freshly computed tensor whose last dimension is the vocabulary, during a full
    generation-batch step (old/reference log-probs, loss, backward)."""
    with VocabRows(VOCAB_SIZE) as rec:
        step = run_step(trainer, case)
    return rec.max_rows, step


def test_no_vocab_sized_activation_during_training_step(tmp_path):
    case = Case(config=dict(beta=0.1, num_iterations=2, per_device_train_batch_size=16, max_completion_length=10))
    hidden, tile_rows = 32, 4
    # hf_fused's reference backend holds 3 fp32 [rows, V] buffers per tile: a budget for 4 rows
    fused = build_trainer(FusedGRPOTrainer, case, tmp_path,
                          fused_options=dict(tile_budget_bytes=3 * 4 * VOCAB_SIZE * tile_rows))
    rows, step = _largest_vocab_activation(fused, case)
    scored = int(step.inputs["completion_mask"].sum())
    assert scored > hidden + 8  # the check below would catch a [scored, V] tensor
    assert rows <= max(tile_rows, hidden + 8), rows
    # control: TRL's own CPU head scores every position in one [N, V] block, and the check sees it
    trl_rows, _ = _largest_vocab_activation(build_trainer(GRPOTrainer, case, tmp_path), case)
    assert trl_rows >= scored


def test_evaluate_matches_trl(tmp_path):
    """``evaluate()`` goes through ``prediction_step`` → ``compute_loss`` in eval mode (no accumulation scaling)."""
    from datasets import Dataset

    from grpo_harness import PROMPTS

    case = Case(config=dict(beta=0.1, per_device_eval_batch_size=8, entropy_coef=0.01))
    results = []
    for cls in (GRPOTrainer, FusedGRPOTrainer):
        trainer = build_trainer(cls, case, tmp_path)
        metrics = trainer.evaluate(eval_dataset=Dataset.from_dict({"prompt": PROMPTS[:4]}))
        results.append({k: v for k, v in metrics.items() if "time" not in k and "per_second" not in k})
    want, got = results
    assert set(got) == set(want) and "eval_loss" in want and "eval_kl" in want
    for key in want:
        assert math.isclose(got[key], want[key], rel_tol=1e-5, abs_tol=2e-6), (key, got[key], want[key])


# --- the same integration: apply_fused_loss + GRPOTrainer ≡ FusedGRPOTrainer ≡ TRL -------------------------------

INTEGRATION_CASES = [*(f"{lt}-offpolicy" for lt in ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo",
                                                     "vespo"]),
                     "grpo-sequence", "beta-biascorr", "temperature", "entropy_bonus", "top_entropy", "moe-aux_loss",
                     "cast_lm_head_to_fp32", "peft-lora", "peft-modules_to_save-lm_head", "is-token_mask"]


def _patched_grpo_trainer(case, tmp_path, patch="before"):
    """``trl.GRPOTrainer`` on a model passed through ``apply_fused_loss`` before (or after) the trainer is built."""
    from hf_fused import apply_fused_loss

    model = make_model(case.arch, dtype=case.dtype, tie=case.tie)
    if patch == "before":
        apply_fused_loss(model)
    trainer = build_trainer(GRPOTrainer, case, tmp_path, model=model)
    if patch == "after":
        apply_fused_loss(trainer.model)
        if trainer.ref_model is not None:
            apply_fused_loss(trainer.ref_model)
    return trainer


@pytest.mark.parametrize("patch", ["before", "after"])
@pytest.mark.parametrize("name", INTEGRATION_CASES)
def test_apply_fused_loss_with_grpo_trainer_matches_trl(name, patch, tmp_path, monkeypatch):
    case = CASES[name]
    if patch == "after" and name not in ("grpo-offpolicy", "beta-biascorr", "peft-lora", "temperature"):
        pytest.skip("patched-after covered on a subset (same code path once built)")
    ref = run_step(build_trainer(GRPOTrainer, case, tmp_path), case)
    trainer = _patched_grpo_trainer(case, tmp_path, patch)
    counts = _count_heads(monkeypatch)
    got = run_step(trainer, case)
    assert_same_step(got, ref, rtol=1e-5)
    assert counts["hf_fused"] > 0 and counts["trl"] == 0, counts
    if trainer.ref_model is not None:
        assert hf_fused_is_fused(trainer.ref_model)


def hf_fused_is_fused(model):
    from hf_fused import is_fused

    return is_fused(model)


@pytest.mark.parametrize("name", ["grpo-offpolicy", "beta-biascorr", "peft-lora", "dapo-onpolicy", "entropy_bonus"])
def test_fused_grpo_trainer_is_apply_fused_loss_plus_grpo_trainer(name, tmp_path):
    """Bit for bit: FusedGRPOTrainer adds nothing to the objective (on-policy, its grad_hint one pass gives the
    same gradients up to fp32 summation order)."""
    case = CASES[name]
    fused = run_step(build_trainer(FusedGRPOTrainer, case, tmp_path), case)
    patched = run_step(_patched_grpo_trainer(case, tmp_path), case)
    exact = name != "dapo-onpolicy"
    assert_same_step(fused, patched, rtol=0.0 if exact else 1e-6, atol=0.0 if exact else 1e-9,
                     loss_atol=0.0 if exact else 1e-7)


SYNC = Case(
    config=dict(max_steps=3, beta=0.1, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5,
                per_device_train_batch_size=4, learning_rate=3e-3),
    scripted=False,
)


def test_sync_ref_model_matches_trl(tmp_path):
    """sync_ref_model: TRL mixes the policy into the (hf_fused-patched) reference after every step; the KL logged
    at steps 2 and 3 depends on it."""
    runs = []
    for build in (lambda: build_trainer(GRPOTrainer, SYNC, tmp_path),
                  lambda: build_trainer(FusedGRPOTrainer, SYNC, tmp_path),
                  lambda: _patched_grpo_trainer(SYNC, tmp_path)):
        trainer = build()
        trainer.train()
        runs.append([{k: v for k, v in e.items() if "time" not in k and "per_second" not in k}
                     for e in trainer.state.log_history])
    want = runs[0]
    assert want[1]["kl"] > 0
    for logs in runs[1:]:
        assert len(logs) == len(want)
        for got_entry, want_entry in zip(logs, want):
            assert set(got_entry) == set(want_entry)
            for key in want_entry:
                assert math.isclose(got_entry[key], want_entry[key], rel_tol=1e-5, abs_tol=2e-6), key


@pytest.mark.parametrize("patch", ["fused_trainer", "after"])
def test_reference_model_wrapped_by_accelerate_bf16(patch, tmp_path):
    """bf16=True (autocast on CPU): accelerate wraps the reference model's forward. FusedGRPOTrainer builds (it
    used to blame the TRL version) and apply_fused_loss after the trainer finds TRL's head under the wrapper."""
    case = Case(config=dict(beta=0.1, bf16=True), off_policy_noise=OFF)
    trainer = (build_trainer(FusedGRPOTrainer, case, tmp_path) if patch == "fused_trainer"
               else _patched_grpo_trainer(case, tmp_path, patch="after"))
    assert hf_fused_is_fused(trainer.ref_model)
    ref = run_step(build_trainer(GRPOTrainer, case, tmp_path), case)
    got = run_step(trainer, case)
    # bf16: TRL's CPU head rounds each logit tile to bf16 (relative 2^-8) before its fp32 statistics, hf_fused
    # computes fp32 logits from the same bf16 operands; log-prob differences of ~|z|·2^-8 for |z| ≲ 4 move the KL,
    # ratios and loss by a few 1e-2 relative. The check is that both are the same objective, not rounding-equal.
    for key in ("kl", "entropy"):
        assert math.isclose(got.metrics[key][0], ref.metrics[key][0], rel_tol=5e-2, abs_tol=1e-3), key


# ------------------------------------------------------------------------------------------------------------
# TRL's default precision: GRPOConfig leaves bf16 unset, which TRL turns into True (autocast, on CPU too).


@pytest.mark.parametrize("loss_type,beta", [("dapo", 0.0), ("grpo", 0.04)])
def test_trl_default_config_bf16_no_further_from_fp32_than_trl(loss_type, beta, tmp_path):
    """``FusedGRPOTrainer`` and ``GRPOTrainer`` with TRL's default ``bf16``: every parameter gradient of one
    generation batch (one vector, a stable statistic) is as close to the fp32 ``GRPOTrainer``'s as TRL's own bf16
    run is (within 1.25×, the bound the ops meet under autocast). Both round the body to bf16 alike; TRL's CPU head
    also rounds its logits to bf16, hf_fused's keeps them fp32."""
    fp32 = Case(config=dict(loss_type=loss_type, beta=beta, bf16=False), off_policy_noise=OFF)
    default = Case(config=dict(loss_type=loss_type, beta=beta, bf16=None), off_policy_noise=OFF)
    ref = run_step(build_trainer(GRPOTrainer, fp32, tmp_path / "fp32"), fp32)
    trl_trainer = build_trainer(GRPOTrainer, default, tmp_path / "trl")
    fused_trainer = build_trainer(FusedGRPOTrainer, default, tmp_path / "fused")
    assert trl_trainer.args.bf16 and fused_trainer.args.bf16  # TRL's default really is bf16
    trl, got = run_step(trl_trainer, default), run_step(fused_trainer, default)

    def vector(step):
        return torch.cat([step.grads[n].double().flatten() for n in sorted(step.grads)])

    want = vector(ref)
    e = float((vector(trl) - want).norm() / want.norm())
    f = float((vector(got) - want).norm() / want.norm())
    assert e > 0, "bf16 changed nothing: autocast was not on"
    print(f"bf16 gradient error: hf_fused {f:.3g}, TRL {e:.3g}")
    assert f <= 1.25 * e, f"hf_fused bf16 gradient error {f:.3g} vs TRL's bf16 {e:.3g}"


@pytest.mark.parametrize("name", ["grpo-offpolicy", "beta-biascorr"])
def test_apply_fused_loss_with_trls_gmpo_trainer_matches_trl(name, tmp_path, monkeypatch):
    """TRL's experimental ``GMPOTrainer`` (a ``GRPOTrainer`` whose ``_compute_loss`` takes the geometric mean of the
    clipped token ratios per sequence: not token-separable, so no hint) on a patched model: its log-probs through
    TRL's fused head are hf_fused's, with the stock trainer's loss, gradients and metrics."""
    from hf_fused import apply_fused_loss

    gmpo = pytest.importorskip("trl.experimental.gmpo")
    case = CASES[name]
    ref = run_step(build_trainer(gmpo.GMPOTrainer, case, tmp_path), case)
    model = make_model(case.arch, dtype=case.dtype, tie=case.tie)
    apply_fused_loss(model)
    trainer = build_trainer(gmpo.GMPOTrainer, case, tmp_path, model=model)
    counts = _count_heads(monkeypatch)
    got = run_step(trainer, case)
    assert_same_step(got, ref, rtol=1e-5)
    assert counts["hf_fused"] > 0 and counts["trl"] == 0, counts
    assert {"clip_ratio/region_mean", "entropy"} <= ref.metrics.keys()
