"""Both ops under the precisions users train in, against float64 and against eager under the same precision.

What ``Trainer(bf16=True)`` does to an fp32 model is autocast: ``lm_head`` becomes a bf16 ``F.linear`` and
transformers upcasts its logits to fp32 for the loss. The fused ops must compute the head from the same
operands in forward and backward, so their error against float64 (outputs and every gradient) is no
worse than that eager computation's: the bound is ``1.25 ×`` eager's error under the same precision,
element-norm relative, per output. The fused path keeps the logits in fp32 (torch backend) or rounds them
to the operand dtype as eager does (triton backend), and accumulates gradients in fp32 either way.
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from references import dense_cross_entropy, dense_logprobs, leaf64, rel_err
from hf_fused.ops import linear_cross_entropy, linear_logprobs

#: The fused error may exceed eager's by this factor at most (the issue's acceptance bound).
RATIO = 1.25

_HAS_TRITON = importlib.util.find_spec("triton") is not None

# (device, backend): the torch reference on CPU; the triton backend on CUDA and, for its kernels' math,
# under Triton's interpreter on CPU.
PLACES = [
    ("cpu", "torch"),
    pytest.param("cpu", "triton", marks=pytest.mark.skipif(not _HAS_TRITON, reason="triton not installed")),
    pytest.param("cuda", "torch", marks=pytest.mark.gpu),
    pytest.param("cuda", "triton", marks=pytest.mark.gpu),
]

# (name, leaf dtype, autocast dtype or None)
PRECISIONS = [
    ("autocast_bf16_fp32_weights", torch.float32, torch.bfloat16),  # Trainer(bf16=True) on an fp32 model
    ("autocast_fp16_fp32_weights", torch.float32, torch.float16),  # Trainer(fp16=True)
    ("bf16_weights", torch.bfloat16, None),  # a model loaded with dtype=bfloat16
    ("bf16_weights_autocast_bf16", torch.bfloat16, torch.bfloat16),  # both (TRL's default on a bf16 model)
]
TRANSFORMS = [{}, {"softcap": 8.0, "temperature": 0.7}]


def _skip_interpreter_bf16(device, backend, dtype, autocast_dtype):
    """Triton's CPU interpreter converts fp32 to bf16 by truncation, even with ``fp_downcast_rounding="rtne"``
    (``test_triton_interpreter_truncates_bf16`` pins this), where GPUs round to nearest; truncation doubles
    the rounding error of the bf16 logits tile, so the bound is checked on the GPU instead."""
    if device == "cpu" and backend == "triton" and torch.bfloat16 in (dtype, autocast_dtype):
        pytest.skip("Triton's interpreter truncates fp32->bf16; this case runs on the GPU (gpu marker)")


def _inputs(dtype, seed=0, n=96, h=48, v=700, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(device, dtype).requires_grad_()
    # std ~4 logits: a trained head's softmax, not a near-uniform one
    weight = (torch.randn(v, h, generator=g) * (4 / h**0.5)).to(device, dtype).requires_grad_()
    bias = (torch.randn(v, generator=g) * 0.1).to(device, dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::6] = -100
    upstream = torch.randn(n, generator=g).to(device), torch.randn(n, generator=g).to(device)
    return hidden, weight, bias, labels.to(device), upstream


def _cublas_tiles(backend):
    """The GPU backend's logits from cuBLAS's tiles, not the fp32 accumulator, for every call in the block."""
    if backend != "triton":
        return contextlib.nullcontext()
    from hf_fused.ops.backends.triton_cublas import fp32_logits_rule

    return fp32_logits_rule.forced(False)


def _precision(autocast_dtype, device="cpu"):
    if autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device, dtype=autocast_dtype)


def _eager_logits(hidden, weight, bias, kw):
    """What a transformers causal LM computes: ``lm_head`` (an ``F.linear``, autocast applies), the model's
    transform on the fp32-upcast logits, then the loss in fp32."""
    z = F.linear(hidden, weight, bias).float()
    if "softcap" in kw:
        z = kw["softcap"] * torch.tanh(z / kw["softcap"])
    return z / kw.get("temperature", 1.0)


def _errors(outputs, params, references, ref_params):
    """Relative errors of each output and each parameter gradient against the float64 ones."""
    return [rel_err(o, r) for o, r in zip(outputs, references)] + [
        rel_err(p.grad, r.grad) for p, r in zip(params, ref_params)
    ]


def _assert_within_eager(fused, eager, what):
    for i, (f, e) in enumerate(zip(fused, eager)):
        assert f <= RATIO * e + 1e-7, f"{what}[{i}]: fused error {f:.3g} > {RATIO} x eager's {e:.3g} (all: {fused} vs {eager})"


@pytest.mark.parametrize("device,backend", PLACES)
@pytest.mark.parametrize("name,dtype,autocast_dtype", PRECISIONS, ids=[p[0] for p in PRECISIONS])
@pytest.mark.parametrize("kw", TRANSFORMS, ids=["identity", "softcap_temperature"])
def test_logprobs_and_entropy_error_at_most_eager_under_mixed_precision(device, backend, name, dtype, autocast_dtype, kw):
    _skip_interpreter_bf16(device, backend, dtype, autocast_dtype)
    hidden, weight, bias, labels, (g_lp, g_ent) = _inputs(dtype, device=device)
    ref = [leaf64(t) for t in (hidden, weight, bias)]
    ref_lp, ref_ent = dense_logprobs(*ref[:2], labels, ref[2], **kw)
    ((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum()).backward()

    params = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
    with _precision(autocast_dtype, device):
        lp, ent = linear_logprobs(params[0], params[1], labels, params[2], return_entropy=True, backend=backend, **kw)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    assert lp.dtype == ent.dtype == torch.float32
    assert [p.grad.dtype for p in params] == [dtype] * 3
    fused = _errors([lp, ent], params, [ref_lp, ref_ent], ref)

    eager_params = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
    with _precision(autocast_dtype, device):
        logp_all = torch.log_softmax(_eager_logits(*eager_params, kw), dim=-1)
    mask = labels != -100
    e_lp = logp_all.gather(-1, labels.clamp(min=0)[:, None]).squeeze(-1) * mask
    e_ent = -(logp_all.exp() * logp_all).sum(-1) * mask
    ((e_lp * g_lp).sum() + (e_ent * g_ent).sum()).backward()
    eager = _errors([e_lp, e_ent], eager_params, [ref_lp, ref_ent], ref)
    _assert_within_eager(fused, eager, f"{name}/{device}/{backend}: [logprobs, entropy, dh, dW, db]")


@pytest.mark.parametrize("device,backend", PLACES)
@pytest.mark.parametrize("name,dtype,autocast_dtype", PRECISIONS, ids=[p[0] for p in PRECISIONS])
@pytest.mark.parametrize("kw", TRANSFORMS, ids=["identity", "softcap_temperature"])
def test_cross_entropy_error_at_most_eager_under_mixed_precision(device, backend, name, dtype, autocast_dtype, kw):
    """The mean loss is one number whose eager error can cancel by luck, so the forward is judged on the
    per-token losses (``reduction="none"``, a norm over tokens) and the mean is pinned to their mean; the
    gradients of the mean loss are judged directly. The pinned per-token losses read the logits as the mean's one
    pass does (cuBLAS's tiles: :func:`_cublas_tiles`); the default per-token losses (on CUDA from the
    matmul's fp32 accumulator, which the mean's bf16 tile differs from by up to ``|z|·2⁻⁸`` a token) are judged
    against eager on their own."""
    _skip_interpreter_bf16(device, backend, dtype, autocast_dtype)
    hidden, weight, bias, labels, _ = _inputs(dtype, seed=1, device=device)
    ref = [leaf64(t) for t in (hidden, weight, bias)]
    ref_tokens = dense_cross_entropy(*ref[:2], labels, ref[2], reduction="none", **kw)
    ref_loss = dense_cross_entropy(*ref[:2], labels, ref[2], **kw)
    ref_loss.backward()

    params = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
    with _precision(autocast_dtype, device):
        loss = linear_cross_entropy(params[0], params[1], labels, params[2], backend=backend, **kw)
        with torch.no_grad():
            with _cublas_tiles(backend):
                tokens = linear_cross_entropy(params[0], params[1], labels, params[2], backend=backend,
                                              reduction="none", **kw)
            statistics = linear_cross_entropy(params[0], params[1], labels, params[2], backend=backend,
                                              reduction="none", **kw)
    loss.backward()
    assert loss.dtype == tokens.dtype == statistics.dtype == torch.float32
    # The same pass over the same operands: only the order of fp32 sums differs.
    assert abs(loss.item() - tokens.sum().item() / int((labels != -100).sum())) <= 1e-6 * abs(loss.item())
    fused = _errors([tokens], params, [ref_tokens], ref)
    fused_statistics = [rel_err(statistics, ref_tokens)] + fused[1:]

    eager_params = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
    with _precision(autocast_dtype, device):
        logits = _eager_logits(*eager_params, kw)
    e_tokens = F.cross_entropy(logits, labels, ignore_index=-100, reduction="none")
    F.cross_entropy(logits, labels, ignore_index=-100).backward()
    eager = _errors([e_tokens], eager_params, [ref_tokens], ref)
    _assert_within_eager(fused, eager, f"{name}/{device}/{backend}: [per-token loss, dh, dW, db]")
    _assert_within_eager(fused_statistics, eager, f"{name}/{device}/{backend}, no_grad: [per-token loss, ...]")


def test_triton_interpreter_truncates_bf16():
    """Pins the reason the interpreter skips bf16 above: if a Triton release makes the interpreter round to
    nearest, this fails and the skip should go."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("checks the CPU interpreter")
    import triton
    import triton.language as tl

    @triton.jit
    def _to_bf16(X, Y, n, BLOCK: tl.constexpr):
        cols = tl.arange(0, BLOCK)
        tl.store(Y + cols, tl.load(X + cols, mask=cols < n).to(tl.bfloat16), mask=cols < n)

    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    y = torch.empty(1000, dtype=torch.bfloat16)
    _to_bf16[(1,)](x, y, 1000, BLOCK=1024)
    assert bool((y.float().abs() <= x.abs()).all()) and not torch.equal(y, x.bfloat16())


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(not _HAS_TRITON, reason="no triton"))])
def test_fp16_loss_scaling_error_at_most_eager(backend):
    """fp16 autocast with a loss scale (what ``GradScaler`` does, here 2**16): the gradient divided by the
    scale is as close to float64 as eager's under the same autocast and scale. The upstream factor reaches
    the fp32 accumulators before the one rounding to fp16, so small gradients do not flush to fp16 zeros."""
    scale = 2.0**16
    hidden, weight, bias, labels, _ = _inputs(torch.float32, seed=2)
    ref = [leaf64(t) for t in (hidden, weight, bias)]
    dense_cross_entropy(*ref[:2], labels, ref[2]).backward()
    errors = {}
    for who in ("fused", "eager"):
        params = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
        with torch.autocast("cpu", dtype=torch.float16):
            if who == "fused":
                loss = linear_cross_entropy(params[0], params[1], labels, params[2], backend=backend)
            else:
                loss = F.cross_entropy(_eager_logits(*params, {}), labels, ignore_index=-100)
        (loss * scale).backward()
        errors[who] = [rel_err(p.grad / scale, r.grad) for p, r in zip(params, ref)]
    _assert_within_eager(errors["fused"], errors["eager"], f"fp16 x 2**16/{backend}: [dh, dW, db]")


@pytest.mark.parametrize("backend", ["torch"])
def test_token_weights_and_grad_hint_run_under_autocast(backend):
    """The one-pass paths (token-weighted cross-entropy, log-probs with a matching grad_hint) under bf16
    autocast: the crash users hit first (``scatter(): Expected self.dtype to be equal to src.dtype``) and
    their gradients equal to the recompute path's own under the same autocast (same operands, same
    fp32 accumulation; only the order of fp32 sums differs). The triton backend rounds each tile's ``dz`` to
    the operand dtype at a scale that differs between the paths, so its one-pass paths are held to the
    float64 bound of the tests above instead (cross-entropy takes its one pass at the default budget)."""
    hidden, weight, bias, labels, (advantages, _) = _inputs(torch.float32, seed=3)
    mask = (labels != -100).float()
    hint = advantages * mask
    grads = {}
    for use_hint in (False, True):
        params = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp, _ = linear_logprobs(params[0], params[1], labels, params[2], backend=backend,
                                    grad_hint=hint if use_hint else None, tile_budget_bytes=2**30)
        (-(lp * hint).sum() / 7).backward()
        grads[use_hint] = [p.grad for p in params]
    for a, b in zip(grads[True], grads[False]):
        _assert_one_rounding_apart(a, b)
    params = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        weighted = linear_cross_entropy(params[0], params[1], labels, params[2], backend=backend,
                                        token_weights=-advantages, reduction="sum")
    weighted.backward()
    for a, b in zip([p.grad for p in params], grads[False]):  # Σ A·logp = −7 × the loss above
        _assert_one_rounding_apart(a, -7 * b)


def _assert_one_rounding_apart(a, b):
    """Gradients that are each one bf16 rounding (autocast's operand dtype) of fp32 values differing only in
    the order of fp32 sums: a rounding moves a value by at most half a bf16 ulp, ≤ 2**-8 of its magnitude,
    so ``|a − b| ≤ 2**-8·(|a| + |b|)`` (``b`` may be a rounded value times a constant: the same bound holds
    for it relative to its own magnitude), plus fp32 noise of 1e-6 of the largest entry."""
    bound = 2.0**-8 * (a.abs() + b.abs()) + 1e-6 * b.abs().max()
    assert bool(((a - b).abs() <= bound).all()), f"max |a-b| {(a - b).abs().max().item():.3g}"


@pytest.mark.parametrize("device,backend", PLACES)
def test_fp32_parameters_under_autocast_get_their_fp32_accumulated_gradients(device, backend):
    """``Trainer(bf16=True)`` on an fp32 model: eager's ``F.linear`` rounds the weight's gradient to bf16 before
    autograd casts it back to fp32; the ops hand the fp32 parameters the fp32 accumulators themselves (the cast
    to bf16 happens inside their Functions), so the gradients are not bf16-representable and are no further
    from the gradient of the same bf16-operand computation in float64 than eager's. The torch backend runs its
    one pass (gradients in the forward) and the two-pass budget recomputes in backward: both keep the weight fp32."""
    # Triton's interpreter truncates the bf16 logits tile (see _skip_interpreter_bf16): there only the dtypes and
    # the absence of a bf16 rounding of the gradients are checked; the error bound runs on the GPU.
    interpreted = device == "cpu" and backend == "triton"
    hidden, weight, bias, labels, _ = _inputs(torch.float32, seed=3, device=device)
    # float64 reference of the computation the ops perform: bf16 operands, exact arithmetic after that
    h64, w64, b64 = (leaf64(t.detach().bfloat16(), requires_grad=True) for t in (hidden, weight, bias))
    F.cross_entropy(F.linear(h64, w64, b64), labels, ignore_index=-100).backward()
    with torch.autocast(device, dtype=torch.bfloat16):
        F.cross_entropy(F.linear(hidden, weight, bias).float(), labels, ignore_index=-100).backward()
    eager = [t.grad.clone() for t in (hidden, weight, bias)]
    assert all(g.dtype == torch.float32 and torch.equal(g, g.bfloat16().float()) for g in eager[1:])
    for budget in (None, 1 << 16):  # the planner's default, then a budget too small for a one pass
        for t in (hidden, weight, bias):
            t.grad = None
        with torch.autocast(device, dtype=torch.bfloat16):
            linear_cross_entropy(hidden, weight, labels, bias, backend=backend, tile_budget_bytes=budget).backward()
        for name, t, e, r in zip(("hidden", "weight", "bias"), (hidden, weight, bias), eager, (h64, w64, b64)):
            assert t.grad.dtype == torch.float32
            # The torch backend's logits stay fp32: never worse than eager. The triton backend rounds its logits
            # tile to bf16 as eager does, so its error is eager's up to summation order: the file's 1.25× bound.
            bound = 1.0 if backend == "torch" else RATIO
            assert interpreted or rel_err(t.grad, r.grad) <= bound * rel_err(e, r.grad) + 1e-7, name
            if name != "hidden":  # hidden arrives in fp32 but its gradient is also bf16-rounded in eager
                assert not torch.equal(t.grad, t.grad.bfloat16().float()), f"{name} gradient rounded to bf16"
