"""The kernel benchmark's GRPO objective is TRL's: :func:`benchmarks.problems.grpo_loss` off-policy with the KL
term (the ``grpo-offpolicy-kl`` problem and its float64 reference) against ``trl.GRPOTrainer._compute_loss`` on a
tiny model, loss and every parameter gradient."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
def test_grpo_loss_off_policy_with_kl_is_trl_compute_loss(tmp_path, loss_type):
    import warnings

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.e2e.grpo import constant_reward, word_tokenizer
    from benchmarks.e2e.models import build_model, quiet_run_kwargs, qwen3_config
    from benchmarks.problems import BETA, EPSILON_HIGH, EPSILON_LOW, OLD_LOGP_NOISE, REF_LOGP_NOISE, grpo_loss

    device = torch.device("cpu")
    g, p, c = 4, 6, 10
    # float64 weights and constants; TRL's head still returns fp32 log-probs (about 1e-6 from float64 here), which
    # is the only rounding in the comparison below
    model = build_model(qwen3_config("tiny", 128), device, torch.float64, seed=0)
    cfg = GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=g, num_generations=g, max_completion_length=c,
        loss_type=loss_type, beta=0.0, epsilon=EPSILON_LOW, epsilon_high=EPSILON_HIGH, learning_rate=1e-6,
        use_vllm=False, **quiet_run_kwargs(SimpleNamespace(dtype=torch.float32, seed=0), device, GRPOConfig),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(model=model, reward_funcs=constant_reward, args=cfg, processing_class=word_tokenizer(),
                              train_dataset=Dataset.from_dict({"prompt": ["the red cat"] * g}))
    # beta > 0 at construction would make TRL re-load a reference model from the hub; _compute_loss reads only
    # self.beta and the batch's ref_per_token_logps, which is what the benchmark feeds it
    trainer.beta = BETA
    trainer.current_gradient_accumulation_steps = 1
    model = trainer.model
    model.train()

    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(2, vocab, (g, p), generator=gen)
    completion = torch.randint(2, vocab, (g, c), generator=gen)
    mask = torch.ones(g, c, dtype=torch.long)
    mask[0, 7:] = 0  # ragged completions: grpo's per-sequence mean differs from bnpo's token mean
    mask[2, 4:] = 0
    ids = torch.cat([prompt, completion], 1)
    attention = torch.cat([torch.ones_like(prompt), mask], 1)

    def dense_logps():  # the completion tokens' log-probs from the full logits (position t scores token t + 1)
        logits = model(input_ids=ids, attention_mask=attention).logits[:, p - 1 : -1]
        return logits.log_softmax(-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)

    with torch.no_grad():
        current = dense_logps()
    noise = torch.randn(2, g, c, generator=gen, dtype=torch.float64)
    old = current + OLD_LOGP_NOISE * noise[0]
    ref = current + REF_LOGP_NOISE * noise[1]
    advantages = torch.randn(g, generator=gen, dtype=torch.float64)
    ratio = torch.exp(current - old)[mask.bool()]
    assert (ratio < 1 - EPSILON_LOW).any() and (ratio > 1 + EPSILON_HIGH).any()  # both clips active

    inputs = dict(prompt_ids=prompt, prompt_mask=torch.ones_like(prompt), completion_ids=completion,
                  completion_mask=mask, advantages=advantages, num_items_in_batch=mask.sum(),
                  old_per_token_logps=old, ref_per_token_logps=ref)
    model.zero_grad(set_to_none=True)
    trl_loss = trainer._compute_loss(model, inputs)
    trl_loss.backward()
    trl_grads = {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}

    model.zero_grad(set_to_none=True)
    ours = grpo_loss(dense_logps(), mask.bool(), advantages, loss_type, old, ref, BETA)
    ours.backward()
    ours_grads = {n: q.grad for n, q in model.named_parameters() if q.grad is not None}

    # without TRL's default use_bias_correction_kl (k3 · ratio) the losses differ by ~2e-5 relative: 1e-6 catches it
    assert trl_loss.item() == pytest.approx(ours.item(), rel=1e-6)
    assert trl_grads.keys() == ours_grads.keys() and trl_grads
    for name, grad in trl_grads.items():
        err = float((ours_grads[name] - grad).norm() / grad.norm())
        assert err < 1e-5, (name, err)
