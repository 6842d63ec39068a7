"""TRL's experimental ``ORPOTrainer`` and ``CPOTrainer`` on a patched model: ``concatenated_forward`` from hidden states
(:mod:`hf_fused.integrations.trl.concatenated_forward`), against the stock trainer on the unpatched model.

Each case trains both through ``trainer.train()`` (2 optimizer steps, SGD) from the same weights and data and
compares the loss, every gradient and every logged metric (the log-probs, rewards, NLL, log-odds and the logits
means) in fp32 to 1e-5, and counts the calls: hf_fused's head on every step of the patched run and never a full
forward of its model. TRL's default precision (``bf16=True`` under autocast) is compared to the stock run at the
bf16-twin tolerance of tests/integrations/test_trl_trainers.py.
"""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
import torch.nn.functional as F

import hf_fused
from hf_fused.model import FusedLossBypassedWarning
from models import GradRecorder, assert_same_gradients, is_timing_metric, make_tokenizer, make_word_model
from models import count_calls, preference_dataset

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
orpo = pytest.importorskip("trl.experimental.orpo")
cpo = pytest.importorskip("trl.experimental.cpo")

RTOL = 1e-5


DATA = preference_dataset()


def _lora():
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                      target_modules=["q_proj", "v_proj", "lm_head"])


#: name -> (trainer module, config options, model options)
CASES = {
    "orpo": (orpo, {}, {}),
    "orpo-beta": (orpo, {"beta": 0.5}, {}),
    "orpo-tied": (orpo, {}, {"tie": True}),
    "orpo-lora-on-lm_head": (orpo, {}, {"peft": True}),
    "orpo-moe-aux_loss": (orpo, {}, {"arch": "qwen3moe"}),
    "cpo-sigmoid": (cpo, {}, {}),
    "cpo-simpo": (cpo, {"loss_type": "simpo", "cpo_alpha": 0.5}, {}),
    "cpo-ipo-no-nll": (cpo, {"loss_type": "ipo", "cpo_alpha": 0.0}, {}),
    "cpo-hinge": (cpo, {"loss_type": "hinge"}, {}),
}


def _train(tmp_path, name, patch, monkeypatch, trainer_module, config, arch="llama", tie=False, peft=False):
    model = make_word_model(arch, tie=tie)
    if arch == "qwen3moe":
        model.config.output_router_logits = True  # TRL adds the router's load-balancing loss
    if patch:
        hf_fused.apply_fused_loss(model)
    prefix = "ORPO" if trainer_module is orpo else "CPO"
    args = getattr(trainer_module, f"{prefix}Config")(
        output_dir=str(tmp_path / name), per_device_train_batch_size=4, max_steps=2, learning_rate=1e-2, optim="sgd",
        report_to=[], use_cpu=True, logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True, max_length=32,
        **{"bf16": False, **config})
    recorder = GradRecorder()
    trainer = getattr(trainer_module, f"{prefix}Trainer")(
        model=model, args=args, train_dataset=DATA, processing_class=make_tokenizer(), callbacks=[recorder],
        peft_config=_lora() if peft else None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusedLossBypassedWarning)  # a patched run that built the full logits fails
        trainer.train()
    logs = [{k: v for k, v in entry.items() if not is_timing_metric(k)} for entry in trainer.state.log_history]
    return logs, recorder.steps


@pytest.mark.parametrize("name", list(CASES))
def test_patched_model_matches_trl(name, tmp_path, monkeypatch):
    trainer_module, config, model_options = CASES[name]
    stock_logs, stock_grads = _train(tmp_path, "stock", False, monkeypatch, trainer_module, config, **model_options)
    import hf_fused.integrations.trl.concatenated_forward as module

    counts = count_calls(monkeypatch, module, "fused_concatenated_forward")
    logs, grads = _train(tmp_path, "fused", True, monkeypatch, trainer_module, config, **model_options)
    assert counts["calls"] == 2  # one call a step, both hf_fused's
    assert len(logs) == len(stock_logs) == 3 and len(grads) == len(stock_grads) == 2
    for got, want in zip(logs, stock_logs):
        assert got.keys() == want.keys(), set(got) ^ set(want)
        for key, value in want.items():
            assert math.isclose(got[key], value, rel_tol=RTOL, abs_tol=1e-6), (key, got[key], value)
    assert {"logits/chosen", "logps/rejected", "nll_loss"} <= stock_logs[0].keys()
    assert_same_gradients(grads, stock_grads, RTOL)


def test_bf16_autocast_close_to_trl(tmp_path, monkeypatch):
    """``bf16=True`` (fp32 weights under autocast): both heads read bf16 operands; TRL's rounds each logit to bf16
    before its log-softmax, hf_fused keeps the statistics in fp32 (a log-prob moves by up to ~0.04 at this model's
    logits, the loss and metrics by ~1e-2 relative: tests/integrations/test_trl_trainers.py's bf16 twins), so the
    twins agree to 3e-2 relative and the gradients in direction (cosine ≥ 0.999)."""
    stock_logs, stock_grads = _train(tmp_path, "stock", False, monkeypatch, orpo, {"bf16": True})
    logs, grads = _train(tmp_path, "fused", True, monkeypatch, orpo, {"bf16": True})
    for got, want in zip(logs, stock_logs):
        for key, value in want.items():
            assert math.isclose(got[key], value, rel_tol=3e-2, abs_tol=2e-2), (key, got[key], value)
    for got, want in zip(grads, stock_grads):
        flat_got, flat_want = (torch.cat([g.flatten() for g in step.values()]) for step in (got, want))
        assert F.cosine_similarity(flat_got, flat_want, dim=0) >= 0.999


def test_a_subclass_reading_the_logits_keeps_trls_forward_and_says_so(tmp_path, monkeypatch):
    """A subclass with its own ``get_batch_loss_metrics`` may read the logits: TRL's method runs (the same gradients
    as unpatched) and one warning says why."""

    class Mine(orpo.ORPOTrainer):
        def get_batch_loss_metrics(self, model, batch, train_eval="train"):
            return super().get_batch_loss_metrics(model, batch, train_eval)

    def step(patch):
        model = make_word_model("llama")
        if patch:
            hf_fused.apply_fused_loss(model)
        args = orpo.ORPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, report_to=[], use_cpu=True,
                               max_length=32)
        trainer = Mine(model=model, args=args, train_dataset=DATA, processing_class=make_tokenizer())
        batch = next(iter(trainer.get_train_dataloader()))
        model.train()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.compute_loss(model, batch).backward()
        return [w for w in caught if issubclass(w.category, FusedLossBypassedWarning)], model.lm_head.weight.grad

    stock_warnings, stock_grad = step(False)
    (warning,), grad = step(True)
    assert not stock_warnings and "Mine overrides get_batch_loss_metrics" in str(warning.message)
    torch.testing.assert_close(grad, stock_grad, rtol=0, atol=0)  # the very same computation
