"""Where a patched model's step loses time at short sequences: one forward+backward of a Qwen3-1.7B-shaped
model (random init, bf16, no Trainer) unpatched, patched with the default rule, and patched lean; and the host
syncs one fused loss call makes (``torch.cuda.set_sync_debug_mode``).

``python -m benchmarks.step_overhead [--seq-len 4096] [--steps 10]`` (CUDA only)."""

from __future__ import annotations

import argparse
import copy
import warnings

import torch

from .e2e.models import build_model, qwen3_config


def _time_steps(model, input_ids, steps: int) -> float:
    def step():
        out = model(input_ids=input_ids, labels=input_ids)
        out.loss.backward()
        model.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def _count_syncs(model, input_ids) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            model(input_ids=input_ids, labels=input_ids).loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    model.zero_grad(set_to_none=True)
    return sum("called a synchronizing" in str(w.message) for w in caught)


def main() -> None:
    from hf_fused import apply_fused_loss

    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_overhead")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    device = torch.device("cuda")
    base = build_model(qwen3_config("qwen3-1.7b", args.seq_len), device, torch.bfloat16, seed=0)
    base.gradient_checkpointing_enable()
    base.train()
    input_ids = torch.randint(0, base.config.vocab_size, (1, args.seq_len), device=device)
    variants = {
        "unpatched": base,
        "hf_fused default": apply_fused_loss(copy.deepcopy(base)),
        "hf_fused lean (256 MiB)": apply_fused_loss(copy.deepcopy(base), tile_budget_bytes=256 * 2**20),
    }
    print(f"Qwen3-1.7B shape, {args.seq_len} tokens, bf16, gradient checkpointing; forward+backward, no optimizer")
    for name, model in variants.items():
        ms = _time_steps(model, input_ids, args.steps)
        syncs = _count_syncs(model, input_ids)
        print(f"{name:28s} {ms:8.1f} ms/step  {args.seq_len / ms * 1e3:8.0f} tok/s  host syncs in a step: {syncs}")


if __name__ == "__main__":
    main()
