"""TRL's ``AsyncGRPOTrainer`` (``trl.experimental.async_grpo``) on hf_fused: the trainer loads its own model (with
TRL's tree attention, ``tree_fa3``) and adds TRL's fused head to it, so hf_fused patches the built trainer's model
(``apply_fused_loss(trainer.model)``); every fused call of its packed-tree batches (``shift_labels``, one row of
shared prefixes) then comes from hf_fused's op, with the stock trainer's objective.

The trainer gets its rollouts from a vLLM server and its attention from a FlashAttention-3 kernel downloaded from the
Hub; here, as TRL's own tests do, an in-process rollout worker hands it fixed scored samples (shared prompts, so the
packed trees branch) and a weight sync that does nothing, and the kernel's ``flash_attn_varlen_func`` is a PyTorch
stand-in (causal attention per segment over the segment's root path, keys aligned to the end as FlashAttention's
``causal=True`` does). The stock run and the patched run use the same stand-ins: two optimizer steps through
``trainer.train()``, the loss, every gradient and every logged metric compared in fp32 to ``1e-5``, and the calls
counted (hf_fused's op on every fused call of the patched run, TRL's chunked head never).
"""

from __future__ import annotations

import math
import os
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset

import hf_fused
from grpo_harness import FixedRollouts, NoWeightTransfer, count_backend_calls, count_heads
from models import GradRecorder, WORD_VOCAB, assert_same_gradients, is_timing_metric, make_tokenizer
from models import make_word_model

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
async_grpo = pytest.importorskip("trl.experimental.async_grpo")
packing = pytest.importorskip("trl.experimental.async_grpo.packing")
trainer_module = pytest.importorskip("trl.experimental.async_grpo.async_grpo_trainer")
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample  # noqa: E402

RTOL = 1e-5


def varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=True, window_size=(-1, -1),
                     **unused):
    """FlashAttention's ``flash_attn_varlen_func`` as TRL's tree attention calls it, in PyTorch: ``q [Nq, H, D]``,
    ``k``/``v [Nk, H_kv, D]`` (grouped heads), segment ``i`` the queries ``cu_q[i]:cu_q[i+1]`` against the keys
    ``cu_k[i]:cu_k[i+1]``, causal with the last query aligned to the last key."""
    assert causal and window_size == (-1, -1)
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        qs = q[cu_q[i]:cu_q[i + 1]].transpose(0, 1)
        ks, vs = (x[cu_k[i]:cu_k[i + 1]].repeat_interleave(groups, 1).transpose(0, 1) for x in (k, v))
        mask = torch.ones(qs.shape[1], ks.shape[1], dtype=torch.bool).tril(ks.shape[1] - qs.shape[1])
        out[cu_q[i]:cu_q[i + 1]] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask,
                                                                  scale=softmax_scale).transpose(0, 1)
    return out


def rollouts(n=24, seed=0):
    """Scored samples in groups of two completions of one prompt that begin alike (the packed rows then share the
    prompt and the completions' first tokens: a trained position serves both samples, with each one's sampler
    log-prob and advantage), with the sampler's log-probs off the policy's and advantages of both signs."""
    g = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt_len, completion_len = 5 + i % 3, 6 + i % 4
        ids = g.integers(3, WORD_VOCAB, prompt_len + completion_len)
        if i % 2:
            prompt_len = out[-1].completion_mask.argmax()  # the previous sample's prompt and 3 completion tokens
            ids[: prompt_len + 3] = out[-1].input_ids[: prompt_len + 3]
        mask = np.r_[np.zeros(prompt_len), np.ones(len(ids) - prompt_len)].astype(np.int64)
        out.append(RolloutSample(prompt=[], completion=[], input_ids=ids, completion_mask=mask,
                                 old_log_probs=np.where(mask, -g.random(len(ids)) * 5, 0.0),
                                 advantage=float(g.normal()), model_version=0, group_id=i // 2,
                                 metrics={"reward": float(i % 3)}))
    return out


def _save_model(path, arch="qwen3"):
    make_word_model(arch).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(packing, "_flash_attn", lambda: types.SimpleNamespace(flash_attn_varlen_func=varlen_attention))
    monkeypatch.setattr(trainer_module, "get_peak_flops_per_device", lambda *a, **k: 1e12)  # reads a CUDA device
    return _save_model(tmp_path / "policy")


def _train(model_dir, tmp_path, name, patch, monkeypatch, trainer_class=None, peft_config=None, **config):
    calls = count_heads(monkeypatch)
    args = async_grpo.AsyncGRPOConfig(
        output_dir=str(tmp_path / name), per_device_train_batch_size=1, token_budget=64, use_cpu=True, report_to=[],
        logging_steps=1, save_strategy="no", learning_rate=1e-2, optim="sgd", seed=0, disable_tqdm=True,
        **{"max_steps": 2, "gradient_accumulation_steps": 1, "bf16": False, "dtype": "float32", **config})
    recorder = GradRecorder()
    # the prompts feed only the rollout worker TRL would start; the fixed one ignores them
    prompts = Dataset.from_dict({"prompt": ["a"] * 8})
    trainer = (trainer_class or async_grpo.AsyncGRPOTrainer)(
        str(model_dir), args=args, processing_class=make_tokenizer(), train_dataset=prompts, callbacks=[recorder],
        rollout_worker=FixedRollouts(rollouts(24 * args.gradient_accumulation_steps)),
        weight_transfer=NoWeightTransfer(), peft_config=peft_config)
    if patch:
        hf_fused.apply_fused_loss(trainer.model)
    trainer.train()
    # its perf/ block is throughput and seconds (sample/time_in_queue_s is a timing metric already)
    logs = [{k: v for k, v in entry.items() if not (is_timing_metric(k) or k.startswith("perf/"))}
            for entry in trainer.state.log_history]
    return trainer, logs, recorder.steps, calls


def test_async_grpo_on_a_patched_model_matches_trl(model_dir, tmp_path, monkeypatch):
    _, stock_logs, stock_grads, stock_calls = _train(model_dir, tmp_path, "stock", False, monkeypatch)
    assert stock_calls["trl"] > 0 and stock_calls["hf_fused"] == 0
    trainer, logs, grads, calls = _train(model_dir, tmp_path, "fused", True, monkeypatch)
    assert calls["hf_fused"] > 0 and calls["trl"] == 0, calls
    assert hf_fused.is_fused(trainer.model)
    assert trainer.model.config._attn_implementation == packing.TREE_ATTENTION  # the probe's attention undone
    assert len(logs) == len(stock_logs) == 3 and len(grads) == len(stock_grads) == 2
    for got, want in zip(logs, stock_logs):
        assert got.keys() == want.keys(), set(got) ^ set(want)
        for key, value in want.items():
            # the clipped-ratio loss sums ±A·ratio terms: fp32 rounding leaves ~1e-7 absolute (as for GRPO)
            assert math.isclose(got[key], value, rel_tol=RTOL, abs_tol=2e-6 if "loss" in key else 1e-7), (key,)
    assert {"loss", "ratio", "kl", "entropy", "clip_ratio/low_mean"} <= stock_logs[0].keys()
    assert_same_gradients(grads, stock_grads, RTOL)


def test_async_grpo_default_precision_close_to_trl(model_dir, tmp_path, monkeypatch):
    """``AsyncGRPOConfig``'s defaults: fp32 weights (``dtype="float32"``) under bf16 autocast (``bf16=True``). Both
    heads read bf16 operands; TRL's CPU head rounds each logit to bf16 before its fp32 statistics, hf_fused keeps them
    in fp32 (as in tests/integrations/test_trl_trainers.py's bf16 twins: a log-prob moves by up to ~0.04 at this
    model's logits, the loss and metrics by ~1e-2 relative), so the twins agree to 3e-2 relative and the gradients in
    direction (cosine ≥ 0.999)."""
    _, stock_logs, stock_grads, _ = _train(model_dir, tmp_path, "stock", False, monkeypatch, bf16=True)
    _, logs, grads, calls = _train(model_dir, tmp_path, "fused", True, monkeypatch, bf16=True)
    assert calls["hf_fused"] > 0 and calls["trl"] == 0, calls
    for got, want in zip(logs, stock_logs):
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert math.isclose(got[key], value, rel_tol=3e-2, abs_tol=2e-2), (key, got[key], value)
    for got, want in zip(grads, stock_grads):
        flat_got, flat_want = (torch.cat([g.flatten() for g in step.values()]) for step in (got, want))
        assert F.cosine_similarity(flat_got, flat_want, dim=0) >= 0.999


# -- FusedAsyncGRPOTrainer: the loss as a hint, the head's gradients in the forward's one pass ---------------------


def _spy_hints(monkeypatch):
    """The terms per position (``K``) of every hint ``FusedAsyncGRPOTrainer`` builds."""
    import hf_fused.trainers.async_grpo as module

    terms, build = [], module.packed_token_loss_hint

    def spied(trainer, inputs):
        hint = build(trainer, inputs)
        terms.append(next(iter(hint.per_token.values())).shape[-1])
        return hint

    monkeypatch.setattr(module, "packed_token_loss_hint", spied)
    return terms


def _lora():
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                      target_modules=["q_proj", "v_proj"])


#: name -> (the policy's architecture, AsyncGRPOConfig options, a PEFT config or None)
FUSED_CASES = {
    "qwen3": ("qwen3", {}, None),
    "grad_accum": ("qwen3", {"gradient_accumulation_steps": 2}, None),
    "lora": ("qwen3", {}, _lora),
    "moe-aux_loss": ("qwen3moe", {}, None),  # TRL adds the router's load-balancing loss to the policy loss
}


@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_fused_async_grpo_trainer_takes_one_pass_and_matches_trl(case, model_dir, tmp_path, monkeypatch):
    """Stock ``AsyncGRPOTrainer`` against ``FusedAsyncGRPOTrainer``: every micro-batch's head gradients come from
    the forward's one pass (no recompute in backward; a hint that missed would warn, an error here), positions
    shared by several samples included, and the loss, every gradient and every logged metric are TRL's (fp32)."""
    from hf_fused import FusedAsyncGRPOTrainer

    arch, config, peft = FUSED_CASES[case]
    if arch != "qwen3":
        model_dir = _save_model(tmp_path / arch, arch)
    options = dict(config, peft_config=peft() if peft else None)
    _, stock_logs, stock_grads, _ = _train(model_dir, tmp_path, "stock", False, monkeypatch, **options)
    terms = _spy_hints(monkeypatch)
    backend, _ = count_backend_calls(monkeypatch)
    trainer, logs, grads, calls = _train(model_dir, tmp_path, "fused", False, monkeypatch,
                                         trainer_class=FusedAsyncGRPOTrainer, **options)
    assert hf_fused.is_fused(trainer.model) and calls["hf_fused"] > 0 and calls["trl"] == 0, calls
    assert backend == {"one_pass": len(terms), "logprobs_backward": 0} and len(terms) >= 2, (backend, terms)
    assert max(terms) >= 2  # some position serves two samples (a shared prompt's last token)
    # both sides of the clip range are exercised (the sampler's log-probs are far from the policy's)
    assert any(0 < entry.get("clip_ratio/region_mean", 0) < 1 for entry in stock_logs)
    assert len(logs) == len(stock_logs) == 3 and len(grads) == len(stock_grads) == 2
    for got, want in zip(logs, stock_logs):
        assert got.keys() == want.keys(), set(got) ^ set(want)
        for key, value in want.items():
            assert math.isclose(got[key], value, rel_tol=RTOL, abs_tol=2e-6 if "loss" in key else 1e-7), (key,)
    assert_same_gradients(grads, stock_grads, RTOL)


# One pass against the recompute, both from the same bf16 operands under autocast: the head's gradients are formed
# in fp32 from the same statistics and rounded once to bf16 either way; they can differ by one bf16 rounding (2^-8
# relative) carried linearly into the body's gradients (tests/trainers/test_grpo_one_pass.py's bound).
BF16_TWIN_TOL = 2**-8


def test_fused_async_grpo_default_precision_one_pass_matches_the_recompute(model_dir, tmp_path, monkeypatch):
    """``AsyncGRPOConfig``'s defaults (fp32 weights under bf16 autocast): ``FusedAsyncGRPOTrainer``'s one pass
    against the same trainer with the hint withheld (``apply_fused_loss`` alone: statistics in the forward, the
    gradients recomputed in backward)."""
    from hf_fused import FusedAsyncGRPOTrainer
    import hf_fused.trainers.async_grpo as module

    backend, dtypes = count_backend_calls(monkeypatch)
    _, logs, grads, _ = _train(model_dir, tmp_path, "one_pass", False, monkeypatch,
                               trainer_class=FusedAsyncGRPOTrainer, bf16=True)
    assert backend["one_pass"] >= 2 and backend["logprobs_backward"] == 0 and dtypes == {torch.bfloat16}
    monkeypatch.setattr(module.FusedAsyncGRPOTrainer, "compute_loss", async_grpo.AsyncGRPOTrainer.compute_loss)
    _, ref_logs, ref_grads, _ = _train(model_dir, tmp_path, "recompute", False, monkeypatch,
                                       trainer_class=FusedAsyncGRPOTrainer, bf16=True)
    assert backend["logprobs_backward"] == len(ref_grads)  # the withheld hint: every backward recomputed
    for got, want in zip(logs, ref_logs):
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert math.isclose(got[key], value, rel_tol=BF16_TWIN_TOL, abs_tol=1e-6), (key, got[key], value)
    assert_same_gradients(grads, ref_grads, BF16_TWIN_TOL)
