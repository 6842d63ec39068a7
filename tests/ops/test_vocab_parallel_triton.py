"""The GPU backend's schedules on a vocabulary-sharded head (:mod:`hf_fused.ops.backends.triton_cublas.vocab_parallel`):
the one pass with every tile's statistics merged over the group, and the two passes (statistics merged once per
call, a local gradient pass). Ranks as threads over the in-process group of tests/ops/test_vocab_parallel.py, the
kernels under Triton's interpreter on CPU (``TRITON_INTERPRET=1``, conftest) and compiled on a GPU (``gpu``):
every op against float64 and against the GPU backend's unsharded op on the same inputs, each rank's rows of the
weight and bias gradients and the whole hidden states' gradient.
"""

from __future__ import annotations

import os

import pytest
import torch

from hf_fused.ops import linear_cross_entropy, linear_logprobs, linear_token_loss
from hf_fused.ops.backends.triton_cublas.one_pass_rule import OnePassPlan
from hf_fused.ops.backends.triton_cublas.plan import forced_plans
from hf_fused.ops.backends.triton_cublas.two_pass_rule import LeanPlan
from hf_fused.ops.backends.vocab_parallel import VocabParallelBackend, vocab_parallel_backend
from hf_fused.ops.vocab_parallel import VocabLayout, VocabShard
from references import RTOL, rel_err
from test_vocab_parallel import (
    BF16_GRAD_TOL,
    FUSED,
    STATISTICS,
    TRANSFORM,
    B,
    T,
    _token_loss,
    _upstream,
    assert_rank_matches,
    chunk_bounds,
    dense_op,
    make_inputs,
    run_ranks,
)

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors need TRITON_INTERPRET=1 (conftest sets it when there is no GPU)")

@pytest.fixture(autouse=True)
def one_interpreted_kernel_at_a_time(monkeypatch):
    """Triton's interpreter patches its language module for the kernel it runs, so two ranks' threads must not run
    kernels at once: each launch holds one lock (compiled kernels on a GPU need none)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import threading

    from triton.runtime import interpreter

    lock, launch = threading.Lock(), interpreter.GridExecutor.__call__

    def serialized(self, *args, **kwargs):
        with lock:
            return launch(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", serialized)


#: schedule name → the plans forced for it: the one pass in tiles of 4 rows, or the two passes in [8, 8] tiles
#: (several row blocks and vocabulary chunks per rank).
SCHEDULES = {"one_pass": dict(one_pass=OnePassPlan(4, "none", 0)),
             "two_passes": dict(one_pass=False, two_pass=LeanPlan(8, 8, False, 0))}


def run_triton(op: str, inputs, bounds=None, group=None, *, dtype=torch.float32, device="cpu",
               hidden_grad: bool = True, ops=FUSED) -> dict:
    """One rank's outputs and gradients of ``ops[op]`` (:data:`FUSED`'s calls) on the GPU backend
    (``backend="triton"``), on its rows ``bounds`` of the head (the whole head without); ``hidden_grad``: the hidden
    states require grad."""
    hidden, weight, bias, labels = (t.to(device) for t in inputs)
    start, stop = bounds if bounds is not None else (0, weight.shape[0])
    h, w, b = (t.to(dtype).clone().requires_grad_() for t in (hidden, weight[start:stop], bias[start:stop]))
    h.requires_grad_(hidden_grad)
    kw = dict(backend="triton")
    if bounds is not None:
        kw["vocab_parallel"] = VocabShard(start, stop, group)
    outputs, scalar = ops[op](h, w, b, labels, **kw)
    if scalar is not None:
        scalar.backward()
    got = {k: v.detach().cpu() for k, v in outputs.items() if v is not None}
    got.update({name: None if t.grad is None else t.grad.cpu()
                for name, t in (("grad_hidden", h), ("grad_weight", w), ("grad_bias", b))})
    return got


@interpreted
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("op", ["cross_entropy", "logprobs", "logprobs_hint", "token_loss", "statistics"])
def test_ranks_match_float64_and_the_unsharded_op(op, schedule):
    """Each op over 3 ranks (a vocabulary of 29: shards 10/10/9) on the GPU backend's kernels, one pass and two
    passes: the outputs (``is_top1`` exactly), the hidden states' gradient and each rank's weight and bias rows
    match float64 and the unsharded op of the same backend and schedule."""
    inputs = make_inputs(29, seed=3)
    bounds = chunk_bounds(29, 3)
    ref = dense_op(op, inputs)
    with forced_plans(**SCHEDULES[schedule]):
        whole = run_triton(op, inputs)
        got, _ = run_ranks(3, lambda r, group: run_triton(op, inputs, bounds[r], group))
    for r, rank_result in enumerate(got):
        assert_rank_matches(rank_result, ref, bounds[r], f"{op} {schedule}, rank {r} vs float64")
        assert_rank_matches(rank_result, whole, bounds[r], f"{op} {schedule}, rank {r} vs unsharded")


@interpreted
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("op", ["cross_entropy", "logprobs"])
def test_fp32_accumulator_statistics(op, schedule):
    """Where the GPU backend takes the statistics from the matmul's fp32 accumulator (``fp32_logits_rule.forced``):
    the two passes' statistics pass over each rank's rows from the fused matmul, merged (``dz`` from the accumulator
    too), and the one pass's calls run as the two passes; against float64 and the unsharded op in the same mode."""
    from hf_fused.ops.backends.triton_cublas import fp32_logits_rule

    inputs = make_inputs(29, seed=9)
    bounds = chunk_bounds(29, 2)
    ref = dense_op(op, inputs)
    with forced_plans(**SCHEDULES[schedule]), fp32_logits_rule.forced(True):
        whole = run_triton(op, inputs)
        got, _ = run_ranks(2, lambda r, group: run_triton(op, inputs, bounds[r], group))
    for r, rank_result in enumerate(got):
        assert_rank_matches(rank_result, ref, bounds[r], f"{op} {schedule} fp32, rank {r} vs float64")
        assert_rank_matches(rank_result, whole, bounds[r], f"{op} {schedule} fp32, rank {r} vs unsharded")


@interpreted
def test_ties_across_slices_keep_the_first_maximum():
    """Integer logits tied between the ranks' slices: ``is_top1`` from the merged arg-max is the unsharded op's,
    bit for bit, in both schedules."""
    inputs = make_inputs(12, seed=5, integer=True)
    _, weight, _, labels = inputs
    weight[7] = weight[2]
    weight[10] = weight[4]
    labels[0, 2:] = torch.tensor([2, 7, 4, 10, 7])
    bounds = chunk_bounds(12, 4)
    for schedule, plans in SCHEDULES.items():
        with forced_plans(**plans):
            whole = run_triton("statistics", inputs)
            got, _ = run_ranks(4, lambda r, group: run_triton("statistics", inputs, bounds[r], group))
        assert whole["is_top1"].any() and not whole["is_top1"].all()
        for r, rank_result in enumerate(got):
            assert torch.equal(rank_result["is_top1"], whole["is_top1"]), (schedule, r)


@interpreted
def test_ranks_agree_on_one_schedule(monkeypatch):
    """The one pass merges per tile, so every rank runs the same tiles: where one rank's plan is the two passes, all
    run the two passes (every rank's collectives are then the same list), with the float64 results."""
    import threading

    import hf_fused.ops.backends.triton_cublas.vocab_parallel as module

    inputs = make_inputs(29, seed=6)
    bounds = chunk_bounds(29, 2)
    rank_of = threading.local()
    original = module.plan_one_pass
    monkeypatch.setattr(module, "plan_one_pass",
                        lambda head, need: None if rank_of.r == 1 else original(head, need))

    def rank(r, group):
        rank_of.r = r
        return run_triton("cross_entropy", inputs, bounds[r], group)

    with forced_plans(one_pass=OnePassPlan(4, "none", 0)):
        got, group = run_ranks(2, rank)
    assert group.calls[0] == group.calls[1]
    ref = dense_op("cross_entropy", inputs)
    for r, rank_result in enumerate(got):
        assert_rank_matches(rank_result, ref, bounds[r], f"rank {r} vs float64")


def test_the_backend_follows_the_named_one(monkeypatch):
    """The GPU schedules by default for CUDA tensors (Triton installed), and for ``"triton"``; the torch loop by
    default on CPU, and for ``"torch"``; a rank of no rows makes every rank run it; another name is refused, saying
    which are accepted."""
    from hf_fused.ops.backends.triton_cublas.vocab_parallel import TritonVocabParallelBackend

    monkeypatch.delenv("HF_FUSED_BACKEND", raising=False)
    layout = VocabLayout(VocabShard(0, 5), 10, 5, 2, 5)
    assert isinstance(vocab_parallel_backend(layout, torch.device("cpu")), VocabParallelBackend)
    assert isinstance(vocab_parallel_backend(layout, torch.device("cuda")), TritonVocabParallelBackend)
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        assert isinstance(vocab_parallel_backend(layout, device, "triton"), TritonVocabParallelBackend)
    assert isinstance(vocab_parallel_backend(layout, torch.device("cpu"), "torch"), VocabParallelBackend)
    empty = VocabLayout(VocabShard(0, 10), 10, 10, 2, 0)
    assert isinstance(vocab_parallel_backend(empty, torch.device("cpu"), "triton"), VocabParallelBackend)
    with pytest.raises(ValueError, match="backend='quack' has no vocabulary-parallel schedule"):
        vocab_parallel_backend(layout, torch.device("cpu"), "quack")


#: Where test_gpu_ranks_match_the_unsharded_op runs ("cpu" under the interpreter: a check of the test itself).
GPU_TEST_DEVICE = "cuda"
#: The GPU test's two passes: the interpreted tests' [8, 8] tiles (two row blocks of a bf16 gradient: each rank's
#: chunks hold their weight gradient's accumulators in the gradient's unwritten rows, the last columns in buffers).
GPU_TWO_PASSES = SCHEDULES["two_passes"]


def device_ops(device) -> dict:
    """:data:`FUSED`'s ``cross_entropy``, ``logprobs`` and ``token_loss`` with their per-token tensors (the same
    values, from the same seeds) on ``device``."""
    adv, up_lp, up_ent = (_upstream(seed).to(device) for seed in (3, 6, 7))

    def cross_entropy(h, w, b, y, **kw):
        loss = linear_cross_entropy(h, w, y, b, **TRANSFORM, **kw)
        return {"loss": loss}, loss

    def logprobs(h, w, b, y, **kw):
        lp, ent, stats = linear_logprobs(h, w, y, b, return_entropy=True, statistics=STATISTICS, **TRANSFORM, **kw)
        return {"logprobs": lp, "entropy": ent, **stats}, (lp * up_lp + ent * up_ent).sum()

    def token_loss(h, w, b, y, **kw):
        out = linear_token_loss(h, w, y, _token_loss, b, per_token={"advantages": adv}, need_entropy=True,
                                **TRANSFORM, **kw)
        return {"loss": out.loss, "logprobs": out.logprobs, "entropy": out.entropy}, out.loss

    return {"cross_entropy": cross_entropy, "logprobs": logprobs, "token_loss": token_loss}


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", [None, "two_passes"])
@pytest.mark.parametrize("op", ["cross_entropy", "logprobs", "token_loss"])
def test_gpu_ranks_match_the_unsharded_op(op, schedule):
    """On a GPU, bf16, 2 and 3 ranks as threads on one device (a vocabulary of 1,001, 14 tokens, H 64): the
    compiled kernels' outputs and each rank's weight and bias gradients within the unsharded op's own distance from
    float64 (plus one bf16 rounding of each gradient), for the plan's own schedule and the two passes (on an H200
    their statistics from the autotuned fp32-accumulator kernel, launched by the ranks' threads at once:
    :func:`test_gpu_autotuned_statistics_from_threads_at_once`). The hidden states take no gradient here: autograd
    runs the CUDA backward of every thread on one device thread, where the sum of a rank's hidden gradient over the
    group would wait for a rank queued behind it (on CPU the interpreted tests above take it)."""
    import contextlib

    g = torch.Generator().manual_seed(0)
    vocab, hidden_size = 1001, 64
    hidden = torch.randn(B, T, hidden_size, generator=g)  # FUSED's per-token inputs are [B, T]
    weight = torch.randn(vocab, hidden_size, generator=g) * (4.0 / hidden_size**0.5)
    bias = torch.randn(vocab, generator=g) * 0.5
    labels = torch.randint(0, vocab, (B, T), generator=g)
    labels[0, :2] = -100
    inputs = (hidden, weight, bias, labels)
    rounded = tuple(t.to(torch.bfloat16).float() if t.is_floating_point() else t for t in inputs)
    ref = dense_op(op, rounded)
    for ranks in (2, 3):
        bounds = chunk_bounds(vocab, ranks)
        kw = dict(dtype=torch.bfloat16, device=GPU_TEST_DEVICE, hidden_grad=False, ops=device_ops(GPU_TEST_DEVICE))
        with forced_plans(**GPU_TWO_PASSES) if schedule else contextlib.nullcontext():
            whole = run_triton(op, inputs, **kw)
            got, _ = run_ranks(ranks, lambda r, group: run_triton(op, inputs, bounds[r], group, **kw))
        for r, rank_result in enumerate(got):
            start, stop = bounds[r]
            for name, exact in ref.items():
                if name == "grad_hidden":
                    assert rank_result[name] is None
                    continue
                mine = rank_result[name].float()
                theirs = whole[name].float()
                if name in ("grad_weight", "grad_bias"):
                    exact, theirs = exact[start:stop], theirs[start:stop]
                bound = 1.05 * rel_err(theirs, exact) + BF16_GRAD_TOL + RTOL
                assert rel_err(mine, exact) <= bound, (op, schedule, ranks, r, name, rel_err(mine, exact), bound)


@pytest.mark.gpu
def test_gpu_autotuned_statistics_from_threads_at_once(monkeypatch):
    """The fp32-accumulator statistics kernel (:func:`~hf_fused.ops.backends.triton_cublas.fused_matmul.
    logits_statistics_`, autotuned on a GPU) launched from 5 threads at once, each on its own vocabulary width, with
    the autotuner's cache cold: each thread's statistics equal, bit for bit, the same call's from one thread once
    the shapes are tuned. Triton's autotuner keeps a call's arguments and its choice on the kernel object, so
    unguarded concurrent launches ran one call's config on another's TMA descriptors or folded the partials at
    another call's width (the thread-ranks of test_gpu_ranks_match_the_unsharded_op, ``nn.DataParallel``)."""
    import threading

    from hf_fused.ops.backends.triton_cublas import fused_matmul
    from hf_fused.ops.backends.triton_cublas.tiles import new_row_stats

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the fused statistics kernel needs compute capability 9.0 (TMA)")
    monkeypatch.setattr(fused_matmul._tuned_statistics_kernel, "cache", {})
    scalars = dict(logit_scale=1.0, softcap=1.0, inv_temperature=1.0, HAS_BIAS=False, SOFTCAP=False, SCALED=False)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(14, 64, generator=g).to("cuda", torch.bfloat16)
    cases = []
    for width in (1001, 501, 500, 334, 333):
        weight = (torch.randn(width, 64, generator=g) * 0.5).to("cuda", torch.bfloat16)
        cases.append((weight, torch.randint(0, width, (14,), generator=g).cuda()))

    def statistics(weight, labels):
        stats = new_row_stats(14, hidden.device, ("mean_logits", "is_top1", "log_sum_sq_probs"))
        fused_matmul.logits_statistics_(hidden, weight, labels, stats, scalars, return_entropy=True)
        return [t.cpu() for t in stats]

    start, got, errors = threading.Barrier(len(cases), timeout=120), [None] * len(cases), []

    def run(i):
        try:
            start.wait()
            got[i] = statistics(*cases[i])
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    for (weight, labels), concurrent in zip(cases, got):
        alone = statistics(weight, labels)
        for k, (a, b) in enumerate(zip(concurrent, alone)):
            assert torch.equal(a, b), (weight.shape[0], k)
