"""``Trainer(use_liger_kernel=True)`` on a model patched by hf_fused: Liger's layer kernels, hf_fused's loss.

Liger's default configuration includes its fused linear cross-entropy, which replaces the model instance's
``forward`` when training starts and so, before hf_fused wrapped ``transformers.trainer.apply_liger_kernel``,
silently dropped the patched forward. On CPU Liger's Triton kernels do not run (not even in Triton's interpreter),
so the CPU tests train with Liger's layer kernels switched off in ``liger_kernel_config`` (what is left is exactly
the fused cross-entropy that must not replace hf_fused's forward) and check the layer-kernel swap without running
it; the GPU twin trains with Liger's layer kernels on.
"""

from __future__ import annotations

import copy
import types
import warnings

import pytest
import torch

pytest.importorskip("liger_kernel")
import transformers.trainer as trainer_module  # noqa: E402
from liger_kernel.transformers.rms_norm import LigerRMSNorm  # noqa: E402
from transformers import Trainer  # noqa: E402

from benchmarks.e2e.sft import restored_module_globals  # noqa: E402

from models import TRAIN, make_model  # noqa: E402
from models import trainer_args as _args, train_on_tokens as _train, trained as _trained  # noqa: E402
from references import rel_err as _rel  # noqa: E402

from hf_fused import FusedTrainer, apply_fused_loss  # noqa: E402
from hf_fused.integrations import transformers_trainer  # noqa: E402
from hf_fused.model.forward import PatchedForward  # noqa: E402

NO_LAYER_KERNELS = {"rope": False, "rms_norm": False, "swiglu": False}


@pytest.fixture(autouse=True)
def _say_again_and_restore_qwen3(monkeypatch):
    """A fresh "said once" and, afterwards, transformers' Qwen3 module as it was: Liger also patches module-level
    names there (``apply_rotary_pos_emb``, ``Qwen3RMSNorm``, ``Qwen3MLP``), which later models would pick up."""
    from transformers.models.qwen3 import modeling_qwen3

    monkeypatch.setattr(transformers_trainer, "_SAID", set())
    # set to itself: monkeypatch puts it back after the test, whatever Liger did to the class
    monkeypatch.setattr(modeling_qwen3.Qwen3ForCausalLM, "forward", modeling_qwen3.Qwen3ForCausalLM.forward)
    with restored_module_globals(modeling_qwen3.__name__):
        yield


def test_liger_would_replace_the_forward_of_an_unpatched_model():
    """The control for the tests below: the same call on an unpatched model installs Liger's loss forward."""
    model = make_model("qwen3")
    trainer_module.apply_liger_kernel(model, dict(NO_LAYER_KERNELS))
    assert isinstance(model.__dict__.get("forward"), types.MethodType)
    assert "liger_kernel" in model.forward.__func__.__module__


@pytest.mark.parametrize("entry", ["apply_fused_loss+Trainer", "FusedTrainer"])
def test_use_liger_kernel_keeps_the_fused_loss(tmp_path, entry):
    """Three steps of ``Trainer(use_liger_kernel=True)`` train exactly as without Liger (its layer kernels off,
    so what Liger would change is only the loss), the patched forward is still in place, and the user is told
    once that Liger's fused cross-entropy is left out."""
    base = make_model("qwen3", tie_word_embeddings=False)
    cls = FusedTrainer if entry == "FusedTrainer" else Trainer

    def run(name, **liger):
        model = copy.deepcopy(base) if cls is FusedTrainer else apply_fused_loss(copy.deepcopy(base))
        trainer = cls(model=model, args=_args(tmp_path / name, **liger), train_dataset=TRAIN)
        return trainer, _trained(trainer)

    _, plain = run("plain")
    with pytest.warns(UserWarning, match="its fused linear cross-entropy is not"):
        trainer, liger = run("liger", use_liger_kernel=True, liger_kernel_config=dict(NO_LAYER_KERNELS))
    assert isinstance(trainer.model.__dict__.get("forward"), PatchedForward)
    for got, want in zip(liger, plain):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with warnings.catch_warnings():  # said once per process; an explicit False says nothing
        warnings.simplefilter("error")
        run("again", use_liger_kernel=True,
            liger_kernel_config={**NO_LAYER_KERNELS, "fused_linear_cross_entropy": False})


def test_liger_layer_kernels_are_swapped_in_around_the_fused_forward():
    """Liger's default configuration on a patched model: its RMSNorm forward replaces the model's (the layer
    kernels apply), the patched forward stays."""
    model = apply_fused_loss(make_model("qwen3"))
    with pytest.warns(UserWarning, match="Liger's layer kernels are applied"):
        trainer_module.apply_liger_kernel(model, {})
    assert model.model.norm.forward.__func__ is LigerRMSNorm.forward
    assert model.model.layers[0].input_layernorm.forward.__func__ is LigerRMSNorm.forward
    assert isinstance(model.__dict__.get("forward"), PatchedForward)


def test_explicit_liger_fused_cross_entropy_is_refused(tmp_path):
    model = apply_fused_loss(make_model("qwen3"))
    trainer = Trainer(model=model, args=_args(tmp_path, use_liger_kernel=True, liger_kernel_config={
        **NO_LAYER_KERNELS, "fused_linear_cross_entropy": True}), train_dataset=TRAIN)
    with pytest.raises(ValueError, match="remove_fused_loss"):
        trainer.train()
    assert isinstance(model.__dict__.get("forward"), PatchedForward)


def test_a_liger_that_replaces_the_forward_anyway_is_an_error(monkeypatch):
    """If a Liger version replaced the forward although told not to, training must not go on silently with it."""
    model = apply_fused_loss(make_model("qwen3"))

    def replacing(model, kernel_config):
        model.forward = types.MethodType(lambda self, **kw: None, model)

    monkeypatch.setattr(trainer_module, "apply_liger_kernel", replacing)
    transformers_trainer.LIGER_KERNEL.install()  # around the replacing Liger (the installed wrapper is not in place)
    with pytest.raises(RuntimeError, match="not supported with apply_fused_loss"):
        trainer_module.apply_liger_kernel(model, {"fused_linear_cross_entropy": False})


@pytest.mark.gpu
def test_liger_layer_kernels_with_the_fused_loss_on_gpu(tmp_path):
    """On CUDA with Liger's layer kernels running: ``apply_fused_loss`` + ``Trainer(use_liger_kernel=True,
    bf16=True)`` against the unpatched model with the same kernels and Liger's fused cross-entropy off (HF's loss
    on bf16 logits), three steps, with an fp32 run without Liger as the yardstick. Final parameters: the patched
    run as close to the fp32 run as the unpatched one (within 1.25×, as the bf16 Trainer test). Logged losses:
    the two bf16 runs round every layer alike and differ only in the head's roundings, under 2**-8 relative."""
    base = make_model("qwen3", tie_word_embeddings=False).cuda()
    kw = dict(use_cpu=False)

    def run(name, model, **overrides):
        return _train(model, tmp_path / name, **kw, **overrides)

    fp32 = run("fp32", copy.deepcopy(base))
    liger = dict(bf16=True, use_liger_kernel=True, liger_kernel_config={"fused_linear_cross_entropy": False})
    eager = run("eager", copy.deepcopy(base), **liger)
    fused = run("fused", apply_fused_loss(copy.deepcopy(base)), **liger)
    e, f = _rel(eager[2], fp32[2]), _rel(fused[2], fp32[2])
    assert e > 0 and f <= 1.25 * e, f"final parameters: fused {f:.3g} vs unpatched {e:.3g}"
    assert float(((fused[0] - eager[0]) / eager[0]).abs().max()) <= 2.0**-8, (fused[0], eager[0])


# Liger 0.8.5's forward passes past_key_values, which transformers 5.x renamed (an upstream notice).
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_apply_fused_loss_over_a_model_liger_already_patched():
    """A model whose forward Liger replaced first (``_apply_liger_kernel_to_instance`` / ``AutoLigerKernelForCausalLM``),
    then ``apply_fused_loss``: hf_fused's probe reads the head through Liger's forward, and loss and every gradient
    equal the unpatched model's (fp32, up to summation order)."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    from models import make_batch

    base = make_model("qwen3")
    model = copy.deepcopy(base)
    _apply_liger_kernel_to_instance(model=model, **NO_LAYER_KERNELS)
    assert "liger_kernel" in model.forward.__func__.__module__
    apply_fused_loss(model)
    input_ids, attention_mask, labels = make_batch()
    got = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    want = base(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    assert got.logits is None
    got.loss.backward()
    want.loss.backward()
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0)
    for (name, p), q in zip(model.named_parameters(), base.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
