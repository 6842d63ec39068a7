"""Smoke test of ``python -m benchmarks.e2e --tiny`` on CPU: both parts run end to end, the JSON and
table are written, Liger is skipped with a note, and the variants agree on the first loss."""

from __future__ import annotations

import json
import math

from benchmarks.e2e.__main__ import main


def test_e2e_tiny_cpu(tmp_path, capsys):
    out = tmp_path / "e2e"
    argv = ["--tiny", "--device", "cpu", "--seq-lens", "32,48", "--steps", "1", "--grpo-completions", "2",
            "--grpo-completion-len", "8", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    doc = json.loads((out / "e2e.json").read_text())
    table = (out / "e2e.txt").read_text()
    assert "longest fit" in table and table.strip() in printed
    assert (out / "e2e.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    sft = {(r["variant"], r["seq_len"]): r for r in doc["sft"]["runs"]}
    assert set(sft) == {(v, n) for v in ("plain", "liger", "hf_fused", "trl_sft", "hf_fused_trl_sft") for n in (32, 48)}
    for n in (32, 48):
        assert sft[("liger", n)]["status"] == "skipped" and sft[("liger", n)]["note"]
        plain, fused = sft[("plain", n)], sft[("hf_fused", n)]
        assert plain["status"] == fused["status"] == "ok", (plain, fused)
        assert plain["checkpointing"] and fused["checkpointing"]
        assert len(plain["step_s"]) == 1 and plain["tokens_per_s"] > 0
        assert math.isclose(plain["losses"][0], fused["losses"][0], rel_tol=1e-4)

    grpo = {r["variant"]: r for r in doc["grpo"]["runs"]}
    assert set(grpo) == {"trl", "hf_fused", "hf_fused_one_pass"}
    assert all(r["status"] == "ok" and r["checkpointing"] for r in grpo.values()), grpo
    for variant in ("hf_fused", "hf_fused_one_pass"):
        assert math.isclose(grpo["trl"]["losses"][0], grpo[variant]["losses"][0], rel_tol=1e-4, abs_tol=1e-6)
        assert math.isclose(grpo["trl"]["grad_norm_last"], grpo[variant]["grad_norm_last"], rel_tol=1e-3)


def test_e2e_tiny_sft_trainer_variants_and_gemma2(tmp_path, capsys):
    """``trl_sft`` (SFTTrainer, TRL's own fused head) and ``hf_fused_trl_sft`` (apply_fused_loss + SFTTrainer)
    next to the Trainer variants on the soft-capped Gemma-2 shape: same rows, same first loss, tokens/s recorded,
    and each variant trained through the forward it claims."""
    import torch

    from benchmarks.e2e.models import SHAPES, build_model, model_config

    out = tmp_path / "e2e"
    variants = ("plain", "hf_fused", "trl_sft", "hf_fused_trl_sft")
    argv = ["--tiny", "--device", "cpu", "--model", "gemma2-2b", "--parts", "sft", "--seq-lens", "32",
            "--sft-variants", ",".join(variants), "--steps", "3", "--out", str(out)]
    assert main(argv) == 0
    doc = json.loads((out / "e2e.json").read_text())
    assert "Gemma-2" in doc["sft"]["model"] and doc["sft"]["shape"]["final_logit_softcapping"] > 0
    runs = {r["variant"]: r for r in doc["sft"]["runs"]}
    assert set(runs) == set(variants)
    for v, r in runs.items():
        assert r["status"] == "ok", r
        assert r["checkpointing"] and len(r["step_s"]) == 3
        # tokens/s of the median step (three steps: the median is one of them, not the mean of all)
        assert r["tokens_per_s"] == 32 / sorted(r["step_s"])[1] == 32 / r["step_s_median"]
        assert "Gemma2ForCausalLM" in r["forward"] or r["forward"].startswith("hf_fused"), r["forward"]
        assert r["forward"].startswith("hf_fused") == v.startswith("hf_fused"), (v, r["forward"])
        # fp32 on CPU: the fused and TRL heads reduce in another order than the dense loss, nothing more
        for step in range(3):
            assert math.isclose(r["losses"][step], runs["plain"]["losses"][step], rel_tol=1e-5), (v, step, r["losses"])
    table = (out / "e2e.txt").read_text()
    assert all(v in table for v in variants)

    # the tiny shape's soft-capping bends its logits, so the agreement above covers it
    ids = torch.randint(2, SHAPES["tiny-gemma2"]["vocab_size"], (1, 32), generator=torch.Generator().manual_seed(0))
    config = model_config("tiny-gemma2", 512)
    with torch.no_grad():
        capped = build_model(config, torch.device("cpu"), torch.float32, 0, "eager")(input_ids=ids, labels=ids).loss
        config.final_logit_softcapping = None
        uncapped = build_model(config, torch.device("cpu"), torch.float32, 0, "eager")(input_ids=ids, labels=ids).loss
    assert not math.isclose(float(capped), float(uncapped), rel_tol=1e-4)


def test_e2e_tiny_grpo_off_policy_with_kl(tmp_path):
    """``--grpo-off-policy-kl``: old and reference log-probs in the inputs and β > 0, so TRL's loss has ratios ≠ 1 and
    the KL term (another loss than the on-policy step's); FusedGRPOTrainer (its off-policy token-loss hint) gives
    TRL's loss and gradient norm."""
    runs = {}
    for mode in ("on", "off"):
        out = tmp_path / mode
        argv = ["--tiny", "--device", "cpu", "--parts", "grpo", "--grpo-variants", "trl,hf_fused", "--steps", "1",
                "--grpo-completions", "2", "--grpo-completion-len", "8", "--out", str(out)]
        assert main(argv + (["--grpo-off-policy-kl"] if mode == "off" else [])) == 0
        doc = json.loads((out / "e2e.json").read_text())
        runs[mode] = {r["variant"]: r for r in doc["grpo"]["runs"]}
        assert ("off-policy" in doc["grpo"]["setup"]) == (mode == "off"), doc["grpo"]["setup"]
    off = runs["off"]
    assert all(r["status"] == "ok" for r in off.values()), off
    assert not math.isclose(off["trl"]["losses"][0], runs["on"]["trl"]["losses"][0], rel_tol=1e-3)
    assert math.isclose(off["trl"]["losses"][0], off["hf_fused"]["losses"][0], rel_tol=1e-4, abs_tol=1e-6)
    assert math.isclose(off["trl"]["grad_norm_last"], off["hf_fused"]["grad_norm_last"], rel_tol=1e-3)


def test_e2e_refuses_a_variant_given_twice(capsys):
    """Runs are keyed by variant name in the table and the JSON, so a repeated variant would hide a run: refused
    before anything is built, with the name."""
    import pytest

    with pytest.raises(SystemExit):
        main(["--tiny", "--device", "cpu", "--parts", "sft", "--sft-variants", "hf_fused,plain,hf_fused"])
    assert "SFT variant given twice: hf_fused" in capsys.readouterr().err


def test_e2e_grpo_in_trls_default_precision(tmp_path):
    """``--grpo-precision trl-default``: float32 weights, every step under bf16 autocast (GRPOTrainer's default).
    Off-policy with KL so the loss depends on the log-probs: under autocast it moves away from the fp32 run's
    (autocast really reached the steps), and hf_fused stays with TRL's head."""
    common = ["--tiny", "--device", "cpu", "--parts", "grpo", "--grpo-variants", "trl,hf_fused", "--steps", "1",
              "--warmup", "0", "--grpo-completions", "2", "--grpo-completion-len", "8", "--grpo-off-policy-kl"]
    runs = {}
    for precision in ("bf16", "trl-default"):  # bf16 means fp32 weights on CPU: the fp32 baseline here
        out = tmp_path / precision
        assert main([*common, "--grpo-precision", precision, "--out", str(out)]) == 0
        doc = json.loads((out / "e2e.json").read_text())
        runs[precision] = {r["variant"]: r for r in doc["grpo"]["runs"]}
        assert all(r["status"] == "ok" for r in runs[precision].values()), runs[precision]
        assert ("float32 under bf16 autocast" in doc["grpo"]["model"]) == (precision == "trl-default")
    fp32, mixed = runs["bf16"], runs["trl-default"]
    assert not math.isclose(fp32["trl"]["losses"][0], mixed["trl"]["losses"][0], rel_tol=1e-6)
    # bf16 operands round each logit by up to 2^-8 relative in both heads, each its own way (TRL: bf16 logits chunk
    # by chunk; hf_fused: fp32 accumulation of bf16 products): loss and gradient agree to that bound, not to fp32's
    # (seen: 3.6e-4 and 6.1e-4 relative).
    assert math.isclose(mixed["trl"]["losses"][0], mixed["hf_fused"]["losses"][0], rel_tol=2**-8)
    assert math.isclose(mixed["trl"]["grad_norm_last"], mixed["hf_fused"]["grad_norm_last"], rel_tol=2**-8)
    assert math.isclose(fp32["trl"]["losses"][0], fp32["hf_fused"]["losses"][0], rel_tol=1e-4)
