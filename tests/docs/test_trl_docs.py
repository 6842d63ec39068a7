"""The examples in ``docs/trl.md`` run as written, with a tiny checkpoint saved under the Hub id (a local path
wins over the Hub) and tiny datasets standing in for the Hub ones (no downloads here; doc_blocks.py), and the
patched trainer really answers TRL's fused-head calls with hf_fused: lm_head answers with hf_fused's placeholder
and no ``[tokens, vocab]`` logits are built in training."""

from __future__ import annotations

import re

import pytest

from doc_blocks import ROOT, assert_fused_training, fast_trl, hub_ids, python_blocks, train_watching_lm_head
from models import WORD_VOCAB

DOC = ROOT / "docs" / "trl.md"


def _examples() -> list[str]:
    """The page's examples: the python blocks that open with a ``# <trainer>`` title line."""
    return [b for b in python_blocks(DOC.read_text()) if b.startswith("# ")]


def test_docs_have_one_example_per_trainer():
    titles = [block.splitlines()[0] for block in _examples()]
    for name in ("SFT", "DPO", "KTO", "RLOO", "GRPO", "LoRA"):
        assert any(name in t for t in titles), (name, titles)


@pytest.mark.parametrize("index", range(len(_examples())))
def test_docs_example_runs(index, offline_hub):
    block = _examples()[index]
    lora = "LoRA" in block.splitlines()[0]
    if lora:  # continues the SFT example
        block = re.sub(r"^trainer\.train\(\).*$", "", _examples()[0], flags=re.M) + block + "\ntrainer.train()\n"
    offline_hub(*hub_ids(block))
    namespace: dict = {}
    setup = re.sub(r"^trainer\.train\(\).*$", "", fast_trl(block), flags=re.M)
    exec(compile(setup, f"docs/trl.md example {index}", "exec"), namespace)
    trainer = namespace["trainer"]
    assert_fused_training(train_watching_lm_head(trainer), WORD_VOCAB)
    if lora:
        assert any("lm_head.lora_B" in n for n, _ in trainer.model.named_parameters())
