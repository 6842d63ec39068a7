"""The README's complete recipe runs as written on CPU, ``bf16=True`` included (CPU autocast), with the two
changes the README states for CPU (``dtype="float32"``, ``use_cpu=True``).

Only what the recipe names outside itself is provided: a checkpoint where its Hub id resolves as a local path
(a tiny Qwen3 and a word-level tokenizer over the corpus) and ``my_corpus/*.txt`` (Python's help pages).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[2] / "README.md"


def _recipe() -> str:
    text = README.read_text()
    section = text[text.index("## A complete recipe"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _write_checkpoint(name: str, corpus: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    words = [w for w, _ in Counter(corpus.split()).most_common(2000)]
    vocab = {tok: i for i, tok in enumerate(["[PAD]", "[EOS]", "[UNK]"] + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]")
    config = Qwen3Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
                         tie_word_embeddings=True, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(name)
    tokenizer.save_pretrained(name)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_readme_recipe_runs_as_written_with_bf16(tmp_path, monkeypatch, device):
    """On a GPU the code block runs unchanged; on CPU with the README's two CPU changes."""
    from pydoc_data.topics import topics

    code = _recipe()
    name = re.search(r'name = "([^"]+)"', code).group(1)
    assert "bf16=True" in code and "apply_fused_loss(model)" in code
    if device == "cpu":  # the README's CPU changes, nothing else
        assert code.count('dtype="bfloat16"') == 1 and code.count('TrainingArguments("out", ') == 1
        code = code.replace('dtype="bfloat16"', 'dtype="float32"').replace(
            'TrainingArguments("out", ', 'TrainingArguments("out", use_cpu=True, ')
    corpus = "\n".join(t.replace("\n", " ") for t in topics.values())
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_corpus").mkdir()
    (tmp_path / "my_corpus" / "help.txt").write_text(corpus)
    _write_checkpoint(name, corpus)
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    trainer, model = namespace["trainer"], namespace["model"]
    from hf_fused import is_fused

    assert is_fused(model) and trainer.args.bf16
    assert next(model.parameters()).device.type == device
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e] or [trainer.state.log_history[-1]["train_loss"]]
    assert trainer.state.global_step >= 2 and all(torch.isfinite(torch.tensor(losses)))
    assert (tmp_path / "out" / "final" / "config.json").exists()
