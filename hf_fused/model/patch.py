"""``apply_fused_loss`` / ``remove_fused_loss``: patch one model instance's forward."""

from __future__ import annotations

import dataclasses
import types
from contextlib import contextmanager
from typing import Optional

import torch
import torch.nn as nn

from .extensions import notify_patched, notify_removed
from .forward import FusedLossState, PatchedForward, check_op_options
from .lm_head import check_head_supported
from .tensor_parallel import check_tensor_parallel_head
from .transform_probe import FusedLossVerificationError, config_logit_transform, probe_inputs, probe_logit_transform
from .unwrap import check_causal_lm, find_causal_lm


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
    instance; the class is untouched). Calls with ``labels`` return ``loss`` and ``logits=None`` (with
    ``return_dict=False``, the tuple keeps ``None`` in the logits slot: ``(loss, None, past_key_values,
    ...)``); calls without labels (generation, inference) run the original forward, whose signature
    ``inspect.signature(model.forward)`` still reports; in training with gradients such a call warns once
    (:class:`~hf_fused.model.forward.FusedLossBypassedWarning`: full logits were built). See
    :func:`hf_fused.model.forward.fused_forward` for the ``fused_output="logprobs" | "hidden_states"``
    requests trainers use.

    ``transformers.Trainer`` works unchanged: where it gathers predictions (``evaluate()`` with
    ``compute_metrics``, ``predict()``), the patched model runs its original forward so predictions are real
    logits (hf_fused wraps ``Trainer.prediction_step`` once, for patched models only). With
    ``use_liger_kernel=True`` Trainer applies Liger's layer kernels but not its fused cross-entropy, which would
    replace this forward. TRL's trainers' own fused-head calls are answered by hf_fused's ops. Those adjustments
    of transformers and TRL are made by :mod:`hf_fused.integrations` (registered with the model layer through
    :mod:`hf_fused.model.extensions` on ``import hf_fused``), listed with how each is undone.

    Saving: ``torch.save(model)`` / ``torch.load`` keep the patch; ``save_pretrained`` writes the weights
    only, so ``from_pretrained`` gives an unpatched model: call ``apply_fused_loss`` on it again.

    Args:
        model: a causal LM, bare or wrapped.
        verify: before returning, run a short probe (``[2, 8]`` random tokens, eval mode, no grad): read the
            logit transform from the forward itself (lm_head answers with known logits from ``±2**-6`` to
            ``±2**14``; a config attribute the forward ignores changes nothing, a soft-cap is exercised), then
            check that the fused per-token log-probabilities equal those of the original forward's logits. An
            attention implementation registered by another library (TRL's ``tree_fa3``) runs as transformers'
            ``eager`` for the probe and is kept afterwards. With ``verify=False`` the transform is read from the
            config unchecked.
        tile_budget_bytes: memory bound of one tile (see :func:`hf_fused.ops.linear_cross_entropy`).
        backend: force an ops backend by name.

    Returns:
        ``model`` itself (patched in place). Applying twice only updates the options.

    Raises:
        TypeError: no causal LM with an lm_head inside ``model``, or a model that is not a causal LM
            (masked LM, encoder-decoder, sequence classifier, plain module), naming the class.
        NotImplementedError: an lm_head hf_fused cannot read (quantized, not ``nn.Linear``, an active DoRA or
            ``lora_bias`` adapter), or a LoRA adapter on a tensor-parallel lm_head
            (:func:`~hf_fused.model.tensor_parallel.check_tensor_parallel_head`).
        ValueError: ``tile_budget_bytes`` not ``None`` or a positive int, or ``backend`` not ``None`` or a
            registered name (:func:`hf_fused.ops.available_backends`).
        FusedLossVerificationError: the probe disagrees, naming the model type and the difference.
    """
    causal_lm = find_causal_lm(model)
    check_causal_lm(causal_lm)
    check_op_options(tile_budget_bytes, backend, "apply_fused_loss")
    check_head_supported(causal_lm.get_output_embeddings())
    check_tensor_parallel_head(causal_lm.get_output_embeddings())
    state = causal_lm.__dict__.get("_hf_fused")
    if state is None:
        state = FusedLossState(
            instance_forward=causal_lm.__dict__.get("forward"),
            transform=config_logit_transform(causal_lm),
        )
        causal_lm._hf_fused = state
        causal_lm.forward = PatchedForward(causal_lm)
        causal_lm._replicate_for_data_parallel = ReplicatePatched(causal_lm)
    state.tile_budget_bytes = tile_budget_bytes
    state.backend = backend
    # The integrations (hf_fused.integrations: transformers' Trainer hooks, TRL's fused head; never importing TRL).
    notify_patched(causal_lm)
    if verify:
        try:
            verify_patch(causal_lm)
        except Exception:
            remove_fused_loss(causal_lm)
            raise
    return model


def remove_fused_loss(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_fused_loss`: the model's forward is the original again, and the integrations undo what
    they did for it (:mod:`hf_fused.integrations`: a TRL trainer's head options leave the model and TRL's own head
    takes the fused calls; once no patched model is left, transformers' and TRL's attributes are the originals
    again). No-op for a causal LM that is not patched. Returns ``model``.

    Raises:
        TypeError: no causal LM with an lm_head inside ``model`` (as :func:`apply_fused_loss`).
    """
    causal_lm = find_causal_lm(model)
    state = causal_lm.__dict__.pop("_hf_fused", None)
    if state is None:
        return model
    if state.instance_forward is not None:
        causal_lm.forward = state.instance_forward
    else:
        del causal_lm.forward
    causal_lm.__dict__.pop("_replicate_for_data_parallel", None)
    notify_removed(causal_lm)
    return model


def _rebind(method, old: nn.Module, new: nn.Module):
    if isinstance(method, types.MethodType) and method.__self__ is old:
        return types.MethodType(method.__func__, new)
    return method


class ReplicatePatched:
    """``model._replicate_for_data_parallel`` of a patched model. ``nn.DataParallel`` replicas are shallow
    copies of the instance: give each its own patched forward (and original forward) so it computes with
    the replica's own parameters. Pickles as "this hook of this model", like :class:`PatchedForward`."""

    def __init__(self, model: nn.Module):
        self.__self__ = model

    def __call__(self) -> nn.Module:
        model = self.__self__
        replica = type(model)._replicate_for_data_parallel(model)
        state = model.__dict__["_hf_fused"]
        replica.__dict__["_hf_fused"] = dataclasses.replace(
            state, instance_forward=_rebind(state.instance_forward, model, replica)
        )
        replica.__dict__["forward"] = PatchedForward(replica)
        replica.__dict__["_replicate_for_data_parallel"] = ReplicatePatched(replica)
        return replica

    def __reduce__(self):
        return (ReplicatePatched, (self.__self__,))


@contextmanager
def original_forward_only(model: nn.Module):
    """Within this block a patched model runs its original forward even with labels (logits and all),
    e.g. for evaluation that needs logits for metrics. No-op for a causal LM that is not patched.

    Raises:
        TypeError: no causal LM with an lm_head inside ``model`` (as :func:`apply_fused_loss`).
    """
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
    """Read the logit transform from the forward (:func:`~hf_fused.model.transform_probe.probe_logit_transform`),
    then compare fused log-probabilities with ``log_softmax`` of the original forward's logits on a probe.

    Tolerance: ``1e-4 + 1e-5·|logp|`` in fp32/fp64; when lm_head computed in bf16/fp16 (the model's dtype, or
    autocast, also inside a wrapper that hands back fp32 logits) the original rounds the logits to that dtype
    (about 3 significant digits) while the fused path keeps fp32, so ``5e-2 + 1e-2·|logp|``. A missed scale
    (Cohere's 0.0625, Granite's 1/8) moves log-probs by far more; a soft-cap is checked by the transform probe,
    which drives the logits far past any cap.

    Raises:
        FusedLossVerificationError: naming the model type and the largest difference.
    """
    state = causal_lm._hf_fused
    # Without labels the patched forward runs the original one.
    with probe_inputs(causal_lm) as input_ids:
        state.transform = probe_logit_transform(causal_lm, input_ids)
        # The dtype lm_head computed in (autocast inside a wrapper such as accelerate's may compute in bf16
        # and hand back fp32): it sets the tolerance below.
        head_dtypes = []
        hook = causal_lm.get_output_embeddings().register_forward_hook(lambda m, i, o: head_dtypes.append(o.dtype))
        try:
            ref_logits = causal_lm(input_ids=input_ids, use_cache=False).logits
        finally:
            hook.remove()
        out = causal_lm(input_ids=input_ids, labels=input_ids, fused_output="logprobs", use_cache=False)
    ref = torch.log_softmax(ref_logits[:, :-1].double(), dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    got = out.logprobs[:, :-1].double()
    low_precision = any(d in (torch.bfloat16, torch.float16) for d in [ref_logits.dtype, *head_dtypes])
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
