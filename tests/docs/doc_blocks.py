"""Helpers for running the documentation's code blocks offline, as written: the blocks of a page, the Hub ids
they load, tiny datasets standing in for the Hub datasets and local files they load, the settings that keep a
trainer to one short CPU step, and the check that hf_fused (not full logits) computed a trainer's loss.

Every substitution is named here or in the test that applies it, so a reader can tell what ran: the blocks'
own code, unchanged but for these. The fixture that saves the tiny checkpoints is in conftest.py.
"""

from __future__ import annotations

import re
from pathlib import Path

from models import WORDS, make_tokenizer

ROOT = Path(__file__).resolve().parents[2]

#: A chat template with generation tags, so SFT's assistant-only paths have what they need.
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} [EOS]"
                 "{% endgeneration %}{% else %}{{ m['content'] }} {% endif %}{% endfor %}")

#: Settings that keep each TRL example to one short CPU step (appended to the example's own config arguments).
FAST_TRL = {
    "SFTConfig": "max_steps=1, per_device_train_batch_size=2",
    "DPOConfig": "max_steps=1, per_device_train_batch_size=2",
    "KTOConfig": "max_steps=1, per_device_train_batch_size=4",
    "RLOOConfig": "max_steps=1, per_device_train_batch_size=4, num_generations=2, max_completion_length=4",
    "GRPOConfig": "max_steps=1, per_device_train_batch_size=4, num_generations=2, max_completion_length=4",
}


def python_blocks(text: str) -> list[str]:
    """The fenced ```python blocks of a Markdown text, in order."""
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """Every fenced block as ``(language, body)``; ``language`` is ``""`` for a bare fence."""
    return re.findall(r"^```([^\n`]*)\n(.*?)^```", text, flags=re.S | re.M)


def fast_trl(block: str) -> str:
    """``XConfig(output_dir="...")`` of a TRL example with :data:`FAST_TRL`'s settings, on CPU and in fp32."""
    for config, fast in FAST_TRL.items():
        block = re.sub(rf'{config}\(output_dir="([^"]+)"\)',
                       rf'{config}(output_dir="\1", report_to=[], use_cpu=True, bf16=False, {fast})', block)
    return block


def hub_ids(block: str) -> set[str]:
    """The Hub ids a block loads a model or tokenizer from (``from_pretrained("id")``, ``model="id"``)."""
    return set(re.findall(r'from_pretrained\("([^"]+)"', block)) | set(re.findall(r'model="([^"]+/[^"]+)"', block))


def _sentence(i: int, n: int = 3) -> str:
    return " ".join(WORDS[(7 * i + 3 * j) % len(WORDS)] for j in range(n))


def tiny_dataset(name: str, *args, split=None, **kwargs):
    """The stand-in for ``load_dataset(name, ...)`` of every dataset the documentation loads; ``None`` for a
    name it does not stand in for (the real ``load_dataset`` runs then, e.g. on local text files)."""
    from datasets import Dataset

    n = 8
    tokens = make_tokenizer()
    if name == "trl-lib/Capybara":
        data = {"messages": [[{"role": "user", "content": _sentence(i)},
                              {"role": "assistant", "content": _sentence(i + 50)}] for i in range(n)]}
    elif name == "trl-lib/ultrafeedback_binarized":
        data = {"prompt": [_sentence(i) for i in range(n)], "chosen": [" " + _sentence(i + 20) for i in range(n)],
                "rejected": [" " + _sentence(i + 40, 2) for i in range(n)]}
    elif name == "trl-lib/kto-mix-14k":
        data = {"prompt": [_sentence(i) for i in range(n)], "completion": [" " + _sentence(i + 30) for i in range(n)],
                "label": [i % 2 == 0 for i in range(n)]}
    elif name == "trl-lib/tldr":
        data = {"prompt": [_sentence(i, 4) for i in range(n)]}
    elif name == "json" and kwargs.get("data_files") == "train.jsonl":
        # the README's pre-tokenized rows: input_ids and labels (a copy; the model shifts them)
        ids = [tokens(_sentence(i, 8)).input_ids for i in range(n)]
        data = {"input_ids": ids, "labels": [list(x) for x in ids]}
    else:
        return None
    dataset = Dataset.from_dict(data)
    return dataset if split is not None else {"train": dataset}


def train_watching_lm_head(trainer) -> list[tuple[int, ...]]:
    """Run ``trainer.train()`` with a forward hook on the model's lm_head; the shapes of everything it
    returned. A patched model's lm_head answers a loss call with an empty ``[..., 0]`` placeholder (the fused
    head ran inside the call); real logits have the vocabulary as last dimension."""
    model = getattr(trainer.model, "module", trainer.model)
    head = model.get_output_embeddings()
    shapes: list[tuple[int, ...]] = []
    handle = head.register_forward_hook(lambda module, args, out: shapes.append(tuple(out.shape)))
    try:
        trainer.train()
    finally:
        handle.remove()
    return shapes


def assert_fused_training(shapes: list[tuple[int, ...]], vocab: int) -> None:
    """hf_fused computed the head's loss (an empty placeholder came back) and no call built logits for more than
    one position per row (generation scores only the last position)."""
    assert any(s[-1] == 0 for s in shapes), f"lm_head never answered with hf_fused's placeholder: {shapes}"
    full = [s for s in shapes if s[-1] == vocab and len(s) == 3 and s[1] > 1]
    assert not full, f"[tokens, vocab] logits were built during training: {full}"
