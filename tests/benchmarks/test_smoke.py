"""Smoke test of ``python -m benchmarks`` on CPU: tiny shapes end to end, outputs written, hf_fused
close to the float64 reference, missing / CUDA-only peers recorded instead of crashing the run."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.__main__ import main
from benchmarks.peers import select_peers
from benchmarks.problems import select_problems

SHAPES = "ce-128-h64-v1k,grpo-2x64-h64-v1k"


def _records(doc):
    return {(r["problem"], r["peer"]): r for r in doc["results"]}


def test_bench_quick_cpu(tmp_path, capsys):
    out = tmp_path / "bench"
    argv = ["--device", "cpu", "--quick", "--shapes", SHAPES, "--peers", "eager,hf_fused,liger,cce",
            "--repeats", "2", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    printed = capsys.readouterr().out

    doc = json.loads((out / "bench.json").read_text())
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "bench.txt").read_text()
    for label in ("eager PyTorch", "hf_fused", "Liger FLCE", "Apple CCE", "ce-128-h64-v1k", "grpo-2x64-h64-v1k"):
        assert label in table and label in printed
    assert "% ceil" not in table and "MiB" in table and doc["runs"][0]["matmul_ceiling"] is None

    recs = _records(doc)
    assert len(recs) == 8
    for shape in SHAPES.split(","):
        assert doc["problems"][shape]["reference"] == "float64"
        for peer in ("liger", "cce"):  # not installed here, or installed but CUDA-only
            assert recs[(shape, peer)]["status"] in ("skipped", "n/a"), recs[(shape, peer)]
            assert recs[(shape, peer)]["note"]
        for peer in ("eager", "hf_fused"):
            r = recs[(shape, peer)]
            assert r["status"] == "ok", r
            assert r["time_ms"] > 0 and r["tflops"] > 0
            assert r["frac_of_ceiling"] is None  # no GPU ceiling on CPU
            assert r["peak_mem_bytes"] > 0  # read through track_peak_memory's dispatch mode on CPU
        p = doc["problems"][shape]
        logits_bytes = p["N"] * p["V"] * 4
        # eager materializes the fp32 logits and their gradient; the dispatch-mode count must see both
        assert recs[(shape, "eager")]["peak_mem_bytes"] >= 2 * logits_bytes
        r = recs[(shape, "hf_fused")]
        assert r["backend"] == "torch"
        # fp32 inputs on CPU: hf_fused accumulates in fp32, so errors are at fp32 rounding level.
        for key in ("loss_rel_err", "grad_hidden_rel_err", "grad_weight_rel_err"):
            assert r[key] < 1e-4, (shape, key, r[key])
    grpo = recs[("grpo-2x64-h64-v1k", "hf_fused")]
    assert grpo["has_entropy"] and grpo["logp_rel_err"] < 1e-5 and grpo["entropy_rel_err"] < 1e-4

    # --resume keeps what is there and adds only the new pairs.
    assert main(["--device", "cpu", "--quick", "--shapes", "ce-128-h64-v1k", "--peers", "hf_fused,hf_fused_32mib",
                 "--repeats", "1", "--out", str(out), "--no-progress", "--resume"]) == 0
    doc2 = json.loads((out / "bench.json").read_text())
    assert len(doc2["results"]) == 9 and len(doc2["runs"]) == 2
    r = _records(doc2)[("ce-128-h64-v1k", "hf_fused_32mib")]
    assert r["status"] == "ok" and r["loss_rel_err"] < 1e-4 and "tile_budget_bytes=33554432" in r["call"]
    assert "hf_fused (32 MiB)" in (out / "bench.txt").read_text()


def test_bench_selection_errors():
    with pytest.raises(ValueError, match="unknown shape"):
        select_problems("nope", quick=True)
    with pytest.raises(ValueError, match="unknown peer"):
        select_peers("eager,nope")
    assert [p.kind for p in select_problems("grpo", quick=False)] == ["grpo", "grpo"]


def test_any_tile_budget_is_a_peer_on_request():
    """``hf_fused_<n>mib`` / ``hf_fused_<n>gib``: hf_fused at that ``tile_budget_bytes``, in table order after the
    named hf_fused rows; the default run has the 4 GiB one only."""
    from benchmarks.peers import DEFAULT_PEERS

    peers = select_peers("hf_fused_8gib,eager,hf_fused_512mib,hf_fused")
    assert [p.key for p in peers] == ["eager", "hf_fused", "hf_fused_8gib", "hf_fused_512mib"]
    assert peers[2].tile_budget_bytes == 8 * 2**30 and peers[2].label == "hf_fused (8 GiB)"
    assert peers[3].tile_budget_bytes == 512 * 2**20 and peers[3].label == "hf_fused (512 MiB)"
    assert "hf_fused_8gib" not in DEFAULT_PEERS and "hf_fused_4gib" in DEFAULT_PEERS
    with pytest.raises(ValueError, match="hf_fused_<n>mib"):
        select_peers("hf_fused_8tb")


def test_hint_peer_matches_float64_and_skips_cross_entropy(tmp_path):
    out = tmp_path / "bench"
    assert main(["--device", "cpu", "--quick", "--shapes", SHAPES, "--peers", "hf_fused_hint",
                 "--repeats", "1", "--out", str(out), "--no-progress"]) == 0
    recs = _records(json.loads((out / "bench.json").read_text()))
    assert recs[("ce-128-h64-v1k", "hf_fused_hint")]["status"] == "n/a"
    r = recs[("grpo-2x64-h64-v1k", "hf_fused_hint")]
    assert r["status"] == "ok", r
    # the DAPO loss and its gradients, against the float64 logps → dapo_loss → backward
    for key in ("loss_rel_err", "grad_hidden_rel_err", "grad_weight_rel_err", "logp_rel_err", "entropy_rel_err"):
        assert r[key] < 1e-5, (key, r[key])


def test_grpo_loss_types_run_against_their_own_float64_reference(tmp_path):
    """``--shapes grpo-loss-types``: every TRL loss type but dapo, on-policy; the gradient-hint peer (its hint taken,
    not recomputed) gets each one's loss and gradients."""
    import warnings

    from benchmarks.losses import SAPO_TEMPERATURE_NEG, SAPO_TEMPERATURE_POS
    from benchmarks.problems import make_inputs
    from hf_fused.ops import HintMissedWarning

    out = tmp_path / "bench"
    with warnings.catch_warnings():
        warnings.simplefilter("error", HintMissedWarning)  # at ratio 1 every type's gradient is a multiple of the hint
        assert main(["--device", "cpu", "--quick", "--shapes", "grpo-loss-types", "--peers",
                     "hf_fused,hf_fused_hint", "--repeats", "1", "--out", str(out), "--no-progress"]) == 0
    doc = json.loads((out / "bench.json").read_text())
    assert list(doc["problems"]) == [f"grpo-2x64-h64-v1k-{lt}" for lt in ("grpo", "bnpo", "dr_grpo", "luspo", "cispo",
                                                                          "sapo")]
    assert len(doc["results"]) == 12
    ref = {}
    for r in doc["results"]:
        assert r["status"] == "ok", r
        for key in ("loss_rel_err", "grad_hidden_rel_err", "grad_weight_rel_err"):
            assert r[key] < 1e-5, (r["problem"], r["peer"], key, r[key])
        ref[r["problem"].rsplit("-", 1)[1]] = r["loss_ref"]
    # every completion has the same length here (56 of 64 tokens), so grpo's per-sequence mean equals bnpo's token
    # mean, while dr_grpo divides by B·T including the masked tail and luspo sums each sequence
    assert ref["grpo"] == pytest.approx(ref["bnpo"], rel=1e-12)
    assert ref["dr_grpo"] == pytest.approx(ref["bnpo"] * 7 / 8, rel=1e-12)
    assert ref["luspo"] == pytest.approx(ref["bnpo"] * 56, rel=1e-12)
    # sapo at ratio 1: −sigmoid(0)·4/τ·A = −2A/τ per token, the temperature by the advantage's sign
    advantages = make_inputs(select_problems("grpo-2x64-h64-v1k-sapo", quick=True)[0], torch.device("cpu"),
                             torch.float32).advantages.tolist()
    per_sequence = [-2 * a / (SAPO_TEMPERATURE_POS if a > 0 else SAPO_TEMPERATURE_NEG) for a in advantages]
    assert ref["sapo"] == pytest.approx(sum(per_sequence) / len(per_sequence), rel=1e-12)


def test_torch_peer_matches_float64_where_torch_has_linear_cross_entropy(tmp_path):
    """The ``torch`` peer (``F.linear_cross_entropy``, torch ≥ 2.13's chunked path) on CPU: the GPU image's
    torch 2.11 lacks it, so this is where the adapter itself is checked against the float64 reference."""
    import torch.nn.functional as F

    if not hasattr(F, "linear_cross_entropy") or not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        pytest.skip(f"torch {torch.__version__} has no F.linear_cross_entropy chunked path")
    out = tmp_path / "bench"
    assert main(["--device", "cpu", "--quick", "--shapes", SHAPES, "--peers", "torch", "--no-entropy",
                 "--repeats", "1", "--out", str(out), "--no-progress"]) == 0
    recs = _records(json.loads((out / "bench.json").read_text()))
    for shape in SHAPES.split(","):
        r = recs[(shape, "torch")]
        assert r["status"] == "ok", r
        keys = ("loss_rel_err", "grad_hidden_rel_err", "grad_weight_rel_err")
        keys += ("logp_rel_err",) if shape.startswith("grpo") else ()
        for key in keys:
            assert r[key] < 1e-4, (shape, key, r[key])


def test_offpolicy_kl_problem_matches_float64_for_every_logprob_peer_and_token_loss(tmp_path):
    """``--shapes grpo-offpolicy-kl``: old log-probs ≠ current (both DAPO clips active), a β·k3 KL term against
    reference log-probs; every log-prob peer through the shared loss code and ``hf_fused_token_loss`` (the whole
    objective in ``linear_token_loss``) against the float64 reference."""
    import warnings

    from benchmarks.losses import EPSILON_HIGH, EPSILON_LOW
    from benchmarks.problems import make_inputs
    from benchmarks.reference import float64_logprobs
    from hf_fused.ops import HintMissedWarning

    out = tmp_path / "bench"
    peers = "eager,trl,hf_fused,hf_fused_hint,hf_fused_token_loss"
    with warnings.catch_warnings():
        warnings.simplefilter("error", HintMissedWarning)  # the off-policy TokenLossHint must be taken, not recomputed
        assert main(["--device", "cpu", "--quick", "--shapes", "grpo-offpolicy-kl,grpo-2x64-h64-v1k", "--peers", peers,
                     "--repeats", "1", "--out", str(out), "--no-progress"]) == 0
    doc = json.loads((out / "bench.json").read_text())
    recs = _records(doc)
    name = "grpo-2x64-h64-v1k-offpolicy-kl"
    assert doc["problems"][name]["reference"] == "float64"
    for peer in peers.split(","):
        r = recs[(name, peer)]
        assert r["status"] == "ok", r
        # fp32 inputs on CPU: fp32 accumulation, errors at fp32 rounding level
        for key in ("loss_rel_err", "grad_hidden_rel_err", "grad_weight_rel_err", "logp_rel_err"):
            assert r[key] < 1e-5, (peer, key, r[key])
    # the variant is really off-policy: its loss differs from the on-policy one on the same hidden/weight/ids,
    # and both clip bounds are crossed by some tokens
    assert recs[(name, "hf_fused")]["loss_ref"] != pytest.approx(recs[("grpo-2x64-h64-v1k", "hf_fused")]["loss_ref"])
    problem = select_problems(name, quick=True)[0]
    inp = make_inputs(problem, torch.device("cpu"), torch.float32)
    current = float64_logprobs(inp.hidden.detach().reshape(-1, problem.H), inp.weight, inp.token_ids.reshape(-1))
    ratio = torch.exp(current.view(inp.mask.shape) - inp.old_logps.double())[inp.mask]
    assert (ratio < 1 - EPSILON_LOW).any() and (ratio > 1 + EPSILON_HIGH).any()
    assert inp.beta > 0 and not torch.equal(inp.ref_logps, inp.old_logps)


def test_token_loss_peer_on_policy_and_loss_types(tmp_path):
    out = tmp_path / "bench"
    assert main(["--device", "cpu", "--quick", "--shapes", "grpo-2x64-h64-v1k,grpo-loss-types", "--peers",
                 "hf_fused_token_loss", "--repeats", "1", "--out", str(out), "--no-progress"]) == 0
    doc = json.loads((out / "bench.json").read_text())
    assert len(doc["results"]) == 7  # DAPO and the six other loss types
    for r in doc["results"]:
        assert r["status"] == "ok", r
        for key in ("loss_rel_err", "grad_hidden_rel_err", "grad_weight_rel_err", "logp_rel_err"):
            assert r[key] < 1e-5, (r["problem"], key, r[key])


def test_loss_types_offpolicy_kl_match_float64_for_every_logprob_peer_and_token_loss(tmp_path):
    """``--shapes grpo-loss-types-offpolicy-kl``: every TRL loss type but dapo (whose off-policy problem is
    ``grpo-offpolicy-kl``) off-policy with the β·k3 KL term; log-prob peers through the shared loss code, the
    off-policy ``TokenLossHint`` (taken, not recomputed) and ``linear_token_loss`` against the float64 reference."""
    import warnings

    from hf_fused.ops import HintMissedWarning

    out = tmp_path / "bench"
    peers = ["eager", "trl", "hf_fused", "hf_fused_hint", "hf_fused_token_loss"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", HintMissedWarning)
        assert main(["--device", "cpu", "--quick", "--shapes", "grpo-loss-types-offpolicy-kl", "--peers",
                     ",".join(peers), "--repeats", "1", "--out", str(out), "--no-progress"]) == 0
    doc = json.loads((out / "bench.json").read_text())
    names = [f"grpo-2x64-h64-v1k-{lt}-offpolicy-kl" for lt in ("grpo", "bnpo", "dr_grpo", "luspo", "cispo", "sapo")]
    assert list(doc["problems"]) == names
    recs = _records(doc)
    assert len(recs) == len(names) * len(peers)
    for name in names:
        assert doc["problems"][name]["reference"] == "float64"
        for peer in peers:
            r = recs[(name, peer)]
            assert r["status"] == "ok", r
            # fp32 inputs on CPU: fp32 accumulation, errors at fp32 rounding level
            for key in ("loss_rel_err", "grad_hidden_rel_err", "grad_weight_rel_err", "logp_rel_err"):
                assert r[key] < 1e-5, (name, peer, key, r[key])


def test_liger_grpo_peer_is_na_only_where_its_loss_differs():
    """Liger 0.8.5's fused GRPO loss matches the benchmark's for every loss type but luspo, off-policy too with
    ``use_bias_correction_kl`` (checked on CPU against the float64 reference; it is CUDA-only in the runs): the
    adapter reports n/a for luspo, and for the off-policy KL problems only where Liger lacks that option."""
    from benchmarks.peers import LigerGRPOPeer

    peer = LigerGRPOPeer()
    problems = select_problems("grpo,grpo-loss-types,grpo-offpolicy-kl,grpo-loss-types-offpolicy-kl", quick=True)
    peer._options = frozenset({"sapo_temperature_pos", "use_bias_correction_kl"})  # what load() reads off 0.8.5
    assert [p.name for p in problems if peer.unsupported_problem(p)] == [
        "grpo-2x64-h64-v1k-luspo", "grpo-2x64-h64-v1k-luspo-offpolicy-kl"]
    assert "luspo reduction" in peer.unsupported_problem(problems[-3])
    peer._options = frozenset({"sapo_temperature_pos"})  # a Liger without the KL bias correction
    assert "bias correction" in peer.unsupported_problem(select_problems("grpo-offpolicy-kl", quick=True)[0])


def test_autocast_runs_every_step_in_mixed_precision(tmp_path, capsys):
    """``--dtype fp32 --autocast bf16``: fp32 inputs and gradients, each step under bf16 autocast (TRL's
    GRPOTrainer default: a float32 model trained with bf16=True). Autocast reaches every peer: their errors against
    float64 are bf16's (fp32 steps are ~1e-6), hf_fused's no larger than eager's (its fp32 gradients are rounded
    once, eager's through bf16 first), and the run and its table say so."""
    out = tmp_path / "bench"
    assert main(["--device", "cpu", "--quick", "--shapes", SHAPES, "--peers", "eager,trl,hf_fused", "--dtype", "fp32",
                 "--autocast", "bf16", "--repeats", "1", "--out", str(out), "--no-progress"]) == 0
    doc = json.loads((out / "bench.json").read_text())
    assert doc["runs"][0]["autocast"] == "bfloat16" and doc["runs"][0]["dtype"] == "float32"
    assert "autocast: bfloat16" in (out / "bench.txt").read_text()
    recs = _records(doc)
    for shape in SHAPES.split(","):
        eager = recs[(shape, "eager")]
        for peer in ("eager", "trl", "hf_fused"):
            r = recs[(shape, peer)]
            assert r["status"] == "ok", r
            for key in ("grad_hidden_rel_err", "grad_weight_rel_err"):
                assert 1e-4 < r[key] < 2e-2, (shape, peer, key, r[key])  # bf16 operands: 2^-8 relative rounding
                if peer == "hf_fused":
                    assert r[key] <= 1.25 * eager[key], (shape, key, r[key], eager[key])

    fp32 = tmp_path / "fp32"
    assert main(["--device", "cpu", "--quick", "--shapes", "ce-128-h64-v1k", "--peers", "eager", "--dtype", "fp32",
                 "--repeats", "1", "--out", str(fp32), "--no-progress"]) == 0
    (plain,) = json.loads((fp32 / "bench.json").read_text())["results"]
    assert plain["grad_hidden_rel_err"] < 1e-5 and json.loads((fp32 / "bench.json").read_text())["runs"][0]["autocast"] is None


def test_the_matmul_ceiling_is_measured_in_the_dtype_the_matmuls_run_in():
    """Under ``--autocast bf16`` the fp32 problems multiply in bf16: a ceiling measured in fp32 (TF32) would make
    fractions of 800-1500 % of it on an H200."""
    from benchmarks.runner import RunConfig, matmul_dtype

    base = dict(device=torch.device("cpu"), problems=[], peers=[], repeats=1, out_dir=None)
    assert matmul_dtype(RunConfig(dtype=torch.float32, autocast=torch.bfloat16, **base)) == torch.bfloat16
    assert matmul_dtype(RunConfig(dtype=torch.bfloat16, **base)) == torch.bfloat16
    assert matmul_dtype(RunConfig(dtype=torch.float32, **base)) == torch.float32
