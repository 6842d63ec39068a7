"""GRPO runs for tests/distributed/test_grpo_engines.py: ``trl.GRPOTrainer`` or ``hf_fused.FusedGRPOTrainer``
on the tiny model and scripted rollouts of tests/grpo_harness.py (TRL's ``rollout_func``: no sampling, the
same completions for both trainers), a few optimizer steps, under whatever ``accelerate launch`` set up.

Argument: a JSON file listing the runs of this launch, ``[{"case": {"trainer", "model_dir", "steps"}, "dir"}, ...]``,
run one after the other (a run that raised writes its traceback to ``<dir>/error.txt``, and the next one runs).
Rank 0 writes ``torch.save({"losses", "logs", "fused_calls", "params", "initial", "world", "lm_head_numel"})`` to
``<dir>/result.pt``: as in train_worker.py, plus every logged metric per step and the count of hf_fused head
computations. SGD at a constant learning rate, β = 0 (no reference model), on-policy: the update is −lr·gradient.
"""

from __future__ import annotations

from pathlib import Path

import grpo_harness
from train_worker import count_fused_head_calls, load_tiny_model, run_trl_worker, save_trl_run


def train(case: dict, out: Path) -> None:
    overrides = dict(max_steps=case.get("steps", 2), per_device_train_batch_size=4, num_generations=4,
                     optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, beta=0.0)
    # GRPOConfig first: under ZeRO-3 it activates DeepSpeed's config, so from_pretrained builds the model
    # partitioned (deepspeed.zero.Init), as it would for a user.
    # (Kept referenced: transformers holds DeepSpeed's config through a weak reference to it.)
    args = grpo_harness.grpo_config(out.parent, **overrides)  # noqa: F841
    model, lm_head_numel, initial = load_tiny_model(case["model_dir"])
    if case["trainer"] == "FusedGRPOTrainer":
        from hf_fused import FusedGRPOTrainer as trainer_cls
    else:
        from trl import GRPOTrainer as trainer_cls
    trainer = grpo_harness.build_trainer(trainer_cls, grpo_harness.Case(config=overrides), out.parent, model=model)
    fused_calls = count_fused_head_calls()
    trainer.train()
    save_trl_run(trainer, out, initial, lm_head_numel, fused_calls)


if __name__ == "__main__":
    run_trl_worker(train)
