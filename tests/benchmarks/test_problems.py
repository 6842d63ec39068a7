"""The ops benchmark's GRPO objective is TRL's: :func:`benchmarks.losses.grpo_loss` of every loss type the
benchmark runs, off-policy with the KL term (the ``grpo-offpolicy-kl`` / ``grpo-loss-types-offpolicy-kl``
problems and their float64 reference) and on-policy (``grpo-loss-types``), against
``trl.GRPOTrainer._compute_loss`` on a tiny model, loss and every parameter gradient; on-policy also against
the gradient of ``−Σ token_weights_at_ratio_one · logp``, the hint the ``hf_fused_hint`` peer passes."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from benchmarks.losses import (
    CISPO_EPSILON_HIGH, EPSILON_HIGH, EPSILON_LOW, TRL_LOSS_TYPES, grpo_loss, token_weights_at_ratio_one,
)
from benchmarks.problems import BETA, OLD_LOGP_NOISE, REF_LOGP_NOISE

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

G, P, C = 4, 6, 10  # completions, prompt and completion lengths


@pytest.fixture(scope="module", params=TRL_LOSS_TYPES)
def trl(request, tmp_path_factory):
    """``(loss_type, trainer, batch)``: a TRL 1.16 ``GRPOTrainer`` of ``loss_type`` on a tiny float64 model and
    a batch of ``G`` ragged completions (``batch.dense_logps()`` their log-probs by the model's full logits)."""
    import warnings

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.e2e.grpo import constant_reward, word_tokenizer
    from benchmarks.e2e.models import build_model, quiet_run_kwargs, qwen3_config

    loss_type, device = request.param, torch.device("cpu")
    # float64 weights and constants; TRL's head still returns fp32 log-probs (about 1e-6 from float64 here), which
    # is the only rounding in the comparisons below
    model = build_model(qwen3_config("tiny", 128), device, torch.float64, seed=0)
    # cispo's epsilon_high is the clamp of its ratio (the benchmark's CISPO_EPSILON_HIGH), the others' clip width
    epsilon_high = CISPO_EPSILON_HIGH if loss_type == "cispo" else EPSILON_HIGH
    cfg = GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp(loss_type)), per_device_train_batch_size=G, num_generations=G,
        max_completion_length=C, loss_type=loss_type, beta=0.0, epsilon=EPSILON_LOW, epsilon_high=epsilon_high,
        learning_rate=1e-6, use_vllm=False,
        **quiet_run_kwargs(SimpleNamespace(dtype=torch.float32, seed=0), device, GRPOConfig),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # luspo with token-level importance sampling: TRL warns, and runs it
        trainer = GRPOTrainer(model=model, reward_funcs=constant_reward, args=cfg, processing_class=word_tokenizer(),
                              train_dataset=Dataset.from_dict({"prompt": ["the red cat"] * G}))
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    return loss_type, trainer, _batch(trainer.model)


def _batch(model) -> SimpleNamespace:
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(2, vocab, (G, P), generator=gen)
    completion = torch.randint(2, vocab, (G, C), generator=gen)
    mask = torch.ones(G, C, dtype=torch.long)
    mask[0, 7:] = 0  # ragged completions: grpo's per-sequence mean differs from bnpo's token mean
    mask[2, 4:] = 0
    ids = torch.cat([prompt, completion], 1)
    attention = torch.cat([torch.ones_like(prompt), mask], 1)

    def dense_logps():  # the completion tokens' log-probs from the full logits (position t scores token t + 1)
        logits = model(input_ids=ids, attention_mask=attention).logits[:, P - 1 : -1]
        return logits.log_softmax(-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)

    with torch.no_grad():
        current = dense_logps()
    noise = torch.randn(2, G, C, generator=gen, dtype=torch.float64)
    old = current + OLD_LOGP_NOISE * noise[0]
    old[1, :2] = current[1, :2] - 2.0  # ratio e² ≈ 7.4 on two tokens: past cispo's clamp at 5 too
    ref = current + REF_LOGP_NOISE * noise[1]
    advantages = torch.randn(G, generator=gen, dtype=torch.float64)
    # the draw is all negative: one positive makes sapo use both temperatures, and puts the ratio-e² tokens under
    # a positive advantage, where the DAPO clip and cispo's clamp bite (no centering: a near-0 loss would be all
    # rounding of TRL's fp32 log-probs)
    advantages[1] = -advantages[1]
    trl_inputs = dict(prompt_ids=prompt, prompt_mask=torch.ones_like(prompt), completion_ids=completion,
                      completion_mask=mask, advantages=advantages, num_items_in_batch=mask.sum())
    return SimpleNamespace(dense_logps=dense_logps, current=current, old=old, ref=ref, advantages=advantages,
                           mask=mask.bool(), trl_inputs=trl_inputs)


def _loss_and_grads(model, loss_fn):
    model.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    return loss.item(), {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}


def _assert_same(a, b, what):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert loss_a == pytest.approx(loss_b, rel=1e-6), what
    assert grads_a.keys() == grads_b.keys() and grads_a, what
    for name, grad in grads_a.items():
        err = float((grads_b[name] - grad).norm() / grad.norm())
        assert err < 1e-5, (what, name, err)


def test_grpo_loss_off_policy_with_kl_is_trl_compute_loss(trl):
    loss_type, trainer, b = trl
    model = trainer.model
    ratio = torch.exp(b.current - b.old)[b.mask]
    assert (ratio < 1 - EPSILON_LOW).any() and (ratio > 1 + EPSILON_HIGH).any()  # both DAPO clips active
    assert (ratio > CISPO_EPSILON_HIGH).any()  # cispo's clamp active
    assert (b.advantages > 0).any() and (b.advantages <= 0).any()  # both sapo temperatures in use

    # beta > 0 at construction would make TRL re-load a reference model from the hub; _compute_loss reads only
    # self.beta and the batch's ref_per_token_logps, which is what the benchmark feeds it
    trainer.beta = BETA
    inputs = dict(b.trl_inputs, old_per_token_logps=b.old, ref_per_token_logps=b.ref)
    trl_result = _loss_and_grads(model, lambda: trainer._compute_loss(model, inputs))
    ours = _loss_and_grads(model, lambda: grpo_loss(b.dense_logps(), b.mask, b.advantages, loss_type, b.old, b.ref,
                                                    BETA))
    # without TRL's default use_bias_correction_kl (k3 · ratio) the losses differ by ~2e-5 relative: 1e-6 catches it
    _assert_same(trl_result, ours, "off-policy with KL")

    # the old log-probs matter for every type (cispo: as a detached weight): old = current (ratio 1) is another loss
    on_policy = grpo_loss(b.current, b.mask, b.advantages, loss_type, None, b.ref, BETA).item()
    assert abs(ours[0] - on_policy) > 1e-3 * abs(on_policy), (ours[0], on_policy)


def test_on_policy_grpo_loss_is_trl_and_has_the_token_weights_gradient(trl):
    """Ratio 1, no KL (TRL without ``old_per_token_logps`` takes the current log-probs, detached): TRL's loss and
    gradients are :func:`grpo_loss`'s, whose gradient is that of ``−Σ w·logp`` with ``w`` =
    :func:`token_weights_at_ratio_one` for every loss type."""
    loss_type, trainer, b = trl
    model = trainer.model
    trainer.beta = 0.0
    trl_result = _loss_and_grads(model, lambda: trainer._compute_loss(model, b.trl_inputs))
    ours = _loss_and_grads(model, lambda: grpo_loss(b.dense_logps(), b.mask, b.advantages, loss_type))
    _assert_same(trl_result, ours, "on-policy")

    weights = token_weights_at_ratio_one(b.mask, b.advantages, loss_type).double()
    _, surrogate_grads = _loss_and_grads(model, lambda: -(weights * b.dense_logps()).sum())  # Σ w·CE
    _assert_same(ours, (ours[0], surrogate_grads), "token weights")
