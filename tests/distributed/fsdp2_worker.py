"""One rank of tests/distributed/test_fsdp2_fully_shard.py (run by ``torch.distributed.run``: gloo on CPU, or NCCL on 2
GPUs, ranks.py), for every configuration listed in the JSON file named on the command line (``[{"case": {"arch",
"tied", "patch_before_sharding", "head_unit"}, "dir"}, ...]``), one after the other in one launch.

For each, builds the same tiny model twice: an unpatched reference on every rank, and a copy patched with
``apply_fused_loss`` and sharded with FSDP2 (``fully_shard`` per decoder layer and at the root, so the
lm_head weight is a sharded DTensor that FSDP2 all-gathers around lm_head's own call). Each rank feeds its
own batch; the reference sees the concatenation of all ranks' batches (FSDP2 averages gradients over
ranks, transformers' loss is a mean over each rank's tokens). Rank 0 writes the largest relative errors
of the loss and of every parameter gradient (full tensors) to ``<dir>/result.json`` (a configuration that raised
writes its traceback to ``<dir>/error.txt`` instead, and the next one runs).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from hf_fused import apply_fused_loss
from models import make_batch, make_model
from ranks import exit_rank, init_process_group
from references import rel_err


def compare(device, out_path: str, arch: str, tied: bool, patch_before_sharding: bool, head_unit: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = make_model(arch, tie_word_embeddings=tied).to(device)
    model = make_model(arch, tie_word_embeddings=tied).to(device)
    if patch_before_sharding:
        apply_fused_loss(model)
    for layer in model.model.layers:
        fully_shard(layer)
    if head_unit:  # lm_head its own FSDP2 unit: resharded after its call, as a layer is
        fully_shard(model.lm_head)
    fully_shard(model)
    if not patch_before_sharding:
        apply_fused_loss(model)  # the patch-time probe runs collectively through the sharded model

    batches = [tuple(t.to(device) for t in make_batch(seed=10 + r)) for r in range(world)]
    ids, attention_mask, labels = batches[rank]
    loss = model(input_ids=ids, attention_mask=attention_mask, labels=labels).loss
    loss.backward()
    # FSDP2 reduce-scatters the mean of the ranks' gradients: the reference is the mean of per-batch losses.
    ref_losses = [reference(input_ids=i, attention_mask=m, labels=y).loss for i, m, y in batches]
    (sum(ref_losses) / world).backward()

    errors = {"loss": rel_err(loss.detach(), ref_losses[rank].detach())}
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        errors[name] = rel_err(grad, ref_params[name].grad)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"errors": errors, "world": world, "lm_head_sharded": hasattr(model.lm_head.weight, "full_tensor")}, f)


def main(batch_file: str) -> None:
    device = init_process_group()
    torch.set_num_threads(1)
    with open(batch_file) as f:
        configurations = json.load(f)
    for entry in configurations:
        c = entry["case"]
        try:
            compare(device, os.path.join(entry["dir"], "result.json"), c["arch"], c["tied"], c["patch_before_sharding"],
                    c["head_unit"])
        except Exception:
            with open(os.path.join(entry["dir"], "error.txt"), "a") as f:
                f.write(f"rank {dist.get_rank()}:\n{traceback.format_exc()}\n")
        dist.barrier()
    # Both ranks past every collective before teardown: without this barrier a rank sometimes aborted in
    # gloo's teardown ("terminate called without an active exception", about 1 run in 10 on 2 cores).
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_rank()
