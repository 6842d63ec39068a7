"""``--tiny`` for the TRL scripts here: an offline model, tokenizer and text, with no Hub access.

A 2-layer Llama built from a config with seeded initial weights and a word-level tokenizer learned from
Python's own documentation (``pydoc_data.topics``, shipped with CPython), saved with ``save_pretrained`` so
that TRL's trainers load them by path as they would a Hub model; and fixed-length lines of the same text.
"""

from __future__ import annotations

import os

#: The tokenizer's vocabulary (3 special tokens and the most frequent words; the rest are ``[UNK]``).
VOCAB = 256


def _words() -> list[str]:
    import pydoc_data.topics
    from tokenizers import pre_tokenizers

    splitter = pre_tokenizers.Whitespace()
    topics = pydoc_data.topics.topics
    return [w for key in sorted(topics) for w, _ in splitter.pre_tokenize_str(topics[key])]


def lines(count: int, words_per_line: int) -> list[str]:
    """``count`` lines of ``words_per_line`` consecutive words of the documentation. Each word is one token
    (a known word or ``[UNK]``), so every line tokenizes to the same length: no rank pads its batch
    differently from a single process."""
    words = _words()
    return [" ".join(words[i:i + words_per_line]) for i in range(0, words_per_line * count, words_per_line)]


def write_model(directory: str) -> None:
    """Save the tiny model and its tokenizer to ``directory`` (nothing if it already holds a model)."""
    if os.path.exists(os.path.join(directory, "config.json")):
        return
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(lines(2048, 16),
                            trainers.WordLevelTrainer(vocab_size=VOCAB, special_tokens=["[PAD]", "[EOS]", "[UNK]"]))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]",
                                                      unk_token="[UNK]")
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
