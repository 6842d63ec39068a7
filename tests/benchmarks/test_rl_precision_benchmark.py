"""benchmarks.rl_precision on CPU at a tiny shape: it runs, and its rows say what the method says they should.
On CPU hf_fused's tiles compute the bf16 operands' products in fp32, so its gradients are as close to float64 as
dense fp32's rounded once to bf16 (the rounding, ~2e-3, is all of it), while eager bf16 logits are far further
on the off-policy objective, whose ratios and KL amplify the logits' rounding."""

from benchmarks import rl_precision


def test_rl_precision_rows_on_cpu(capsys):
    rows = rl_precision.measure(__import__("torch").device("cpu"), (2, 17, 64, 301), 0.7)
    table = {(case, name): [float(x) for x in rest] for case, name, *rest in rows}
    assert len(table) == 6
    for case in ("off-policy, k3 KL, rho", "on-policy"):
        fused, eager, fp32 = (table[(case, n)] for n in ("hf_fused", "eager, bf16 logits",
                                                          "dense fp32, gradients in bf16"))
        assert fused[1] <= 1.5 * fp32[1] and fused[2] <= 1.5 * fp32[2], (fused, fp32)  # dh, dW: one bf16 rounding
        assert fused[3] < 1e-5, fused  # per-token log-probs: fp32 products
    off = table[("off-policy, k3 KL, rho", "eager, bf16 logits")]
    assert off[1] > 10 * table[("off-policy, k3 KL, rho", "hf_fused")][1], off
    rl_precision.main(["--device", "cpu", "--shape", "2x9x32x101"])
    assert "hf_fused" in capsys.readouterr().out
