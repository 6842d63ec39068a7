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


@pytest.mark.parametrize("name", ["orpo", "cpo"])
def test_trls_experimental_logit_trainers_run_the_original_forward_and_say_so(name, tmp_path):
    """TRL's experimental ``ORPOTrainer`` and ``CPOTrainer`` compute their losses from the model's full logits
    (``concatenated_forward``), which hf_fused does not serve: on a patched model a step is the unpatched model's
    (the original forward runs), and one warning names the trainer's call."""
    module = pytest.importorskip(f"trl.experimental.{name}")
    from datasets import Dataset

    from models import WORDS, make_tokenizer, make_word_model

    trainer_class, config_class = (getattr(module, f"{name.upper()}{kind}") for kind in ("Trainer", "Config"))
    sentence = lambda i, n: " ".join(WORDS[(7 * i + 3 * k) % len(WORDS)] for k in range(n))  # noqa: E731
    data = Dataset.from_dict({"prompt": [sentence(i, 3) for i in range(4)],
                              "chosen": [" " + sentence(50 + i, 2 + i % 3) for i in range(4)],
                              "rejected": [" " + sentence(90 + i, 1 + i % 4) for i in range(4)]})

    def step(patch):
        model = make_word_model("llama")
        if patch:
            apply_fused_loss(model)
        args = config_class(output_dir=str(tmp_path / name), per_device_train_batch_size=4, report_to=[],
                            use_cpu=True, max_length=32)
        trainer = trainer_class(model=model, args=args, train_dataset=data, processing_class=make_tokenizer())
        batch = next(iter(trainer.get_train_dataloader()))
        model.train()
        caught = _bypass_warnings(lambda: trainer.compute_loss(model, batch).backward())
        return caught, model.lm_head.weight.grad

    stock_warnings, stock_grad = step(False)
    (warning,), grad = step(True)
    assert not stock_warnings
    assert f"trl.experimental.{name}.{name}_trainer.{name.upper()}Trainer.concatenated_forward" in str(warning.message)
    torch.testing.assert_close(grad, stock_grad, rtol=0, atol=0)  # the very same computation
