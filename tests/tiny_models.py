"""Tiny causal LMs built from configs (no downloads) and the parity helpers the model-layer tests share.

Every model has hidden size 32, 2 layers, 4 attention heads and a small vocabulary, and is built in fp32
with a fixed seed. ``initializer_range`` is raised from the usual 0.02 so the logits are O(1): then the
architectures' logit transforms (Gemma's soft-cap, Cohere's ``logit_scale``, Granite's
``logits_scaling``) change the loss visibly and a fused path that missed one would fail.

Parity helpers compare a patched model against an unpatched deep copy on the loss AND every parameter
gradient with the relative error ``‖a − b‖ / ‖b‖ ≤ 1e-5`` (fp32).
"""

from __future__ import annotations

import copy
from typing import Callable, Optional

import pytest
import torch
import transformers

HIDDEN = 32
LAYERS = 2
HEADS = 4
VOCAB = 128
RTOL = 1e-5

@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine the OpenMP pool
    oversubscribes (10x slower). Import this fixture into a test module to run it on one thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


#: Common config fields; every architecture accepts these.
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=64,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

#: name → (config class, model class, architecture-specific config fields).
ARCHITECTURES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=8, sliding_window=None)),
    # final_logit_softcapping small so tanh actually bends O(1) logits
    "gemma2": (
        "Gemma2Config", "Gemma2ForCausalLM",
        dict(head_dim=8, final_logit_softcapping=1.0, attn_logit_softcapping=50.0, query_pre_attn_scalar=8,
             sliding_window=16),
    ),
    "gemma3_text": (
        "Gemma3TextConfig", "Gemma3ForCausalLM",
        dict(head_dim=8, final_logit_softcapping=1.5, query_pre_attn_scalar=8, sliding_window=16),
    ),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(logit_scale=0.5)),
    "granite": (
        "GraniteConfig", "GraniteForCausalLM",
        dict(logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.25),
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "qwen3_moe": (
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        dict(head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
             output_router_logits=True, router_aux_loss_coef=0.1),
    ),
    "mixtral": (
        "MixtralConfig", "MixtralForCausalLM",
        dict(head_dim=8, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
             router_aux_loss_coef=0.1, sliding_window=None),
    ),
}

#: The architectures the per-architecture parity suite runs (MoE included).
ARCH_NAMES = list(ARCHITECTURES)


def make_config(arch: str = "llama", *, tie_word_embeddings: Optional[bool] = None, **overrides):
    config_cls, _, extra = ARCHITECTURES[arch]
    fields = {**_COMMON, **extra, **overrides}
    if tie_word_embeddings is not None:
        fields["tie_word_embeddings"] = tie_word_embeddings
    config = getattr(transformers, config_cls)(**fields)
    config._attn_implementation = "eager"
    return config


def make_model(arch: str = "llama", *, seed: int = 0, tie_word_embeddings: Optional[bool] = None, **overrides):
    """A tiny fp32 ``*ForCausalLM`` in train mode (dropouts are 0 in every config, so it is deterministic)."""
    config = make_config(arch, tie_word_embeddings=tie_word_embeddings, **overrides)
    model_cls = getattr(transformers, ARCHITECTURES[arch][1])
    torch.manual_seed(seed)
    model = model_cls(config).float()
    if tie_word_embeddings is False:
        assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    elif tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    model.train()
    return model


def make_batch(batch: int = 2, seq: int = 12, *, seed: int = 1, vocab: int = VOCAB, ignore: bool = True):
    """``(input_ids, attention_mask, labels)``; labels have -100 on a prompt prefix and on padding, with a
    different number of ignored tokens per row."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (batch, seq), generator=g)
    attention_mask = torch.ones_like(input_ids)
    labels = input_ids.clone()
    if ignore:
        for row in range(batch):
            prefix = 1 + (row * 3) % max(1, seq // 2)
            labels[row, :prefix] = -100
            if row % 2 == 1:  # right padding on odd rows
                pad = 2 + row % 3
                input_ids[row, -pad:] = 0
                attention_mask[row, -pad:] = 0
                labels[row, -pad:] = -100
    return input_ids, attention_mask, labels


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    denom = b.norm()
    if denom == 0:
        return float((a - b).norm())
    return float((a - b).norm() / denom)


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str = "", rtol: float = RTOL) -> None:
    assert a is not None and b is not None, f"{what}: one side is None ({a is None}, {b is None})"
    assert a.shape == b.shape, f"{what}: shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    err = rel_err(a, b)
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol}"


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter's gradient by name (a missing gradient shows up as ``None``); names
    without ``torch.compile``'s ``_orig_mod.`` prefix."""
    return {n.replace("_orig_mod.", ""): (p.grad.detach().clone() if p.grad is not None else None) for n, p in model.named_parameters()
            if p.requires_grad}


def assert_same_grads(got: dict, ref: dict, rtol: float = RTOL, *, require_nonzero: bool = True) -> None:
    assert got.keys() == ref.keys(), f"parameter names differ: {set(got) ^ set(ref)}"
    for name, r in ref.items():
        g = got[name]
        assert (g is None) == (r is None), f"{name}: gradient is None on one side only ({g is None}, {r is None})"
        if r is None:
            continue
        assert_close(g, r, f"grad {name}", rtol)
    if require_nonzero:
        assert any(r is not None and r.abs().sum() > 0 for r in ref.values()), "reference gradients are all zero"


def loss_and_grads(model: torch.nn.Module, call: Callable[[torch.nn.Module], torch.Tensor], seed: Optional[int] = None):
    """Zero grads, run ``call(model)`` → scalar, backward; returns ``(loss, grads)``. With ``seed``, seeds the
    RNG right before the forward (so dropout masks match between two models)."""
    model.zero_grad(set_to_none=True)
    if seed is not None:
        torch.manual_seed(seed)
    loss = call(model)
    loss.backward()
    return loss.detach(), grads(model)


def patched_and_reference(model: torch.nn.Module, **apply_kwargs):
    """``(patched, reference)``: ``reference`` is an unpatched deep copy taken before patching."""
    from hf_fused import apply_fused_loss

    reference = copy.deepcopy(model)
    apply_fused_loss(model, **apply_kwargs)
    return model, reference


def shifted_token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0):
    """Reference ``(logprobs [B, T], entropy [B, T])`` from full logits, aligned like the fused output:
    position t scores ``labels[t + 1]``; 0 where the target is -100 (and at the last position)."""
    targets = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    mask = targets != -100
    logp = logp_all.gather(-1, targets.clamp_min(0)[..., None]).squeeze(-1) * mask
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy, mask
