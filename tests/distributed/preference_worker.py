"""ORPO and CPO runs for tests/distributed/test_preference_engines.py: TRL's experimental ``ORPOTrainer`` or
``CPOTrainer`` on the tiny word model (patched by ``apply_fused_loss`` or not) and :func:`models.preference_dataset`,
a few optimizer steps, under whatever ``accelerate launch`` set up.

Argument: a JSON file listing the runs of this launch, ``[{"case": {"trainer", "patch", "model_dir", "steps"}, "dir"},
...]``, run one after the other (a run that raised writes its traceback to ``<dir>/error.txt``). Rank 0 writes
``torch.save({"losses", "logs", "fused_calls", "params", "initial", "world", "lm_head_numel", "wrapper"})`` to
``<dir>/result.pt``, as grpo_worker.py does. SGD at a constant learning rate: the update is −lr·gradient.
"""

from __future__ import annotations

import os
from pathlib import Path

from models import make_tokenizer, preference_dataset
from train_worker import count_fused_head_calls, load_tiny_model, run_trl_worker, save_trl_run

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def train(case: dict, out: Path) -> None:
    import importlib

    kind = case["trainer"]  # "orpo" or "cpo"
    module = importlib.import_module(f"trl.experimental.{kind}")
    prefix = kind.upper()
    # the config first: under ZeRO-3 it activates DeepSpeed's config, so from_pretrained builds the model partitioned
    args = getattr(module, f"{prefix}Config")(
        output_dir=str(out.parent / "out"), per_device_train_batch_size=2, max_steps=case.get("steps", 2),
        learning_rate=1e-2, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
        report_to=[], logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True, max_length=32, bf16=False,
        use_cpu=not case.get("cuda"), dataloader_num_workers=0)
    model, lm_head_numel, initial = load_tiny_model(case["model_dir"])
    if case["patch"]:
        from hf_fused import apply_fused_loss

        apply_fused_loss(model)
    trainer = getattr(module, f"{prefix}Trainer")(model=model, args=args, train_dataset=preference_dataset(),
                                                 processing_class=make_tokenizer())
    fused_calls = count_fused_head_calls()
    trainer.train()
    save_trl_run(trainer, out, initial, lm_head_numel, fused_calls)


if __name__ == "__main__":
    run_trl_worker(train)
