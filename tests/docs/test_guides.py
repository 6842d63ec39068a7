"""The guides' code runs as written and computes what the guide says.

* ``docs/trainer.md``: the complete recipe on CPU with ``bf16=True`` (CPU autocast) and the guide's two CPU
  changes (``dtype="float32"``, ``use_cpu=True``), a tiny Qwen3 and word-level tokenizer saved under the
  recipe's model name, 40 of Python's help pages as ``my_corpus/*.txt``; the loss comes from hf_fused's head.
* ``docs/ops.md``: every block, in order, in one namespace; each block's outputs and gradients against a
  float64 computation on the full logits (the ops' own tolerance, relative 1e-5 in fp32), and the loss module's
  loss against the unpatched model's.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

from doc_blocks import ROOT, assert_fused_training, python_blocks, train_watching_lm_head

TRAINER = ROOT / "docs" / "trainer.md"
OPS = ROOT / "docs" / "ops.md"
RTOL = 1e-5


# -- docs/trainer.md ------------------------------------------------------------------------------------------


def _recipe() -> str:
    text = TRAINER.read_text()
    return python_blocks(text[text.index("## A complete recipe"):])[0]


def _write_checkpoint(name: str, corpus: str) -> int:
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
    return len(vocab)


def test_trainer_recipe_runs_as_written_on_cpu_with_bf16(tmp_path, monkeypatch):
    """The guide's two CPU changes and nothing else; ``bf16=True`` stays (autocast on the CPU)."""
    from pydoc_data.topics import topics

    from hf_fused import is_fused

    code = _recipe()
    name = re.search(r'name = "([^"]+)"', code).group(1)
    assert "bf16=True" in code and "apply_fused_loss(model)" in code
    assert code.count('dtype="bfloat16"') == 1 and code.count('TrainingArguments("out", ') == 1
    code = code.replace('dtype="bfloat16"', 'dtype="float32"').replace(
        'TrainingArguments("out", ', 'TrainingArguments("out", use_cpu=True, ')
    # 40 of the 79 help pages: 29 blocks of 1024 tokens, two optimizer steps of 4 × 4 blocks (all of them made four)
    corpus = "\n".join(t.replace("\n", " ") for t in list(topics.values())[:40])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_corpus").mkdir()
    (tmp_path / "my_corpus" / "help.txt").write_text(corpus)
    vocab = _write_checkpoint(name, corpus)
    setup, _, rest = code.partition("\ntrainer.train()")
    namespace: dict = {}
    exec(compile(setup, str(TRAINER), "exec"), namespace)
    trainer, model = namespace["trainer"], namespace["model"]
    assert is_fused(model) and trainer.args.bf16
    assert_fused_training(train_watching_lm_head(trainer), vocab)
    exec(compile(rest.split("\n", 1)[1], str(TRAINER), "exec"), namespace)  # after train(): save_pretrained
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e] or [trainer.state.log_history[-1]["train_loss"]]
    assert trainer.state.global_step >= 2 and all(torch.isfinite(torch.tensor(losses)))
    assert (tmp_path / "out" / "final" / "config.json").exists()


# -- docs/ops.md ----------------------------------------------------------------------------------------------


def _dense(ns) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 leaves of the block's hidden and weight, the log-probs of its targets and the entropies."""
    hidden = ns["hidden"].detach().double().requires_grad_()
    weight = ns["weight"].detach().double().requires_grad_()
    logits = hidden @ weight.T
    logp_all = torch.log_softmax(logits, dim=-1)
    targets = ns["targets"]
    kept = targets != -100
    logp = torch.where(kept, logp_all.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1), 0.0)
    entropy = torch.where(kept, -(logp_all.exp() * logp_all).sum(-1), 0.0)
    return hidden, weight, logp, entropy


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    err = float((got.double() - want).norm() / want.norm().clamp(min=1e-30))
    assert err <= RTOL, err


def _grads_close(ns, hidden, weight) -> None:
    _close(ns["hidden"].grad, hidden.grad)
    _close(ns["weight"].grad, weight.grad)


@pytest.fixture
def ops_blocks():
    blocks = python_blocks(OPS.read_text())
    assert len(blocks) == 4, "docs/ops.md: cross-entropy, log-probs, token loss, loss module"
    return blocks


def test_ops_blocks_compute_what_the_guide_says(ops_blocks, offline_hub):
    torch.manual_seed(0)
    ns: dict = {}
    exec(compile(ops_blocks[0], "docs/ops.md block 0", "exec"), ns)  # cross-entropy
    assert (ns["targets"][:, :-1] == ns["labels"][:, 1:]).all() and (ns["targets"][:, -1] == -100).all()
    hidden, weight, logp, _ = _dense(ns)
    kept = ns["targets"] != -100
    want = -logp[kept].mean()
    want.backward()
    _close(ns["loss"].detach(), want.detach())
    _grads_close(ns, hidden, weight)

    for name in ("hidden", "weight"):
        ns[name].grad = None
    exec(compile(ops_blocks[1], "docs/ops.md block 1", "exec"), ns)  # log-probs, then a loss on them
    hidden, weight, logp, entropy = _dense(ns)
    _close(ns["logp"].detach(), logp.detach())
    _close(ns["entropy"].detach(), entropy.detach())
    mask = ns["mask"].double()
    want = -(ns["advantages"].double() * logp * mask).sum() / mask.sum() - 0.01 * (entropy * mask).sum() / mask.sum()
    want.backward()
    _close(ns["loss"].detach(), want.detach())
    _grads_close(ns, hidden, weight)

    for name in ("hidden", "weight"):
        ns[name].grad = None
    exec(compile(ops_blocks[2], "docs/ops.md block 2", "exec"), ns)  # the token loss in one pass
    hidden, weight, logp, _ = _dense(ns)
    per_token = {k: v.double() for k, v in ns["per_token"].items()}
    want = -(per_token["advantages"] * logp * per_token["weight"]).sum()
    want.backward()
    _close(ns["out"].loss.detach(), want.detach())
    _grads_close(ns, hidden, weight)

    offline_hub("Qwen/Qwen3-0.6B")
    exec(compile(ops_blocks[3], "docs/ops.md block 3", "exec"), ns)  # the loss module
    model, input_ids = ns["model"], ns["input_ids"]
    assert model.lm_head.weight.grad is not None
    with torch.no_grad():
        want = model(input_ids=input_ids, labels=input_ids).loss
    _close(ns["loss"].detach(), want.double())
