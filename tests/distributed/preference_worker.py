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
import sys
from pathlib import Path

import torch
import transformers

from models import make_tokenizer, preference_dataset
from ranks import exit_rank, run_each
from train_worker import count_fused_head_calls, full_parameters

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
    model = transformers.AutoModelForCausalLM.from_pretrained(case["model_dir"], attn_implementation="eager",
                                                              dtype=torch.float32)
    lm_head_numel = model.get_output_embeddings().weight.numel()
    initial = full_parameters(model)
    if case["patch"]:
        from hf_fused import apply_fused_loss

        apply_fused_loss(model)
    trainer = getattr(module, f"{prefix}Trainer")(model=model, args=args, train_dataset=preference_dataset(),
                                                 processing_class=make_tokenizer())
    fused_calls = count_fused_head_calls()
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    params = full_parameters(trainer.model)
    if trainer.accelerator.is_main_process:
        torch.save({"losses": [entry["loss"] for entry in logs], "logs": logs, "fused_calls": dict(fused_calls),
                    "params": params, "initial": initial, "lm_head_numel": lm_head_numel,
                    "world": trainer.accelerator.num_processes, "wrapper": type(trainer.model_wrapped).__name__},
                   out)
    trainer.accelerator.wait_for_everyone()


def main(batch_file: str) -> None:
    torch.set_num_threads(1)
    run_each(batch_file, lambda case, directory: train(case, Path(directory) / "result.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
    exit_rank()
