"""The patched forward matches each architecture's own forward: loss AND every parameter gradient.

Every test builds a tiny model from a config (see ``models``), deep-copies it as the unpatched
reference, patches the original with :func:`hf_fused.apply_fused_loss` and compares. Architectures cover
the logit transforms hf_fused reads from configs (Gemma 2 / Gemma 3 soft-cap, Cohere ``logit_scale``,
Granite ``logits_scaling``) and the MoE router auxiliary loss (Qwen3-MoE, Mixtral).
"""

from __future__ import annotations

import inspect

import pytest
import torch

from models import ARCH_NAMES, VOCAB, loss_and_grads, make_batch, make_model, patched_and_reference  # noqa: E402
from references import assert_close, assert_same_grads  # noqa: E402

from hf_fused import apply_fused_loss, is_fused  # noqa: E402

MOE = {"qwen3_moe", "mixtral"}
TRANSFORMED = {"gemma2": "softcap", "gemma3_text": "softcap", "cohere": "scale", "granite": "scale"}


def _pair(arch, tie=None):
    model = make_model(arch, tie_word_embeddings=tie)
    return patched_and_reference(model)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_loss_and_grads_match(arch, tie):
    """Labels with -100 (prompt prefix + padding); loss, logits=None, every parameter gradient."""
    patched, ref = _pair(arch, tie)
    assert is_fused(patched) and not is_fused(ref)
    ids, mask, labels = make_batch()
    assert (labels == -100).any()

    outs = {}

    def call(key):
        def f(m):
            out = m(input_ids=ids, attention_mask=mask, labels=labels)
            outs[key] = out
            return out.loss
        return f

    loss, g = loss_and_grads(patched, call("patched"))
    ref_loss, ref_g = loss_and_grads(ref, call("ref"))
    assert outs["patched"].logits is None
    assert outs["ref"].logits is not None
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert_close(loss, ref_loss, f"{arch} loss")
    assert_same_grads(g, ref_g)
    head = patched.get_output_embeddings().weight
    assert g["lm_head.weight" if not tie else "model.embed_tokens.weight"].abs().sum() > 0
    assert (head is patched.get_input_embeddings().weight) == bool(patched.config.tie_word_embeddings)

    if arch in MOE:
        # the router auxiliary loss is returned and added exactly as the original adds it
        aux, ref_aux = outs["patched"].aux_loss, outs["ref"].aux_loss
        assert aux is not None and ref_aux is not None
        assert_close(aux, ref_aux, "aux_loss")
        coef = patched.config.router_aux_loss_coef
        assert (coef * ref_aux).abs() > 1e-3 * ref_loss.abs(), "aux loss too small for the test to notice it"
        assert outs["patched"].router_logits is not None


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_num_items_in_batch_and_shift_labels(arch):
    """As Trainer passes them: ``num_items_in_batch`` (sum / N) and pre-shifted ``shift_labels``."""
    patched, ref = _pair(arch)
    ids, mask, labels = make_batch(seed=3)
    # a count larger than this micro-batch's own (as with gradient accumulation), as a tensor
    n_items = (labels[:, 1:] != -100).sum() + 7

    def with_items(m):
        return m(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=n_items).loss

    loss, g = loss_and_grads(patched, with_items)
    ref_loss, ref_g = loss_and_grads(ref, with_items)
    assert_close(loss, ref_loss, "loss with num_items_in_batch")
    assert_same_grads(g, ref_g)
    with torch.no_grad():
        mean_loss = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert abs(float(mean_loss) - float(ref_loss)) > 1e-3, "num_items_in_batch must change the loss"

    # shift_labels that are NOT labels shifted: the fused path must use them
    g_ = torch.Generator().manual_seed(5)
    shift_labels = torch.randint(0, VOCAB, labels.shape, generator=g_)
    shift_labels[0, :3] = -100
    shift_labels[:, -1] = -100

    def with_shift(m, pass_labels=True):
        kwargs = dict(labels=labels) if pass_labels else {}
        return m(input_ids=ids, attention_mask=mask, shift_labels=shift_labels, **kwargs).loss

    ref_loss, ref_g = loss_and_grads(ref, with_shift)
    for pass_labels in (True, False):  # shift_labels alone is enough for the patched model
        loss, g = loss_and_grads(patched, lambda m: with_shift(m, pass_labels))
        assert_close(loss, ref_loss, f"loss with shift_labels (labels passed: {pass_labels})")
        assert_same_grads(g, ref_g)


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_generation_and_signature_untouched(arch):
    """Without labels the patched forward is the original: same logits, same greedy generate(), same
    ``inspect.signature``."""
    patched, ref = _pair(arch)
    assert inspect.signature(patched.forward) == inspect.signature(ref.forward)
    assert inspect.signature(patched.forward) == inspect.signature(type(patched).forward.__get__(patched))
    patched.eval(), ref.eval()
    ids, mask, _ = make_batch(batch=2, seq=6, ignore=False)
    with torch.no_grad():
        out, ref_out = patched(input_ids=ids, attention_mask=mask), ref(input_ids=ids, attention_mask=mask)
    assert torch.equal(out.logits, ref_out.logits)
    gen_kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    seq = patched.generate(input_ids=ids, attention_mask=mask, **gen_kwargs)
    ref_seq = ref.generate(input_ids=ids, attention_mask=mask, **gen_kwargs)
    assert seq.shape == (2, 12)
    assert torch.equal(seq, ref_seq)
    assert is_fused(patched)


@pytest.mark.parametrize("arch", sorted(TRANSFORMED))
def test_logit_transform_is_exercised(arch):
    """The config's transform visibly changes this tiny model's logits (so the parity tests above would
    fail if hf_fused missed it), and hf_fused reads it from the config."""
    model = make_model(arch)
    raw = {}
    handle = model.get_output_embeddings().register_forward_hook(lambda mod, inp, out: raw.setdefault("z", out))
    ids, mask, _ = make_batch(ignore=False)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    handle.remove()
    z = raw["z"]
    assert (logits - z).norm() > 0.05 * z.norm(), f"{arch}: the logit transform barely changes the logits"
    apply_fused_loss(model)
    transform = model._hf_fused.transform
    if TRANSFORMED[arch] == "softcap":
        cap = model.config.final_logit_softcapping
        assert transform.softcap == cap
        assert z.abs().max() > cap, "soft-cap not reached: tanh would be nearly linear"
        torch.testing.assert_close(logits, cap * torch.tanh(z / cap))
    else:
        assert transform.softcap is None
        torch.testing.assert_close(logits, z * transform.logit_scale)
        assert transform.logit_scale != 1.0


@pytest.mark.parametrize("arch", sorted(MOE))
def test_moe_without_router_logits(arch):
    """MoE with ``output_router_logits=False``: no aux loss on either side."""
    model = make_model(arch, output_router_logits=False)
    patched, ref = patched_and_reference(model)
    ids, mask, labels = make_batch()
    f = lambda m: m(input_ids=ids, attention_mask=mask, labels=labels).loss  # noqa: E731
    loss, g = loss_and_grads(patched, f)
    ref_loss, ref_g = loss_and_grads(ref, f)
    assert_close(loss, ref_loss, "loss")
    assert_same_grads(g, ref_g)
    # and the per-call override turns it on exactly as the original does
    f_on = lambda m: m(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True).loss  # noqa: E731
    loss, g = loss_and_grads(patched, f_on)
    ref_loss, ref_g = loss_and_grads(ref, f_on)
    assert_close(loss, ref_loss, "loss with output_router_logits=True")
    assert_same_grads(g, ref_g)
    with torch.no_grad():
        assert abs(float(loss) - float(f(ref))) > 1e-4, "the aux loss must change the loss"
