"""A deleted model is garbage-collected once hf_fused and its integrations are installed: patched by
``apply_fused_loss`` and trained, given TRL's own fused head (``add_fused_lm_head``) while hf_fused's wrapper of it is
installed, and trained inside a TRL trainer (patched, and not). Each check is ``weakref.ref(model)() is None`` after
``del`` and ``gc.collect()``, from a frame that stays alive meanwhile (the test function), as a training script's
loop over models would be.

The cause these pin down: hf_fused's wrapper of ``add_fused_lm_head`` looked for the trainer being built by reading
``f_locals`` of every frame up the stack; on Python < 3.13 that stores a snapshot of a running frame's locals on the
frame, so a caller that deleted its model kept it alive through the snapshot (weights and gradients: 6.4 GiB of a
Qwen3-1.7B run on the GPU) until the frame returned.
"""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch

import hf_fused
from models import WORDS, make_batch, make_model, make_tokenizer, make_word_model

trl_utils = pytest.importorskip("trl.trainer.utils")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def _collected(ref: weakref.ref) -> bool:
    gc.collect()
    return ref() is None


def _train_step(model, **kwargs):
    input_ids, attention_mask, labels = make_batch()
    model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs).loss.backward()


def test_patched_model_is_collected():
    model = hf_fused.apply_fused_loss(make_model("llama"))
    _train_step(model)
    ref = weakref.ref(model)
    del model
    assert _collected(ref)


def test_trl_headed_model_is_collected_with_hf_fused_hooks_installed():
    hf_fused.apply_fused_loss(make_model("llama"))  # installs the wrapper of TRL's add_fused_lm_head
    assert getattr(trl_utils.add_fused_lm_head, "__hf_fused__", False)
    model = make_model("llama")
    trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy"))  # an unpatched model: TRL's own head
    _train_step(model, fused_lm_head=True)
    ref = weakref.ref(model)
    del model
    assert _collected(ref)


def test_patched_model_with_a_trl_head_recorded_is_collected():
    model = hf_fused.apply_fused_loss(make_model("llama"))
    trl_utils.add_fused_lm_head(model, outputs=("log_probs",))  # recorded on the model; hf_fused answers
    _train_step(model, fused_lm_head=True)
    ref = weakref.ref(model)
    del model
    assert _collected(ref)


@pytest.mark.parametrize("patch", [True, False], ids=["patched", "unpatched"])
def test_model_is_collected_after_a_trl_trainer_trained_it(tmp_path, patch):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    hf_fused.apply_fused_loss(make_model("llama"))  # the integrations are installed in both cases
    model, ref_model = make_word_model(), make_word_model(seed=1)
    if patch:
        hf_fused.apply_fused_loss(model)
    pairs = Dataset.from_dict({
        "prompt": [" ".join(WORDS[i:i + 2]) for i in range(4)],
        "chosen": [" " + WORDS[i + 3] for i in range(4)],
        "rejected": [" " + WORDS[i + 5] for i in range(4)],
    })
    args = DPOConfig(output_dir=str(tmp_path), bf16=False, max_steps=1, per_device_train_batch_size=4, report_to=[],
                     use_cpu=True, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, optim="sgd")
    trainer = DPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=pairs,
                         processing_class=make_tokenizer())
    assert hf_fused.is_fused(trainer.ref_model) == patch  # the reference model is patched with its policy
    trainer.train()
    refs = [weakref.ref(model), weakref.ref(ref_model)]
    del model, ref_model, trainer
    assert all(_collected(ref) for ref in refs)
