"""One rank of tests/distributed/test_pipeline.py: a tiny Llama split into 2 pipeline stages
(``torch.distributed.pipelining``, GPipe schedule, 2 microbatches, gloo on CPU or NCCL on 2 GPUs: ranks.py) whose loss function is
``hf_fused.LinearCrossEntropyLoss`` owning lm_head; compared with the unsplit, unpatched model.

Stage 0 (rank 0): embeddings and decoder layer 0. Stage 1 (rank 1): decoder layer 1 and the final norm,
returning hidden states; the schedule calls ``loss_fn(hidden, labels)`` per microbatch. ``loss_fn`` divides
each microbatch's token sum by the whole batch's token count (``num_items_in_batch``) and the schedule
does not rescale (``scale_grads=False``), so the microbatch losses add up to the full batch's mean loss
and their gradients to its gradient. Each rank compares the gradients of the parameters it owns with the
reference's; rank 0 writes every relative error (and the loss's) to the JSON file named on the command line.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from hf_fused import LinearCrossEntropyLoss
from models import make_batch, make_model
from ranks import exit_rank, init_process_group
from references import rel_err

MICROBATCHES = 2


class Stage(nn.Module):
    """Decoder layers ``[first, last)`` of ``model`` (with the embeddings on the first stage, the final norm
    on the last), called as the model's own forward calls them: sdpa attention, causal without a mask."""

    def __init__(self, model: nn.Module, first: int, last: int, is_first: bool, is_last: bool):
        super().__init__()
        self.embed_tokens = model.model.embed_tokens if is_first else None
        self.layers = nn.ModuleList(model.model.layers[first:last])
        self.rotary_emb = model.model.rotary_emb
        self.norm = model.model.norm if is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = torch.arange(hidden.shape[1], device=hidden.device)[None].expand(hidden.shape[0], -1)
        rotary = self.rotary_emb(hidden, positions)
        for layer in self.layers:
            hidden = layer(hidden, position_ids=positions, position_embeddings=rotary)
        return self.norm(hidden) if self.norm is not None else hidden


def main(out_path: str) -> None:
    device = init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2
    torch.set_num_threads(1)
    # sdpa: causal without an attention mask, so a stage needs none. Padding is on the right and its labels
    # are ignored, so the positions that count see the same keys as in the masked reference.
    model = make_model("llama", tie_word_embeddings=False, attn_implementation="sdpa").to(device)
    model.config._attn_implementation = "sdpa"
    reference = make_model("llama", tie_word_embeddings=False).to(device)
    ids, mask, labels = (t.to(device) for t in make_batch(batch=4, seed=5))
    tokens = int((F.pad(labels, (0, 1), value=-100)[:, 1:] != -100).sum())

    stage_module = Stage(model, 0, 1, True, False) if rank == 0 else Stage(model, 1, 2, False, True)
    loss_fn = LinearCrossEntropyLoss.from_model(model)
    stage = PipelineStage(stage_module, rank, world, device)
    schedule = ScheduleGPipe(stage, MICROBATCHES, loss_fn=lambda hidden, y: loss_fn(hidden, y, num_items_in_batch=tokens),
                             scale_grads=False)
    losses: list = []
    if rank == 0:
        schedule.step(ids)
    else:
        schedule.step(target=labels, losses=losses)

    ref_loss = reference(input_ids=ids, attention_mask=mask, labels=labels).loss
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    errors = {}
    owned = list(stage_module.named_parameters(prefix="model"))
    if rank == 1:
        owned += [("lm_head.weight", loss_fn.lm_head.weight)]
        errors["loss"] = rel_err(sum(losses).detach(), ref_loss.detach())
    names = {id(p): n for n, p in model.named_parameters()}
    for _, p in owned:
        name = names[id(p)]
        errors[name] = rel_err(p.grad, ref_grads[name]) if p.grad is not None else float("inf")
    gathered = [None, None]
    dist.all_gather_object(gathered, errors)
    if rank == 0:
        merged = {k: v for part in gathered for k, v in part.items()}
        with open(out_path, "w") as f:
            json.dump({"errors": merged, "parameters": len(ref_grads)}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_rank()
