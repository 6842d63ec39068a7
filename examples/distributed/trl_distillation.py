"""TRL's distillation script (``trl/scripts/distillation.py`` of TRL 1.16) with hf_fused's loss: the student that
``DistillationTrainer`` would load from ``--model_name_or_path`` is loaded here the same way and passed through
``apply_fused_loss`` before the trainer sees it, after which the trainer's divergence between the student and the
teacher (``_chunked_divergence_loss``: forward KL, reverse KL or the generalized JSD by ``--beta``) is computed by
``hf_fused.linear_distillation_loss`` in one pass from both models' hidden states and lm_heads; the teacher is
loaded and prepared by TRL as in its script. Launch it under any engine with the configs beside it:

```bash
accelerate launch --config_file examples/distributed/zero3.yaml examples/distributed/trl_distillation.py \\
    --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
    --teacher_model_name_or_path Qwen/Qwen2.5-1.5B-Instruct \\
    --dataset_name trl-lib/ultrafeedback-prompt \\
    --learning_rate 2.0e-5 \\
    --output_dir Qwen2.5-0.5B-Distillation
```

(`fsdp2.yaml`, `fsdp1.yaml`, `ddp.yaml` the same way; `--use_peft --lora_target_modules q_proj v_proj lm_head` trains
a LoRA adapter on the student's lm_head too, which TRL's own kernel refuses.) Every option of TRL's script is accepted
(``ScriptArguments``, ``DistillationConfig``, ``ModelConfig``, ``DatasetMixtureConfig``), plus three:

* ``--no_fused_loss``: run TRL's stock trainer and kernel (the unpatched reference for the same command).
* ``--prepare_teacher_fsdp``: under FSDP, prepare the teacher with TRL's ``prepare_fsdp`` where TRL 1.16 leaves it
  unprepared (huggingface/trl#2580: on the CPU of a GPU rank, where its forward fails; the fix of trl#6573). With
  ``apply_fused_loss`` hf_fused does this itself; the flag gives the stock run (``--no_fused_loss``) the same teacher.
  (Under FSDP1 with ``use_orig_params`` TRL's kernel then fails on the teacher's lm_head, a piece of the flat
  parameter outside its forward; hf_fused gathers it.)
* ``--tiny``: offline, no Hub (``tiny.py``): the 2-layer Llama student (hidden 32) and word-level tokenizer of the
  other scripts written to ``<output_dir>/tiny-model``, a wider teacher (hidden 48, same vocabulary) to
  ``<output_dir>/tiny-teacher``, and 256 prompts of 6 words of Python's own documentation; any
  ``--model_name_or_path``, ``--teacher_model_name_or_path`` or ``--dataset_name`` is ignored.

Run from the repository root (the DeepSpeed configs name their JSON files relative to it). Besides TRL's
``save_model`` the script writes ``trainer_state.json`` (every logged step) to ``--output_dir``.
"""

import os
from dataclasses import dataclass, field

from tiny import FusedArguments

#: ``--tiny``'s teacher: the student's architecture and vocabulary, wider (the divergence needs only the vocabulary).
TINY_TEACHER_HIDDEN = 48


@dataclass
class DistillationArguments(FusedArguments):
    prepare_teacher_fsdp: bool = field(
        default=False,
        metadata={"help": "Under FSDP, prepare the teacher with TRL's prepare_fsdp where TRL 1.16 leaves it unprepared "
                          "(huggingface/trl#2580: it stays on the CPU of a GPU rank and its forward fails there; the "
                          "fix of trl#6573). hf_fused does this itself for a patched student; this gives the stock run "
                          "(--no_fused_loss) the same teacher."},
    )


def prepare_teacher_fsdp(trainer) -> None:
    """What trl#6573 adds to the distillation trainers' ``__init__``: under FSDP, a teacher that TRL left unwrapped
    prepared with ``trl.models.prepare_fsdp`` (TRL's own function, as for DPO's reference model)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from trl.models import prepare_fsdp

    if trainer.is_fsdp_enabled and not isinstance(trainer.teacher_model, (FullyShardedDataParallel, FSDPModule)):
        trainer.teacher_model = prepare_fsdp(trainer.teacher_model, trainer.accelerator)


def write_tiny_teacher(directory: str, student_directory: str) -> None:
    """Save a teacher for ``--tiny``'s student (in ``student_directory``) to ``directory``: its config with hidden
    size ``TINY_TEACHER_HIDDEN``, seeded weights, its tokenizer (nothing if ``directory`` already holds a model)."""
    if os.path.exists(os.path.join(directory, "config.json")):
        return
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(student_directory)
    config.hidden_size, config.intermediate_size = TINY_TEACHER_HIDDEN, 2 * TINY_TEACHER_HIDDEN
    torch.manual_seed(1)
    # the class's own constructor, as tiny.write_model builds the student: from_config would build it partitioned
    # under a ZeRO-3 launch (a collective, while the other ranks wait for this one to write it)
    teacher = getattr(transformers, config.architectures[0])(config)
    with torch.no_grad():  # a peaked teacher distribution, as a trained one is
        teacher.get_output_embeddings().weight.mul_(8.0)
    teacher.save_pretrained(directory)
    transformers.AutoTokenizer.from_pretrained(student_directory).save_pretrained(directory)


def main(script_args, training_args, model_args, dataset_args, fused_args):
    import tiny
    from trl import DistillationTrainer

    # What TRL's script does for the teacher (the student's model_init_kwargs: tiny.model_kwargs_and_dataset)
    teacher_model_init_kwargs = dict(
        revision=training_args.teacher_model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    if training_args.teacher_model_init_kwargs is not None:
        teacher_model_init_kwargs.update(training_args.teacher_model_init_kwargs)
    training_args.teacher_model_init_kwargs = teacher_model_init_kwargs

    dataset = tiny.model_kwargs_and_dataset(script_args, training_args, model_args, dataset_args, fused_args,
                                            {"prompt": tiny.lines(256, 6)})
    if fused_args.tiny:
        training_args.teacher_model_name_or_path = os.path.join(training_args.output_dir, "tiny-teacher")
        with training_args.main_process_first(desc="tiny teacher"):
            write_tiny_teacher(training_args.teacher_model_name_or_path, model_args.model_name_or_path)
    if training_args.teacher_model_name_or_path is None:
        raise ValueError(
            "A teacher model is required for distillation training. Set it with `--teacher_model_name_or_path`."
        )

    # hf_fused: the student DistillationTrainer would load from the name, patched before the trainer sees it
    # (tiny.py); TRL loads and prepares the teacher from its name, as in its script
    trainer = tiny.patched_trainer(DistillationTrainer, dataset, script_args, training_args, model_args, fused_args,
                                   teacher_model=training_args.teacher_model_name_or_path)
    if fused_args.prepare_teacher_fsdp:
        prepare_teacher_fsdp(trainer)
    tiny.train_and_save(trainer, training_args, script_args)


if __name__ == "__main__":
    import tiny
    from trl import DistillationConfig, ScriptArguments

    tiny.run(main, ScriptArguments, DistillationConfig, DistillationArguments)
