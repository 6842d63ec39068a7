"""The patch API: apply / remove / deepcopy / save-load / wrappers / call conventions / fused outputs /
the patch-time verification probe. Each comparison is against an unpatched deep copy, on the loss (or
the returned tensors) AND every parameter gradient, relative error ≤ 1e-5 in fp32."""

from __future__ import annotations

import copy
import functools
import inspect
import os
import types

import pytest
import torch
import torch.nn as nn
from transformers import LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from models import VOCAB, loss_and_grads, make_batch, make_model, patched_and_reference  # noqa: E402
from references import assert_close, assert_same_grads, shifted_token_logprobs  # noqa: E402

from hf_fused import FusedLossVerificationError, apply_fused_loss, is_fused, remove_fused_loss  # noqa: E402
from hf_fused.model import find_causal_lm, original_forward_only  # noqa: E402

BATCH = make_batch()


def _loss(m, batch=BATCH, **kwargs):
    ids, mask, labels = batch
    return m(input_ids=ids, attention_mask=mask, labels=labels, **kwargs).loss


def _assert_parity(model, ref, call=_loss, what="loss"):
    loss, g = loss_and_grads(model, call)
    ref_loss, ref_g = loss_and_grads(ref, call)
    assert_close(loss, ref_loss, what)
    assert_same_grads(g, ref_g)
    return loss, ref_loss


def _assert_unpatched(model):
    assert not is_fused(model)
    assert "forward" not in model.__dict__
    assert "_hf_fused" not in model.__dict__
    with torch.no_grad():
        out = model(input_ids=BATCH[0], labels=BATCH[2])
    assert out.logits is not None and out.logits.shape[-1] == VOCAB and out.loss is not None


@pytest.fixture
def pair():
    return patched_and_reference(make_model("llama", tie_word_embeddings=False))


# ----------------------------------------------------------------------------------------- apply / remove


def test_apply_twice_is_idempotent(pair):
    model, ref = pair
    state, forward = model._hf_fused, model.__dict__["forward"]
    assert apply_fused_loss(model, tile_budget_bytes=3 * 4 * VOCAB * 5) is model  # 5 rows per tile
    assert model._hf_fused is state and model.__dict__["forward"] is forward
    assert state.tile_budget_bytes == 3 * 4 * VOCAB * 5
    assert state.original_forward(model).__func__ is LlamaForCausalLM.forward  # not the patched forward
    _assert_parity(model, ref, what="loss with small tiles after re-apply")
    remove_fused_loss(model)  # one remove undoes any number of applies
    _assert_unpatched(model)
    _assert_parity(model, ref)


def test_remove_restores_original(pair):
    model, ref = pair
    assert model.forward.__hf_fused__
    assert remove_fused_loss(model) is model
    _assert_unpatched(model)
    assert model.forward.__func__ is LlamaForCausalLM.forward
    assert remove_fused_loss(model) is model  # no-op when not patched
    ids, mask, labels = BATCH
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, labels=labels).logits, ref(input_ids=ids, labels=labels).logits)


def test_remove_restores_a_preexisting_instance_forward():
    """accelerate (mixed precision) wraps ``model.forward`` on the instance; patch on top, remove restores it."""
    model = make_model("llama")
    ref = copy.deepcopy(model)
    calls = []

    def wrap(func):
        @functools.wraps(func)
        def forward(*args, **kwargs):
            calls.append(1)
            return func(*args, **kwargs)
        return forward

    wrapped = types.MethodType(wrap(LlamaForCausalLM.forward), model)
    model.forward = wrapped
    apply_fused_loss(model)
    n = len(calls)
    _assert_parity(model, ref)
    assert len(calls) > n, "the instance-level forward (the original) must still run"
    remove_fused_loss(model)
    assert model.__dict__["forward"] is wrapped and not is_fused(model)


def test_failed_verification_leaves_model_unpatched():
    model = _QuadraticLogits(make_model("llama").config)
    with pytest.raises(FusedLossVerificationError):
        apply_fused_loss(model)
    _assert_unpatched(model)


# ----------------------------------------------------------------------------------------- deepcopy / save


@pytest.mark.parametrize("options, match", [
    (dict(tile_budget_bytes=0), "tile_budget_bytes must be a positive int"),
    (dict(tile_budget_bytes=2.5e8), "tile_budget_bytes must be a positive int"),
    (dict(backend="nope"), r"backend='nope'.*available: \['torch'"),
], ids=["zero_budget", "float_budget", "unknown_backend"])
def test_bad_options_raise_at_patch_time(options, match):
    """A bad budget or backend name is refused by apply_fused_loss itself, also with ``verify=False`` (no probe
    runs), not at the first forward with labels; the model stays unpatched."""
    model = make_model("llama")
    with pytest.raises(ValueError, match=match):
        apply_fused_loss(model, verify=False, **options)
    assert not is_fused(model)
    from hf_fused import LinearCrossEntropyLoss

    with pytest.raises(ValueError, match=match):  # the loss module checks them when built too
        LinearCrossEntropyLoss(model.lm_head, **options)


@pytest.mark.parametrize("call", [
    lambda loss, h, y: loss([[0.0]], y),
    lambda loss, h, y: loss(h, y.tolist()),
    lambda loss, h, y: loss(h, shift_labels=y.tolist()),
], ids=["hidden_list", "labels_list", "shift_labels_list"])
def test_loss_module_inputs_that_are_not_tensors_are_a_type_error(call):
    """``LinearCrossEntropyLoss`` names the argument (a list used to fail in ``F.pad`` or as an ``AttributeError``)."""
    from hf_fused import LinearCrossEntropyLoss

    model = make_model("llama")
    loss = LinearCrossEntropyLoss(model.lm_head)
    hidden = torch.randn(2, 3, model.config.hidden_size)
    labels = torch.randint(0, VOCAB, (2, 3))
    with pytest.raises(TypeError, match="LinearCrossEntropyLoss: .* must be a tensor"):
        call(loss, hidden, labels)


def test_deepcopy_of_patched_model_computes_its_own_loss(pair):
    model, ref = pair
    clone = copy.deepcopy(model)
    assert is_fused(clone)
    assert clone._hf_fused is not model._hf_fused
    assert clone.forward.__self__ is clone
    assert clone._hf_fused.original_forward(clone).__self__ is clone
    with torch.no_grad():  # perturb the ORIGINAL: the clone must not see it
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    _assert_parity(clone, ref, what="deep copy's loss")
    assert all(p.grad is None for p in model.parameters()), "the copy's backward reached the original"
    with torch.no_grad():
        assert abs(float(_loss(model)) - float(_loss(clone))) > 1e-3
    remove_fused_loss(clone)
    assert is_fused(model) and not is_fused(clone)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_save_pretrained_round_trip(tmp_path, tie):
    from safetensors import safe_open

    model, ref = patched_and_reference(make_model("llama", tie_word_embeddings=tie))
    assert model.state_dict().keys() == ref.state_dict().keys()
    model.save_pretrained(tmp_path / "patched")
    ref.save_pretrained(tmp_path / "ref")

    def saved(path):
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    got, want = saved(tmp_path / "patched"), saved(tmp_path / "ref")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert sorted(os.listdir(tmp_path / "patched")) == sorted(os.listdir(tmp_path / "ref"))
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "patched")
    assert not is_fused(reloaded) and "forward" not in reloaded.__dict__
    reloaded.train()
    _assert_parity(reloaded, ref, what="reloaded loss")
    assert is_fused(model)  # saving does not unpatch


# ----------------------------------------------------------------------------------------------- wrappers


class _DDPLike(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_module_wrapper(pair):
    model, ref = pair
    remove_fused_loss(model)
    wrapper = _DDPLike(model)
    assert find_causal_lm(wrapper) is model
    assert apply_fused_loss(wrapper) is wrapper
    assert is_fused(wrapper) and is_fused(model)
    _assert_parity(wrapper, _DDPLike(ref), what="loss through .module")
    remove_fused_loss(wrapper)
    _assert_unpatched(model)


def test_nested_wrappers_and_torch_compile(pair):
    model, ref = pair
    remove_fused_loss(model)
    compiled = torch.compile(_DDPLike(model), backend="eager")
    assert find_causal_lm(compiled) is model
    assert apply_fused_loss(compiled) is compiled
    assert is_fused(compiled) and is_fused(model)
    remove_fused_loss(compiled)
    assert not is_fused(model)
    compiled = torch.compile(model, backend="eager")
    assert compiled._orig_mod is model
    apply_fused_loss(compiled)
    assert is_fused(model) and "forward" in model.__dict__
    # The compiled module dispatches to the instance's (patched) forward. Dynamo itself is switched off
    # for the call: tracing this model costs ~5 s on 2 cores, and what is tested here is the wrapping.
    with torch._dynamo.config.patch(disable=True):
        _assert_parity(compiled, ref, what="loss through torch.compile")
        with torch.no_grad():
            assert compiled(input_ids=BATCH[0], labels=BATCH[2]).logits is None


def _replicate_like_data_parallel(module, scale=2.0):
    """What ``torch.nn.parallel.replicate`` does for one device, on CPU: every module is copied with its
    own ``_replicate_for_data_parallel`` (a shallow ``__dict__`` copy) and gets new parameter tensors
    (here ``scale · p``, so using the wrong module shows; gradients still flow to ``p``)."""
    replicas = {m: m._replicate_for_data_parallel() for m in module.modules()}
    for m, rep in replicas.items():
        for name, child in m._modules.items():
            rep._modules[name] = None if child is None else replicas[child]
        for name, p in m._parameters.items():
            rep._parameters[name] = None if p is None else p * scale
    return replicas[module]


def test_data_parallel_replica_computes_with_its_own_parameters(pair):
    model, ref = pair

    def call(m):
        return _loss(_replicate_like_data_parallel(m))

    loss, g = loss_and_grads(model, call)
    ref_loss, ref_g = loss_and_grads(ref, call)
    assert abs(float(ref_loss) - float(_loss(ref))) > 1e-2  # the replica's parameters differ
    assert_close(loss, ref_loss, "replica's loss")
    assert_same_grads(g, ref_g)


def test_find_causal_lm_rejects_non_lm():
    with pytest.raises(TypeError, match="could not find a causal LM"):
        apply_fused_loss(nn.Linear(3, 3))
    assert not is_fused(nn.Linear(3, 3))


# --------------------------------------------------------------------------------------- call conventions


def test_positional_labels(pair):
    model, ref = pair
    ids, mask, labels = BATCH
    names = list(inspect.signature(LlamaForCausalLM.forward).parameters)[1:]
    args = [dict(input_ids=ids, attention_mask=mask, labels=labels).get(n) for n in names[: names.index("labels") + 1]]
    outs = {}

    def call(m):
        outs[m is model] = out = m(*args)
        return out.loss

    _assert_parity(model, ref, call, "positional labels")
    assert outs[True].logits is None and outs[False].logits is not None
    # positional without labels: the original forward
    with torch.no_grad():
        assert torch.equal(model(ids, mask).logits, ref(ids, mask).logits)


def test_return_dict_false(pair):
    model, ref = pair
    outs = {}

    def call(m):
        out = _tuple_out = m(input_ids=BATCH[0], attention_mask=BATCH[1], labels=BATCH[2], return_dict=False)
        outs[m is model] = _tuple_out
        assert isinstance(out, tuple)
        return out[0]

    _assert_parity(model, ref, call, "tuple loss")
    assert outs[True][0].dim() == 0
    assert not any(isinstance(t, torch.Tensor) and t.shape[-1:] == (VOCAB,) for t in outs[True]), "no logits"


def test_logits_is_none_and_no_labels_runs_original(pair):
    model, ref = pair
    ids, mask, labels = BATCH
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.loss is not None and out.logits is None
    with torch.no_grad():
        out, ref_out = model(input_ids=ids, attention_mask=mask), ref(input_ids=ids, attention_mask=mask)
    assert out.loss is None and torch.equal(out.logits, ref_out.logits)


def test_all_labels_ignored_in_one_row(pair):
    model, ref = pair
    ids, mask, labels = make_batch(batch=3, seq=10, seed=7)
    labels[1] = -100
    _assert_parity(model, ref, lambda m: _loss(m, (ids, mask, labels)), "loss with a fully ignored row")


def test_logits_to_keep_with_shift_labels(pair):
    model, ref = pair
    ids, mask, labels = BATCH
    keep = 5
    shift_labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:][:, -keep:].clone()
    shift_labels[0, 0] = -100

    def ref_call(m):  # the original needs `labels` to compute a loss; shift_labels replaces them
        return m(input_ids=ids, attention_mask=mask, labels=labels, shift_labels=shift_labels, logits_to_keep=keep).loss

    def call(m):
        return m(input_ids=ids, attention_mask=mask, shift_labels=shift_labels, logits_to_keep=keep).loss

    loss, g = loss_and_grads(model, call)
    ref_loss, ref_g = loss_and_grads(ref, ref_call)
    assert_close(loss, ref_loss, "loss with logits_to_keep")
    assert_same_grads(g, ref_g)
    assert abs(float(ref_loss) - float(_loss(ref))) > 1e-4, "keeping fewer positions must change the loss"
    with pytest.raises(ValueError, match="shift_labels"):  # full-length labels cannot align with kept rows
        model(input_ids=ids, labels=labels, logits_to_keep=keep)


def test_original_forward_only(pair):
    model, ref = pair
    outs = {}

    def call(m):
        outs[m is model] = out = m(input_ids=BATCH[0], attention_mask=BATCH[1], labels=BATCH[2])
        return out.loss

    with original_forward_only(model):
        _assert_parity(model, ref, call, "original forward's loss")
        assert torch.equal(outs[True].logits, outs[False].logits)
        with original_forward_only(model):  # nests
            pass
        assert not model._hf_fused.enabled
    assert model._hf_fused.enabled
    with pytest.raises(RuntimeError, match="boom"):
        with original_forward_only(model):
            raise RuntimeError("boom")
    assert model._hf_fused.enabled and model(input_ids=BATCH[0], labels=BATCH[2]).logits is None
    with original_forward_only(ref):  # no-op on an unpatched model
        assert ref(input_ids=BATCH[0], labels=BATCH[2]).logits is not None


# ------------------------------------------------------------------------------------------ fused outputs


@pytest.mark.parametrize("arch,temperature", [("llama", 0.7), ("gemma2", 1.3), ("cohere", 1.0)])
def test_fused_output_logprobs(arch, temperature):
    model, ref = patched_and_reference(make_model(arch))
    ids, mask, labels = BATCH
    g = torch.Generator().manual_seed(11)
    w_logp, w_ent = torch.randn(labels.shape, generator=g), torch.randn(labels.shape, generator=g)
    got = {}

    def fused(m):
        out = m(input_ids=ids, attention_mask=mask, labels=labels, fused_output="logprobs",
                temperature=temperature, return_entropy=True)
        assert out.logits is None and out.loss is None
        got["logp"], got["ent"] = out.logprobs, out.entropy
        return (w_logp * out.logprobs).sum() + (w_ent * out.entropy).sum()

    def dense(m):
        logits = m(input_ids=ids, attention_mask=mask).logits
        logp, ent, valid = shifted_token_logprobs(logits, labels, temperature)
        got["ref_logp"], got["ref_ent"], got["valid"] = logp, ent * valid, valid
        return (w_logp * logp).sum() + (w_ent * ent * valid).sum()

    ref_loss, ref_g = loss_and_grads(ref, dense)
    loss, g_ = loss_and_grads(model, fused)
    assert_close(loss, ref_loss, "logprobs objective vs dense")
    assert_same_grads(g_, ref_g)
    assert got["logp"].shape == labels.shape and got["logp"].dtype == torch.float32
    assert_close(got["logp"], got["ref_logp"].detach(), "logprobs")
    assert_close(got["ent"], got["ref_ent"].detach(), "entropy")
    assert (got["logp"][~got["valid"]] == 0).all() and (got["ent"][~got["valid"]] == 0).all()
    # without return_entropy: entropy is None, logprobs identical
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_output="logprobs", temperature=temperature)
    assert out.entropy is None
    assert_close(out.logprobs, got["ref_logp"].detach(), "logprobs without entropy")


def test_fused_output_hidden_states(pair):
    model, ref = pair
    ids, mask, _ = BATCH
    weights = torch.randn(ids.shape + (model.config.hidden_size,), generator=torch.Generator().manual_seed(3))
    seen = {}
    ref.lm_head.register_forward_pre_hook(lambda mod, args: seen.__setitem__("h", args[0]))

    def fused(m):
        out = m(input_ids=ids, attention_mask=mask, fused_output="hidden_states")
        assert out.logits is None and out.loss is None
        seen["fused"] = out.last_hidden_state
        return (weights * out.last_hidden_state).sum()

    def dense(m):
        m(input_ids=ids, attention_mask=mask)
        return (weights * seen["h"]).sum()

    loss, g = loss_and_grads(model, fused)
    ref_loss, ref_g = loss_and_grads(ref, dense)
    assert_close(loss, ref_loss, "hidden-states objective")
    assert_same_grads(g, ref_g)
    assert g["lm_head.weight"] is None
    assert_close(seen["fused"], seen["h"], "hidden states")


def test_fused_output_errors(pair):
    model, _ = pair
    ids, _, labels = BATCH
    with pytest.raises(ValueError, match="fused_output"):
        model(input_ids=ids, labels=labels, fused_output="logits")
    with pytest.raises(ValueError, match="labels"):
        model(input_ids=ids, fused_output="logprobs")
    with pytest.raises(ValueError, match="labels"):
        model(input_ids=ids, fused_output="loss")


# ------------------------------------------------------------------------------------------- verify probe


class _TransformedLogits(LlamaForCausalLM):
    """An architecture whose forward transforms lm_head outputs with ``_transform`` (not in its config)."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        logits = self._transform(out.logits)
        loss = self.loss_function(logits, labels, self.config.vocab_size, **kwargs) if labels is not None else None
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class _TripledLogits(_TransformedLogits):
    @staticmethod
    def _transform(logits):
        return logits * 3


class _QuadraticLogits(_TransformedLogits):
    @staticmethod
    def _transform(logits):
        return logits + logits**2 / 100


def test_scale_the_config_does_not_state_is_read_from_the_forward():
    """The forward triples the logits and nothing in the config says so: the probe measures it."""
    model = _TripledLogits(make_model("llama").config)
    ref = copy.deepcopy(model)
    apply_fused_loss(model)
    assert model._hf_fused.transform.logit_scale == 3.0 and model._hf_fused.transform.softcap is None
    _assert_parity(model, ref, what="loss of a model that triples its logits")


def test_config_softcap_the_forward_ignores_changes_nothing():
    """Llama's forward ignores ``final_logit_softcapping``: the fused loss must too, also once logits are
    far above the cap (there a wrongly applied cap would move the loss by far more than the tolerance)."""
    model = make_model("llama", tie_word_embeddings=False)
    model.config.final_logit_softcapping = 2.0
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # logits of tens, well past the cap
    ref = copy.deepcopy(model)
    apply_fused_loss(model)
    assert model._hf_fused.transform.softcap is None
    _assert_parity(model, ref, what="loss with a config soft-cap the forward ignores")


def test_softcap_is_measured_even_when_real_logits_stay_below_it():
    """Gemma 2 caps at its config's value; the probe drives lm_head past it, so a cap the fused path
    dropped could not pass unnoticed even with tiny random logits."""
    model = make_model("gemma2")
    apply_fused_loss(model)
    assert model._hf_fused.transform.softcap == model.config.final_logit_softcapping


def test_verify_probe_rejects_unknown_transform():
    model = _QuadraticLogits(make_model("llama").config)
    with pytest.raises(FusedLossVerificationError, match="llama") as info:
        apply_fused_loss(model)
    assert "_QuadraticLogits" in str(info.value) and "verify=False" in str(info.value)
    assert not is_fused(model)
    apply_fused_loss(model, verify=False)  # at the user's own risk
    assert is_fused(model)
    with torch.no_grad():
        assert model(input_ids=BATCH[0], labels=BATCH[2]).logits is None


def test_verify_probe_passes_and_restores_train_mode():
    model = make_model("gemma2")
    model.train()
    model.model.layers[0].eval()  # a mixed train/eval state must be restored exactly
    modes = {n: m.training for n, m in model.named_modules()}
    apply_fused_loss(model)
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert all(p.grad is None for p in model.parameters())


def test_an_attention_that_needs_arguments_of_its_own_is_probed_with_eager_and_kept():
    """An attention implementation registered by another library may need arguments on every call (TRL's
    ``AsyncGRPOTrainer`` loads its model with ``tree_fa3``, which reads the packed batch's tree indices): the patch's
    probes run transformers' eager attention instead (the fused and the original forward through the same one), and
    the model keeps its own afterwards, in every config that named it. Training calls then pass its arguments."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def needs_a_tag(module, query, key, value, attention_mask, *, tag, **kwargs):
        assert tag == "ok"
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("needs_a_tag", needs_a_tag)
    model = make_model()
    model.config._attn_implementation = "needs_a_tag"
    with pytest.raises(TypeError, match="tag"):
        model(input_ids=torch.tensor([[1, 2, 3]]))  # what the probe would have run into
    apply_fused_loss(model)
    assert is_fused(model) and model.config._attn_implementation == "needs_a_tag"
    assert all(m.config._attn_implementation == "needs_a_tag" for m in model.modules() if hasattr(m, "config"))
    ids = torch.tensor([[1, 2, 3, 4]])
    out = model(input_ids=ids, labels=ids, tag="ok")
    model.config._attn_implementation = "sdpa"
    ref = remove_fused_loss(copy.deepcopy(model))(input_ids=ids, labels=ids)
    assert_close(out.loss, ref.loss, "loss under the model's own attention against sdpa's")
