"""PEFT LoRA through the patch: adapters on attention and on lm_head (their lora_A / lora_B must train
exactly like the unpatched model's), lora_dropout in train mode (same RNG seed → same masks), and
``modules_to_save=["lm_head"]``. Compared with an unpatched deep copy: loss AND every trainable
parameter's gradient, relative error ≤ 1e-5 (fp32).

PEFT initializes ``lora_B`` to zero, which would make every ``lora_A`` gradient zero and let a fused
path that ignores the adapter pass; ``_perturb`` gives every adapter weight random values first.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from models import loss_and_grads, make_batch, make_model  # noqa: E402
from references import assert_close, assert_same_grads, shifted_token_logprobs  # noqa: E402

from hf_fused import LinearCrossEntropyLoss, apply_fused_loss, is_fused, remove_fused_loss  # noqa: E402
from hf_fused.model import find_causal_lm  # noqa: E402

BATCH = make_batch(batch=3, seq=10)


def _perturb(peft_model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif "modules_to_save" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)


def _peft_pair(arch="llama", *, tie=False, **lora):
    lora = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, **lora}
    peft_model = get_peft_model(make_model(arch, tie_word_embeddings=tie), LoraConfig(**lora))
    _perturb(peft_model)
    ref = copy.deepcopy(peft_model)
    apply_fused_loss(peft_model)
    assert is_fused(peft_model) and not is_fused(ref)
    peft_model.train(), ref.train()
    return peft_model, ref


def _loss(m, batch=BATCH):
    ids, mask, labels = batch
    return m(input_ids=ids, attention_mask=mask, labels=labels).loss


def _compare(model, ref, call=_loss, seed=None):
    loss, g = loss_and_grads(model, call, seed=seed)
    ref_loss, ref_g = loss_and_grads(ref, call, seed=seed)
    assert_close(loss, ref_loss, "loss")
    assert_same_grads(g, ref_g)
    return loss, g


def _head_adapter_grads(g):
    head = {n: t for n, t in g.items() if "lm_head" in n}
    assert {n.split("lm_head.")[1] for n in head} == {"lora_A.default.weight", "lora_B.default.weight"}, head.keys()
    for name, t in head.items():
        assert t is not None and t.abs().sum() > 0, f"{name} got no gradient"
    return head


def test_lora_on_attention():
    model, ref = _peft_pair(target_modules=["q_proj", "v_proj"])
    _, g = _compare(model, ref)
    assert len(g) == 2 * 2 * 2  # 2 layers × (q, v) × (A, B): only the adapters train
    assert all(t.abs().sum() > 0 for t in g.values())
    assert not any("lm_head" in n for n in g)


@pytest.mark.parametrize("arch,tie", [("llama", False), ("llama", True), ("gemma2", False)],
                         ids=["llama", "llama-tied", "gemma2"])
def test_lora_on_lm_head(arch, tie):
    """lm_head's lora_A / lora_B gradients match (Gemma 2: through the soft-cap too; tied: the adapter
    sits on the shared embedding matrix)."""
    model, ref = _peft_pair(arch, tie=tie, target_modules=["q_proj", "v_proj", "lm_head"])
    head = find_causal_lm(model).get_output_embeddings()
    assert hasattr(head, "lora_A") and hasattr(head, "lora_B")
    _, g = _compare(model, ref)
    _head_adapter_grads(g)
    # the adapter matters: disabling it changes the loss (both sides agree there too; nothing trains)
    with torch.no_grad():
        with model.disable_adapter(), ref.disable_adapter():
            off = _loss(model)
            assert_close(off, _loss(ref), "loss with adapters disabled")
        assert abs(float(off) - float(_loss(model))) > 1e-3


def test_lora_on_lm_head_with_num_items_and_logprobs():
    """The lm_head adapter also trains through ``num_items_in_batch`` and ``fused_output="logprobs"``."""
    model, ref = _peft_pair(target_modules=["lm_head"])
    ids, mask, labels = BATCH
    n = (labels[:, 1:] != -100).sum() + 5
    _, g = _compare(model, ref, lambda m: m(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=n).loss)
    _head_adapter_grads(g)

    w = torch.randn(labels.shape, generator=torch.Generator().manual_seed(2))

    def fused(m):
        out = m(input_ids=ids, attention_mask=mask, labels=labels, fused_output="logprobs", temperature=0.8,
                return_entropy=True)
        return (w * out.logprobs).sum() + (w.flip(0) * out.entropy).sum()

    def dense(m):
        logp, ent, valid = shifted_token_logprobs(m(input_ids=ids, attention_mask=mask).logits, labels, 0.8)
        return (w * logp).sum() + (w.flip(0) * ent * valid).sum()

    loss, g = loss_and_grads(model, fused)
    ref_loss, ref_g = loss_and_grads(ref, dense)
    assert_close(loss, ref_loss, "logprobs objective")
    assert_same_grads(g, ref_g)
    _head_adapter_grads(g)


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["q_proj", "v_proj", "lm_head"]], ids=["attn", "attn+head"])
def test_lora_dropout_in_train_mode(targets):
    """lora_dropout > 0 in train mode: seeded identically right before each forward, the dropout masks
    (on attention and on lm_head's adapter input) match the unpatched model's."""
    model, ref = _peft_pair(target_modules=targets, lora_dropout=0.3)
    for step, seed in enumerate((123, 7)):
        _, g = _compare(model, ref, seed=seed)
        if "lm_head" in targets:
            _head_adapter_grads(g)
    # dropout is really active: another seed gives another loss
    with torch.no_grad():
        torch.manual_seed(1)
        a = _loss(model)
        torch.manual_seed(2)
        b = _loss(model)
    assert abs(float(a) - float(b)) > 1e-4


def test_modules_to_save_lm_head():
    model, ref = _peft_pair(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    head = find_causal_lm(model).get_output_embeddings()
    assert hasattr(head, "modules_to_save") and hasattr(head, "original_module")
    _, g = _compare(model, ref)
    trained = [n for n in g if "lm_head" in n]
    assert trained == ["base_model.model.lm_head.modules_to_save.default.weight"], trained
    assert g[trained[0]].abs().sum() > 0
    with torch.no_grad(), model.disable_adapter(), ref.disable_adapter():  # the original (frozen) head
        off = _loss(model)
        assert_close(off, _loss(ref), "loss with adapters disabled")
    with torch.no_grad():
        assert abs(float(off) - float(_loss(model))) > 1e-3


def test_merged_lm_head_adapter():
    model, ref = _peft_pair(target_modules=["q_proj", "lm_head"])
    model.merge_adapter(), ref.merge_adapter()
    with torch.no_grad():
        assert_close(_loss(model), _loss(ref), "loss with merged adapters")
    model.unmerge_adapter(), ref.unmerge_adapter()
    _compare(model, ref)


def test_patch_peft_model_then_remove():
    model, ref = _peft_pair(target_modules=["q_proj", "v_proj"])
    base = model.get_base_model()
    assert find_causal_lm(model) is base and "forward" in base.__dict__
    remove_fused_loss(model)
    assert not is_fused(model) and "forward" not in base.__dict__
    out = model(input_ids=BATCH[0], labels=BATCH[2])
    assert out.logits is not None
    _compare(model, ref)


def test_two_active_adapters_on_lm_head():
    model = get_peft_model(make_model("llama", tie_word_embeddings=False),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"]))
    model.add_adapter("other", LoraConfig(r=2, lora_alpha=4, target_modules=["lm_head"]))
    model.base_model.set_adapter(["default", "other"])
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    _perturb(model)
    ref = copy.deepcopy(model)
    apply_fused_loss(model)
    _, g = _compare(model, ref)
    head = [n for n in g if "lm_head" in n]
    assert len(head) == 4 and all(g[n].abs().sum() > 0 for n in head), head


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no_verify"])
@pytest.mark.parametrize("extra", [dict(use_dora=True), dict(lora_bias=True)], ids=["dora", "lora_bias"])
def test_unsupported_head_adapters_raise(extra, verify):
    """A head adapter whose map is not ``[h, s·A h]·[W, B]ᵀ`` is refused at patch time, before the probe (so also
    with ``verify=False``), model unpatched, with what to do instead."""
    model = get_peft_model(make_model("llama", tie_word_embeddings=False),
                           LoraConfig(r=4, target_modules=["lm_head"], **extra))
    with pytest.raises(NotImplementedError, match="target_modules.*remove_fused_loss"):
        apply_fused_loss(model, verify=verify)
    assert not is_fused(model) and "forward" not in model.get_base_model().__dict__
    with pytest.raises(NotImplementedError, match="target_modules"):
        LinearCrossEntropyLoss(model.get_base_model().lm_head)  # at construction, not at the first call


def test_patch_before_get_peft_model():
    """Patching the bare model first, then wrapping it with PEFT: the intercept finds the LoRA head."""
    base = make_model("llama", tie_word_embeddings=False)
    ref_base = copy.deepcopy(base)
    apply_fused_loss(base)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj", "lm_head"])
    model, ref = get_peft_model(base, config), get_peft_model(ref_base, config)
    _perturb(model)
    _perturb(ref)
    assert is_fused(model) and not is_fused(ref)
    _, g = _compare(model, ref)
    _head_adapter_grads(g)
