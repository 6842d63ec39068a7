"""How far an RL objective's gradients are from float64 when the log-probs come from bf16 logits:
``python -m benchmarks.rl_precision [--device cuda] [--shape 8x513x1024x32003] [--temperature 0.7]``.

open-instruct's DAPO objective (:func:`hf_fused.ops.linear_grpo_loss`, ``GRPOObjective()``: clip 0.2 / 0.272, k3 KL
with β 0.05) on bf16 hidden states and head, old log-probs 0.3 nats and reference log-probs 0.2 nats from the
current ones, truncated importance weights ρ in [0, 0.9]; and without old / reference / ρ. For each: the loss and
the hidden-state and weight gradients relative to float64 on the same bf16 operands, and the largest per-token
log-prob error, for hf_fused (its defaults on the device), eager bf16 logits (``(h @ W.T).float()``, TRL's head
without ``cast_lm_head_to_fp32``) and a dense fp32 computation whose gradients are rounded to bf16 once, as the
others' are (the parameters' dtype). Logits of standard deviation ~4.
"""

from __future__ import annotations

import argparse
from typing import Optional

import torch

from hf_fused.ops import linear_grpo_loss
from hf_fused.ops.rl_objectives import GRPOObjective, grpo_token_loss

from .measure import text_table


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def _dense(h, w, labels, temperature, objective_inputs, dtype, logits_dtype=None):
    """The objective through the full logits: ``(loss, dh, dw, logprobs)``; ``logits_dtype`` rounds the logits."""
    h = h.to(dtype).detach().requires_grad_()
    w = w.to(dtype).detach().requires_grad_()
    z = h @ w.t()
    if logits_dtype is not None:
        z = z.to(logits_dtype)
    logp = torch.log_softmax(z.to(dtype if dtype == torch.float64 else torch.float32) / temperature, -1)
    logp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    mask, advantages, kw = objective_inputs
    loss = grpo_token_loss(logp, None, objective=GRPOObjective(), inv_denominator=1 / mask.sum().item(),
                           advantages=advantages.to(logp.dtype), mask=mask,
                           **{k: v.to(logp.dtype) for k, v in kw.items()}).sum()
    loss.backward()
    return loss.detach(), h.grad, w.grad, logp.detach()


def measure(device: torch.device, shape: tuple, temperature: float, seed: int = 0) -> list[list[str]]:
    """Rows ``[case, computation, loss err, dh err, dW err, max logp err]``."""
    b, t, hidden, vocab = shape
    g = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(b, t, hidden, device=device, generator=g).bfloat16()
    w = (torch.randn(vocab, hidden, device=device, generator=g) * (4 / hidden**0.5)).bfloat16()
    labels = torch.randint(0, vocab, (b, t), device=device, generator=g)
    mask = torch.rand(b, t, device=device, generator=g) > 0.2
    advantages = torch.randn(b, 1, device=device, generator=g).expand(b, t)
    _, _, _, logp64 = _dense(h, w, labels, temperature, (mask, advantages, {}), torch.float64)
    off_policy = dict(old_logprobs=(logp64 + 0.3 * torch.randn(b, t, device=device, generator=g)).float(),
                      ref_logprobs=(logp64 + 0.2 * torch.randn(b, t, device=device, generator=g)).float(),
                      rho_weights=torch.rand(b, t, device=device, generator=g).clamp(max=0.9))
    rows = []
    for case, kw in (("off-policy, k3 KL, rho", off_policy), ("on-policy", {})):
        inputs = (mask, advantages, kw)
        loss64, dh64, dw64, logp64 = _dense(h, w, labels, temperature, inputs, torch.float64)

        def row(name, loss, dh, dw, logp):
            lp = (logp.double() - logp64)[mask].abs().max().item()
            rows.append([case, name, f"{abs(loss.item() - loss64.item()) / abs(loss64.item()):.1e}",
                         f"{_rel(dh, dh64):.1e}", f"{_rel(dw, dw64):.1e}", f"{lp:.1e}"])

        hb, wb = h.clone().requires_grad_(), w.clone().requires_grad_()
        out = linear_grpo_loss(hb, wb, labels, advantages=advantages, response_mask=mask,
                               loss_denominator=mask.sum().item(), temperature=temperature, **kw)
        out.loss.backward()
        row("hf_fused", out.loss, hb.grad, wb.grad, out.logprobs)
        row("eager, bf16 logits", *_dense(h, w, labels, temperature, inputs, torch.bfloat16, torch.bfloat16))
        loss32, dh32, dw32, logp32 = _dense(h, w, labels, temperature, inputs, torch.float32)
        row("dense fp32, gradients in bf16", loss32, dh32.bfloat16(), dw32.bfloat16(), logp32)
    return rows


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", default="8x513x1024x32003", help="BxTxHxV (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    shape = tuple(int(x) for x in args.shape.lower().split("x"))
    if len(shape) != 4:
        p.error(f"--shape must be BxTxHxV, got {args.shape!r}")
    rows = measure(torch.device(args.device), shape, args.temperature, args.seed)
    print(f"DAPO at T = {args.temperature}, {args.shape}, bf16 operands, errors relative to float64")
    print("\n".join(text_table(["case", "computation", "loss", "dh", "dW", "max logp (nats)"], rows, align_left=2)))


if __name__ == "__main__":
    main()
