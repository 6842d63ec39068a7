"""Find the ``*ForCausalLM`` inside the wrappers training stacks put around it."""

from __future__ import annotations

import torch.nn as nn


def find_causal_lm(model: nn.Module) -> nn.Module:
    """The innermost causal LM of ``model``: through ``torch.compile`` (``_orig_mod``), DDP / DeepSpeed /
    accelerate (``.module``) and PEFT (``get_base_model()``) wrappers, in any nesting.

    Returns the module that owns ``get_output_embeddings()`` (the lm_head) and the forward to patch.

    Raises:
        TypeError: if no module with a ``forward`` and an lm_head is found.
    """
    seen = set()
    current = model
    while id(current) not in seen:
        seen.add(id(current))
        if hasattr(current, "_orig_mod") and isinstance(current._orig_mod, nn.Module):
            current = current._orig_mod
        elif _is_peft_model(current):
            current = current.get_base_model()
        elif isinstance(getattr(current, "module", None), nn.Module) and not _owns_lm_head(current):
            current = current.module
        else:
            break
    if not _has_lm_head(current):
        raise TypeError(
            f"hf_fused could not find a causal LM with an lm_head inside {type(model).__name__} "
            f"(stopped at {type(current).__name__}). Pass a transformers *ForCausalLM model, optionally "
            "wrapped by PEFT, DDP/DeepSpeed, accelerate or torch.compile."
        )
    return current


def _is_peft_model(module: nn.Module) -> bool:
    return hasattr(module, "get_base_model") and hasattr(module, "peft_config")


def _owns_lm_head(module: nn.Module) -> bool:
    # DeepSpeed's engine forwards unknown attributes to its module (``__getattr__``), so it seems to have an
    # lm_head; only a class that defines get_output_embeddings owns one.
    return hasattr(type(module), "get_output_embeddings") and _has_lm_head(module)


def _has_lm_head(module: nn.Module) -> bool:
    get = getattr(module, "get_output_embeddings", None)
    if get is None:
        return False
    try:
        return isinstance(get(), nn.Module)
    except (NotImplementedError, AttributeError):
        return False


def check_causal_lm(causal_lm: nn.Module) -> None:
    """Refuse models whose loss is not the causal-LM loss hf_fused computes (a shifted next-token
    cross-entropy): it would silently become one.

    Raises:
        TypeError: not a transformers model (no config), an encoder-decoder (T5, BART: the loss is on the
            decoder's outputs given the encoder's), or a model that cannot generate (a masked LM such as
            ``BertForMaskedLM``, whose loss is unshifted on masked positions), naming the class.
    """
    name = type(causal_lm).__name__
    config = getattr(causal_lm, "config", None)
    if config is None or not hasattr(causal_lm, "can_generate"):
        raise TypeError(
            f"hf_fused patches transformers causal LMs (a PreTrainedModel such as LlamaForCausalLM); {name} is "
            "not one. For your own module, call hf_fused.ops.linear_cross_entropy on its hidden states."
        )
    if getattr(config, "is_encoder_decoder", False):
        raise TypeError(
            f"hf_fused computes the decoder-only causal-LM loss; {name} is an encoder-decoder model "
            f"({getattr(config, 'model_type', '?')}), which it does not support. Train it with its own loss (do not "
            "call apply_fused_loss), or call hf_fused.ops.linear_cross_entropy on its decoder's hidden states."
        )
    if not causal_lm.can_generate():
        raise TypeError(
            f"hf_fused computes the causal-LM loss (each position predicts the next token); {name} is not a "
            "causal LM (it cannot generate: e.g. a masked LM, whose loss is on masked positions without a "
            "shift), so its loss would silently change. Use a *ForCausalLM model."
        )
