"""What is live at the peak of one fused cross-entropy step: ``python -m benchmarks.memory_trace --budget-mib 256``.

A developer's tool (CUDA only) for checking that an explicit ``tile_budget_bytes`` bounds what the op holds. One
warm-up step, then one step under ``torch.cuda.memory._record_memory_history``; prints the peak above the
allocations that existed before the step, that peak minus the gradients that end up in ``hidden.grad`` and
``weight.grad`` (the benchmark's "peak above inputs + gradients"), and the largest allocations live at the peak
with the hf_fused source lines that made them. Inputs as the benchmark's cross-entropy problems: bf16, logits of
standard deviation 4, ``--ignored`` of the labels set to -100 at random.
"""

from __future__ import annotations

import argparse

import torch

from hf_fused.ops import linear_cross_entropy


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--ignored", type=float, default=0.1, help="share of labels set to -100")
    parser.add_argument("--budget-mib", type=int, default=None, help="tile_budget_bytes in MiB (default: none)")
    parser.add_argument("--top", type=int, default=12, help="allocations to list")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    n, h, v = args.tokens, args.hidden, args.vocab
    budget = None if args.budget_mib is None else args.budget_mib * 2**20
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, h, device=device, generator=gen).bfloat16().requires_grad_()
    weight = (torch.randn(v, h, device=device, generator=gen) * (4 / h**0.5)).bfloat16().requires_grad_()
    labels = torch.randint(0, v, (n,), device=device, generator=gen)
    labels[torch.rand(n, device=device, generator=gen) < args.ignored] = -100

    def step():
        hidden.grad = weight.grad = None
        linear_cross_entropy(hidden, weight, labels, tile_budget_bytes=budget).backward()

    step()
    torch.cuda.synchronize(device)
    hidden.grad = weight.grad = None
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    grads = (hidden.numel() + weight.numel()) * 2
    label = "no budget" if budget is None else f"tile_budget_bytes {args.budget_mib} MiB"
    print(f"{torch.cuda.get_device_name(device)}, {n}×{h}×{v}, {label}: peak above the step's start "
          f"{(peak - base) / 2**20:.1f} MiB, minus the gradients {(peak - base - grads) / 2**20:.1f} MiB")
    total, events = live_at_peak(snapshot, device)
    print(f"live at the peak (allocated during the step): {total / 2**20:.1f} MiB")
    for event in events[: args.top]:
        print(f"{event['size'] / 2**20:9.2f} MiB  {where(event, ('hf_fused',), 2)}")
    return 0


def live_at_peak(snapshot: dict, device: torch.device) -> tuple[int, list[dict]]:
    """Replay the allocator's trace (``torch.cuda.memory._snapshot()`` after ``_record_memory_history``) to the
    moment the most memory allocated during the recording was live: (those bytes, those allocations, largest
    first)."""
    live, current, best = {}, 0, (0, {})
    for event in snapshot["device_traces"][device.index or 0]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            current += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"])["size"]
        if current > best[0]:
            best = (current, dict(live))
    return best[0], sorted(best[1].values(), key=lambda e: -e["size"])


def where(event: dict, packages: tuple[str, ...], depth: int) -> str:
    """The innermost ``depth`` Python frames of an allocation that lie in ``packages`` (path fragments)."""
    frames = [f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in event.get("frames", [])
              if any(p in f["filename"] for p in packages)][:depth]
    return " < ".join(frames) or "(no frame in " + ", ".join(packages) + ": autograd's engine or C++)"


if __name__ == "__main__":
    raise SystemExit(main())
