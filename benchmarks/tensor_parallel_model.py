"""A tensor-parallel model's training step on each rank, transformers' lm_head against hf_fused's:
``torchrun --nproc_per_node 2 -m benchmarks.tensor_parallel_model [--layers 2 --batch 4 --seq-len 4096]
[--vocab 151936] [--repeats 3]``.

A Qwen3-shaped model (by default Qwen3-1.7B's widths: hidden 2048, 16 query and 8 key-value heads of 128, MLP 6144,
tied embeddings; ``--hidden 4096 --heads 32 --kv-heads 8 --intermediate 12288 --untied`` gives Qwen3-8B's) with
``--layers`` layers, random weights from its config, ``--dtype`` bf16, loaded with ``DistributedConfig(tp_size=world)``:
every layer split over the ranks, lm_head a ``Shard(0)`` DTensor. Variants, each a forward + backward of
``model(input_ids, labels=input_ids)`` on the same batch, interleaved call by call (so that drift or order favours
none):

* ``transformers``: the model unpatched: lm_head's ``colwise_gather_output`` plan all-gathers the ``[tokens, V]``
  logits on every rank before the loss;
* ``hf_fused``: ``apply_fused_loss(model)``: the vocabulary-parallel head with its default backend (the GPU
  backend's schedules on CUDA);
* ``hf_fused-torch``: ``apply_fused_loss(model, backend="torch")``: the torch tile loop on each rank's rows.

Per rank: the median time of ``--repeats`` steps and the tokens per second it gives, the peak memory above the
weights during one step (activations, gradients, the head's buffers: :func:`benchmarks.measure.peak_memory`) and, on
CUDA, the allocator's whole peak in that step, the loss, and the relative error of the loss and of the rank's rows of
lm_head's gradient against ``transformers``' step. A variant whose first step runs out of GPU memory on any rank is
reported as such (the ranks agree on it before going on) and the others still run. Rank 0 prints every rank's rows.
On CPU ranks (gloo) it runs as a smoke test; give it small sizes (``--hidden``, ``--heads``, ``--vocab``...).

Raises:
    ValueError: the query heads are not a multiple of the key-value heads, or either count is not a multiple of the
        number of ranks (each rank holds whole heads).
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
    parser.add_argument("--heads", type=int, default=16, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=None, help="key-value heads (default: half the query heads)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=6144)
    parser.add_argument("--untied", action="store_true", help="lm_head a weight of its own (Qwen3-8B), not the "
                                                              "embedding's (Qwen3-1.7B, the default)")
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


def kv_heads(args) -> int:
    return max(1, args.heads // 2) if args.kv_heads is None else args.kv_heads


def check_heads(args, ranks: int) -> None:
    """Raise ``ValueError`` unless the ranks can each hold whole query and key-value heads of whole groups."""
    kv = kv_heads(args)
    if kv < 1 or args.heads % kv:
        raise ValueError(f"--heads {args.heads} is not a multiple of --kv-heads {kv}: give a key-value head count that "
                         f"divides the query heads")
    if args.heads % ranks or kv % ranks:
        raise ValueError(f"{args.heads} query and {kv} key-value heads cannot be split over {ranks} ranks: tensor "
                         f"parallelism gives each rank whole heads; give counts that {ranks} divides")


def load_model(args, device: torch.device):
    """The random Qwen3-shaped model (made once by rank 0: fp32 weights drawn on ``device``, since torchrun leaves a
    rank one CPU thread, ~0.7 s per 100 M values; saved in ``--dtype``, the same rounding as loading fp32 weights in
    it), loaded tensor-parallel over every rank in ``--dtype`` (on the rank's device: transformers places it where
    ``torch.cuda.set_device`` points), for sequences of ``--seq-len`` tokens."""
    import transformers
    from transformers.distributed import DistributedConfig

    config = transformers.Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=kv_heads(args),
        head_dim=args.head_dim, tie_word_embeddings=not args.untied, max_position_embeddings=max(args.seq_len, 64))
    path = args.model_dir or os.path.join(
        tempfile.gettempdir(), f"hf_fused-qwen3like-{args.layers}x{args.hidden}-{args.heads}q{kv_heads(args)}kv"
                               f"x{args.head_dim}-{args.intermediate}-{args.vocab}-"
                               f"{'untied' if args.untied else 'tied'}-{args.dtype}")
    if dist.get_rank() == 0 and not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.to(DTYPES[args.dtype]).save_pretrained(path)
        del model
        if device.type == "cuda":  # the ranks start with the same free memory: a step too large fails on each alike
            torch.cuda.empty_cache()
    dist.barrier()
    # the sequence length is the run's, whatever run saved the weights (they do not depend on it)
    config = transformers.AutoConfig.from_pretrained(path, max_position_embeddings=max(args.seq_len, 64))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=DTYPES[args.dtype],
        distributed_config=DistributedConfig(tp_size=dist.get_world_size()), attn_implementation="sdpa")
    model.train()
    return model


def set_variant(model, variant: str) -> None:
    """Patch or unpatch ``model`` for ``variant`` (the patch was verified once, by :func:`run`)."""
    from hf_fused import apply_fused_loss, remove_fused_loss

    if variant == "transformers":
        remove_fused_loss(model)
    else:
        apply_fused_loss(model, backend="torch" if variant == "hf_fused-torch" else None, verify=False)


def ran_on_every_rank(step, device: torch.device) -> Optional[torch.Tensor]:
    """``step()``'s result, or ``None`` where it ran out of memory on this rank or another (a collective: the ranks
    agree, so that none goes on to collectives the others will not make)."""
    try:
        out = step()
    except RuntimeError as e:
        if not measure.is_oom(e):
            raise
        out = None
    failed = torch.tensor([out is None], dtype=torch.int32, device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    return None if failed.item() else out


def run(args, device: torch.device) -> list[dict]:
    """This rank's rows (a collective: every rank of the process group calls it), one per variant: ``ms``
    (median), ``tokens_per_s``, ``peak_gib`` (above the weights), ``total_gib`` (the allocator's peak; ``None`` on
    CPU), ``loss``, ``errors`` (the loss's and lm_head's gradient rows' relative error against ``transformers``;
    ``None`` for it); each ``None`` for a variant that ran out of memory (``oom``)."""
    from hf_fused import apply_fused_loss

    check_heads(args, dist.get_world_size())
    model = load_model(args, device)
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

    results, out_of_memory = {}, []

    def attempt(variant, fn):
        """``fn()`` on every rank, or None where it ran out of memory on one: the variant is then dropped (a step
        that fit once can still fail later, when another variant's buffers fragmented the allocator)."""
        set_variant(model, variant)
        model.zero_grad(set_to_none=True)
        out = ran_on_every_rank(fn, device)
        if out is None:
            out_of_memory.append(variant)
            results.pop(variant, None)
            model.zero_grad(set_to_none=True)
            measure.free_memory(device)
        return out

    for variant in variants:  # a warm-up step each (compiles), its loss and lm_head gradient kept
        loss = attempt(variant, step)
        if loss is not None:
            results[variant] = dict(loss=loss, grad=head_grad(), times=[])
    for _ in range(args.repeats):
        for variant in list(results):
            ms = attempt(variant, lambda: measure.time_once_ms(step, device))
            if ms is not None:
                results[variant]["times"].append(ms)
    peaks = {}  # variant -> (peak bytes above the weights, the allocator's whole peak in GiB), read after its step
    for variant in list(results):
        peak = attempt(variant, lambda: measure.peak_memory(step, device)[1])
        if peak is not None:
            peaks[variant] = (peak, measure.peak_gib(device))
    rows = []
    for variant in variants:
        if variant in out_of_memory:
            rows.append(dict(rank=dist.get_rank(), variant=variant, oom=True, ms=None, tokens_per_s=None,
                             peak_gib=None, total_gib=None, loss=None, errors=None))
            continue
        peak, total_gib = peaks[variant]
        errors = None
        if variant != "transformers" and "transformers" in results:
            ref = results["transformers"]
            errors = [measure.relative_error(results[variant][k], ref[k]) for k in ("loss", "grad")]
        ms = statistics.median(results[variant]["times"])
        rows.append(dict(rank=dist.get_rank(), variant=variant, oom=False, ms=ms,
                         tokens_per_s=args.batch * args.seq_len / ms * 1e3, peak_gib=peak / measure.GIB,
                         total_gib=total_gib, loss=results[variant]["loss"].item(), errors=errors))
    model.zero_grad(set_to_none=True)
    return rows


def table(rows: list[dict]) -> list[str]:
    def cell(value, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    body = [[str(r["rank"]), r["variant"], "out of memory" if r["oom"] else cell(r["ms"], ".1f"),
             cell(r["tokens_per_s"], ",.0f"), cell(r["peak_gib"], ".2f"), cell(r["total_gib"], ".2f"),
             cell(r["loss"], ".6f"), "-" if r["errors"] is None else " / ".join(f"{e:.1e}" for e in r["errors"])]
            for r in rows]
    return measure.text_table(["rank", "variant", "ms", "tokens/s", "peak GiB", "total GiB", "loss",
                               "error loss / dW rows"], body, align_left=2)


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    device, created = process_group()
    try:
        rows = run(args, device)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, rows)
        if dist.get_rank() == 0:
            print(f"{dist.get_world_size()} x {measure.device_name(device)}, torch {torch.__version__}: "
                  f"tensor parallelism over {dist.get_backend()}, {args.layers} layers of hidden {args.hidden} "
                  f"({args.heads} query / {kv_heads(args)} key-value heads of {args.head_dim}, MLP "
                  f"{args.intermediate}), {'untied' if args.untied else 'tied'} vocabulary {args.vocab}, "
                  f"{args.batch} x {args.seq_len} tokens, {args.dtype}, median of {args.repeats}; peak GiB above "
                  f"the weights, total GiB the allocator's peak", flush=True)
            print("\n".join(table([row for rank_rows in gathered for row in rank_rows])), flush=True)
        dist.barrier()
    finally:
        if created:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
