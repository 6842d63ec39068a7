"""TRL's experimental ``OnlineDPOTrainer`` on a patched model: the completions' log-probs (policy and reference) from
hidden states (:mod:`hf_fused.integrations.trl.online_dpo`), against the stock trainer on the unpatched model.

Both generate their completion pairs with the model's own ``generate`` (the original forward, the same sampling from
the same seed), score them with the same reward function, and train 2 optimizer steps of SGD through
``trainer.train()``; compared in fp32: the loss, every gradient and every logged metric to 1e-5 (the log-probs feed
the DPO loss, the rewards and the KL metrics), and the calls counted (hf_fused's log-probs on every ``_forward`` of
the patched run).
"""

from __future__ import annotations

import math
import os
import warnings

import pytest

import hf_fused
from hf_fused.model import FusedLossBypassedWarning
from models import GradRecorder, assert_same_gradients, is_timing_metric, make_tokenizer, make_word_model
from models import count_calls, preference_dataset
from references import logp_difference_tol

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
online_dpo = pytest.importorskip("trl.experimental.online_dpo")

RTOL = 1e-5


def length_reward(completions, **kwargs):
    """Deterministic, with spread within each pair (so the chosen/rejected split varies)."""
    return [float(len(c) % 7) + 0.1 * len(c) for c in completions]


def _lora():
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                      target_modules=["q_proj", "v_proj", "lm_head"])


def _logp_differences(beta: float) -> dict:
    """OnlineDPO's metrics that are differences of summed log-probabilities (policy − reference), with their factor:
    ``objective/kl`` itself, and β times it in the rewards (references.LOGP_DIFFERENCES says why these are held to
    the log-probabilities' precision, not their own)."""
    return {"objective/kl": 1.0, **{key: beta for key in ("objective/non_score_reward", "objective/rlhf_reward",
                                                          "rewards/chosen", "rewards/rejected", "rewards/margins")}}


def _train(tmp_path, name, patch, peft=False, **config):
    model = make_word_model("llama")
    if patch:
        hf_fused.apply_fused_loss(model)
    args = online_dpo.OnlineDPOConfig(
        output_dir=str(tmp_path / name), per_device_train_batch_size=2, max_steps=2, learning_rate=1e-2, optim="sgd",
        report_to=[], use_cpu=True, logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True, max_new_tokens=6,
        max_length=24, **{"bf16": False, **config})
    recorder = GradRecorder()
    trainer = online_dpo.OnlineDPOTrainer(
        model=model, reward_funcs=length_reward, args=args,
        train_dataset=preference_dataset().select_columns(["prompt"]), processing_class=make_tokenizer(),
        callbacks=[recorder], peft_config=_lora() if peft else None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusedLossBypassedWarning)  # a patched run that built the full logits fails
        trainer.train()
    logs = [{k: v for k, v in entry.items() if not is_timing_metric(k)} for entry in trainer.state.log_history]
    return logs, recorder.steps


@pytest.mark.parametrize("name, options", [("sigmoid", {}), ("ipo", {"loss_type": "ipo", "beta": 0.5}),
                                           ("lora-on-lm_head", {"peft": True})])
def test_patched_model_matches_trl(name, options, tmp_path, monkeypatch):
    stock_logs, stock_grads = _train(tmp_path, "stock", False, **options)
    import hf_fused.integrations.trl.online_dpo as module

    counts = count_calls(monkeypatch, module, "fused_completion_logprobs")
    logs, grads = _train(tmp_path, "fused", True, **options)
    assert counts["calls"] == 2 * 2  # each step: the policy and the reference (or the adapter disabled)
    assert len(logs) == len(stock_logs) == 3 and len(grads) == len(stock_grads) == 2
    factors = _logp_differences(options.get("beta", 0.1))
    for got, want in zip(logs, stock_logs):
        assert got.keys() == want.keys(), set(got) ^ set(want)
        for key, value in want.items():
            tol = max(1e-6, logp_difference_tol(key, want, factors=factors))
            assert math.isclose(got[key], value, rel_tol=RTOL, abs_tol=tol), (key, got[key], value)
    assert {"logps/chosen", "objective/kl", "rewards/margins"} <= stock_logs[0].keys()
    assert_same_gradients(grads, stock_grads, RTOL)


def test_bf16_autocast_close_to_trl(tmp_path, monkeypatch):
    """``bf16=True`` (fp32 weights under autocast, what users run): both generate the same completions (the original
    forward), both heads read bf16 operands; TRL's rounds each logit to bf16 before its log-softmax, hf_fused keeps
    the statistics in fp32 (a log-prob moves by up to ~0.04 at this model's logits, the loss and metrics by ~1e-2
    relative: tests/integrations/test_trl_trainers.py's bf16 twins), so the twins agree to 3e-2 relative (the
    log-prob differences to 3e-2 of the log-probs) and the gradients in direction (cosine ≥ 0.999)."""
    import torch
    import torch.nn.functional as F

    stock_logs, stock_grads = _train(tmp_path, "stock", False, bf16=True)
    logs, grads = _train(tmp_path, "fused", True, bf16=True)
    factors = _logp_differences(0.1)
    for got, want in zip(logs, stock_logs):
        for key, value in want.items():
            tol = max(2e-2, 3e3 * logp_difference_tol(key, want, factors=factors))  # RTOL 1e-5 → 3e-2
            assert math.isclose(got[key], value, rel_tol=3e-2, abs_tol=tol), (key, got[key], value)
    for got, want in zip(grads, stock_grads):
        flat_got, flat_want = (torch.cat([g.flatten() for g in step.values()]) for step in (got, want))
        assert F.cosine_similarity(flat_got, flat_want, dim=0) >= 0.999
