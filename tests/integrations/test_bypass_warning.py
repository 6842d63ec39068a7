"""The warning a patched model gives when it is called without labels in training (its original forward builds the
full logits) names the code that called it so: ``Trainer.compute_loss`` with its two reasons (label smoothing,
``compute_loss_func``), TRL's GKD trainer (a distillation loss on the logits), any other caller; and it points at
that caller's line."""

from __future__ import annotations

import os
import types
import warnings

import pytest
import torch
from transformers import Trainer

from hf_fused import apply_fused_loss
from hf_fused.model import FusedLossBypassedWarning
from models import TRAIN, make_batch, make_model, trainer_args

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def _bypass_warnings(call) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [w for w in caught if issubclass(w.category, FusedLossBypassedWarning)]


def _inputs():
    input_ids, attention_mask, labels = make_batch()
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def test_trainer_with_label_smoothing_is_named_with_its_reasons(tmp_path):
    model = apply_fused_loss(make_model("llama")).train()
    trainer = Trainer(model=model, args=trainer_args(tmp_path, label_smoothing_factor=0.1), train_dataset=TRAIN)
    (warning,) = _bypass_warnings(lambda: trainer.compute_loss(model, _inputs()))
    message = str(warning.message)
    assert "transformers.trainer.Trainer.compute_loss" in message
    assert "label_smoothing_factor > 0 or compute_loss_func" in message


def test_a_distillation_loss_is_named_and_label_smoothing_is_not():
    """TRL's GKD trainer calls the student without labels to compute its generalized JSD from the logits."""
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    student = apply_fused_loss(make_model("llama")).train()
    teacher = make_model("llama", seed=1)
    trainer = types.SimpleNamespace(teacher_model=teacher, beta=0.5,
                                    generalized_jsd_loss=gkd.GKDTrainer.generalized_jsd_loss)
    (warning,) = _bypass_warnings(lambda: gkd.GKDTrainer.compute_loss(trainer, student, _inputs()))
    message = str(warning.message)
    assert "trl.experimental.gkd.gkd_trainer.GKDTrainer.compute_loss" in message
    assert "distillation" in message and "label_smoothing" not in message
    assert warning.filename == gkd.__file__  # the warning points at GKD's call, not at torch's module machinery


def test_any_other_caller_is_named_at_its_line():
    model = apply_fused_loss(make_model("llama")).train()

    def my_logits_loss(model):
        return model(input_ids=make_batch()[0]).logits.logsumexp(-1).mean()

    (warning,) = _bypass_warnings(lambda: my_logits_loss(model))
    message = str(warning.message)
    assert "test_bypass_warning.test_any_other_caller_is_named_at_its_line.<locals>.my_logits_loss" in message
    assert "label_smoothing" not in message
    assert warning.filename == __file__


def test_said_once_per_model_and_never_without_gradients():
    model = apply_fused_loss(make_model("llama")).train()
    ids = make_batch()[0]
    with torch.no_grad():
        assert not _bypass_warnings(lambda: model(input_ids=ids))
    assert len(_bypass_warnings(lambda: [model(input_ids=ids) for _ in range(3)])) == 1

