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

(`fsdp2.yaml`, `ddp.yaml` the same way; `--use_peft --lora_target_modules q_proj v_proj lm_head` trains a LoRA
adapter on the student's lm_head too, which TRL's own kernel refuses.) Every option of TRL's script is accepted
(``ScriptArguments``, ``DistillationConfig``, ``ModelConfig``, ``DatasetMixtureConfig``), plus two:

* ``--no_fused_loss``: run TRL's stock trainer and kernel (the unpatched reference for the same command).
* ``--tiny``: offline, no Hub (``tiny.py``): the 2-layer Llama student (hidden 32) and word-level tokenizer of the
  other scripts written to ``<output_dir>/tiny-model``, a wider teacher (hidden 48, same vocabulary) to
  ``<output_dir>/tiny-teacher``, and 256 prompts of 6 words of Python's own documentation; any
  ``--model_name_or_path``, ``--teacher_model_name_or_path`` or ``--dataset_name`` is ignored.

Run from the repository root (the DeepSpeed configs name their JSON files relative to it). Besides TRL's
``save_model`` the script writes ``trainer_state.json`` (every logged step) to ``--output_dir``.
"""

import os

#: ``--tiny``'s teacher: the student's architecture and vocabulary, wider (the divergence needs only the vocabulary).
TINY_TEACHER_HIDDEN = 48


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
    tiny.train_and_save(trainer, training_args, script_args)


if __name__ == "__main__":
    import tiny
    from trl import DistillationConfig, ScriptArguments

    tiny.run(main, ScriptArguments, DistillationConfig)
