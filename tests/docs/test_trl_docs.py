"""The examples in ``docs/trl.md`` run as written, with a tiny checkpoint saved under the Hub id (a local path
wins over the Hub) and tiny datasets standing in for the Hub ones (no downloads here), and the patched trainer really answers TRL's fused-head calls with hf_fused."""

from __future__ import annotations

import os
import re

import pytest
from datasets import Dataset

import hf_fused.integrations.trl.head as trl_head
from grpo_helpers import WORDS, make_model, make_tokenizer
from tiny_models import single_thread  # noqa: F401  (autouse fixture)

DOC = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "docs", "trl.md")
_CHAT = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} [EOS]"
         "{% endgeneration %}{% else %}{{ m['content'] }} {% endif %}{% endfor %}")

#: Settings that keep each example to one short step on CPU (appended to the example's own config arguments).
_FAST = {
    "SFTConfig": "max_steps=1, per_device_train_batch_size=2",
    "DPOConfig": "max_steps=1, per_device_train_batch_size=2",
    "KTOConfig": "max_steps=1, per_device_train_batch_size=4",
    "RLOOConfig": "max_steps=1, per_device_train_batch_size=4, num_generations=2, max_completion_length=4",
    "GRPOConfig": "max_steps=1, per_device_train_batch_size=4, num_generations=2, max_completion_length=4",
}


def _fast(block: str) -> str:
    for config, fast in _FAST.items():
        block = re.sub(rf'{config}\(output_dir="([^"]+)"\)',
                       rf'{config}(output_dir="\1", report_to=[], use_cpu=True, bf16=False, {fast})', block)
    return block


def _examples():
    text = open(DOC).read()
    return re.findall(r"```python\n(# [^\n]*\n.*?)```", text, flags=re.S)


def _sentence(i, n=3):
    return " ".join(WORDS[(7 * i + 3 * j) % len(WORDS)] for j in range(n))


def _tiny_dataset(name, split="train", **kwargs):
    n = 8
    if name == "trl-lib/Capybara":
        return Dataset.from_dict({"messages": [[{"role": "user", "content": _sentence(i)},
                                                {"role": "assistant", "content": _sentence(i + 50)}] for i in range(n)]})
    if name == "trl-lib/ultrafeedback_binarized":
        return Dataset.from_dict({"prompt": [_sentence(i) for i in range(n)],
                                  "chosen": [" " + _sentence(i + 20) for i in range(n)],
                                  "rejected": [" " + _sentence(i + 40, 2) for i in range(n)]})
    if name == "trl-lib/kto-mix-14k":
        return Dataset.from_dict({"prompt": [_sentence(i) for i in range(n)],
                                  "completion": [" " + _sentence(i + 30) for i in range(n)],
                                  "label": [i % 2 == 0 for i in range(n)]})
    if name == "trl-lib/tldr":
        return Dataset.from_dict({"prompt": [_sentence(i, 4) for i in range(n)]})
    raise AssertionError(f"the docs load an unexpected dataset {name}")


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    """A tiny checkpoint saved where the examples' Hub id resolves as a local path, and tiny datasets."""
    import datasets

    monkeypatch.chdir(tmp_path)
    names = {m for block in _examples() for m in re.findall(r'from_pretrained\("([^"]+)"\)', block)}
    for name in names:
        make_model().save_pretrained(name)
        tokenizer = make_tokenizer()
        tokenizer.chat_template = _CHAT
        tokenizer.save_pretrained(name)
    monkeypatch.setattr(datasets, "load_dataset", _tiny_dataset)


def test_docs_have_one_example_per_trainer():
    titles = [block.splitlines()[0] for block in _examples()]
    for name in ("SFT", "DPO", "KTO", "RLOO", "GRPO", "LoRA"):
        assert any(name in t for t in titles), (name, titles)


@pytest.mark.parametrize("index", range(6))
def test_docs_example_runs(index, offline_hub, monkeypatch):
    block = _examples()[index]
    calls = []
    op = trl_head.linear_logprobs
    monkeypatch.setattr(trl_head, "linear_logprobs", lambda *a, **k: (calls.append(1), op(*a, **k))[1])
    namespace = {}
    if "LoRA" in block.splitlines()[0]:  # continues the SFT example
        exec(_fast(_examples()[0]).replace("trainer.train()", ""), namespace)
        block += "\ntrainer.train()\n"
    exec(compile(_fast(block), f"docs/trl.md example {index}", "exec"), namespace)
    assert calls, "hf_fused's op did not answer the trainer's fused-head calls"
    if "LoRA" in block.splitlines()[0]:
        assert any("lm_head.lora_B" in n for n, _ in namespace["trainer"].model.named_parameters())
