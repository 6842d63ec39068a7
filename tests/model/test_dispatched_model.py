"""A model dispatched by accelerate (``from_pretrained(device_map=...)``: TRL 1.16 loads a DPO or KTO reference model
with ``device_map="auto"`` under FSDP, which splits it over every GPU a rank sees). The original forward's outputs
come back on the inputs' device (accelerate's ``io_same_device`` hook); the patched forward's loss, log-probs and
entropy must too, with the unpatched model's values and gradients, and ``apply_fused_loss``'s verification must pass
on it (2 GPUs; lm_head with the final norm, or tied to the embeddings on the other GPU). The hook accelerate puts on lm_head itself (moving its input to lm_head's device) still runs around
hf_fused's head (CPU, with a hook of accelerate's that records what it hands on), and a model offloaded by accelerate
(weights on meta between calls) scores through the fused head (CPU)."""

from __future__ import annotations

import pytest
import torch

from models import loss_and_grads, make_batch, make_model
from references import assert_close, assert_same_grads, shifted_token_logprobs

from hf_fused import apply_fused_loss


def _dispatched(path, tied):
    """Two copies of a tiny fp32 Llama, embeddings and layer 0 on cuda:0, layer 1 and the norm on cuda:1; lm_head on
    cuda:1, or, ``tied`` to the embeddings, with them on cuda:0 (the final hidden states cross back to it)."""
    from transformers import LlamaForCausalLM

    make_model("llama", tie_word_embeddings=tied).save_pretrained(path)
    first = ["embed_tokens", "rotary_emb", "layers.0"]
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    device_map = {f"model.{name}": 0 if name in first else 1
                  for name, _ in model.model.named_children() if name != "layers"}
    device_map.update({f"model.layers.{i}": 0 if i == 0 else 1 for i in range(len(model.model.layers))})
    device_map["lm_head"] = 0 if tied else 1
    return [LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, device_map=device_map).train()
            for _ in range(2)]


@pytest.mark.multigpu
@pytest.mark.parametrize("tied", [False, True])
def test_a_model_dispatched_over_two_gpus_answers_on_its_inputs_device(tmp_path, tied):
    stock, fused = _dispatched(tmp_path, tied)
    assert fused.lm_head.weight.device == torch.device("cuda", 0 if tied else 1)
    assert fused.model.norm.weight.device == torch.device("cuda", 1)
    assert fused.model.embed_tokens.weight.device == torch.device("cuda", 0)
    assert (fused.lm_head.weight is fused.model.embed_tokens.weight) == tied
    apply_fused_loss(fused)  # its verification compares the fused log-probs with the original forward's

    input_ids, attention_mask, labels = (t.to("cuda:0") for t in make_batch())
    call = lambda m: m(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss  # noqa: E731
    ref_loss, ref_grads = loss_and_grads(stock, call)
    loss, got_grads = loss_and_grads(fused, call)
    assert loss.device == ref_loss.device == input_ids.device
    assert_close(loss, ref_loss, "loss")
    assert_same_grads(got_grads, ref_grads)

    with torch.no_grad():
        logits = stock(input_ids=input_ids, attention_mask=attention_mask).logits
        out = fused(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_output="logprobs",
                    return_entropy=True)
    ref_logp, ref_entropy, mask = shifted_token_logprobs(logits, labels)
    assert out.logprobs.device == out.entropy.device == input_ids.device
    assert_close(out.logprobs, ref_logp, "log-probs")
    assert_close(out.entropy * mask, ref_entropy * mask, "entropy")


@pytest.mark.parametrize("tied", [False, True])
def test_accelerates_hook_on_lm_head_runs_around_the_fused_head(tied):
    """accelerate's ``AlignDevicesHook`` (what ``dispatch_model`` puts on each module) and a recording hook of
    accelerate's on lm_head: the fused forward's lm_head call still goes through them (the hook's ``pre_forward``
    sees the hidden states), the loss and every gradient as the unpatched model with the same hooks, and the hooked
    forward is in place again afterwards."""
    from accelerate.hooks import AlignDevicesHook, ModelHook, SequentialHook, add_hook_to_module

    class Recording(ModelHook):
        def __init__(self):
            self.shapes = []

        def pre_forward(self, module, *args, **kwargs):
            self.shapes.append(tuple(args[0].shape))
            return args, kwargs

    models, hooks = [], []
    for _ in range(2):
        model = make_model("llama", tie_word_embeddings=tied)
        hooks.append(Recording())
        add_hook_to_module(model.lm_head, SequentialHook(AlignDevicesHook(execution_device=torch.device("cpu")),
                                                         hooks[-1]))
        models.append(model)
    stock, fused = models
    hooked_forward, old_forward = fused.lm_head.forward, fused.lm_head._old_forward
    apply_fused_loss(fused)
    hooks[1].shapes.clear()  # the verification's probe calls

    input_ids, attention_mask, labels = make_batch()
    call = lambda m: m(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss  # noqa: E731
    ref_loss, ref_grads = loss_and_grads(stock, call)
    loss, got_grads = loss_and_grads(fused, call)
    assert hooks[1].shapes == hooks[0].shapes == [(*input_ids.shape, fused.config.hidden_size)]
    assert_close(loss, ref_loss, "loss")
    assert_same_grads(got_grads, ref_grads)
    assert fused.lm_head.forward is hooked_forward and fused.lm_head._old_forward is old_forward


@pytest.mark.parametrize("tied", [False, True])
def test_an_offloaded_model_scores_through_the_fused_head(tied):
    """accelerate's offload (``cpu_offload``; a ``device_map`` with ``"cpu"`` or ``"disk"`` entries, as a large
    reference model may get) keeps every weight on the meta device between calls and loads each module's in its
    hook: ``apply_fused_loss`` verifies on it (the probe's tokens go to the hook's execution device), and the fused
    log-probs, entropy and loss (no gradient: offloaded weights are not trained) equal the unpatched model's."""
    from accelerate import cpu_offload

    stock = make_model("llama", tie_word_embeddings=tied).eval()
    fused = cpu_offload(make_model("llama", tie_word_embeddings=tied).eval(), execution_device=torch.device("cpu"))
    assert fused.lm_head.weight.is_meta
    apply_fused_loss(fused)
    input_ids, attention_mask, labels = make_batch()
    with torch.no_grad():
        logits = stock(input_ids=input_ids, attention_mask=attention_mask).logits
        ref_loss = stock(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        out = fused(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_output="logprobs",
                    return_entropy=True)
        loss = fused(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    ref_logp, ref_entropy, mask = shifted_token_logprobs(logits, labels)
    assert_close(out.logprobs, ref_logp, "log-probs")
    assert_close(out.entropy * mask, ref_entropy * mask, "entropy")
    assert_close(loss, ref_loss, "loss")
    assert fused.lm_head.weight.is_meta  # offloaded again after each call
