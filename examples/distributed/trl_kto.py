"""TRL's KTO script (``trl/scripts/kto.py`` of TRL 1.16) with hf_fused's loss: the policy that ``KTOTrainer``
would load from ``--model_name_or_path`` is loaded here the same way and passed through ``apply_fused_loss``
before the trainer sees it, after which the policy's fused-head calls of ``KTOTrainer`` (the completions'
log-probabilities, those of the mismatched pairs it estimates the KL term from, and the mean logits it logs) are
computed from the hidden states and lm_head tile by tile, never as ``[tokens, vocab]`` logits; the reference model
``KTOTrainer`` builds is patched alongside (docs/trl.md). Launch it under any engine with the configs beside it:

```bash
accelerate launch --config_file examples/distributed/zero3.yaml examples/distributed/trl_kto.py \\
    --model_name_or_path Qwen/Qwen2-0.5B-Instruct \\
    --dataset_name trl-lib/kto-mix-14k \\
    --learning_rate 5.0e-7 \\
    --per_device_train_batch_size 4 \\
    --gradient_accumulation_steps 4 \\
    --output_dir Qwen2-0.5B-KTO
```

Every option of TRL's script is accepted (``ScriptArguments``, ``KTOConfig``, ``ModelConfig``,
``DatasetMixtureConfig``), plus ``--no_fused_loss`` (TRL's stock head: the reference for the same command) and
``--tiny`` (offline, no Hub, ``tiny.py``: the 2-layer Llama and word-level tokenizer written to
``<output_dir>/tiny-model``, and 512 unpaired rows from Python's documentation, a 6-word prompt with its next 10
words labelled desirable or the next line's labelled undesirable; any ``--model_name_or_path`` /
``--dataset_name`` is ignored).

Run from the repository root (the DeepSpeed configs name their JSON files relative to it). Besides TRL's
``save_model`` the script writes ``trainer_state.json`` (every logged step) to ``--output_dir``.
"""


def main(script_args, training_args, model_args, dataset_args, fused_args):
    import tiny
    from trl import KTOTrainer

    dataset = tiny.model_kwargs_and_dataset(script_args, training_args, model_args, dataset_args, fused_args,
                                            tiny.unpaired_rows(256, 6, 10))
    # hf_fused: the policy KTOTrainer would load from the name, patched before the trainer sees it (tiny.py)
    trainer = tiny.patched_trainer(KTOTrainer, dataset, script_args, training_args, model_args, fused_args)
    tiny.train_and_save(trainer, training_args, script_args)


if __name__ == "__main__":
    import tiny
    from trl import KTOConfig, ScriptArguments

    tiny.run(main, ScriptArguments, KTOConfig)
