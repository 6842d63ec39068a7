"""linear_distillation_loss against a float64 dense reference (both models' full logits, autograd) and against
TRL 1.16's own ``_chunked_divergence_loss``: loss, per-token divergence and entropy, and the student's gradients
(hidden, weight, bias); none for the teacher.

Tolerances: ``RTOL = 1e-5`` for fp32 against float64 and against TRL's fp32 function (the op computes fp32
logits, fp32 log-softmaxes over V = 97 columns and fp32 gradient sums: a few fp32 roundings of O(1) terms; measured
at most 1.6e-6 against float64 and 1e-6 against TRL). In bf16 and under autocast, two bounds: the error of the eager
computation in the same precision (``F.linear`` in bf16, the divergence in fp32 autograd, as transformers' models
and TRL's non-fused path compute it) times ``RATIO``, as ``test_mixed_precision`` bounds the other ops; and, since
the op keeps the logits and the gradient sums in fp32 where eager rounds the logits to bf16, its own claim: fp32
outputs within ``RTOL`` of float64 on the same operands, and gradients float64's rounded once to the leaf dtype
(``RTOL`` for fp32 leaves, ``BF16_ROUNDING`` for bf16 ones). Measured: bf16 gradients 1.4e-3 to 2.2e-3 from float64
where eager's are 3.7e-3 to 1.8e-2; fp32 gradients under autocast 3e-7 to 1e-6.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

from references import dense_logits, leaf64, rel_err
from hf_fused.ops.distillation import distillation_rows_per_tile, linear_distillation_loss
from hf_fused.ops.distillation_math import DISTILLATION_TILE_BUFFERS

RTOL = 1e-5
#: bf16/autocast: the op's error against float64 at most this times eager's in the same precision.
RATIO = 1.25
#: One rounding to bf16 (8 significant bits): at most 2⁻⁸ of each element, so of the norm.
BF16_ROUNDING = 2.0**-8
V, H_S, H_T = 97, 16, 24
BETAS = [0.0, 0.5, 1.0, 0.1]
TEMPERATURES = [1.0, 0.7, 2.0]
#: Each model's own logit transform: (student_logit_scale, student_softcap, teacher_logit_scale, teacher_softcap).
TRANSFORMS = {
    "identity": (1.0, None, 1.0, None),
    "student_softcap": (1.0, 4.0, 1.0, None),
    "both_scaled_and_capped": (0.5, 5.0, 2.0, 8.0),
    "teacher_scaled": (1.0, None, 0.6, 3.0),
}


def _transform_kwargs(name):
    s_scale, s_cap, t_scale, t_cap = TRANSFORMS[name]
    return dict(student_logit_scale=s_scale, student_softcap=s_cap, teacher_logit_scale=t_scale, teacher_softcap=t_cap)


def _budget_for(tile_rows: int) -> int:
    """A tile budget whose tiles hold exactly ``tile_rows`` rows (uneven against the token counts used here)."""
    budget = tile_rows * DISTILLATION_TILE_BUFFERS * 4 * V
    assert distillation_rows_per_tile(V, budget) == tile_rows
    return budget


def _inputs(batch_shape=(3, 7), *, seed=0, dtype=torch.float32, bias=True, teacher_bias=True, masked=True):
    """Student and teacher heads whose logits have a standard deviation of ~3 (a trained head's spread) and are
    correlated as a real pair's are: the teacher's hidden states extend the student's, its weight extends the
    student's with an independent part. Returns ``(student leaves, teacher tensors, mask)``."""
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(*batch_shape, H_S, generator=g)
    ws = torch.randn(V, H_S, generator=g) * (3 / H_S**0.5)
    bs = torch.randn(V, generator=g) * 0.5 if bias else None
    ht = torch.cat([hs, torch.randn(*batch_shape, H_T - H_S, generator=g)], -1)
    wt = torch.cat([ws + 0.5 * torch.randn(V, H_S, generator=g) / H_S**0.5,
                    torch.randn(V, H_T - H_S, generator=g) * (2 / H_S**0.5)], 1)
    bt = torch.randn(V, generator=g) * 0.5 if teacher_bias else None
    mask = (torch.rand(batch_shape, generator=g) > 0.3).long() if masked else torch.ones(batch_shape, dtype=torch.long)
    mask.view(-1)[0] = 1
    student = [None if t is None else t.to(dtype).requires_grad_() for t in (hs, ws, bs)]
    teacher = [None if t is None else t.to(dtype) for t in (ht, wt, bt)]
    return student, teacher, mask


def _dense(student, teacher, mask, *, beta, temperature=1.0, student_logit_scale=1.0, student_softcap=None,
           teacher_logit_scale=1.0, teacher_softcap=None):
    """Float64 ``(per-token divergence, student entropy)``, 0 at masked tokens, differentiable in ``student``."""
    zs = dense_logits(*student, logit_scale=student_logit_scale, softcap=student_softcap, temperature=temperature)
    with torch.no_grad():
        zt = dense_logits(*teacher, logit_scale=teacher_logit_scale, softcap=teacher_softcap, temperature=temperature)
    s, t = zs.log_softmax(-1), zt.log_softmax(-1)
    if beta == 0:
        div = (t.exp() * (t - s)).sum(-1)
    elif beta == 1:
        div = (s.exp() * (s - t)).sum(-1)
    else:
        m = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))
        div = beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)
    kept = mask != 0
    entropy = -(s.exp() * s).sum(-1)
    return torch.where(kept, div, 0.0), torch.where(kept, entropy, 0.0).detach()


def _reduce(div, mask, reduction="mean", num_items_in_batch=None):
    if reduction == "none":
        return div
    if num_items_in_batch is not None:
        return div.sum() / float(num_items_in_batch)
    return div.sum() / max(int((mask != 0).sum()), 1) if reduction == "mean" else div.sum()


def _student64(student):
    return [leaf64(t) for t in student]


def _assert_student_grads(student, ref, tol=RTOL):
    for name, ours, exact in zip(("hidden", "weight", "bias"), student, ref):
        if ours is None:
            continue
        assert ours.grad is not None and ours.grad.dtype == ours.dtype, name
        err = rel_err(ours.grad, exact.grad)
        assert err <= tol, f"d{name}: relative error {err:.2e} > {tol:.0e}"


def _check_against_dense(student, teacher, mask, *, beta, temperature, transform="identity", reduction="mean",
                         num_items_in_batch=None, upstream=None, tile_rows=4):
    kw = _transform_kwargs(transform)
    out = linear_distillation_loss(
        student[0], student[1], teacher[0], teacher[1], student_bias=student[2], teacher_bias=teacher[2], mask=mask,
        beta=beta, temperature=temperature, reduction=reduction, num_items_in_batch=num_items_in_batch,
        tile_budget_bytes=_budget_for(tile_rows), **kw,
    )
    ref = _student64(student)
    div, ent = _dense(ref, teacher, mask, beta=beta, temperature=temperature, **kw)
    loss = _reduce(div, mask, reduction, num_items_in_batch)
    up = torch.ones(()) if upstream is None else upstream
    (out.loss * up).sum().backward()
    (loss * up.double()).sum().backward()
    assert out.loss.dtype == out.divergence.dtype == out.entropy.dtype == torch.float32
    assert not out.divergence.requires_grad and not out.entropy.requires_grad
    assert out.divergence.shape == out.entropy.shape == mask.shape
    assert rel_err(out.loss, loss) <= RTOL
    assert rel_err(out.divergence, div) <= RTOL
    assert rel_err(out.entropy, ent) <= RTOL
    _assert_student_grads(student, ref)
    return out


# -- the math against float64 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("beta", BETAS)
def test_divergence_and_student_grads_match_float64(beta, temperature):
    student, teacher, mask = _inputs()
    _check_against_dense(student, teacher, mask, beta=beta, temperature=temperature)


@pytest.mark.parametrize("transform", [t for t in TRANSFORMS if t != "identity"])
@pytest.mark.parametrize("beta", BETAS)
def test_each_model_logit_scale_and_softcap_before_temperature(beta, transform):
    student, teacher, mask = _inputs(seed=1)
    _check_against_dense(student, teacher, mask, beta=beta, temperature=0.7, transform=transform)


@pytest.mark.parametrize("tile_rows", [1, 4, 5, 64])
def test_uneven_tiles_give_the_same_result(tile_rows):
    # 21 tokens, 15 kept: tiles of 4 and 5 leave a short last tile, 64 is one tile, 1 is one row per tile
    student, teacher, mask = _inputs(seed=2)
    _check_against_dense(student, teacher, mask, beta=0.5, temperature=1.0, tile_rows=tile_rows,
                         transform="both_scaled_and_capped")


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reductions_with_upstream_gradient(reduction, beta):
    # upstream != 1: a loss scale / 1/accumulation-steps factor ("mean"/"sum"), per-token weights ("none")
    student, teacher, mask = _inputs(seed=3)
    g = torch.Generator().manual_seed(7)
    upstream = torch.randn(mask.shape, generator=g) if reduction == "none" else torch.tensor(0.37)
    out = _check_against_dense(student, teacher, mask, beta=beta, temperature=0.7, reduction=reduction,
                               upstream=upstream)
    if reduction == "none":
        assert out.loss.shape == mask.shape and torch.equal(out.loss.detach(), out.divergence)
        assert (out.loss.detach()[mask == 0] == 0).all()


@pytest.mark.parametrize("items", [40, 40.0, "tensor"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_num_items_in_batch_divides_the_sum(reduction, items):
    student, teacher, mask = _inputs(seed=4)
    num_items = torch.tensor(40) if items == "tensor" else items
    _check_against_dense(student, teacher, mask, beta=1.0, temperature=1.0, reduction=reduction,
                         num_items_in_batch=num_items)


def test_gradient_accumulation_over_micro_batches_equals_one_batch():
    """Two micro-batches, each normalized by the whole batch's kept-token count and backpropagated into the same
    ``.grad`` (transformers' gradient accumulation), give the gradient of the one full batch."""
    student, teacher, mask = _inputs((4, 6), seed=5)
    n = int(mask.sum())
    for part in (slice(0, 2), slice(2, 4)):
        out = linear_distillation_loss(
            student[0][part], student[1], teacher[0][part], teacher[1], student_bias=student[2],
            teacher_bias=teacher[2], mask=mask[part], beta=0.5, temperature=0.7, num_items_in_batch=n,
            tile_budget_bytes=_budget_for(3),
        )
        out.loss.backward()
    ref = _student64(student)
    div, _ = _dense(ref, teacher, mask, beta=0.5, temperature=0.7)
    (div.sum() / n).backward()
    _assert_student_grads(student, ref)


def test_labels_with_ignore_index_and_three_dim_inputs():
    student, teacher, mask = _inputs((2, 5), seed=6)
    labels = torch.where(mask != 0, torch.arange(10).view(2, 5), -100)
    ours = linear_distillation_loss(student[0], student[1], teacher[0], teacher[1], student_bias=student[2],
                                    teacher_bias=teacher[2], labels=labels, beta=0.0)
    by_mask = linear_distillation_loss(student[0], student[1], teacher[0], teacher[1], student_bias=student[2],
                                       teacher_bias=teacher[2], mask=mask, beta=0.0)
    assert torch.equal(ours.loss, by_mask.loss) and torch.equal(ours.divergence, by_mask.divergence)
    # a mask keeps its tokens whatever ignore_index says (it applies to labels only)
    mask_any_index = linear_distillation_loss(student[0], student[1], teacher[0], teacher[1], student_bias=student[2],
                                              teacher_bias=teacher[2], mask=mask.bool(), ignore_index=0, beta=0.0)
    assert torch.equal(mask_any_index.divergence, by_mask.divergence)
    flat = linear_distillation_loss(student[0].reshape(10, H_S), student[1], teacher[0].reshape(10, H_T),
                                    teacher[1], student_bias=student[2], teacher_bias=teacher[2],
                                    mask=mask.reshape(10), beta=0.0)
    assert torch.equal(flat.divergence, ours.divergence.reshape(10))
    unmasked = linear_distillation_loss(student[0], student[1], teacher[0], teacher[1], beta=0.0,
                                        student_bias=student[2], teacher_bias=teacher[2])
    assert (unmasked.divergence > 0).all()


def test_all_tokens_ignored_gives_zero_loss_and_zero_gradients():
    student, teacher, mask = _inputs(seed=7)
    out = linear_distillation_loss(student[0], student[1], teacher[0], teacher[1], student_bias=student[2],
                                   teacher_bias=teacher[2], mask=torch.zeros_like(mask), beta=0.5)
    out.loss.backward()
    assert out.loss.item() == 0 and (out.divergence == 0).all() and (out.entropy == 0).all()
    assert all(t.grad is not None and (t.grad == 0).all() for t in student)


def test_teacher_gets_no_gradient_and_frozen_student_weight_none():
    student, teacher, mask = _inputs(seed=8)
    teacher = [t.detach().clone().requires_grad_() for t in teacher]
    student[1].requires_grad_(False)
    out = linear_distillation_loss(student[0], student[1], teacher[0], teacher[1], student_bias=student[2],
                                   teacher_bias=teacher[2], mask=mask, beta=0.5, temperature=2.0)
    out.loss.backward()
    assert all(t.grad is None for t in teacher)
    assert student[1].grad is None
    ref = _student64(student)
    div, _ = _dense(ref, [t.detach() for t in teacher], mask, beta=0.5, temperature=2.0)
    _reduce(div, mask).backward()
    assert rel_err(student[0].grad, ref[0].grad) <= RTOL and rel_err(student[2].grad, ref[2].grad) <= RTOL


def test_no_grad_mode_gives_the_same_values():
    student, teacher, mask = _inputs(seed=9)
    kw = dict(student_bias=student[2], teacher_bias=teacher[2], mask=mask, beta=0.1, temperature=0.7)
    with_grad = linear_distillation_loss(student[0], student[1], teacher[0], teacher[1], **kw)
    with torch.no_grad():
        without = linear_distillation_loss(student[0], student[1], teacher[0], teacher[1], **kw)
    assert not without.loss.requires_grad
    assert torch.equal(with_grad.loss.detach(), without.loss) and torch.equal(with_grad.entropy, without.entropy)


def test_teacher_in_another_dtype():
    """A frozen bf16 teacher beside an fp32 student: its logits are fp32 products of its bf16 values."""
    student, teacher, mask = _inputs(seed=10)
    teacher = [t.bfloat16() for t in teacher]
    out = linear_distillation_loss(student[0], student[1], teacher[0], teacher[1], student_bias=student[2],
                                   teacher_bias=teacher[2], mask=mask, beta=1.0, temperature=0.7)
    out.loss.backward()
    ref = _student64(student)
    div, _ = _dense(ref, teacher, mask, beta=1.0, temperature=0.7)
    _reduce(div, mask).backward()
    assert rel_err(out.loss, _reduce(div, mask)) <= RTOL
    _assert_student_grads(student, ref)


def test_second_backward_and_double_backward_raise():
    student, teacher, mask = _inputs(seed=11)
    out = linear_distillation_loss(student[0], student[1], teacher[0], teacher[1], mask=mask, beta=0.5)
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="once"):
        out.loss.backward()
    out = linear_distillation_loss(student[0], student[1], teacher[0], teacher[1], mask=mask, beta=0.5)
    with pytest.raises(RuntimeError, match="second-order"):
        torch.autograd.grad(out.loss, student[0], create_graph=True)


def test_reduction_none_backpropagates_twice():
    student, teacher, mask = _inputs(seed=12)
    out = linear_distillation_loss(student[0], student[1], teacher[0], teacher[1], mask=mask, beta=0.5,
                                   reduction="none")
    first = torch.autograd.grad(out.loss.sum(), student[1], retain_graph=True)[0]
    second = torch.autograd.grad(out.loss.sum(), student[1])[0]
    assert torch.equal(first, second)


# -- bf16 and autocast twins --------------------------------------------------------------------------------------


def _eager(student, teacher, mask, *, beta, temperature, **kw):
    """What the non-fused path computes (TRL's ``DistillationTrainer`` without its kernel, transformers models):
    each ``lm_head`` an ``F.linear`` (autocast applies), the transforms and the divergence in fp32 autograd."""
    def logits(h, w, b, scale, cap):
        z = F.linear(h, w, b).float() * scale
        if cap is not None:
            z = cap * torch.tanh(z / cap)
        return z / temperature

    zs = logits(*student, kw["student_logit_scale"], kw["student_softcap"])
    with torch.no_grad():
        zt = logits(*teacher, kw["teacher_logit_scale"], kw["teacher_softcap"])
    s, t = zs.log_softmax(-1), zt.log_softmax(-1)
    if beta == 0:
        div = (t.exp() * (t - s)).sum(-1)
    elif beta == 1:
        div = (s.exp() * (s - t)).sum(-1)
    else:
        m = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))
        div = beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)
    kept = mask != 0
    return torch.where(kept, div, 0.0), torch.where(kept, -(s.exp() * s).sum(-1), 0.0)


PRECISIONS = [
    ("bf16_weights", torch.bfloat16, None),  # both models loaded in bf16
    ("autocast_bf16_fp32_weights", torch.float32, torch.bfloat16),  # Trainer(bf16=True) on fp32 models
    ("bf16_weights_autocast_bf16", torch.bfloat16, torch.bfloat16),  # TRL's default on bf16 models
]


@pytest.mark.parametrize("transform", ["identity", "both_scaled_and_capped"])
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
@pytest.mark.parametrize("name,dtype,autocast", PRECISIONS, ids=[p[0] for p in PRECISIONS])
def test_error_at_most_eager_in_bf16_and_under_autocast(name, dtype, autocast, beta, transform):
    kw = _transform_kwargs(transform)
    student, teacher, mask = _inputs((6, 8), seed=13, dtype=dtype)
    g = torch.Generator().manual_seed(3)
    upstream = torch.rand(mask.shape, generator=g) + 0.5  # per-token weights: "none" exercises the recompute
    region = contextlib.nullcontext() if autocast is None else torch.autocast("cpu", dtype=autocast)
    # float64 ground truth from the very values the operands hold (autocast's bf16 copies where it casts)
    cast = (lambda t: t) if autocast is None else (lambda t: None if t is None else t.to(autocast))
    ref = [None if t is None else cast(t.detach()).double().requires_grad_() for t in student]
    div64, ent64 = _dense(ref, [cast(t) for t in teacher], mask, beta=beta, temperature=0.7, **kw)
    (div64 * upstream).sum().backward()
    ref_grads = [t.grad for t in ref]

    results = {}
    for path in ("fused", "eager"):
        params = [t.detach().clone().requires_grad_() for t in student]
        with region:
            if path == "fused":
                out = linear_distillation_loss(params[0], params[1], teacher[0], teacher[1], student_bias=params[2],
                                               teacher_bias=teacher[2], mask=mask, beta=beta, temperature=0.7,
                                               reduction="none", tile_budget_bytes=_budget_for(5), **kw)
                div, ent = out.loss, out.entropy
            else:
                div, ent = _eager(params, teacher, mask, beta=beta, temperature=0.7, **kw)
        (div * upstream).sum().backward()
        assert [p.grad.dtype for p in params] == [dtype] * 3
        results[path] = [rel_err(div, div64), rel_err(ent, ent64)] + [
            rel_err(p.grad, r) for p, r in zip(params, ref_grads)]
    one_rounding = RTOL if dtype == torch.float32 else BF16_ROUNDING
    for i, what in enumerate(["divergence", "entropy", "d_hidden", "d_weight", "d_bias"]):
        fused, eager = results["fused"][i], results["eager"][i]
        assert fused <= RATIO * eager + 1e-7, f"{name}/{what}: fused {fused:.3g} > {RATIO} x eager {eager:.3g}"
        assert fused <= (RTOL if i < 2 else one_rounding), f"{name}/{what}: {fused:.3g} from float64"


# -- parity with TRL's own function ------------------------------------------------------------------------------

trl_distillation = pytest.importorskip("trl.trainer.distillation_trainer")


@pytest.mark.parametrize("num_items", [None, 23])
@pytest.mark.parametrize("transform", ["identity", "both_scaled_and_capped"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("beta", BETAS)
def test_parity_with_trl_chunked_divergence_loss(beta, temperature, transform, num_items):
    """TRL's ``_chunked_divergence_loss`` called on the same tensors: the same loss, entropy sum, valid count and
    student gradients, to fp32 precision (both compute fp32 logits from fp32 operands)."""
    kw = _transform_kwargs(transform)
    student, teacher, mask = _inputs(seed=14)
    theirs = [t.detach().clone().requires_grad_() for t in student]
    loss, entropy_sum, n_valid = trl_distillation._chunked_divergence_loss(
        theirs[0], teacher[0], theirs[1], teacher[1], mask, beta, num_items_in_batch=num_items,
        student_lm_head_bias=theirs[2], teacher_lm_head_bias=teacher[2], temperature=temperature,
        student_logit_scale=kw["student_logit_scale"], teacher_logit_scale=kw["teacher_logit_scale"],
        student_final_logit_softcapping=kw["student_softcap"], teacher_final_logit_softcapping=kw["teacher_softcap"],
    )
    loss.backward()
    out = linear_distillation_loss(student[0], student[1], teacher[0], teacher[1], student_bias=student[2],
                                   teacher_bias=teacher[2], mask=mask, beta=beta, temperature=temperature,
                                   num_items_in_batch=num_items, **kw)
    out.loss.backward()
    assert int(n_valid) == int((mask != 0).sum())
    assert rel_err(out.loss, loss) <= RTOL
    assert rel_err(out.entropy.sum(), entropy_sum) <= RTOL
    for name, ours, trl in zip(("hidden", "weight", "bias"), student, theirs):
        err = rel_err(ours.grad, trl.grad)
        assert err <= RTOL, f"d{name}: {err:.2e} from TRL's"


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
def test_no_further_from_float64_than_trl_under_autocast(beta):
    """TRL's default precision (``bf16=True``): both compute from bf16 operands; TRL rounds its logits-gradient
    tile to bf16 before the gradient matmuls, the op keeps it fp32, so its gradients are no further from float64.
    No bias: TRL adds an fp32 bias where ``F.linear`` under autocast (and the op) adds a bf16 one."""
    student, teacher, mask = _inputs((6, 8), seed=15, bias=False, teacher_bias=False)
    cast = [None if t is None else t.detach().bfloat16().double() for t in student]
    ref = [None if t is None else t.requires_grad_() for t in cast]
    div64, _ = _dense(ref, [None if t is None else t.bfloat16() for t in teacher], mask, beta=beta, temperature=0.7)
    loss64 = _reduce(div64, mask)
    loss64.backward()
    theirs = [None if t is None else t.detach().clone().requires_grad_() for t in student]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _, _ = trl_distillation._chunked_divergence_loss(theirs[0], teacher[0], theirs[1], teacher[1], mask,
                                                               beta, temperature=0.7)
        out = linear_distillation_loss(student[0], student[1], teacher[0], teacher[1], mask=mask, beta=beta,
                                       temperature=0.7)
    loss.backward()
    out.loss.backward()
    assert rel_err(out.loss, loss) <= RTOL  # the same fp32 logits of the same bf16 operands
    for name, i in (("hidden", 0), ("weight", 1)):
        ours, trl = rel_err(student[i].grad, ref[i].grad), rel_err(theirs[i].grad, ref[i].grad)
        assert ours <= trl + 1e-7, f"d{name}: {ours:.3g} from float64, TRL's {trl:.3g}"


# -- bad inputs ---------------------------------------------------------------------------------------------------


def _call(**changes):
    student, teacher, mask = _inputs(seed=16)
    args = dict(student_hidden=student[0], student_weight=student[1], teacher_hidden=teacher[0],
                teacher_weight=teacher[1], mask=mask)
    args.update(changes)
    return linear_distillation_loss(**args)


@pytest.mark.parametrize("changes,error,match", [
    (dict(teacher_weight=torch.randn(V + 3, H_T)), ValueError, "share one vocabulary"),
    (dict(teacher_hidden=torch.randn(3, 6, H_T)), ValueError, "leading shape"),
    (dict(teacher_hidden=torch.randn(3, 7, H_T + 1)), ValueError, "teacher: hidden must be"),
    (dict(student_weight=torch.randn(V, H_S + 1)), ValueError, "student: hidden must be"),
    (dict(beta=1.5), ValueError, "beta must be"),
    (dict(beta=-0.1), ValueError, "beta must be"),
    (dict(beta=float("nan")), ValueError, "beta must be"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(student_softcap=0.0), ValueError, "student: softcap"),
    (dict(teacher_logit_scale=float("inf")), ValueError, "teacher: logit_scale"),
    (dict(reduction="batchmean"), ValueError, "reduction"),
    (dict(reduction="none", num_items_in_batch=4), ValueError, "num_items_in_batch"),
    (dict(num_items_in_batch=0), ValueError, "student: num_items_in_batch"),
    (dict(labels=torch.zeros(3, 7, dtype=torch.long)), ValueError, "not both"),
    (dict(mask=torch.ones(3, 6)), ValueError, "mask must have"),
    (dict(mask=None, labels=torch.zeros(3, 7)), TypeError, "student: labels must be an integer"),
    (dict(mask=None, labels=torch.full((3, 7), V)), ValueError, "student: labels contain"),
    (dict(teacher_hidden=torch.zeros(3, 7, H_T, dtype=torch.long)), TypeError, "teacher: .*floating point"),
    (dict(student_hidden="hidden"), TypeError, "student: hidden must be a torch.Tensor"),
    (dict(student_bias=torch.zeros(V + 1)), ValueError, "student: bias must be"),
    (dict(teacher_bias=torch.zeros(V, device="meta")), ValueError, "teacher: .*device"),
    (dict(tile_budget_bytes=0), ValueError, "student: tile_budget_bytes"),
    (dict(backend="no-such-backend"), ValueError, "student: unknown hf_fused backend"),
])
def test_bad_inputs_raise_clear_errors(changes, error, match):
    with pytest.raises(error, match=match):
        _call(**changes)


# -- CUDA: products from bf16 operands ----------------------------------------------------------------------------
#
# On CUDA the pass computes bf16 products with fp32 accumulation and output (``half_products``) instead of from fp32
# copies of the weights (fp16 keeps the fp32 path). Bounds, against float64 on the very operands both paths compute
# from:
# - divergence and entropy at most a tenth of eager's error: the op's logits are the fp32 accumulator's values,
#   eager's are rounded to bf16 (2⁻⁹ of each logit of spread ~3), which a path rounding its logits would match;
# - gradients no further from float64 than eager's: both round the logits gradient once to the operand dtype for
#   the gradient matmuls, eager's gradient also carries its bf16 logits' error (and, for fp32 leaves under autocast,
#   a rounding of the products to bf16 that the op's fp32 accumulators skip).

GPU_V, GPU_H_S, GPU_H_T = 8192, 256, 384


def _cuda_inputs(n, dtype, *, v=GPU_V, h_s=GPU_H_S, h_t=GPU_H_T, seed=0):
    """:func:`_inputs`' construction (logits of spread ~3, a correlated teacher, a mask) at ``n`` tokens of a wider
    head, on CUDA."""
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(n, h_s, generator=g)
    ws = torch.randn(v, h_s, generator=g) * (3 / h_s**0.5)
    bs = torch.randn(v, generator=g) * 0.5
    ht = torch.cat([hs, torch.randn(n, h_t - h_s, generator=g)], -1)
    wt = torch.cat([ws + 0.5 * torch.randn(v, h_s, generator=g) / h_s**0.5,
                    torch.randn(v, h_t - h_s, generator=g) * (2 / h_s**0.5)], 1)
    bt = torch.randn(v, generator=g) * 0.5
    mask = (torch.rand(n, generator=g) > 0.3).long()
    mask[0] = 1
    student = [t.to("cuda", dtype).requires_grad_() for t in (hs, ws, bs)]
    teacher = [t.to("cuda", dtype) for t in (ht, wt, bt)]
    return student, teacher, mask.cuda()


@pytest.mark.gpu
def test_cuda_half_products_predicate():
    from types import SimpleNamespace

    from hf_fused.ops.distillation import half_products

    def head(dtype, device="cuda", hidden_dtype=None):
        return SimpleNamespace(hidden=torch.zeros(2, 4, dtype=hidden_dtype or dtype, device=device),
                               weight=torch.zeros(3, 4, dtype=dtype, device=device))

    assert half_products(head(torch.bfloat16))
    assert not half_products(head(torch.float16))  # "mean"'s dz (p/N) would flush to zero in fp16
    assert not half_products(head(torch.float32))
    assert not half_products(head(torch.bfloat16, "cpu"))
    assert not half_products(head(torch.bfloat16, hidden_dtype=torch.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("transform", ["identity", "both_scaled_and_capped"])
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
@pytest.mark.parametrize("name,dtype,autocast", PRECISIONS, ids=[p[0] for p in PRECISIONS])
def test_cuda_half_products_no_further_from_float64_than_eager(name, dtype, autocast, beta, transform, reduction):
    kw = _transform_kwargs(transform)
    student, teacher, mask = _cuda_inputs(1000, dtype, seed=17)
    g = torch.Generator().manual_seed(5)
    upstream = (torch.rand(mask.shape, generator=g) + 0.5).cuda() if reduction == "none" else None
    region = contextlib.nullcontext() if autocast is None else torch.autocast("cuda", dtype=autocast)
    cast = (lambda t: t) if autocast is None else (lambda t: t.to(autocast))
    ref = [cast(t.detach()).double().requires_grad_() for t in student]
    div64, ent64 = _dense(ref, [cast(t) for t in teacher], mask, beta=beta, temperature=0.7, **kw)
    loss64 = (div64 * upstream).sum() if upstream is not None else _reduce(div64, mask)
    loss64.backward()

    results = {}
    for path in ("fused", "eager"):
        params = [t.detach().clone().requires_grad_() for t in student]
        with region:
            if path == "fused":
                out = linear_distillation_loss(params[0], params[1], teacher[0], teacher[1], student_bias=params[2],
                                               teacher_bias=teacher[2], mask=mask, beta=beta, temperature=0.7,
                                               reduction=reduction, tile_budget_bytes=96 * DISTILLATION_TILE_BUFFERS
                                               * 4 * GPU_V, **kw)  # 96-row tiles: uneven against 1000 tokens
                div, ent = out.divergence, out.entropy
                loss = (out.loss * upstream).sum() if upstream is not None else out.loss
            else:
                div, ent = _eager(params, teacher, mask, beta=beta, temperature=0.7, **kw)
                loss = (div * upstream).sum() if upstream is not None else _reduce(div, mask)
        loss.backward()
        assert [p.grad.dtype for p in params] == [dtype] * 3
        results[path] = [rel_err(loss, loss64), rel_err(div, div64), rel_err(ent, ent64)] + [
            rel_err(p.grad, r.grad) for p, r in zip(params, ref)]
    for i, what in enumerate(["loss", "divergence", "entropy", "d_hidden", "d_weight", "d_bias"]):
        fused, eager = results["fused"][i], results["eager"][i]
        bound = eager / 10 if i < 3 else eager
        assert fused <= bound, f"{name}/{what}: fused {fused:.3g} from float64, eager {eager:.3g}"


@pytest.mark.gpu
def test_cuda_half_products_hold_no_copy_of_either_weight():
    """bf16 heads of TRL's shape class (a teacher twice the student's width): the pass holds its tiles, the
    hidden gradient and no copy of either weight in any dtype, so its peak stays under one bf16 copy of the smaller
    weight (the fp32 path holds fp32 copies of both: 6x that). The student's weight is frozen: its fp32 gradient
    buffer would be the size of an fp32 copy."""
    n, v, h_s, h_t = 1024, 32768, 2048, 4096
    g = torch.Generator(device="cuda").manual_seed(0)
    hs = torch.randn(n, h_s, device="cuda", generator=g).bfloat16().requires_grad_()
    ws = (torch.randn(v, h_s, device="cuda", generator=g) / h_s**0.5).bfloat16()
    ht = torch.randn(n, h_t, device="cuda", generator=g).bfloat16()
    wt = (torch.randn(v, h_t, device="cuda", generator=g) / h_t**0.5).bfloat16()
    budget = 32 * 2**20

    def run():
        out = linear_distillation_loss(hs, ws, ht, wt, beta=0.5, tile_budget_bytes=budget)
        out.loss.backward()
        assert hs.grad is not None and torch.isfinite(hs.grad).all()
        hs.grad = None

    run()  # cuBLAS workspaces and the allocator's first blocks come before the measurement
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    bf16_copy = v * h_s * 2
    assert peak < bf16_copy, f"peak {peak / 2**20:.0f} MiB above the inputs >= a bf16 copy of the student's weight"
