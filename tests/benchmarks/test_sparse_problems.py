"""The sparse-teacher problems of ``python -m benchmarks`` on CPU: the shared divergence equal to TRL 1.16's
``_jsd_loss_chunk`` (AsyncDistillationTrainer), inputs whose teacher is a correlated head known by its top-K, the
float64 reference equal to float64 autograd through the whole logits, and every sparse peer that runs here against
that reference."""

from __future__ import annotations

import json
import os

import pytest
import torch

from benchmarks.__main__ import main
from benchmarks.losses import sparse_divergence
from benchmarks.problems import CE_IGNORED_FRACTION, SPARSE_KS, make_inputs, select_problems
from benchmarks.reference import compute_reference

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
CPU = torch.device("cpu")


def _problems():
    return [p for p in select_problems("sparse", quick=True) if p.kind == "sparse"]


def test_the_group_is_the_cross_entropy_and_four_widths():
    full = select_problems("sparse", quick=False)
    assert [p.kind for p in full] == ["ce"] + ["sparse"] * 4 and [p.K for p in full[1:]] == list(SPARSE_KS)
    assert {(p.N, p.H, p.V) for p in full} == {(16384, 2048, 151936)}
    assert all(p.beta == 0.0 for p in full[1:])  # TRL's async default: forward KL with the tail bucket
    assert full[1].flops(10) == full[0].flops(10) == 6 * 2048 * 10 * 151936
    assert [p.K for p in _problems()] == list(SPARSE_KS)


@pytest.mark.parametrize("add_tail_bucket", [True, False], ids=["tail", "renormalized"])
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
def test_divergence_is_trls_jsd_loss_chunk(beta, add_tail_bucket):
    """The divergence every peer is measured by is TRL's ``_jsd_loss_chunk`` (value and the weight's gradient;
    invalid slots and a row without a valid slot included). TRL's function computes fp32 logits from fp32 copies of
    its operands whatever their dtype, so the two agree to fp32 rounding (``1e-5``), ours in float64."""
    from trl.experimental.async_distillation.async_distillation_trainer import _jsd_loss_chunk

    g = torch.Generator().manual_seed(0)
    n, h, v, k = 9, 8, 50, 6
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) * 1.5).requires_grad_()
    ids = torch.randint(0, v, (n, k), generator=g)
    valid = torch.rand(n, k, generator=g) > 0.25
    valid[1] = False
    teacher = torch.log_softmax(torch.randn(n, v, generator=g, dtype=torch.float64) * 2, -1).gather(1, ids)
    theirs = _jsd_loss_chunk(hidden, weight, None, 1.0, None, torch.where(valid, ids, -1), teacher, valid, beta, 1.0,
                             add_tail_bucket, None, 1)[0]
    (g_theirs,) = torch.autograd.grad(theirs, weight)
    ours = sparse_divergence(hidden @ weight.t(), torch.where(valid, ids, -1), teacher, valid, beta,
                             add_tail_bucket).sum()
    (g_ours,) = torch.autograd.grad(ours, weight)
    assert (ours - theirs).abs() <= 1e-5 * theirs.abs()
    assert (g_ours - g_theirs).norm() <= 1e-5 * g_theirs.norm()


def test_inputs_are_a_correlated_teachers_top_k():
    """The teacher's ids are its most likely tokens, sorted, with log-probs below 0; every slot valid; a tenth of the
    tokens masked; the same seed gives the same tensors."""
    problem = _problems()[1]
    inp = make_inputs(problem, CPU, torch.float32)
    assert inp.support_ids.shape == inp.teacher_logprobs.shape == inp.support_mask.shape == (problem.N, problem.K)
    assert inp.support_mask.all() and (inp.teacher_logprobs < 0).all()
    assert (inp.teacher_logprobs[:, :-1] >= inp.teacher_logprobs[:, 1:]).all()
    assert inp.n_valid == problem.N - round(CE_IGNORED_FRACTION * problem.N)
    with torch.no_grad():  # the student agrees with the teacher's top-1 far more often than chance
        student_top = (inp.hidden @ inp.weight.T).argmax(-1)
    assert (student_top == inp.support_ids[:, 0]).float().mean() > 0.3
    again = make_inputs(problem, CPU, torch.float32)
    assert torch.equal(again.support_ids, inp.support_ids) and torch.equal(again.teacher_logprobs,
                                                                           inp.teacher_logprobs)


@pytest.mark.parametrize("index", [0, 3])
def test_reference_is_float64_autograd_through_the_whole_logits(index):
    problem = _problems()[index]
    inp = make_inputs(problem, CPU, torch.float32)
    ref = compute_reference(problem, inp)
    h, w = inp.hidden.detach().double().requires_grad_(), inp.weight.detach().double().requires_grad_()
    per_token = sparse_divergence(h @ w.T, inp.support_ids, inp.teacher_logprobs.double(), inp.support_mask,
                                  problem.beta)
    loss = (per_token * inp.mask).sum() / inp.mask.sum()
    loss.backward()
    assert ref.loss == pytest.approx(loss.item(), rel=1e-12)
    assert torch.allclose(ref.grad_hidden, h.grad, rtol=1e-10, atol=1e-16)
    assert torch.allclose(ref.grad_weight, w.grad, rtol=1e-10, atol=1e-16)
    assert not h.grad[~inp.mask].any()


def test_sparse_peers_on_cpu(tmp_path):
    """``--shapes sparse``: eager PyTorch, TRL's chunked ``_chunked_jsd_loss`` and hf_fused's
    ``sparse_distillation_loss`` against the float64 reference at fp32 rounding on fp32 inputs; the cross-entropy
    of the same head runs for hf_fused and eager, and is n/a for TRL's sparse loss."""
    out = tmp_path / "bench"
    peers = ["eager", "trl_sparse", "hf_fused"]
    assert main(["--device", "cpu", "--quick", "--shapes", "sparse", "--peers", ",".join(peers), "--repeats", "1",
                 "--out", str(out), "--no-progress"]) == 0
    doc = json.loads((out / "bench.json").read_text())
    recs = {(r["problem"], r["peer"]): r for r in doc["results"]}
    names = [p.name for p in select_problems("sparse", quick=True)]
    assert list(doc["problems"]) == names and len(recs) == len(names) * len(peers)
    for name in names:
        for peer in peers:
            r = recs[(name, peer)]
            if name.startswith("ce-") and peer == "trl_sparse":
                assert r["status"] == "n/a"
                continue
            assert r["status"] == "ok", r
            for key in ("loss_rel_err", "grad_hidden_rel_err", "grad_weight_rel_err"):
                assert r[key] < 1e-5, (name, peer, key, r[key])
    assert doc["problems"][names[-1]]["K"] == 256
    table = (out / "bench.txt").read_text()
    assert "TRL chunked sparse" in table and "sparse teacher (top-64 log-probs, forward KL, tail bucket)" in table
