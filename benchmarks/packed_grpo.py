"""The head of TRL's ``AsyncGRPOTrainer`` on one packed row, side by side: ``python -m benchmarks.packed_grpo
[--device cuda] [--prompt 512] [--completion 1536] [--group 8] [--groups 2] [--shared 4] [--hidden 2048]
[--vocab 151936] [--repeats 5] [--out PATH]``.

The row is packed by TRL's own code (``trl.experimental.async_grpo.packing``): ``--groups`` prompts of ``--prompt``
tokens, each with ``--group`` completions of ``--completion`` tokens whose first ``--shared`` tokens agree (so those
positions serve every completion of the group, as the first tokens of sampled completions often do), advantages of
both signs, and the sampler's log-probs the policy's own plus Gaussian noise of ``--noise`` nats (its ratios mostly
inside the clip range, as a sampler's are: where a term is clipped its gradient is zero, and a backward that
recomputes skips such rows). Each variant computes the row's per-position log-probs and
entropies, then TRL 1.16's ``AsyncGRPOTrainer.compute_loss`` loss on them (the terms gathered by ``token_index``),
then backward, in bf16:

* ``trl``: TRL's ``ChunkedLogProbFunction`` on the labelled positions, as TRL's head calls it on CUDA;
* ``hf_fused``: ``hf_fused.ops.linear_logprobs(..., return_entropy=True)`` (what ``apply_fused_loss`` on the stock
  trainer runs: statistics in the forward, gradients recomputed in backward);
* ``hf_fused_hint``: the same with ``FusedAsyncGRPOTrainer``'s hint
  (:func:`hf_fused.trainers.async_grpo.packed_token_loss_hint`), the head's gradients from the forward's one pass.

Printed: median ms and peak GiB above the inputs and final gradients per variant, the time ratio to TRL's, and the
loss and gradients' relative difference from the ``hf_fused`` variant (the hint must not move them).
"""

from __future__ import annotations

import argparse
import os
import sys
import types
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch

from . import measure
from .report import fmt_number


def packed_row(args, generator: torch.Generator) -> dict:
    """TRL's packed batch of ``--groups × --group`` samples (``TreeRow.pack``), with ``global_n_tokens``; the
    sampler's log-probs are set by :func:`run` from the policy's."""
    from trl.experimental.async_grpo.packing import TreeRow

    row = TreeRow()
    vocab = args.vocab
    for g in range(args.groups):
        prompt = torch.randint(0, vocab, (args.prompt,), generator=generator)
        shared = torch.randint(0, vocab, (args.shared,), generator=generator)
        for _ in range(args.group):
            rest = torch.randint(0, vocab, (args.completion - args.shared,), generator=generator)
            ids = torch.cat([prompt, shared, rest])
            mask = torch.cat([torch.zeros(args.prompt, dtype=torch.long),
                              torch.ones(args.completion, dtype=torch.long)])
            row.add({"input_ids": ids, "completion_mask": mask, "old_log_probs": torch.zeros(ids.shape), "group_id": g,
                     "advantage": float(torch.randn((), generator=generator))})
    packed = row.pack()
    packed["global_n_tokens"] = torch.tensor([float(packed["token_index"].numel())])
    return packed


def async_grpo_loss(log_probs: torch.Tensor, packed: dict, epsilon: float) -> torch.Tensor:
    """``AsyncGRPOTrainer.compute_loss``'s loss (TRL 1.16) on the row's ``[1, L]`` log-probs, one process, no
    accumulation."""
    log_probs = log_probs.flatten()[packed["token_index"]]
    coef_1 = torch.exp(log_probs - packed["old_log_probs"])
    coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + epsilon)
    per_token_loss = -torch.min(coef_1 * packed["advantages"], coef_2 * packed["advantages"])
    return per_token_loss.sum() / packed["global_n_tokens"][0].clamp(min=1.0)


def variants(packed: dict, epsilon: float) -> dict[str, Callable]:
    """``{name: fn(hidden [1, L, H], weight [V, H]) -> (loss, log_probs)}``, each the row's step up to backward."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    from hf_fused.ops import linear_logprobs
    from hf_fused.trainers.async_grpo import packed_token_loss_hint

    labels = packed["shift_labels"].unsqueeze(0)
    kept = labels != -100
    trainer = types.SimpleNamespace(accelerator=types.SimpleNamespace(num_processes=1), epsilon_low=epsilon,
                                    epsilon_high=epsilon, current_gradient_accumulation_steps=1)
    inputs = {"attention_mask": torch.ones_like(labels), **{k: packed[k] for k in (
        "token_index", "old_log_probs", "advantages", "global_n_tokens")}}

    def trl(hidden, weight):
        logps, _ = ChunkedLogProbFunction.apply(hidden[kept], weight, None, labels[kept], 1.0, 32768, None, 1.0,
                                                ("entropy",))[:2]
        full = logps.new_zeros(labels.shape).masked_scatter(kept, logps)
        return async_grpo_loss(full, packed, epsilon), full

    def fused(hint: bool):
        def step(hidden, weight):
            grad_hint = packed_token_loss_hint(trainer, inputs) if hint else None
            logps, _ = linear_logprobs(hidden, weight, labels, return_entropy=True, grad_hint=grad_hint)
            return async_grpo_loss(logps, packed, epsilon), logps
        return step

    return {"trl": trl, "hf_fused": fused(False), "hf_fused_hint": fused(True)}


def run(args) -> list[dict]:
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    packed = {k: v.to(device) for k, v in packed_row(args, generator).items()}
    length = packed["input_ids"].numel()
    # logits of standard deviation 4, a trained head's: hidden of std 1/2, weight of std 8/√H
    hidden = (torch.randn(1, length, args.hidden, generator=generator) / 2).to(device, torch.bfloat16)
    weight = (torch.randn(args.vocab, args.hidden, generator=generator) * 8 / args.hidden**0.5).to(
        device, torch.bfloat16)
    hidden.requires_grad_(), weight.requires_grad_()
    with torch.no_grad():
        from hf_fused.ops import linear_logprobs

        policy = linear_logprobs(hidden, weight, packed["shift_labels"].unsqueeze(0))[0].flatten()
        noise = torch.randn(packed["token_index"].shape, generator=generator).to(device)
        packed["old_log_probs"] = policy[packed["token_index"]] + args.noise * noise
    terms = int(torch.bincount(packed["token_index"]).max())
    ratio = torch.exp(policy[packed["token_index"]] - packed["old_log_probs"])
    clipped = float(((ratio - 1).abs() > args.epsilon).float().mean())
    print(f"packed row: {length} positions, {packed['token_index'].numel()} loss terms, at most {terms} per "
          f"position, {clipped:.1%} of ratios outside the clip range; H {args.hidden}, V {args.vocab}, bf16, "
          f"{measure.device_name(device)}")
    records, baseline = [], None
    for name, fn in variants(packed, args.epsilon).items():
        def step(fn=fn):
            loss, _ = fn(hidden, weight)
            loss.backward()
            return loss.detach()

        rec = {"variant": name}
        try:
            hidden.grad = weight.grad = None
            step()  # warm-up
            hidden.grad = weight.grad = None
            loss, peak = measure.peak_memory(step, device)
            peak -= sum(t.grad.numel() * t.grad.element_size() for t in (hidden, weight))
            rec.update(loss=float(loss), peak_gib=peak / 2**30)
            grads = (hidden.grad.float(), weight.grad.float())
            if baseline is None and name == "hf_fused":
                baseline = (float(loss), grads)
            rec["grads"] = grads
            rec["ms"], rec["timer"] = measure.median_ms(step, device, args.repeats)
        except torch.cuda.OutOfMemoryError as e:
            rec["note"] = f"out of memory: {measure.short_error(e, 120)}"
        records.append(rec)
        hidden.grad = weight.grad = None
        measure.free_memory(device)
    trl_ms = next((r.get("ms") for r in records if r["variant"] == "trl"), None)
    rows = []
    for rec in records:
        grads = rec.pop("grads", None)
        if baseline is not None and grads is not None:
            rec["loss_diff"] = abs(rec["loss"] - baseline[0]) / max(abs(baseline[0]), 1e-30)
            rec["grad_hidden_diff"] = measure.relative_error(grads[0], baseline[1][0])
            rec["grad_weight_diff"] = measure.relative_error(grads[1], baseline[1][1])
        if trl_ms and rec.get("ms"):
            rec["x_trl"] = rec["ms"] / trl_ms
        rows.append([rec["variant"], *(fmt_number(rec.get(key), spec) for key, spec in (
            ("ms", ".2f"), ("peak_gib", ".2f"), ("x_trl", ".3f"), ("loss_diff", ".1e"), ("grad_hidden_diff", ".1e"),
            ("grad_weight_diff", ".1e"))), rec.get("note", "")])
    header = ["variant", "ms", "GiB", "× TRL", "loss vs hf_fused", "dX vs hf_fused", "dW vs hf_fused", "note"]
    print("\n".join(measure.text_table(header, rows)))
    return records


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.packed_grpo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    for name, default, what in (("prompt", 512, "tokens per prompt"), ("completion", 1536, "tokens per completion"),
                                ("group", 8, "completions per prompt"), ("groups", 2, "prompts"),
                                ("shared", 4, "first completion tokens a group's completions share"),
                                ("hidden", 2048, "hidden size H"), ("vocab", 151936, "vocabulary size V"),
                                ("repeats", 5, "timed repeats (median)")):
        parser.add_argument(f"--{name}", type=int, default=default, help=f"{what} (default {default})")
    parser.add_argument("--epsilon", type=float, default=0.2, help="the clip range (AsyncGRPOConfig's default 0.2)")
    parser.add_argument("--noise", type=float, default=0.1,
                        help="std of the sampler's log-probs around the policy's, nats (default 0.1)")
    parser.add_argument("--out", help="write the records as JSON here")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # the packing and the hint's trainer are TRL's experimental
    if not 0 <= args.shared <= args.completion:
        parser.error(f"--shared must be between 0 and --completion ({args.completion}), got {args.shared}")
    with warnings.catch_warnings():
        warnings.simplefilter("error", __import__("hf_fused").HintMissedWarning)  # a missed hint is a wrong result
        records = run(args)
    if args.out:
        measure.save_json({"args": vars(args), "versions": measure.versions(), "records": records}, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
