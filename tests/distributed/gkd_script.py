"""A GKD training script in the shape of TRL's scripts (TRL 1.16 ships none for its experimental ``GKDTrainer``), for
tests/distributed/test_distillation_engines.py: the student ``GKDTrainer`` would load from ``--model_name_or_path``
loaded the same way and passed through ``apply_fused_loss`` (unless ``--no_fused_loss``), the teacher given by name
and loaded and prepared by TRL (``--prepare_teacher_fsdp`` as in examples/distributed/trl_distillation.py). Only
``--tiny`` (examples/distributed/tiny.py): the tiny student and tokenizer, the wider teacher of
examples/distributed/trl_distillation.py, and 256 two-turn conversations of the documentation's words joined by a
plain chat template.

    accelerate launch --config_file examples/distributed/<engine>.yaml tests/distributed/gkd_script.py --tiny ...

(with examples/distributed on ``PYTHONPATH``, as ``launch.worker_env`` sets it, for ``tiny``).
"""

import os

#: Joins the turns: GKD's collator tokenizes the conversation, and the prompt with the generation prompt, through it.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def conversations(count: int) -> list:
    """``count`` conversations: a user turn of 4 words and an assistant turn of 3, consecutive lines of the text."""
    import tiny

    lines = tiny.lines(count, 7)
    return [[{"role": "user", "content": " ".join(line.split()[:4])},
             {"role": "assistant", "content": " ".join(line.split()[4:])}] for line in lines]


def main(script_args, training_args, model_args, dataset_args, fused_args):
    import tiny
    import transformers
    from trl_distillation import prepare_teacher_fsdp, write_tiny_teacher
    from trl.experimental.gkd import GKDTrainer

    if not fused_args.tiny:
        raise ValueError("gkd_script.py runs with --tiny only")
    dataset = tiny.model_kwargs_and_dataset(script_args, training_args, model_args, dataset_args, fused_args,
                                            {"messages": conversations(256)})
    teacher = os.path.join(training_args.output_dir, "tiny-teacher")
    with training_args.main_process_first(desc="tiny teacher"):
        write_tiny_teacher(teacher, model_args.model_name_or_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    tokenizer.chat_template = CHAT_TEMPLATE
    model = tiny.load_like_trl_trainer(model_args.model_name_or_path, training_args, None)
    if fused_args.fused_loss:
        from hf_fused import apply_fused_loss

        apply_fused_loss(model)
    trainer = GKDTrainer(model=model, teacher_model=teacher, args=training_args,
                         train_dataset=dataset[script_args.dataset_train_split], processing_class=tokenizer)
    if fused_args.prepare_teacher_fsdp:
        prepare_teacher_fsdp(trainer)
    tiny.train_and_save(trainer, training_args, script_args)


if __name__ == "__main__":
    import tiny
    from trl import ScriptArguments
    from trl.experimental.gkd import GKDConfig

    from trl_distillation import DistillationArguments

    tiny.run(main, ScriptArguments, GKDConfig, DistillationArguments)
