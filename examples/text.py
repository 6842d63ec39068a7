"""Real English text for the demos, with no download: CPython's ``pydoc_data.topics``.

``pydoc_data.topics.topics`` maps help-topic names (``"assert"``, ``"class"``, ...) to the
reference-manual text that ``help("assert")`` prints: about 80 documents and ~465k characters
(~106k Qwen tokens) on Python 3.11.  The exact content depends on the Python version, but for
one interpreter it is fixed, so the demos are reproducible.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

__all__ = ["IGNORE_INDEX", "pydoc_topics", "pydoc_documents", "TokenBlocks", "build_sft_blocks"]

IGNORE_INDEX = -100  # label value skipped by the loss (transformers / PyTorch convention)


def pydoc_topics() -> list[tuple[str, str]]:
    """All ``(topic name, text)`` pairs, sorted by name; texts are non-empty and stripped."""
    from pydoc_data.topics import topics

    return [(name, text.strip()) for name, text in sorted(topics.items()) if text.strip()]


def pydoc_documents() -> list[str]:
    """The topic texts of ``pydoc_topics()``, in the same (deterministic) order."""
    return [text for _, text in pydoc_topics()]


class TokenBlocks(Dataset):
    """Fixed-length token blocks; item ``i`` is a dict of three 1-D int64 tensors of length L.

    * ``input_ids``: token ids;
    * ``attention_mask``: all ones (blocks are packed, never padded);
    * ``labels``: ``input_ids`` with ``IGNORE_INDEX`` (-100) where no loss is wanted.  Labels
      are *not* shifted: as in transformers' causal-LM convention, the model shifts them.

    Works with ``transformers.Trainer``'s default collator (it stacks the tensors).
    """

    def __init__(self, input_ids: torch.Tensor, labels: torch.Tensor):
        if input_ids.shape != labels.shape or input_ids.dim() != 2:
            raise ValueError(
                f"input_ids and labels must both be [num_blocks, seq_len]; got "
                f"{tuple(input_ids.shape)} and {tuple(labels.shape)}"
            )
        self.input_ids = input_ids.long()
        self.labels = labels.long()

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.input_ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": self.labels[i]}


def build_sft_blocks(
    tokenizer,
    seq_len: int,
    *,
    num_blocks: int | None = None,
    mask_prompt: bool = True,
) -> TokenBlocks:
    """Pack the pydoc topics into SFT examples cut into ``[num_blocks, seq_len]`` blocks.

    Each topic becomes a prompt ``"Explain the Python help topic '<name>'.\\n"`` followed by the
    completion (the topic text) and the tokenizer's eos token.  Examples are concatenated in
    ``pydoc_topics()`` order and cut into consecutive blocks; the incomplete last block is
    dropped.  With ``mask_prompt`` the prompt tokens get label -100, so the loss only covers
    completions (and the blocks exercise ``ignore_index``).

    Args:
        tokenizer: a transformers tokenizer with an ``eos_token_id`` (e.g.
            ``build_qwen_tokenizer()``).
        seq_len: tokens per block (>= 2).
        num_blocks: keep only the first ``num_blocks`` blocks (all blocks if None).
        mask_prompt: set the labels of prompt tokens to -100.

    Returns:
        ``TokenBlocks`` with int64 ``[N, seq_len]`` ids and labels.

    Raises:
        ValueError: bad ``seq_len`` / ``num_blocks``, no eos token, not enough text for
            ``num_blocks`` blocks (the message gives how many there are), or a block with no
            supervised token (``seq_len`` shorter than a prompt).
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if num_blocks is not None and num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1 or None, got {num_blocks}")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token_id; it is needed to separate documents")

    topics = pydoc_topics()
    prompts = tokenizer(
        [f"Explain the Python help topic '{name}'.\n" for name, _ in topics], add_special_tokens=False
    ).input_ids
    completions = tokenizer([text for _, text in topics], add_special_tokens=False).input_ids

    ids: list[int] = []
    labels: list[int] = []
    needed = None if num_blocks is None else num_blocks * seq_len
    for prompt, completion in zip(prompts, completions):
        completion = completion + [tokenizer.eos_token_id]
        ids += prompt + completion
        labels += ([IGNORE_INDEX] * len(prompt) if mask_prompt else prompt) + completion
        if needed is not None and len(ids) >= needed:
            break  # tokenising is cheap; this just keeps the tensors small

    available = len(ids) // seq_len
    if num_blocks is not None and available < num_blocks:
        raise ValueError(
            f"the pydoc topics give only {available} blocks of {seq_len} tokens, "
            f"{num_blocks} were asked for"
        )
    n = available if num_blocks is None else num_blocks
    shape = (n, seq_len)
    blocks = TokenBlocks(
        torch.tensor(ids[: n * seq_len]).view(shape), torch.tensor(labels[: n * seq_len]).view(shape)
    )
    # The model predicts labels[1:] (it shifts); a block with none would give a 0/0 loss.
    if not (blocks.labels[:, 1:] != IGNORE_INDEX).any(dim=1).all():
        raise ValueError(f"seq_len={seq_len} leaves a block with only prompt tokens; use a longer seq_len")
    return blocks
