"""Which logit transform a causal LM's forward applies to its lm_head output: read from the forward itself.

A config attribute is a claim; the forward is the truth (Llama ignores a ``final_logit_softcapping`` its
config may carry). So the transform is measured: on a short probe the lm_head call is intercepted and
answers with known raw logits, spread from ``±2**-6`` to ``±2**14`` (far past any soft-cap), and the
original forward's output logits show what it does to them. The config's reading
(:func:`config_logit_transform`) is taken when it reproduces that map (its constants are exact);
otherwise a scale and soft-cap fitted to the map are, when they reproduce it; otherwise
:class:`FusedLossVerificationError` names the model type.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.nn as nn

from ..ops import LogitTransform
from .distributed import gathered_per_module
from .forward import lm_head_answering
from .tensor_parallel import local_hidden

#: Probe batch ``[batch, tokens]``: short, so a probe costs about one tiny forward.
PROBE_SHAPE = (2, 8)

#: Raw logits fed to the forward: 0 and ±2**k for k in [-6, 14] (exact in fp32, bf16 and fp16);
#: the small ones show the scale, the large ones a soft-cap.
_GRID = torch.tensor([0.0] + [s * 2.0**k for k in range(-6, 15) for s in (1.0, -1.0)], dtype=torch.float64)


class FusedLossVerificationError(RuntimeError):
    """The fused path did not reproduce the original forward (its logit transform or its log-probabilities)."""


def config_logit_transform(causal_lm: nn.Module) -> LogitTransform:
    """The transform ``causal_lm``'s config describes (what transformers' models read):

    - ``final_logit_softcapping`` (Gemma 2/3/4, nanochat): ``softcap · tanh(z / softcap)``.
    - ``logit_scale`` (Cohere, Cohere2): ``z · logit_scale`` (the model keeps it as an attribute).
    - ``logits_scaling`` (Granite, GraniteMoE): ``z / logits_scaling``.
    - ``lm_head_multiplier`` (Falcon-H1): ``z · lm_head_multiplier``.
    """
    config = causal_lm.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = 1.0
    logit_scale = getattr(causal_lm, "logit_scale", getattr(text_config, "logit_scale", None))
    if isinstance(logit_scale, (int, float)):
        scale *= float(logit_scale)
    logits_scaling = getattr(text_config, "logits_scaling", None)
    if isinstance(logits_scaling, (int, float)):
        scale /= float(logits_scaling)
    multiplier = getattr(text_config, "lm_head_multiplier", None)
    if isinstance(multiplier, (int, float)):
        scale *= float(multiplier)
    softcap = getattr(text_config, "final_logit_softcapping", None)
    return LogitTransform(logit_scale=scale, softcap=float(softcap) if softcap else None)


@contextmanager
def probe_inputs(causal_lm: nn.Module) -> Iterator[torch.Tensor]:
    """Probe token ids (:data:`PROBE_SHAPE`, seed 0, below the vocabulary size, on the input embeddings' device),
    with ``causal_lm`` in the state a probe needs for the block: every module in eval mode (dropout off, so the
    forward is a fixed map of lm_head's output) and, for a ZeRO-3 model not yet in its engine, its parameters
    gathered module by module (:func:`~hf_fused.model.distributed.gathered_per_module`; collective: every rank
    must run the same forward). Each module's training flag is restored on exit. Run forwards under
    ``torch.no_grad()``.

    Raises:
        FusedLossVerificationError: neither lm_head nor the config tells the vocabulary size.
    """
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, _probe_vocab_size(causal_lm), PROBE_SHAPE, generator=generator)
    input_ids = input_ids.to(_probe_device(causal_lm))
    modes = {m: m.training for m in causal_lm.modules()}
    causal_lm.eval()
    try:
        # Forwards go through the module call (a patched model without labels runs its original forward), so
        # the hooks of a wrapper such as FSDP2's fully_shard or ZeRO-3 gather the parameters.
        with gathered_per_module(causal_lm), own_attention(causal_lm):
            yield input_ids
    finally:
        for module, training in modes.items():
            module.training = training


#: transformers' own attention implementations: a forward with only the probe's arguments runs with any of them.
_OWN_ATTENTION = ("eager", "sdpa", "flex_attention")
_OWN_ATTENTION_PREFIXES = ("flash_attention_", "paged|")


@contextmanager
def own_attention(causal_lm: nn.Module) -> Iterator[None]:
    """Within the block, a model whose config names an attention implementation registered by another library runs
    transformers' ``eager`` attention instead; restored on exit, every config as it was. Such an implementation
    may need arguments of its own on every call: TRL's ``AsyncGRPOTrainer`` loads its model with ``tree_fa3``, whose
    attention reads the packed batch's tree indices (``tree_kv_index``, ``tree_cu_seqlens_q``...), which a probe
    does not have. The probe measures lm_head's transform and compares the fused log-probabilities with the
    original forward's through the same attention, so which attention runs does not change what it checks."""
    saved = {}
    for config in (getattr(m, "config", None) for m in causal_lm.modules()):
        if not hasattr(config, "to_dict"):
            continue
        for sub in [config, *(getattr(config, key, None) for key in getattr(config, "sub_configs", None) or {})]:
            if sub is not None and id(sub) not in saved and "_attn_implementation_internal" in vars(sub):
                saved[id(sub)] = (sub, sub._attn_implementation_internal)
    foreign = [(config, name) for config, name in saved.values()
               if isinstance(name, str) and name not in _OWN_ATTENTION and not name.startswith(_OWN_ATTENTION_PREFIXES)]
    for config, _ in foreign:
        config._attn_implementation_internal = "eager"  # this config alone: its sub-configs are in ``saved`` too
    try:
        yield
    finally:
        for config, name in foreign:
            config._attn_implementation_internal = name


@torch.no_grad()
def measure_logit_transform(causal_lm: nn.Module) -> LogitTransform:
    """The logit transform ``causal_lm``'s forward applies, measured by :func:`probe_logit_transform` on
    :func:`probe_inputs` (one short forward; training flags restored, no gradients, parameters untouched).
    The forward must be runnable: parameters materialized (not on the meta device), on one device or
    dispatched by accelerate, or ZeRO-3/FSDP2-sharded with every rank calling this.

    Raises:
        FusedLossVerificationError: as :func:`probe_logit_transform`.
    """
    with probe_inputs(causal_lm) as input_ids:
        return probe_logit_transform(causal_lm, input_ids)


@torch.no_grad()
def probe_logit_transform(causal_lm: nn.Module, input_ids: torch.Tensor) -> LogitTransform:
    """The transform ``causal_lm``'s forward applies to lm_head outputs, measured on ``input_ids``
    (see the module docstring). The model must be in eval mode (:func:`probe_inputs` puts it there); its forward
    runs once, through the module call (so wrapper hooks such as FSDP2's and ZeRO-3's gather run).

    Raises:
        FusedLossVerificationError: the forward's map is neither the config's transform nor a fitted
            scale and soft-cap, naming the model type.
    """
    seen = {}

    def answer(hidden):
        hidden, as_output = local_hidden(hidden)  # torch's ColwiseParallel hands lm_head a replicated DTensor
        seen["dtype"] = hidden.dtype
        return as_output(_GRID.to(hidden.device, hidden.dtype).expand(*hidden.shape[:-1], _GRID.numel()).contiguous())

    with lm_head_answering(causal_lm.get_output_embeddings(), answer):
        out = causal_lm(input_ids=input_ids, use_cache=False)
    logits = out.logits if hasattr(out, "logits") else out[0]
    name = _model_name(causal_lm)
    if logits is None or logits.shape[-1] != _GRID.numel():
        raise FusedLossVerificationError(
            f"hf_fused could not read the logit transform of {name}: its forward does not return lm_head's "
            "output as logits of the same width. "
            "Pass verify=False (to apply_fused_loss or LinearCrossEntropyLoss.from_model) to use the config's "
            "transform anyway (at your own risk)."
        )
    got = logits.reshape(-1, _GRID.numel())[-1].double().cpu()
    rtol = _rtol(seen.get("dtype", logits.dtype), logits.dtype)
    candidates = [config_logit_transform(causal_lm)]
    fitted = _fit(got)
    if fitted is not None:
        candidates.append(fitted)
    for candidate in candidates:
        if _reproduces(candidate, got, rtol):
            return candidate
    raise FusedLossVerificationError(
        f"hf_fused could not reproduce the logit transform of {name}: for raw logits {_GRID.tolist()} its "
        f"forward returns {got.tolist()}, which neither the config's {candidates[0]} nor a fitted scale and "
        "soft-cap reproduce. This architecture transforms lm_head outputs in a way hf_fused does not "
        "support. Pass verify=False (to apply_fused_loss or LinearCrossEntropyLoss.from_model) to use the "
        "config's transform anyway (at your own risk)."
    )


def _rtol(*dtypes: torch.dtype) -> float:
    # One rounding of the returned logits (and of any intermediate) in the coarsest dtype involved.
    eps = max(torch.finfo(d).eps if d.is_floating_point else 0.0 for d in dtypes)
    return 16 * max(eps, torch.finfo(torch.float32).eps)


def _reproduces(transform: LogitTransform, got: torch.Tensor, rtol: float) -> bool:
    want, _ = transform.forward(_GRID.clone())  # the ops' own transform, in float64
    return bool(((got - want).abs() <= rtol * want.abs() + 1e-30).all())


def _fit(got: torch.Tensor) -> Optional[LogitTransform]:
    """A scale from the smallest raw logits (where a soft-cap is linear) and a soft-cap from the largest
    (where it saturates), if both are finite and the map is increasing; else ``None``."""
    x_small, x_large = _GRID[1], _GRID[-2]
    scale = float(got[1] / x_small)
    if not math.isfinite(scale) or scale <= 0:
        return None
    top = float(got[-2])
    softcap = None
    if top < 0.5 * scale * float(x_large):  # saturated: c·tanh(s·x/c) → c
        softcap = top
        if not math.isfinite(softcap) or softcap <= 0:
            return None
    try:
        return LogitTransform(logit_scale=scale, softcap=softcap)
    except ValueError:
        return None


def _model_name(causal_lm: nn.Module) -> str:
    model_type = getattr(getattr(causal_lm, "config", None), "model_type", None) or type(causal_lm).__name__
    return f"{model_type} ({type(causal_lm).__name__})"


def _probe_vocab_size(causal_lm: nn.Module) -> int:
    """Token ids the probe may use: the config's vocabulary, or lm_head's rows where the config has none.
    Under ZeRO-3 ``lm_head.weight`` outside its forward is an empty shard: its ``ds_shape`` is the full one."""
    weight = causal_lm.get_output_embeddings().weight
    rows = weight.shape[0] if weight.numel() else getattr(weight, "ds_shape", weight.shape)[0]
    config_vocab = getattr(causal_lm.config.get_text_config(), "vocab_size", None)
    sizes = [n for n in (rows, config_vocab) if n]
    if not sizes:
        raise FusedLossVerificationError(
            f"hf_fused cannot tell the vocabulary size of {type(causal_lm).__name__} for its patch-time probe; "
            "pass verify=False"
        )
    return min(sizes)


def _probe_device(causal_lm: nn.Module) -> torch.device:
    embeddings = causal_lm.get_input_embeddings()
    weight = getattr(embeddings, "weight", None)
    if weight is not None and weight.device.type != "meta":
        return weight.device
    # accelerate's offload (device_map with "cpu" or "disk", cpu_offload) keeps the weights on meta between calls
    # and computes on its hook's execution device
    device = getattr(getattr(embeddings, "_hf_hook", None), "execution_device", None)
    if device is not None:
        return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return next(causal_lm.parameters()).device
