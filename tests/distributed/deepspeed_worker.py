"""One rank of tests/distributed/test_deepspeed_engine.py: DeepSpeed's own API, no Trainer.

``deepspeed.initialize`` partitions a tiny Llama under ZeRO-3 (or ZeRO-2), then ``apply_fused_loss`` is
applied to the *engine* (the patch finds the model inside it; its probe runs through DeepSpeed's hooks),
and the engine trains ``STEPS`` SGD steps, each rank on its own batch. Every rank also trains an unpatched
copy without DeepSpeed on the concatenation of all ranks' batches (the mean of the per-rank mean losses,
which is what the engine's averaged gradients follow). Rank 0 writes the losses and the relative error of
every parameter after training, ``‖θ − θ_ref‖ / ‖θ_ref − θ_0‖``, to ``<dir>/result.json``.

The JSON file named on the command line lists the runs of this launch, ``[{"case": {"stage"}, "dir"}, ...]``, run
one after the other (a run that raised writes its traceback to ``<dir>/error.txt``, and the next one runs).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback

import deepspeed
import torch
import torch.distributed as dist

from hf_fused import apply_fused_loss, is_fused
from models import make_batch, make_model
from ranks import CUDA, exit_rank, rank_device

STEPS = 3
LR = 0.5


def train(device, out_path: str, stage: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model("llama", tie_word_embeddings=False).to(device)
    reference = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    # gradient_clipping 0: DeepSpeed clips at 1.0 unless told (SGD's update must stay −lr·gradient).
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": stage}}
    if stage == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # lm_head of a tiny model too
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                      config=config)
    apply_fused_loss(engine)
    assert is_fused(engine)
    lm_head_numel = engine.module.lm_head.weight.numel()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)

    losses, ref_losses = [], []
    for step in range(STEPS):
        batches = [tuple(t.to(device) for t in make_batch(seed=100 * step + r)) for r in range(world)]
        ids, mask, labels = batches[rank]
        loss = engine(input_ids=ids, attention_mask=mask, labels=labels).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        ref_optimizer.zero_grad()
        ref_loss = sum(reference(input_ids=i, attention_mask=m, labels=y).loss for i, m, y in batches) / world
        ref_loss.backward()
        ref_optimizer.step()
        ref_losses.append(float(ref_loss))

    errors = {}
    ref_params = dict(reference.named_parameters())
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_status")):
            got = p.detach().clone()
        update = (ref_params[name].detach() - initial[name]).norm()
        errors[name] = float((got - ref_params[name].detach()).norm() / update)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"losses": losses, "ref_losses": ref_losses, "errors": errors, "world": world,
                       "lm_head_numel": lm_head_numel}, f)
    dist.barrier()


def main(batch_file: str) -> None:
    torch.set_num_threads(1)
    device = rank_device()
    deepspeed.init_distributed("nccl" if CUDA else "gloo")
    with open(batch_file) as f:
        runs = json.load(f)
    for entry in runs:
        try:
            train(device, os.path.join(entry["dir"], "result.json"), entry["case"]["stage"])
        except Exception:
            with open(os.path.join(entry["dir"], "error.txt"), "a") as f:
                f.write(f"rank {dist.get_rank()}:\n{traceback.format_exc()}\n")
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_rank()
