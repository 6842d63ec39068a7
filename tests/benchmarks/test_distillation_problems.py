"""The distillation problems of ``python -m benchmarks`` on CPU: inputs that look like a trained student/teacher pair,
the shared divergence equal to TRL's ``GKDTrainer.generalized_jsd_loss``, the float64 reference equal to float64
autograd through the whole logits, and every distillation peer that runs here against that reference."""

from __future__ import annotations

import json
import os

import pytest
import torch

from benchmarks.__main__ import main
from benchmarks.losses import distillation_divergence
from benchmarks.problems import (
    CE_IGNORED_FRACTION, DISTILL_BETAS, DISTILL_LOGIT_CORRELATION, LOGIT_STD, make_inputs, select_problems,
)
from benchmarks.reference import compute_reference

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
CPU = torch.device("cpu")


def _problems():
    return select_problems("distill", quick=True)


def test_the_quick_and_full_problems_are_the_three_divergences():
    full = select_problems("distill", quick=False)
    assert [p.beta for p in full] == list(DISTILL_BETAS) == [0.0, 1.0, 0.5]
    assert {(p.N, p.H, p.H_t, p.V) for p in full} == {(16384, 2048, 4096, 151936)}
    assert [p.beta for p in _problems()] == [0.0, 1.0, 0.5]
    # one pass's useful FLOPs: the student's logits, dX and dW, and the teacher's logits
    assert full[0].flops(10) == (6 * 2048 + 2 * 4096) * 10 * 151936


def test_inputs_look_like_a_trained_student_teacher_pair():
    """Both models' logits have the trained-head spread (standard deviation LOGIT_STD) and correlate token by token
    as DISTILL_LOGIT_CORRELATION says; the teacher gets no gradient; a tenth of the tokens is masked."""
    problem = _problems()[0]
    inp = make_inputs(problem, CPU, torch.float32)
    assert inp.hidden.shape == (problem.N, problem.H) and inp.teacher_hidden.shape == (problem.N, problem.H_t)
    assert inp.hidden.requires_grad and inp.weight.requires_grad
    assert not inp.teacher_hidden.requires_grad and not inp.teacher_weight.requires_grad
    assert inp.n_valid == problem.N - round(CE_IGNORED_FRACTION * problem.N)
    with torch.no_grad():
        zs, zt = (inp.hidden @ inp.weight.T).double(), (inp.teacher_hidden @ inp.teacher_weight.T).double()
    assert zs.std().item() == pytest.approx(LOGIT_STD, rel=0.1) and zt.std().item() == pytest.approx(LOGIT_STD, rel=0.1)
    corr = torch.corrcoef(torch.stack([zs.flatten(), zt.flatten()]))[0, 1].item()
    assert corr == pytest.approx(DISTILL_LOGIT_CORRELATION, abs=0.03)
    # the same seed gives the same tensors
    again = make_inputs(problem, CPU, torch.float32)
    assert torch.equal(again.weight, inp.weight) and torch.equal(again.teacher_hidden, inp.teacher_hidden)


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5, 0.1])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_divergence_is_trls_generalized_jsd(beta, temperature):
    """The divergence every peer is measured by is TRL's ``GKDTrainer.generalized_jsd_loss`` (F.kl_div based, another
    implementation of the same conventions), values and gradients, in float64."""
    from trl.experimental.gkd import GKDTrainer

    gen = torch.Generator().manual_seed(0)
    zs = (4 * torch.randn(6, 50, generator=gen, dtype=torch.float64)).requires_grad_()
    zt = 4 * torch.randn(6, 50, generator=gen, dtype=torch.float64)
    ours = distillation_divergence(zs, zt, beta, temperature).mean()
    trl = GKDTrainer.generalized_jsd_loss(zs, zt, beta=beta, temperature=temperature, num_items_in_batch=6)
    assert ours.item() == pytest.approx(trl.item(), rel=1e-12)
    (g_ours,), (g_trl,) = torch.autograd.grad(ours, zs), torch.autograd.grad(trl, zs)
    torch.testing.assert_close(g_ours, g_trl, rtol=1e-10, atol=1e-14)


def test_divergence_refuses_a_beta_outside_0_1():
    with pytest.raises(ValueError, match="beta must lie in"):
        distillation_divergence(torch.zeros(1, 3), torch.zeros(1, 3), 1.5)


@pytest.mark.parametrize("index", range(len(DISTILL_BETAS)))
def test_reference_is_float64_autograd_through_the_whole_logits(index):
    """The tile-by-tile reference (tiles of 7 rows here) against float64 autograd on both models' whole logits:
    the masked mean of the divergence and the student's gradients."""
    problem = _problems()[index]
    inp = make_inputs(problem, CPU, torch.float32)
    ref = compute_reference(problem, inp, tile_bytes=10 * 8 * problem.V * 7)
    h = inp.hidden.detach().double().requires_grad_()
    w = inp.weight.detach().double().requires_grad_()
    zt = inp.teacher_hidden.double() @ inp.teacher_weight.double().T
    per_token = distillation_divergence(h @ w.T, zt, problem.beta)
    loss = per_token[inp.mask].sum() / inp.mask.sum()
    loss.backward()
    assert ref.loss == pytest.approx(loss.item(), rel=1e-12) and ref.loss > 0.01
    torch.testing.assert_close(ref.grad_hidden, h.grad, rtol=1e-10, atol=1e-15)
    torch.testing.assert_close(ref.grad_weight, w.grad, rtol=1e-10, atol=1e-15)
    assert ref.logps is None and ref.entropy is None
    assert not h.grad[~inp.mask].any()  # masked tokens get no gradient


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # Liger's masked lanes, interpreted
def test_distillation_peers_on_cpu(tmp_path):
    """``--shapes distill``: eager PyTorch, TRL's ChunkedDivergenceFunction, (under Triton's interpreter) Liger's
    LigerFusedLinearJSD and hf_fused's ``linear_distillation_loss`` (defaults, and a 256 MiB budget) against the
    float64 reference, at fp32 rounding on fp32 inputs; the GRPO-only hf_fused row is n/a."""
    out = tmp_path / "bench"
    peers = ["eager", "trl_divergence", "liger_jsd", "hf_fused", "hf_fused_lean", "hf_fused_hint"]
    assert main(["--device", "cpu", "--quick", "--shapes", "distill", "--peers", ",".join(peers), "--repeats", "1",
                 "--out", str(out), "--no-progress"]) == 0
    doc = json.loads((out / "bench.json").read_text())
    recs = {(r["problem"], r["peer"]): r for r in doc["results"]}
    names = [p.name for p in _problems()]
    assert list(doc["problems"]) == names and len(recs) == len(names) * len(peers)
    measured = ["eager", "trl_divergence", "hf_fused", "hf_fused_lean"]
    if os.environ.get("TRITON_INTERPRET") == "1":
        measured.append("liger_jsd")
    for name in names:
        assert doc["problems"][name]["reference"] == "float64"
        for peer in measured:
            r = recs[(name, peer)]
            assert r["status"] == "ok", r
            assert r["time_ms"] > 0 and r["peak_mem_bytes"] > 0
            for key in ("loss_rel_err", "grad_hidden_rel_err", "grad_weight_rel_err"):
                assert r[key] < 1e-5, (name, peer, key, r[key])
        assert recs[(name, "hf_fused")]["backend"] == "torch"
        assert recs[(name, "hf_fused_hint")]["status"] == "n/a"
    table = (out / "bench.txt").read_text()
    assert "TRL ChunkedDivergence" in table and "distillation (JSD β=0.5, T=1)" in table
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hf_fused_rows_are_skipped_where_hf_fused_has_no_distillation_op(tmp_path, monkeypatch):
    """An hf_fused without ``hf_fused.ops.linear_distillation_loss``: its distillation rows are skipped with that
    reason, its other rows run."""
    import hf_fused.ops

    monkeypatch.delattr(hf_fused.ops, "linear_distillation_loss")
    out = tmp_path / "bench"
    assert main(["--device", "cpu", "--quick", "--shapes", "distill-128-h32-t48-v1k-beta1,ce-128-h64-v1k", "--peers",
                 "hf_fused", "--repeats", "1", "--out", str(out), "--no-progress"]) == 0
    recs = {r["problem"]: r for r in json.loads((out / "bench.json").read_text())["results"]}
    assert recs["ce-128-h64-v1k"]["status"] == "ok"
    skipped = recs["distill-128-h32-t48-v1k-beta1"]
    assert skipped["status"] == "skipped" and "no hf_fused.ops.linear_distillation_loss" in skipped["note"]
    assert "no hf_fused.ops.linear_distillation_loss" in (out / "bench.txt").read_text()
