"""A tensor-parallel model's training step on each rank, transformers' lm_head against hf_fused's:
``torchrun --nproc_per_node 2 -m benchmarks.tensor_parallel_model [--layers 2 --batch 4 --seq-len 4096]
[--vocab 151936] [--repeats 3]``.

A Qwen3-shaped model (hidden 2048, 16 query and 8 key-value heads of 128, MLP 6144, tied embeddings, ``--layers``
layers; random weights from its config, ``--dtype`` bf16) loaded with ``DistributedConfig(tp_size=world)``: every layer split
over the ranks, lm_head a ``Shard(0)`` DTensor. Variants, each a forward + backward of ``model(input_ids,
labels=input_ids)`` on the same batch, interleaved call by call (so that drift or order favours none):

* ``transformers``: the model unpatched: lm_head's ``colwise_gather_output`` plan all-gathers the ``[tokens, V]``
  logits on every rank before the loss;
* ``hf_fused``: ``apply_fused_loss(model)``: the vocabulary-parallel head with its default backend (the GPU
  backend's schedules on CUDA);
* ``hf_fused-torch``: ``apply_fused_loss(model, backend="torch")``: the torch tile loop on each rank's rows.

Per rank: the median time of ``--repeats`` steps, the peak memory above the weights during one step (activations,
gradients, the head's buffers: :func:`benchmarks.measure.peak_memory`), the loss, and the relative error of the loss
and of the rank's rows of lm_head's gradient against ``transformers``' step. Rank 0 prints every rank's rows. On
CPU ranks (gloo) it runs as a smoke test; give it small sizes (``--hidden``, ``--heads``, ``--vocab``...).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from typing import Optional

import torch
import torch.distributed as dist

from . import measure

VARIANTS = ("transformers", "hf_fused", "hf_fused-torch")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchrun --nproc_per_node N -m benchmarks.tensor_parallel_model",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16, help="query heads (key-value heads: half as many)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=6144)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--model-dir", default=None, help="where rank 0 saves the random model (default: a temporary "
                                                          "directory named for its shape)")
    return parser


def process_group() -> tuple[torch.device, bool]:
    """``(this rank's device, whether this call initialized the process group)``: NCCL on the rank's GPU under
    ``torchrun`` where CUDA is available, else gloo on CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if dist.is_initialized():
        return device, False
    if device.type == "cuda":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    return device, True


def load_model(args):
    """The random Qwen3-shaped model (saved once by rank 0, in fp32), loaded tensor-parallel over every rank in
    ``--dtype`` (on the rank's device: transformers places it where ``torch.cuda.set_device`` points)."""
    import transformers
    from transformers.distributed import DistributedConfig

    config = transformers.Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 2),
        head_dim=args.head_dim, tie_word_embeddings=True, max_position_embeddings=max(args.seq_len, 64))
    path = args.model_dir or os.path.join(
        tempfile.gettempdir(), f"hf_fused-qwen3like-{args.layers}x{args.hidden}-{args.heads}x{args.head_dim}-"
                               f"{args.intermediate}-{args.vocab}")
    if dist.get_rank() == 0 and not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    dist.barrier()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=DTYPES[args.dtype], distributed_config=DistributedConfig(tp_size=dist.get_world_size()),
        attn_implementation="sdpa")
    model.train()
    return model


def set_variant(model, variant: str) -> None:
    """Patch or unpatch ``model`` for ``variant`` (the patch was verified once, by :func:`run`)."""
    from hf_fused import apply_fused_loss, remove_fused_loss

    if variant == "transformers":
        remove_fused_loss(model)
    else:
        apply_fused_loss(model, backend="torch" if variant == "hf_fused-torch" else None, verify=False)


def run(args, device: torch.device) -> list[dict]:
    """This rank's rows (a collective: every rank of the process group calls it), one per variant: ``ms``
    (median), ``peak_gib``, ``loss``, ``errors`` (the loss's and lm_head's gradient rows' relative error against
    ``transformers``; ``None`` for it)."""
    from hf_fused import apply_fused_loss

    model = load_model(args)
    apply_fused_loss(model)  # its probe checks the patched forward on the tensor-parallel model once
    variants = args.variants.split(",")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=g).to(device)
    labels = ids.clone()
    labels[:, : max(1, args.seq_len // 256)] = -100

    def step():
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        return loss.detach().float()

    def head_grad() -> torch.Tensor:
        grad = model.get_output_embeddings().weight.grad
        return (grad.to_local() if hasattr(grad, "to_local") else grad).detach().float()

    results = {}
    for variant in variants:  # a warm-up step each (compiles), its loss and lm_head gradient kept
        set_variant(model, variant)
        model.zero_grad(set_to_none=True)
        loss = step()
        results[variant] = dict(loss=loss, grad=head_grad(), times=[])
    for _ in range(args.repeats):
        for variant in variants:
            set_variant(model, variant)
            model.zero_grad(set_to_none=True)
            results[variant]["times"].append(measure.time_once_ms(step, device))
    rows = []
    for variant in variants:
        set_variant(model, variant)
        model.zero_grad(set_to_none=True)
        _, peak = measure.peak_memory(step, device)
        errors = None
        if variant != "transformers" and "transformers" in results:
            ref = results["transformers"]
            errors = [measure.relative_error(results[variant][k], ref[k]) for k in ("loss", "grad")]
        rows.append(dict(rank=dist.get_rank(), variant=variant, ms=statistics.median(results[variant]["times"]),
                         peak_gib=peak / measure.GIB, loss=results[variant]["loss"].item(), errors=errors))
    model.zero_grad(set_to_none=True)
    return rows


def table(rows: list[dict]) -> list[str]:
    body = [[str(r["rank"]), r["variant"], f"{r['ms']:.1f}", f"{r['peak_gib']:.2f}", f"{r['loss']:.6f}",
             "-" if r["errors"] is None else " / ".join(f"{e:.1e}" for e in r["errors"])] for r in rows]
    return measure.text_table(["rank", "variant", "ms", "peak GiB", "loss", "error loss / dW rows"], body,
                              align_left=2)


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    device, created = process_group()
    try:
        rows = run(args, device)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, rows)
        if dist.get_rank() == 0:
            print(f"{dist.get_world_size()} x {measure.device_name(device)}, torch {torch.__version__}: "
                  f"tensor parallelism over {dist.get_backend()}, {args.layers} layers, {args.batch} x "
                  f"{args.seq_len} tokens, vocabulary {args.vocab}, {args.dtype}, median of {args.repeats}",
                  flush=True)
            print("\n".join(table([row for rank_rows in gathered for row in rank_rows])), flush=True)
        dist.barrier()
    finally:
        if created:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
