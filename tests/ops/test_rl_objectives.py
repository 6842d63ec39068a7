"""open-instruct's GRPO objective on hf_fused (:func:`hf_fused.ops.linear_grpo_loss`) against open-instruct's own
code run on float64 dense logits: loss, dh, dW, db and the clip fraction (per token and its masked mean), over
DAPO/CISPO × with/without a reference × temperature 1 / 0.7 × with/without ρ × the four KL estimators.

The reference below transcribes allenai/open-instruct at e6c3044: ``grpo_utils.forward_for_logprobs`` (logits
/ temperature, log-softmax, gather), ``grpo_utils.compute_grpo_loss``, ``model_utils.estimate_kl`` and
``rl_utils.masked_mean`` with a denominator, assembled as in ``grpo_fast.py``. fp32 vs float64: 1e-5.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from references import H, RTOL, assert_head_grads, dense_logits, leaf64, make_head_inputs, rel_err
from hf_fused.ops import GRPOObjective, get_backend, linear_grpo_loss


# -- open-instruct, transcribed --------------------------------------------------------------------------


def oi_estimate_kl(ref_logprobs_diff, ratio):
    return torch.stack([ref_logprobs_diff, ref_logprobs_diff**2 / 2, torch.expm1(-ref_logprobs_diff) + ref_logprobs_diff,
                        ratio * ref_logprobs_diff])


def oi_compute_grpo_loss(new_logprobs, ratio, advantages, ref_logprobs, config, rho_weights):
    if config.loss_fn == "dapo":
        pg_losses = -advantages * ratio
        pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - config.clip_lower, 1.0 + config.clip_higher)
        clipfrac = (pg_losses2 > pg_losses).float()
        pg_loss = torch.max(pg_losses, pg_losses2)
    else:
        clipfrac = (ratio > 1.0 + config.clip_higher).float()
        pg_loss = -advantages * torch.clamp(ratio.detach(), max=1.0 + config.clip_higher) * new_logprobs
    pg_loss = pg_loss * rho_weights
    clipfrac = clipfrac * (rho_weights != 0).float()
    if ref_logprobs is not None:
        ref_logprobs_diff = (new_logprobs - ref_logprobs).clamp(-40.0, 40.0)
        kl = oi_estimate_kl(ref_logprobs_diff, ratio)[config.kl_estimator]
    else:
        kl = torch.zeros_like(pg_loss)
    return pg_loss, clipfrac, kl


def oi_masked_mean(values, mask, denominator):
    numerator = (values * mask).sum()
    return numerator / denominator if denominator > 0 else torch.zeros_like(numerator)


def oi_loss(hidden, weight, bias, labels, mask, advantages, old, ref, rho, config, temperature, denominator, scale):
    """float64 ``(loss, clipfrac, new_logprobs)`` exactly as open-instruct assembles them."""
    logits = dense_logits(hidden, weight, bias, temperature=temperature)
    new_logprobs = torch.log_softmax(logits, -1).gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    old = new_logprobs.detach() if old is None else old
    ratio = torch.exp(new_logprobs - old)
    rho = torch.ones_like(ratio) if rho is None else rho
    pg_loss, clipfrac, kl = oi_compute_grpo_loss(new_logprobs, ratio, advantages, ref, config, rho)
    loss = oi_masked_mean(pg_loss + config.beta * kl, mask, denominator) * scale
    return loss, clipfrac, new_logprobs


# -- the grid ---------------------------------------------------------------------------------------------


def batch(seed: int, shape=(3, 8), vocab=97, temperature=1.0):
    hidden, weight, bias, labels = make_head_inputs(shape, H, vocab, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    mask = torch.rand(shape, generator=g) < 0.75
    mask[:, 0] = False  # prompt position
    labels = torch.where(mask, labels, torch.zeros_like(labels))  # open-instruct's pad -> 0
    advantages = torch.randn(shape[0], 1, generator=g).expand(shape).contiguous()
    with torch.no_grad():
        z = dense_logits(hidden, weight, bias, temperature=temperature)
        current = torch.log_softmax(z, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1).float()
    # old/ref a few tenths from the current log-probs: ratios on both sides of the clip range
    old = current + 0.35 * torch.randn(shape, generator=g)
    ref = current + 0.5 * torch.randn(shape, generator=g)
    rho = (torch.rand(shape, generator=g) * 2.0).where(torch.rand(shape, generator=g) < 0.85, torch.zeros(()))
    return hidden, weight, bias, labels, mask, advantages, old, ref, rho


@pytest.mark.parametrize("kl_estimator", [0, 1, 2, 3])
@pytest.mark.parametrize("with_rho", [False, True], ids=["no_rho", "rho"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_ref", [False, True], ids=["no_ref", "ref"])
@pytest.mark.parametrize("loss_fn", ["dapo", "cispo"])
def test_matches_open_instruct_on_float64_dense_logits(loss_fn, with_ref, temperature, with_rho, kl_estimator):
    hidden, weight, bias, labels, mask, advantages, old, ref, rho = batch(seed=kl_estimator, temperature=temperature)
    objective = GRPOObjective(loss_fn=loss_fn, beta=0.05, kl_estimator=kl_estimator)
    denominator, scale = float(mask.sum() + 5), 2.0  # a token count of the accumulation group; world size
    h64, w64, b64 = leaf64(hidden), leaf64(weight), leaf64(bias)
    out = linear_grpo_loss(
        hidden, weight, labels, advantages=advantages, response_mask=mask, loss_denominator=denominator,
        old_logprobs=old, ref_logprobs=ref if with_ref else None, rho_weights=rho if with_rho else None,
        objective=objective, loss_scale=scale, bias=bias, temperature=temperature,
    )
    ref_loss, ref_clipfrac, ref_logp = oi_loss(
        h64, w64, b64, labels, mask, advantages.double(), old.double(), ref.double() if with_ref else None,
        rho.double() if with_rho else None, objective, temperature, denominator, scale,
    )
    assert rel_err(out.loss, ref_loss) <= RTOL
    assert rel_err(out.logprobs[mask], ref_logp[mask]) <= RTOL
    # A clip indicator may only differ where the ratio sits on a clip boundary to fp32 precision: none here.
    torch.testing.assert_close(out.clipfrac, (ref_clipfrac * mask).float(), rtol=0, atol=0)
    assert abs(out.clipfrac_avg.item() - oi_masked_mean(ref_clipfrac, mask, mask.sum()).item()) <= 1e-7
    assert 0 < out.clipfrac.sum() < mask.sum()  # the grid exercises clipping, both ways
    out.loss.backward()
    ref_loss.backward()
    assert_head_grads((hidden, weight, bias), (h64, w64, b64), RTOL)


def test_on_policy_first_epoch_has_ratio_one_and_open_instructs_gradient():
    """``old_logprobs=None``: open-instruct's first epoch caches the current log-probs, detached (ratio 1)."""
    hidden, weight, bias, labels, mask, advantages, _, ref, _ = batch(seed=7)
    objective = GRPOObjective(loss_fn="dapo", beta=0.1, kl_estimator=3)
    h64, w64, b64 = leaf64(hidden), leaf64(weight), leaf64(bias)
    out = linear_grpo_loss(hidden, weight, labels, advantages=advantages, response_mask=mask, loss_denominator=11,
                           ref_logprobs=ref, objective=objective, bias=bias, temperature=0.7)
    ref_loss, _, _ = oi_loss(h64, w64, b64, labels, mask, advantages.double(), None, ref.double(), None, objective,
                             0.7, 11, 1.0)
    assert (out.ratio[mask] == 1).all() and (out.clipfrac == 0).all()
    assert rel_err(out.loss, ref_loss) <= RTOL
    out.loss.backward()
    ref_loss.backward()
    assert_head_grads((hidden, weight, bias), (h64, w64, b64), RTOL)


def test_metrics_are_open_instructs_per_token_terms():
    hidden, weight, bias, labels, mask, advantages, old, ref, rho = batch(seed=8)
    objective = GRPOObjective(loss_fn="dapo", kl_estimator=2)
    with torch.no_grad():
        out = linear_grpo_loss(hidden, weight, labels, advantages=advantages, response_mask=mask, loss_denominator=9,
                               old_logprobs=old, ref_logprobs=ref, rho_weights=rho, objective=objective, bias=bias,
                               need_entropy=True)
        logp = dense_logits(hidden, weight, bias).log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(logp - old.double())
        pg, clipfrac, kl = oi_compute_grpo_loss(logp, ratio, advantages.double(), ref.double(), objective, rho.double())
    for ours, theirs in ((out.ratio, ratio), (out.pg_loss, pg), (out.kl, kl), (out.clipfrac, clipfrac)):
        assert rel_err(ours[mask], theirs[mask]) <= RTOL and (ours[~mask] == 0).all()
    assert out.entropy is not None and (out.entropy[~mask] == 0).all()


def test_masked_positions_are_never_scored(monkeypatch):
    """Positions outside the response mask (prompt, padding) cost no head work and get no gradient."""
    hidden, weight, bias, labels, mask, advantages, old, _, _ = batch(seed=9)
    seen = []
    backend = get_backend(torch.device("cpu"), "torch")
    original = backend.token_loss_with_grads

    def spy(head, *args, **kwargs):
        seen.append(head.rows.numel())
        return original(head, *args, **kwargs)

    monkeypatch.setattr(backend, "token_loss_with_grads", spy)
    out = linear_grpo_loss(hidden, weight, labels, advantages=advantages, response_mask=mask, loss_denominator=10,
                           old_logprobs=old, bias=bias)
    out.loss.backward()
    assert seen == [int(mask.sum())]
    assert (hidden.grad[~mask] == 0).all()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(objective=dict(loss_fn="ppo")), ValueError, "loss_fn"),
        (dict(objective=dict(kl_estimator=4)), ValueError, "kl_estimator"),
        (dict(loss_denominator=0), ValueError, "loss_denominator"),
        (dict(loss_denominator=torch.ones(2)), ValueError, "one number"),
        (dict(advantages=torch.ones(5)), ValueError, "broadcastable"),
        (dict(response_mask="meta"), ValueError, r"response_mask is on meta.*response_mask.to\(labels.device\)"),
        (dict(loss_scale=None), TypeError, "loss_scale must be a number"),
    ],
    ids=["loss_fn", "kl_estimator", "zero_denominator", "tensor_denominator", "advantages_shape", "mask_device",
         "loss_scale_none"],
)
def test_bad_inputs_raise(kwargs, error, match):
    hidden, weight, bias, labels, mask, advantages, old, _, _ = batch(seed=10)
    args = dict(advantages=advantages, response_mask=mask, loss_denominator=4, old_logprobs=old, bias=bias)
    if "objective" in kwargs:
        with pytest.raises(error, match=match):
            GRPOObjective(**kwargs["objective"])
        return
    args.update(kwargs)
    if isinstance(args["response_mask"], str):  # "meta": on another device than labels (meta: no second device needed)
        args["response_mask"] = mask.to("meta")
    with pytest.raises(error, match=match):
        linear_grpo_loss(hidden, weight, labels, **args)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
@pytest.mark.parametrize("loss_fn", ["dapo", "cispo"])
def test_triton_backend_matches_open_instruct(loss_fn):
    """The same objective on the GPU backend's kernels (Triton interpreter on CPU), one-pass schedule."""
    hidden, weight, bias, labels, mask, advantages, old, ref, rho = batch(seed=11, temperature=0.7)
    objective = GRPOObjective(loss_fn=loss_fn, beta=0.05, kl_estimator=2)
    h64, w64, b64 = leaf64(hidden), leaf64(weight), leaf64(bias)
    out = linear_grpo_loss(hidden, weight, labels, advantages=advantages, response_mask=mask, loss_denominator=13,
                           old_logprobs=old, ref_logprobs=ref, rho_weights=rho, objective=objective, bias=bias,
                           temperature=0.7, backend="triton", tile_budget_bytes=97 * H * 4 + 512 * 97 * 4 + 1024 * H * 8)
    ref_loss, ref_clipfrac, _ = oi_loss(h64, w64, b64, labels, mask, advantages.double(), old.double(), ref.double(),
                                        rho.double(), objective, 0.7, 13, 1.0)
    assert rel_err(out.loss, ref_loss) <= RTOL
    torch.testing.assert_close(out.clipfrac, (ref_clipfrac * mask).float(), rtol=0, atol=0)
    out.loss.backward()
    ref_loss.backward()
    assert_head_grads((hidden, weight, bias), (h64, w64, b64), RTOL)
