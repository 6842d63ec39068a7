"""``apply_fused_loss`` / ``remove_fused_loss``: patch one model instance's forward."""

from __future__ import annotations

import dataclasses
import inspect
import types
from contextlib import contextmanager
from typing import Optional

import torch
import torch.nn as nn

from .forward import FusedLossState, make_fused_forward
from .logit_transform import logit_transform_for
from .unwrap import find_causal_lm

#: Probe size for the patch-time check: short, so it costs about one tiny forward.
_PROBE_SHAPE = (2, 8)


class FusedLossVerificationError(RuntimeError):
    """The fused path did not reproduce the original forward's log-probabilities on the probe."""


def apply_fused_loss(
    model: nn.Module,
    *,
    verify: bool = True,
    tile_budget_bytes: Optional[int] = None,
    backend: Optional[str] = None,
) -> nn.Module:
    """Make ``model`` compute its causal-LM loss from hidden states, tile by tile, without logits.

    Finds the ``*ForCausalLM`` through PEFT, DDP/DeepSpeed (``.module``), accelerate and
    ``torch.compile`` (``_orig_mod``) wrappers and replaces that instance's ``forward`` (only that
    instance; the class is untouched). Calls with ``labels`` return ``loss`` and ``logits=None``; calls
    without labels (generation, inference) run the original forward, whose signature
    ``inspect.signature(model.forward)`` still reports. See :func:`hf_fused.model.forward.fused_forward`
    for the ``fused_output="logprobs" | "hidden_states"`` requests trainers use.

    Args:
        model: a causal LM, bare or wrapped.
        verify: before returning, run a short probe (``[2, 8]`` random tokens, eval mode, no grad) and
            check that the fused per-token log-probabilities equal those of the original forward's logits.
        tile_budget_bytes: memory bound of one tile (see :func:`hf_fused.ops.linear_cross_entropy`).
        backend: force an ops backend by name.

    Returns:
        ``model`` itself (patched in place). Applying twice only updates the options.

    Raises:
        TypeError: no causal LM with an lm_head inside ``model``.
        FusedLossVerificationError: the probe disagrees, naming the model type and the difference.
    """
    causal_lm = find_causal_lm(model)
    state = getattr(causal_lm, "_hf_fused", None)
    if state is None:
        original = causal_lm.forward
        state = FusedLossState(
            original_forward=original,
            instance_forward=causal_lm.__dict__.get("forward"),
            signature=inspect.signature(original),
            transform=logit_transform_for(causal_lm),
        )
        causal_lm._hf_fused = state
        causal_lm.forward = types.MethodType(make_fused_forward(original), causal_lm)
        causal_lm._replicate_for_data_parallel = types.MethodType(_replicate_patched, causal_lm)
    state.tile_budget_bytes = tile_budget_bytes
    state.backend = backend
    if verify:
        try:
            verify_patch(causal_lm)
        except Exception:
            remove_fused_loss(causal_lm)
            raise
    return model


def remove_fused_loss(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_fused_loss`: the model's forward is the original again. No-op if not patched."""
    causal_lm = find_causal_lm(model)
    state = causal_lm.__dict__.pop("_hf_fused", None)
    if state is None:
        return model
    if state.instance_forward is not None:
        causal_lm.forward = state.instance_forward
    else:
        del causal_lm.forward
    causal_lm.__dict__.pop("_replicate_for_data_parallel", None)
    return model


def _rebind(method, old: nn.Module, new: nn.Module):
    if isinstance(method, types.MethodType) and method.__self__ is old:
        return types.MethodType(method.__func__, new)
    return method


def _replicate_patched(self: nn.Module) -> nn.Module:
    """``nn.DataParallel`` replicas are shallow copies of the instance: rebind the patched forward (and
    the original it wraps) to each replica so it computes with the replica's own parameters."""
    replica = type(self)._replicate_for_data_parallel(self)
    state = self.__dict__["_hf_fused"]
    replica.__dict__["_hf_fused"] = dataclasses.replace(
        state,
        original_forward=_rebind(state.original_forward, self, replica),
        instance_forward=_rebind(state.instance_forward, self, replica),
    )
    for name in ("forward", "_replicate_for_data_parallel"):
        replica.__dict__[name] = _rebind(self.__dict__[name], self, replica)
    return replica


@contextmanager
def original_forward_only(model: nn.Module):
    """Within this block a patched model runs its original forward even with labels (logits and all),
    e.g. for evaluation that needs logits for metrics. No-op for an unpatched model."""
    state = find_causal_lm(model).__dict__.get("_hf_fused")
    if state is None:
        yield model
        return
    previous, state.enabled = state.enabled, False
    try:
        yield model
    finally:
        state.enabled = previous


def is_fused(model: nn.Module) -> bool:
    """Whether :func:`apply_fused_loss` is in effect on ``model``'s causal LM."""
    try:
        return "_hf_fused" in find_causal_lm(model).__dict__
    except TypeError:
        return False


@torch.no_grad()
def verify_patch(causal_lm: nn.Module) -> None:
    """Compare fused log-probabilities with ``log_softmax`` of the original forward's logits on a probe.

    Tolerance: ``1e-4 + 1e-5·|logp|`` in fp32/fp64; in bf16/fp16 the original rounds the logits to the
    model dtype (about 3 significant digits) while the fused path keeps fp32, so ``5e-2 + 1e-2·|logp|``.
    A missed scale (Cohere's 0.0625, Granite's 1/8) or temperature moves log-probs by far more. A missed
    soft-cap is only visible once logits approach the cap, which random probes may not reach.

    Raises:
        FusedLossVerificationError: naming the model type and the largest difference.
    """
    state = causal_lm._hf_fused
    weight = causal_lm.get_output_embeddings().weight
    vocab_size = min(weight.shape[0], getattr(causal_lm.config.get_text_config(), "vocab_size", weight.shape[0]))
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab_size, _PROBE_SHAPE, generator=generator).to(weight.device)
    modes = {m: m.training for m in causal_lm.modules()}
    causal_lm.eval()
    try:
        # Both through the module call (without labels the patched forward is the original one), so the
        # hooks of a wrapper such as FSDP2's fully_shard gather the parameters for the reference too.
        ref_logits = causal_lm(input_ids=input_ids, use_cache=False).logits
        out = causal_lm(input_ids=input_ids, labels=input_ids, fused_output="logprobs", use_cache=False)
    finally:
        for module, training in modes.items():
            module.training = training
    ref = torch.log_softmax(ref_logits[:, :-1].double(), dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    got = out.logprobs[:, :-1].double()
    low_precision = weight.dtype in (torch.bfloat16, torch.float16)
    atol, rtol = (5e-2, 1e-2) if low_precision else (1e-4, 1e-5)
    diff = (got - ref).abs()
    bound = atol + rtol * ref.abs()
    if not bool((diff <= bound).all()):
        model_type = getattr(causal_lm.config, "model_type", type(causal_lm).__name__)
        raise FusedLossVerificationError(
            f"hf_fused could not reproduce {model_type} ({type(causal_lm).__name__}): fused log-probabilities "
            f"differ from the original forward's by up to {diff.max().item():.3g} (allowed {bound.min().item():.3g}) "
            f"with logit transform {state.transform}. This architecture transforms lm_head outputs in a way "
            "hf_fused does not read from its config. Pass verify=False to patch anyway (at your own risk)."
        )
