"""The vocabulary-parallel code path against the unsharded op on one device, at the work of ``tp = 1``:
``python -m benchmarks.tensor_parallel [--device cuda] [--tokens 16384 --hidden 2048 --vocab 151936] [--repeats 10]``.

Variants, each forward + backward of ``linear_cross_entropy`` and of ``linear_logprobs`` with the entropy (bf16):

* ``unsharded``: the op.
* ``one-rank``: ``vocab_parallel=VocabShard(0, V, group)`` with a one-rank process group: the call the model layer
  makes for a DTensor on a one-rank mesh (the plain op's path after the layout check).
* ``tp-path``: the tensor-parallel schedules at ``tp = 1``'s work: this process holds every row ``[0, V)`` of a
  two-rank group whose other rank (:class:`IdleRank`) holds one row and contributes nothing, so every collective is
  the identity and the call runs what a rank of a real group runs (the GPU backend's vocabulary-parallel schedules
  on CUDA, ``backend="triton"``; the torch loop on CPU; the merges, the hidden states' fp32 gradient sum) on the
  whole vocabulary.
* ``tp-path-torch``: the same with ``backend="torch"`` (the torch tile loop over cuBLAS, the default on CPU).

Time: the median of ``--repeats`` calls, the variants interleaved call by call (so that drift or order favours
none). Memory: the peak above the inputs during one call (:func:`benchmarks.measure.peak_memory`). Error: relative
to the unsharded op's loss or summed outputs, hidden and weight gradients.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Optional

import torch
import torch.distributed as dist

from . import measure
from hf_fused.ops import VocabShard, linear_cross_entropy, linear_logprobs

VARIANTS = ("unsharded", "one-rank", "tp-path", "tp-path-torch")
OPS = ("cross_entropy", "logprobs")


class IdleRank:
    """A two-rank group seen from rank 0, whose rank 1 holds the one row ``[V, V + 1)`` and adds nothing to any
    reduction (the group interface of :class:`~hf_fused.ops.vocab_parallel.VocabShard`)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return 0

    def all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        pass  # rank 1's −inf maximum and zero sums change nothing

    def all_gather(self, tensor: torch.Tensor) -> list:
        other = tensor.clone()  # (start, stop, kept tokens, weight rows, labels' fingerprint)
        other[0], other[1], other[3] = self.vocab_size, self.vocab_size + 1, 1
        return [tensor, other]


def inputs(device: torch.device, tokens: int, hidden: int, vocab: int) -> dict:
    """bf16 hidden states and weight (logits of standard deviation ~4), labels with 1 % ignored, upstream
    gradients of the log-probs and entropies."""
    g = torch.Generator(device=device).manual_seed(0)
    labels = torch.randint(0, vocab, (tokens,), device=device, generator=g)
    labels[: max(1, tokens // 100)] = -100
    return dict(
        hidden=torch.randn(tokens, hidden, device=device, generator=g).to(torch.bfloat16),
        weight=(torch.randn(vocab, hidden, device=device, generator=g) * (4.0 / hidden**0.5)).to(torch.bfloat16),
        labels=labels, g_lp=torch.randn(tokens, device=device, generator=g),
        g_ent=torch.randn(tokens, device=device, generator=g) * 0.1,
    )


def call(op: str, variant: str, data: dict, group) -> tuple:
    """``(value, hidden's gradient, weight's gradient)`` of one forward + backward."""
    h, w = data["hidden"].clone().requires_grad_(), data["weight"].clone().requires_grad_()
    vocab = w.shape[0]
    kw = {}
    if variant == "one-rank":
        kw = dict(vocab_parallel=VocabShard(0, vocab, group))
    elif variant.startswith("tp-path"):
        kw = dict(vocab_parallel=VocabShard(0, vocab, IdleRank(vocab)),
                  backend="torch" if variant.endswith("torch") or device_type(h) != "cuda" else "triton")
    if op == "cross_entropy":
        value = linear_cross_entropy(h, w, data["labels"], **kw)
        value.backward()
    else:
        lp, ent = linear_logprobs(h, w, data["labels"], return_entropy=True, **kw)
        (lp * data["g_lp"] + ent * data["g_ent"]).sum().backward()
        value = torch.stack([lp.detach().float().sum(), ent.detach().float().sum()])
    return value.detach().float(), h.grad, w.grad


def device_type(tensor: torch.Tensor) -> str:
    return tensor.device.type


def one_rank_group(device: torch.device):
    """A one-rank process group (NCCL on CUDA, gloo on CPU) on an in-process store: no port, no launcher."""
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kw = dict(device_id=torch.device("cuda", device.index or 0)) if device.type == "cuda" else {}
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kw)
    return dist.new_group([0])


def run(device: torch.device, tokens: int, hidden: int, vocab: int, repeats: int,
        variants=VARIANTS, ops=OPS) -> list[dict]:
    """One row per (op, variant): ``ms`` (median), ``peak_gib``, ``errors`` (value, hidden gradient, weight
    gradient relative to ``unsharded``; ``None`` for it)."""
    data = inputs(device, tokens, hidden, vocab)
    group = one_rank_group(device)
    rows = []
    for op in ops:
        refs = {}
        for variant in variants:  # a warm-up call each (compiles), the reference's results kept
            refs[variant] = call(op, variant, data, group)
        times = {variant: [] for variant in variants}
        for _ in range(repeats):
            for variant in variants:
                times[variant].append(measure.time_once_ms(lambda: call(op, variant, data, group), device))
        for variant in variants:
            _, peak = measure.peak_memory(lambda: call(op, variant, data, group), device)
            errors = None
            if variant != "unsharded" and "unsharded" in refs:
                errors = [measure.relative_error(mine, ref) for mine, ref in zip(refs[variant], refs["unsharded"])]
            rows.append(dict(op=op, variant=variant, ms=statistics.median(times[variant]), peak_gib=peak / measure.GIB,
                             errors=errors))
    return rows


def table(rows: list[dict]) -> list[str]:
    body = [[r["op"], r["variant"], f"{r['ms']:.1f}", f"{r['peak_gib']:.2f}",
             "-" if r["errors"] is None else " / ".join(f"{e:.1e}" for e in r["errors"])] for r in rows]
    return measure.text_table(["op", "variant", "ms", "peak GiB", "error value / dX / dW"], body, align_left=2)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--ops", default=",".join(OPS))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    print(f"{measure.device_name(device)}, torch {torch.__version__}: {args.tokens} tokens x {args.hidden} x "
          f"{args.vocab} bf16, median of {args.repeats}", flush=True)
    rows = run(device, args.tokens, args.hidden, args.vocab, args.repeats, args.variants.split(","),
               args.ops.split(","))
    print("\n".join(table(rows)))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
