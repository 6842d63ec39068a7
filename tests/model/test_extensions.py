"""The model layer's extension point (``hf_fused.model.extensions``): an extension's keyword is answered by its own
forward, which can intercept the lm_head call with its own head; it hears of every patch and removal of the causal
LM (through wrappers); two extensions cannot answer one keyword; the list of patched models never keeps one alive."""

from __future__ import annotations

import copy
import gc
import inspect
import weakref

import pytest
import torch

from hf_fused import apply_fused_loss, remove_fused_loss
from hf_fused.model import (
    FusedRequest,
    ModelExtension,
    as_kwargs,
    intercept_lm_head,
    patched_models,
    register_extension,
    registered_extensions,
    unregister_extension,
)
from models import make_batch, make_model


@pytest.fixture
def extension():
    """A test extension answering ``sum_of_hidden=True`` with the sum of the states lm_head receives."""
    heard = []

    def forward(model, *args, **kwargs):
        original = model._hf_fused.original_forward(model)
        kwargs = as_kwargs(inspect.signature(original), args, kwargs)
        kwargs.pop("sum_of_hidden")
        request = FusedRequest(mode="logprobs", state=model._hf_fused)
        request.head = lambda lm_head, hidden: hidden.sum()  # in place of the mode's op
        with intercept_lm_head(model.get_output_embeddings(), request):
            original(**kwargs)
        return request.result

    ext = ModelExtension("test_sum", call_keyword="sum_of_hidden", forward=forward,
                         on_patch=lambda m: heard.append(("patch", m)), on_remove=lambda m: heard.append(("remove", m)))
    register_extension(ext)
    try:
        yield heard
    finally:
        unregister_extension("test_sum")


def test_keyword_is_answered_by_the_extension_with_its_own_head(extension):
    model = make_model("llama")
    input_ids = make_batch()[0]
    with torch.no_grad():
        hidden = model(input_ids=input_ids, output_hidden_states=True).hidden_states[-1]
    apply_fused_loss(model)
    with torch.no_grad():
        got = model(input_ids=input_ids, sum_of_hidden=True)
    torch.testing.assert_close(got, hidden.sum())


def test_extension_hears_of_patch_and_removal_of_the_causal_lm(extension):
    peft = pytest.importorskip("peft")
    model = make_model("llama")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    causal_lm = wrapped.get_base_model()
    apply_fused_loss(wrapped, verify=False)
    remove_fused_loss(wrapped)
    assert extension == [("patch", causal_lm), ("remove", causal_lm)]


def test_extensions_run_in_order_and_removal_in_reverse(extension):
    order = []
    register_extension(ModelExtension("test_second", on_patch=lambda m: order.append("second patch"),
                                      on_remove=lambda m: order.append("second remove")))
    try:
        model = apply_fused_loss(make_model("llama"), verify=False)
        remove_fused_loss(model)
    finally:
        unregister_extension("test_second")
    names = [e.name for e in registered_extensions()]
    assert names[-1] == "test_sum" and "test_second" not in names
    assert [kind for kind, _ in extension] == ["patch", "remove"]
    assert order == ["second patch", "second remove"]


def test_one_keyword_one_extension(extension):
    with pytest.raises(ValueError, match="already answered by 'test_sum'"):
        register_extension(ModelExtension("other", call_keyword="sum_of_hidden", forward=lambda m, **kw: None))
    with pytest.raises(ValueError, match="go together"):
        ModelExtension("half", call_keyword="x")


def test_patched_models_lists_copies_and_keeps_none_alive():
    model = apply_fused_loss(make_model("llama"), verify=False)
    clone = copy.deepcopy(model)
    listed = patched_models()
    assert any(m is model for m in listed) and any(m is clone for m in listed)
    refs = [weakref.ref(model), weakref.ref(clone)]
    del model, clone, listed
    gc.collect()
    assert all(ref() is None for ref in refs)


class _LogitsWithoutTheModule(torch.nn.Module):
    """A causal LM whose forward takes its logits from ``F.linear`` on lm_head's weight, never calling the module."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def get_output_embeddings(self):
        return self.inner.lm_head

    def forward(self, input_ids=None, labels=None, return_dict=True):
        hidden = self.inner.model(input_ids=input_ids).last_hidden_state
        return {"logits": torch.nn.functional.linear(hidden, self.inner.lm_head.weight)}


def test_a_forward_that_never_calls_its_lm_head_is_refused():
    """run_intercepted (every intercepted call: the patched forward, TRL's head, both distillation heads): a forward
    that never calls lm_head gets a RuntimeError naming the model, its head and what hf_fused cannot do, not a
    result read from an empty request. Through the public call too (a model patched without verification)."""
    from hf_fused.model import run_intercepted

    model = _LogitsWithoutTheModule(make_model("llama"))
    request = FusedRequest(mode="loss", state=None)
    with pytest.raises(RuntimeError, match=r"_LogitsWithoutTheModule.forward did not call its lm_head \(Linear\); "
                                           r"hf_fused cannot serve the test for this model\. Call remove_fused_loss"):
        run_intercepted(model, model.forward, {"input_ids": make_batch()[0]}, request, "serve the test")

    bypass = make_model("llama")
    input_ids, labels = make_batch()[:2]

    def forward(self, input_ids=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids).last_hidden_state
        return {"logits": torch.nn.functional.linear(hidden, self.lm_head.weight)}

    bypass.__class__ = type("Bypass", (type(bypass),), {"forward": forward})
    apply_fused_loss(bypass, verify=False)
    with pytest.raises(RuntimeError, match="Bypass.forward did not call its lm_head .*compute the loss from hidden"):
        bypass(input_ids=input_ids, labels=labels)
