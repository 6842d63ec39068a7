"""The demos' model: a small Qwen3 with Qwen's real, padded vocabulary."""

from __future__ import annotations

import transformers

from .tokenizer import QWEN_MODEL_VOCAB_SIZE


def tiny_qwen3_config(tokenizer, **overrides) -> transformers.Qwen3Config:
    """A 2-layer, 128-wide Qwen3 with Qwen's padded 151,936-row vocabulary (``overrides`` win).

    The vocabulary dominates (19.4M of ~20M parameters), which is the regime the fused loss is
    for: logits of ``tokens x 151,936`` fp32 dwarf everything else.
    """
    config = dict(
        vocab_size=QWEN_MODEL_VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    config.update(overrides)
    return transformers.Qwen3Config(**config)
