"""``hf_fused.LinearCrossEntropyLoss`` in one process, against the unpatched model's own loss: the loss and
every parameter gradient (fp32, relative 1e-5: the fused op accumulates in fp32 over tiles in another
order than the dense ``log_softmax``; measured ≤ 1e-6), with the causal shift, ``num_items_in_batch``,
``reduction="none"``, the logit transform measured from the forward as ``apply_fused_loss`` does (Gemma 2's
soft-cap; a config soft-cap the forward ignores; a scale applied in code; a patched model's own transform), a LoRA
adapter on lm_head, and ``forward_logits`` against the model's logits. The 2-stage pipeline lives in test_pipeline.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from transformers import LlamaForCausalLM

from hf_fused import LinearCrossEntropyLoss, apply_fused_loss
from models import make_batch, make_model
from references import assert_close


def _hidden_and_reference(arch, **model_kwargs):
    model = make_model(arch, **model_kwargs)
    ids, mask, labels = make_batch(seed=3)
    return model, ids, mask, labels


def _split_loss(model, loss_fn, ids, mask, labels, **kwargs):
    """Backbone → hidden states → the loss module (what a pipeline's last stage and loss_fn do)."""
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    return loss_fn(hidden, labels, **kwargs)


def _assert_matches_own_loss(model, loss_fn, reference=None):
    """``loss_fn`` on ``model``'s backbone states equals the unpatched ``reference``'s own loss (default: a copy of
    ``model``), and so does every parameter gradient."""
    reference = copy.deepcopy(model) if reference is None else reference
    ids, mask, labels = make_batch(seed=3)
    loss = _split_loss(model, loss_fn, ids, mask, labels)
    loss.backward()
    ref = reference(input_ids=ids, attention_mask=mask, labels=labels).loss
    ref.backward()
    assert_close(loss.detach(), ref.detach(), "loss")
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert_close(p.grad, ref_params[name].grad, f"grad {name}")


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_loss_and_gradients_match_the_models_own_loss(arch):
    model = make_model(arch)
    loss_fn = LinearCrossEntropyLoss.from_model(model)
    if arch == "gemma2":
        assert loss_fn.transform.softcap == model.config.final_logit_softcapping
    _assert_matches_own_loss(model, loss_fn)


class _TripledLogits(LlamaForCausalLM):
    """Multiplies its logits by 3 in its forward; nothing in its config says so."""

    def forward(self, *args, labels=None, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 3
        if labels is not None:
            out.loss = self.loss_function(out.logits, labels, self.config.vocab_size)
        return out


def test_config_softcap_the_forward_ignores_changes_nothing():
    """Llama's forward ignores ``final_logit_softcapping``: from_model measures the forward, so its loss does too,
    with logits far past the claimed cap (where applying it would move the loss far beyond the tolerance)."""
    model = make_model("llama", tie_word_embeddings=False)
    model.config.final_logit_softcapping = 2.0
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    assert LinearCrossEntropyLoss.from_model(model, verify=False).transform.softcap == 2.0  # the config's claim
    model.train()
    loss_fn = LinearCrossEntropyLoss.from_model(model)
    assert loss_fn.transform.softcap is None and loss_fn.transform.logit_scale == 1.0
    assert model.training and all(p.grad is None for p in model.parameters())  # the probe left no trace
    _assert_matches_own_loss(model, loss_fn)


def test_scale_applied_in_the_forward_is_measured():
    model = _TripledLogits(make_model("llama").config)
    loss_fn = LinearCrossEntropyLoss.from_model(model)
    assert loss_fn.transform.logit_scale == 3.0 and loss_fn.transform.softcap is None
    _assert_matches_own_loss(model, loss_fn)


def test_patched_model_gives_the_transform_the_patch_measured():
    """No second probe: the loss takes the patched model's transform, and matches the unpatched model's loss."""
    model = _TripledLogits(make_model("llama").config)
    reference = copy.deepcopy(model)
    apply_fused_loss(model)
    probes = []
    model.model.register_forward_hook(lambda *_: probes.append(1))
    loss_fn = LinearCrossEntropyLoss.from_model(model)
    assert probes == [] and loss_fn.transform == model._hf_fused.transform
    assert loss_fn.transform.logit_scale == 3.0
    _assert_matches_own_loss(model, loss_fn, reference)


def test_num_items_in_batch_sums_microbatches_to_the_full_batch_loss():
    model, ids, mask, labels = _hidden_and_reference("llama")
    loss_fn = LinearCrossEntropyLoss.from_model(model)
    total = int((F.pad(labels, (0, 1), value=-100)[:, 1:] != -100).sum())
    parts = [_split_loss(model, loss_fn, ids[i:i + 1], mask[i:i + 1], labels[i:i + 1], num_items_in_batch=total)
             for i in range(ids.shape[0])]
    full = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert_close(sum(parts).detach(), full.detach(), "Σ microbatch losses")


def test_reduction_none_and_shift_labels():
    model, ids, mask, labels = _hidden_and_reference("llama")
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    per_token = _split_loss(model, LinearCrossEntropyLoss.from_model(model, reduction="none"), ids, mask, None,
                            shift_labels=shifted)
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    ref = F.cross_entropy(logits.transpose(1, 2), shifted, ignore_index=-100, reduction="none")
    assert per_token.shape == shifted.shape
    assert_close(per_token.detach(), ref.detach(), "per-token losses")


def test_lora_adapter_on_lm_head_trains():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = peft.get_peft_model(make_model("llama"), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False))
    reference = copy.deepcopy(model)
    ids, mask, labels = make_batch(seed=3)
    loss_fn = LinearCrossEntropyLoss.from_model(model)
    hidden = model.base_model.model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    loss = loss_fn(hidden, labels)
    loss.backward()
    ref = reference(input_ids=ids, attention_mask=mask, labels=labels).loss
    ref.backward()
    assert_close(loss.detach(), ref.detach(), "loss")
    ref_params = dict(reference.named_parameters())
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("lm_head.lora_B" in n for n in trained)
    for name in trained:
        assert_close(dict(model.named_parameters())[name].grad, ref_params[name].grad, f"grad {name}")


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_forward_logits_are_the_models_logits(arch):
    model, ids, mask, _ = _hidden_and_reference(arch)
    with torch.no_grad():
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        got = LinearCrossEntropyLoss.from_model(model).forward_logits(hidden)
        ref = model(input_ids=ids, attention_mask=mask).logits
    assert_close(got, ref, "logits")


def test_bad_input_raises_clear_errors():
    model, ids, mask, labels = _hidden_and_reference("llama")
    loss_fn = LinearCrossEntropyLoss.from_model(model)
    hidden = torch.randn(2, 12, 32)
    with pytest.raises(ValueError, match="needs `labels`"):
        loss_fn(hidden)
    with pytest.raises(ValueError, match="do not match hidden states"):
        loss_fn(hidden, labels[:, :5])
    with pytest.raises(ValueError, match="reduction"):
        LinearCrossEntropyLoss(model.lm_head, reduction="avg")
