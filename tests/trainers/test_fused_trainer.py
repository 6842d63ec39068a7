"""``FusedTrainer`` against ``transformers.Trainer``: same seed, deep-copied model, same data, CPU fp32.

Logged losses and grad norms per step (relative error ≤ 1e-5), final parameters, eval loss. Labels carry
a different number of -100 per example, so with gradient accumulation Trainer's ``num_items_in_batch``
normalization changes the result and a fused path that ignored it would fail.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import Trainer, TrainingArguments

from models import VOCAB, make_model  # noqa: E402
from references import assert_close, rel_err  # noqa: E402

from hf_fused import FusedTrainer, is_fused  # noqa: E402

SEQ = 12


def _dataset(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(3, VOCAB, (SEQ,), generator=g)
        labels = ids.clone()
        prompt = int(torch.randint(1, SEQ - 2, (1,), generator=g))  # 1..9 ignored tokens
        labels[:prompt] = -100
        mask = torch.ones(SEQ, dtype=torch.long)
        if i % 3 == 2:  # some right padding
            ids[-2:], mask[-2:], labels[-2:] = 0, 0, -100
        rows.append(dict(input_ids=ids.tolist(), attention_mask=mask.tolist(), labels=labels.tolist()))
    counts = [sum(x != -100 for x in r["labels"][1:]) for r in rows]
    assert len(set(counts)) > 2, counts
    return Dataset.from_list(rows)


TRAIN, EVAL = _dataset(8, seed=0), _dataset(4, seed=1)


def _args(tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no", seed=0, data_seed=0,
        per_device_train_batch_size=2, per_device_eval_batch_size=2, gradient_accumulation_steps=1,
        max_steps=3, logging_steps=1, learning_rate=5e-3, lr_scheduler_type="constant", warmup_steps=0,
        bf16=False, fp16=False, dataloader_num_workers=0, disable_tqdm=True, eval_strategy="no",
        max_grad_norm=1.0,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def _pair(tmp_path, trainer_kwargs=None, **arg_overrides):
    model = make_model("llama", tie_word_embeddings=False)
    ref_model = copy.deepcopy(model)
    trainer_kwargs = dict(train_dataset=TRAIN, eval_dataset=EVAL, **(trainer_kwargs or {}))
    fused = FusedTrainer(model=model, args=_args(tmp_path / "fused", **arg_overrides), **trainer_kwargs)
    ref = Trainer(model=ref_model, args=_args(tmp_path / "ref", **arg_overrides), **trainer_kwargs)
    assert is_fused(fused.model) and not is_fused(ref.model)
    return fused, ref


def _train_logs(trainer):
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == trainer.args.max_steps
    return logs


def _assert_same_training(fused, ref):
    logs, ref_logs = _train_logs(fused), _train_logs(ref)
    for step, (a, b) in enumerate(zip(logs, ref_logs)):
        for key in ("loss", "grad_norm"):
            err = abs(a[key] - b[key]) / abs(b[key])
            assert err <= 1e-5, f"step {step} {key}: {a[key]} vs {b[key]} (rel {err:.3g})"
    ref_params = dict(ref.model.named_parameters())
    for name, p in fused.model.named_parameters():
        assert_close(p, ref_params[name], f"final {name}")
    init = dict(make_model("llama", tie_word_embeddings=False).named_parameters())
    moved = max(rel_err(p, init[n]) for n, p in ref.model.named_parameters())
    assert moved > 1e-3, "training did not move the parameters"
    assert is_fused(fused.model)
    return logs, ref_logs


@pytest.mark.parametrize("accumulation", [1, 3])
def test_training_matches_trainer(tmp_path, accumulation):
    fused, ref = _pair(tmp_path, gradient_accumulation_steps=accumulation, per_device_train_batch_size=2 if accumulation == 1 else 1)
    assert fused.model_accepts_loss_kwargs and ref.model_accepts_loss_kwargs  # num_items_in_batch reaches the model
    _assert_same_training(fused, ref)
    metrics, ref_metrics = fused.evaluate(), ref.evaluate()
    assert_close(torch.tensor(metrics["eval_loss"]), torch.tensor(ref_metrics["eval_loss"]), "eval_loss")


@pytest.mark.parametrize("accumulation", [1, 3])
def test_training_bf16_no_further_from_fp32_than_trainer(tmp_path, accumulation):
    """The twin of the parity above under ``bf16=True`` (autocast on CPU): ``FusedTrainer`` and ``Trainer`` both
    in bf16 against an fp32 ``Trainer``. The final parameters (one vector) are as close to the fp32 run's as
    ``Trainer``'s are (within 1.25×, the bound the ops meet under autocast); the logged losses agree to 2**-8
    and the grad norms to 1e-2 (both runs round every layer to bf16 alike, 2**-8 relative per rounding, and
    differ in the head's roundings only)."""
    batch = dict(gradient_accumulation_steps=accumulation, per_device_train_batch_size=2 if accumulation == 1 else 1)
    fused, bf16_ref = _pair(tmp_path / "bf16", bf16=True, **batch)
    _, fp32_ref = _pair(tmp_path / "fp32", **batch)
    logs, ref_logs, fp32_logs = _train_logs(fused), _train_logs(bf16_ref), _train_logs(fp32_ref)
    for step, (a, b) in enumerate(zip(logs, ref_logs)):
        assert abs(a["loss"] - b["loss"]) <= 2.0**-8 * abs(b["loss"]), (step, a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-2 * abs(b["grad_norm"]), (step, a, b)

    def vector(trainer):
        return torch.cat([p.detach().double().flatten() for p in trainer.model.parameters()])

    want = vector(fp32_ref)
    e = float((vector(bf16_ref) - want).norm() / want.norm())
    f = float((vector(fused) - want).norm() / want.norm())
    assert e > 0 and f <= 1.25 * e, f"final parameters: FusedTrainer bf16 error {f:.3g} vs Trainer bf16 {e:.3g}"


def test_accumulation_normalization_matters(tmp_path):
    """Guard: with these labels, accumulating over micro-batches normalized by ``num_items_in_batch``
    differs from averaging per-micro-batch means, so the parity above is a real check."""
    _, ref = _pair(tmp_path, gradient_accumulation_steps=2, per_device_train_batch_size=1, max_steps=1)
    model = ref.model
    ids = torch.tensor(TRAIN[:2]["input_ids"])
    mask = torch.tensor(TRAIN[:2]["attention_mask"])
    labels = torch.tensor(TRAIN[:2]["labels"])
    with torch.no_grad():
        per_mb = [model(input_ids=ids[i:i + 1], attention_mask=mask[i:i + 1], labels=labels[i:i + 1]).loss for i in range(2)]
        joint = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert abs(float(sum(per_mb) / 2) - float(joint)) > 1e-3 * float(joint)


def test_eval_with_compute_metrics_uses_logits(tmp_path):
    seen = {}

    def compute_metrics(pred):
        logits = pred.predictions[0] if isinstance(pred.predictions, tuple) else pred.predictions
        seen.setdefault("shapes", []).append(logits.shape)
        seen.setdefault("logits", []).append(logits)
        return {"logit_mean": float(np.mean(logits))}

    fused, ref = _pair(tmp_path, trainer_kwargs=dict(compute_metrics=compute_metrics))
    metrics, ref_metrics = fused.evaluate(), ref.evaluate()
    assert seen["shapes"][0] == (len(EVAL), SEQ, VOCAB)
    np.testing.assert_array_equal(seen["logits"][0], seen["logits"][1])
    assert_close(torch.tensor(metrics["eval_loss"]), torch.tensor(ref_metrics["eval_loss"]), "eval_loss")
    assert metrics["eval_logit_mean"] == ref_metrics["eval_logit_mean"]
    # the fused path is back on after evaluation
    assert fused.model._hf_fused.enabled
    with torch.no_grad():
        out = fused.model(input_ids=torch.tensor(EVAL[:1]["input_ids"]), labels=torch.tensor(EVAL[:1]["labels"]))
    assert out.logits is None
    # prediction_loss_only keeps the fused (logit-free) path for the loss
    fused.args.prediction_loss_only = True
    assert "eval_logit_mean" not in fused.evaluate()


def test_predict_returns_logits(tmp_path):
    """``predict()`` without ``compute_metrics`` returns the logits, as Trainer's does (regression: the
    fused path used to return empty predictions there)."""
    fused, ref = _pair(tmp_path)
    out, ref_out = fused.predict(EVAL), ref.predict(EVAL)
    assert isinstance(ref_out.predictions, np.ndarray) and ref_out.predictions.shape == (len(EVAL), SEQ, VOCAB)
    assert isinstance(out.predictions, np.ndarray), type(out.predictions)
    np.testing.assert_array_equal(out.predictions, ref_out.predictions)
    np.testing.assert_array_equal(out.label_ids, ref_out.label_ids)
    assert_close(torch.tensor(out.metrics["test_loss"]), torch.tensor(ref_out.metrics["test_loss"]), "test_loss")
    assert fused.model._hf_fused.enabled


def test_eval_loss_only_never_builds_logits(tmp_path):
    """``evaluate()`` without ``compute_metrics`` runs the fused path: no forward returns logits."""
    fused, _ = _pair(tmp_path)
    head = fused.model.get_output_embeddings()
    widths = []
    handle = head.register_forward_hook(lambda mod, inp, out: widths.append(out.shape[-1]))
    try:
        fused.evaluate()
        fused.predict(EVAL)  # the original forward: full logits
    finally:
        handle.remove()
    n_eval = len(EVAL) // 2
    assert widths[:n_eval] == [0] * n_eval, widths  # the intercept hands back [..., 0] placeholders
    assert widths[n_eval:] == [VOCAB] * n_eval, widths


def test_model_init(tmp_path):
    fused = FusedTrainer(model_init=lambda: make_model("llama"), args=_args(tmp_path, max_steps=1), train_dataset=TRAIN)
    fused.train()
    assert is_fused(fused.model)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(args=dict(label_smoothing_factor=0.1)), "label_smoothing_factor"),
        (dict(compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.loss), "compute_loss_func"),
    ],
    ids=["label_smoothing", "compute_loss_func"],
)
def test_unsupported_options_raise(tmp_path, kwargs, match):
    kwargs = dict(kwargs)
    args = _args(tmp_path, **kwargs.pop("args", {}))
    with pytest.raises(ValueError, match=match):
        FusedTrainer(model=make_model("llama"), args=args, train_dataset=TRAIN, **kwargs)


def test_fused_options_reach_apply_fused_loss(tmp_path):
    """``fused_options`` (the name FusedGRPOTrainer uses too) configures the patch; ``fused_loss_kwargs``, the former
    name, still does, with a FutureWarning; both at once is an error."""
    budget = {"tile_budget_bytes": 4096}
    trainer = FusedTrainer(model=make_model("llama"), args=_args(tmp_path), train_dataset=TRAIN, fused_options=budget)
    assert trainer.model._hf_fused.tile_budget_bytes == 4096
    with pytest.warns(FutureWarning, match="fused_options"):
        trainer = FusedTrainer(model=make_model("llama"), args=_args(tmp_path), train_dataset=TRAIN,
                               fused_loss_kwargs=budget)
    assert trainer.model._hf_fused.tile_budget_bytes == 4096
    with pytest.raises(ValueError, match="fused_options only"):
        FusedTrainer(model=make_model("llama"), args=_args(tmp_path), train_dataset=TRAIN, fused_options=budget,
                     fused_loss_kwargs=budget)
