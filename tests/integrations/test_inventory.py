"""The inventory of process-wide patches (``hf_fused.integrations``): every entry documented; ``apply_fused_loss``
rebinds each target; ``remove_fused_loss`` on the last patched model, or ``uninstall_all()``, gives every target its
original object back (and TRL's modules that imported ``add_fused_lm_head`` by name), with no import hook left; and
``remove_fused_loss`` undoes what the TRL integration did for that model."""

from __future__ import annotations

import importlib
import weakref

import pytest
import torch

import hf_fused
import hf_fused.model.extensions as extensions
from hf_fused import integrations
from hf_fused.integrations import import_hooks
from hf_fused.integrations.trl import trl_head_options
from hf_fused.integrations.trl.protocol import OPTIONS_ATTR, trl_head_options_in
from models import make_batch, make_model

pytest.importorskip("trl")
pytest.importorskip("liger_kernel")

_TRL_TRAINERS = {
    "trl.trainer.sft_trainer": "SFTTrainer", "trl.trainer.dpo_trainer": "DPOTrainer",
    "trl.trainer.kto_trainer": "KTOTrainer", "trl.trainer.rloo_trainer": "RLOOTrainer",
    "trl.trainer.grpo_trainer": "GRPOTrainer",
}


def _targets() -> list[tuple[object, str]]:
    """Every attribute hf_fused rebinds, listed here independently of the inventory."""
    import transformers
    import transformers.trainer as trainer_module
    import trl.trainer.distillation_trainer as distillation_module
    import trl.trainer.utils as trl_utils
    import trl.experimental.async_distillation.async_distillation_trainer as async_module
    from trl.experimental.server_distillation.server_distillation_trainer import ServerDistillationTrainer
    from trl.experimental.cpo.cpo_trainer import CPOTrainer
    from trl.experimental.gkd.gkd_trainer import GKDTrainer
    from trl.experimental.online_dpo.online_dpo_trainer import OnlineDPOTrainer
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer
    from trl.trainer.distillation_trainer import DistillationTrainer
    # imports add_fused_lm_head by name, as the trainers below do; imported here so that the list does not depend on
    # whether another test loaded it first (a module loaded by then is rebound too)
    import trl.experimental.async_grpo.async_grpo_trainer as async_grpo_module

    targets = [(transformers.Trainer, "prediction_step"), (trainer_module, "apply_liger_kernel"),
               (trl_utils, "add_fused_lm_head"), (DistillationTrainer, "__init__"),
               (distillation_module, "_chunked_divergence_loss"), (GKDTrainer, "compute_loss"), (GKDTrainer, "__init__"),
               (async_module, "_chunked_jsd_loss"), (async_module.AsyncDistillationTrainer, "_compute_loss"),
               (ServerDistillationTrainer, "compute_loss"), (async_grpo_module, "add_fused_lm_head"),
               (ORPOTrainer, "concatenated_forward"), (CPOTrainer, "concatenated_forward"),
               (OnlineDPOTrainer, "_forward")]
    for module_name, cls in _TRAINER_CLASSES().items():
        module = importlib.import_module(module_name)
        targets += [(module, "add_fused_lm_head"), (cls, "__init__")]
    return targets


def _TRAINER_CLASSES() -> dict:
    return {name: getattr(importlib.import_module(name), cls) for name, cls in _TRL_TRAINERS.items()}


@pytest.fixture
def only_this_tests_models(monkeypatch):
    """Patched models of other tests still alive would keep the patches installed: count this test's only."""
    monkeypatch.setattr(extensions, "_PATCHED", weakref.WeakSet())


def test_every_entry_is_in_the_table_with_every_column():
    for patch in integrations.PATCHES:
        assert patch.name.split(".")[0] in integrations.__doc__, patch.name
        for column in (patch.target, patch.trigger, patch.versions, patch.why, patch.passes_through):
            assert isinstance(column, str) and column, patch.name
    assert len({patch.name for patch in integrations.PATCHES}) == len(integrations.PATCHES) == 15


def test_remove_on_the_last_patched_model_restores_every_original(only_this_tests_models):
    integrations.uninstall_all()
    targets = _targets()
    originals = [vars(owner)[name] for owner, name in targets]
    assert all(not getattr(o, "__hf_fused__", False) for o in originals)

    model = hf_fused.apply_fused_loss(make_model("llama"))
    second = hf_fused.apply_fused_loss(make_model("llama"))
    replaced = [vars(owner)[name] for owner, name in targets]
    assert all(r is not o and r.__hf_fused__ for r, o in zip(replaced, originals)), "a target was not rebound"
    assert len(integrations.rebinds()) == len(targets)

    hf_fused.remove_fused_loss(model)  # another patched model is left: still installed
    assert [vars(owner)[name] for owner, name in targets] == replaced
    hf_fused.remove_fused_loss(second)
    restored = [vars(owner)[name] for owner, name in targets]
    assert all(r is o for r, o in zip(restored, originals)), [t for t, r, o in zip(targets, restored, originals)
                                                               if r is not o]
    assert not integrations.rebinds() and not import_hooks.finder_installed()

    hf_fused.apply_fused_loss(model)  # and again on the next patch
    assert all(vars(owner)[name].__hf_fused__ for owner, name in targets)


def test_uninstall_all_restores_every_original_and_the_patches_come_back_on_the_next_patch():
    hf_fused.apply_fused_loss(make_model("llama"))
    targets = _targets()
    installed = [vars(owner)[name] for owner, name in targets]
    integrations.uninstall_all()
    for (owner, name), wrapper in zip(targets, installed):
        assert vars(owner)[name] is wrapper.__wrapped__, (owner, name)
    assert not import_hooks.finder_installed()
    model = hf_fused.apply_fused_loss(make_model("llama"))
    assert all(vars(owner)[name].__hf_fused__ for owner, name in targets)
    assert hf_fused.is_fused(model)


def test_a_pending_entry_is_withdrawn_with_the_import_finder():
    """An entry whose module is not imported yet waits in the import finder; uninstalling withdraws it."""
    from hf_fused.integrations.patching import ThirdPartyPatch

    applied = []
    patch = ThirdPartyPatch(name="probe", module="json.tool_hf_fused_absent", target="t", trigger="t", versions="v",
                            why="w", passes_through="p", apply=lambda module, patch: applied.append(module))
    integrations.uninstall_all()
    patch.install()
    assert import_hooks.finder_installed() and patch.installed
    patch.uninstall()
    assert not import_hooks.finder_installed() and not patch.installed and not applied
    hf_fused.apply_fused_loss(make_model("llama"))  # the inventory as the other tests expect it


class _Target:
    def method(self):
        return "original"


def test_a_wrapper_someone_wrapped_since_passes_through_once_uninstalled():
    """A wrapper of ours inside someone else's wrapper cannot be taken out of their chain: uninstalling leaves their
    wrapper in place and makes ours pass every call straight through; installing again wraps theirs."""
    from hf_fused.integrations.patching import ThirdPartyPatch

    def apply(module, patch):
        current, live = _Target.method, patch.liveness()

        def method(self):
            return f"hf_fused({current(self)})" if live() else current(self)

        patch.rebind(_Target, "method", method)

    patch = ThirdPartyPatch(name="probe", module=__name__, target="t", trigger="t", versions="v", why="w",
                            passes_through="p", apply=apply)
    original = _Target.method
    try:
        patch.install()
        ours = _Target.method
        assert _Target().method() == "hf_fused(original)"
        _Target.method = lambda self: f"theirs({ours(self)})"
        theirs = _Target.method
        patch.uninstall()
        assert _Target.method is theirs and _Target().method() == "theirs(original)"
        patch.install()
        assert _Target().method() == "hf_fused(theirs(original))"
        patch.uninstall()
        assert _Target.method is theirs
    finally:
        _Target.method = original


# ----------------------------------------------------------------------------------------------------------------
# What remove_fused_loss undoes for one model: the TRL head options it set, TRL's own head where hf_fused withheld it


def _fused_call(model):
    input_ids, attention_mask, labels = make_batch()
    return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)


def test_remove_takes_the_trl_options_off_and_gives_back_trls_head():
    import trl.trainer.utils as trl_utils

    stock = make_model("llama")
    trl_utils.add_fused_lm_head(stock, temperature=0.7, outputs=("log_probs", "entropy"))
    model = hf_fused.apply_fused_loss(make_model("llama"))
    trl_utils.add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))  # withheld: recorded
    options = trl_head_options(model)
    assert options is not None and trl_head_options_in(model.__dict__["forward"]) is None

    hf_fused.remove_fused_loss(model)
    assert OPTIONS_ATTR not in model.__dict__ and not hf_fused.is_fused(model)
    assert trl_head_options_in(model.forward) == options  # TRL's head, with the trainer's options
    got, want = _fused_call(model), _fused_call(stock)
    torch.testing.assert_close(got.log_probs, want.log_probs, rtol=0, atol=0)
    torch.testing.assert_close(got.entropy, want.entropy, rtol=0, atol=0)


def test_remove_after_a_trl_head_leaves_that_head():
    import trl.trainer.utils as trl_utils

    model, stock = make_model("llama"), make_model("llama")
    for m in (model, stock):
        trl_utils.add_fused_lm_head(m, outputs=("log_probs",))  # TRL's head first (hf_fused not yet on the model)
    trl_forward = model.__dict__["forward"]
    hf_fused.apply_fused_loss(model)
    assert trl_head_options(model) is not None
    hf_fused.remove_fused_loss(model)
    assert model.__dict__["forward"] is trl_forward and OPTIONS_ATTR not in model.__dict__
    torch.testing.assert_close(_fused_call(model).log_probs, _fused_call(stock).log_probs, rtol=0, atol=0)


@pytest.mark.parametrize("entry, class_name, method", [
    ("TRL_ORPO", "ORPOTrainer", "concatenated_forward"), ("TRL_CPO", "CPOTrainer", "concatenated_forward"),
    ("TRL_ONLINE_DPO", "OnlineDPOTrainer", "_forward"),
])
def test_a_trainer_of_another_shape_is_refused_with_a_warning(entry, class_name, method):
    """A TRL whose trainer method takes other parameters: the entry rebinds nothing, records why and says so."""
    import dataclasses
    import types

    from hf_fused.integrations.trl import concatenated_forward, online_dpo

    patch = getattr(concatenated_forward, entry, None) or getattr(online_dpo, entry)
    fresh = dataclasses.replace(patch, rebinds=[], state={})

    def other(self, model, batch, extra):
        return "TRL's own"

    trainer_cls = type(class_name, (), {method: other, "concatenated_inputs": staticmethod(
        lambda batch, is_encoder_decoder=False, padding_value=0, device=None: batch)})
    with pytest.warns(UserWarning, match=rf"{class_name}\.{method} takes .* expected"):
        fresh.apply(types.SimpleNamespace(**{class_name: trainer_cls}), fresh)
    assert "expected" in fresh.state["refused"] and not fresh.rebinds
    assert getattr(trainer_cls, method) is other
