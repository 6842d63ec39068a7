"""``apply_fused_loss`` does not import TRL (its trainers take seconds to import): the TRL integration installs itself
when TRL's modules are imported. Each test runs a fresh interpreter, so nothing is imported beforehand: patch a model
(optionally after a bare ``import trl``, which loads none of TRL's trainers), check TRL's trainers are still not
loaded, then import ``SFTTrainer`` and train one step on the model patched before: hf_fused's op answers every fused
call, TRL's chunked head none, a LoRA adapter on lm_head is accepted, and the loss equals the stock trainer's on an
unpatched copy (fp32, 1e-5 relative)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("trl")
pytest.importorskip("peft")

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)

_SCRIPT = textwrap.dedent("""
    import copy, json, os, sys, tempfile
    if {import_trl_first}:
        import trl  # TRL's top level is lazy: this loads none of its trainers
    import torch
    import hf_fused
    from models import make_model

    torch.set_num_threads(1)
    model, lora_model = make_model("llama", tie_word_embeddings=False), make_model("llama", seed=1)
    stock_model = copy.deepcopy(model)
    hf_fused.apply_fused_loss(model)
    hf_fused.apply_fused_loss(lora_model)
    loaded_after_patch = sorted(m for m in sys.modules if m == "trl" or m.startswith("trl."))

    # TRL's trainers only now, after the patch.
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer
    import pytest
    from models import WORDS, make_tokenizer
    from grpo_harness import count_heads as _count_heads

    counts = _count_heads(pytest.MonkeyPatch())  # calls of hf_fused's op and of TRL's chunked head
    tokenizer = make_tokenizer()
    tokenizer.padding_side = "right"
    text = Dataset.from_dict({{"text": [" ".join(WORDS[(7 * i + j) % len(WORDS)] for j in range(4 + i % 5))
                                        for i in range(8)]}})

    def trainer(model, **kwargs):
        args = SFTConfig(output_dir=tempfile.mkdtemp(), bf16=False, max_steps=1, per_device_train_batch_size=4,
                         report_to=[], use_cpu=True, logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0,
                         dataloader_num_workers=0, optim="sgd")
        return SFTTrainer(model=model, args=args, train_dataset=text, processing_class=tokenizer, **kwargs)

    def first_loss(model):
        torch.manual_seed(0)
        built = trainer(model)
        built.train()
        return built, built.state.log_history[0]["loss"]

    patched, loss = first_loss(model)
    fused_counts = dict(counts)
    _, stock_loss = first_loss(stock_model)
    # TRL refuses a LoRA adapter on lm_head (its head would read the bare weight); on a patched model it is accepted.
    trainer(lora_model, peft_config=LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0,
                                               target_modules=["q_proj", "lm_head"]))
    print(json.dumps({{
        "loaded_after_patch": loaded_after_patch,
        "counts": fused_counts,
        "served": hf_fused.integrations.trl.trl_head_options(patched.model) is not None,
        "fused": hf_fused.is_fused(patched.model),
        "loss": loss,
        "stock_loss": stock_loss,
    }}))
""")


@pytest.mark.parametrize("import_trl_first", [False, True], ids=["trl_not_imported", "bare_import_trl_first"])
def test_patching_does_not_import_trl_and_trainers_imported_later_are_served(import_trl_first):
    script = _SCRIPT.format(import_trl_first=import_trl_first)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, TESTS]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    loaded = result["loaded_after_patch"]
    if import_trl_first:
        assert "trl" in loaded and not [m for m in loaded if m.startswith("trl.trainer")], loaded
    else:
        assert loaded == []
    assert result["served"] and result["fused"]
    assert result["counts"]["hf_fused"] > 0 and result["counts"]["trl"] == 0, result["counts"]
    assert abs(result["loss"] - result["stock_loss"]) <= 1e-5 * abs(result["stock_loss"]), result
