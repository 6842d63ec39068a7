"""TRL's SFT script (``trl/scripts/sft.py`` of TRL 1.16) with hf_fused's loss: the model that ``SFTTrainer``
would load from ``--model_name_or_path`` is loaded here the same way and passed through ``apply_fused_loss``
before the trainer sees it, after which every fused-head call of ``SFTTrainer`` (its loss, entropy and token
accuracy) is computed from the hidden states and lm_head tile by tile, never as ``[tokens, vocab]`` logits.
(Patching first, not ``apply_fused_loss(trainer.model)`` after, is what lets a LoRA adapter on lm_head pass
TRL's check.) Launch it under any engine with the configs beside it:

```bash
accelerate launch --config_file examples/distributed/zero3.yaml examples/distributed/trl_sft.py \\
    --model_name_or_path Qwen/Qwen3-0.6B \\
    --dataset_name trl-lib/Capybara \\
    --learning_rate 2.0e-5 \\
    --per_device_train_batch_size 2 \\
    --gradient_accumulation_steps 8 \\
    --output_dir Qwen3-0.6B-SFT
```

(`zero2.yaml`, `fsdp2.yaml`, `ddp.yaml` the same way; `--use_peft --lora_target_modules q_proj v_proj lm_head`
trains a LoRA adapter on lm_head too, which TRL's own head refuses.) Every option of TRL's script is
accepted (``ScriptArguments``, ``SFTConfig``, ``ModelConfig``, ``DatasetMixtureConfig``), plus two:

* ``--no_fused_loss``: run TRL's stock head instead (the unpatched reference for the same command).
* ``--tiny``: offline, no Hub (``tiny.py``): a 2-layer Llama built from a config and a word-level tokenizer,
  written to ``<output_dir>/tiny-model`` before training (so that directory holds the initial weights), and
  a dataset of 512 lines of 15 words of Python's own documentation (``pydoc_data.topics``); any
  ``--model_name_or_path`` / ``--dataset_name`` is ignored.

Run from the repository root (the DeepSpeed configs name their JSON files relative to it). Besides TRL's
``save_model`` the script writes ``trainer_state.json`` (every logged step) to ``--output_dir``.
"""


def main(script_args, training_args, model_args, dataset_args, fused_args):
    import tiny
    from trl import SFTTrainer

    dataset = tiny.model_kwargs_and_dataset(script_args, training_args, model_args, dataset_args, fused_args,
                                            {"text": tiny.lines(512, 15)})
    # hf_fused: the model SFTTrainer would load from the name, patched before the trainer sees it (tiny.py)
    trainer = tiny.patched_trainer(SFTTrainer, dataset, script_args, training_args, model_args, fused_args)
    tiny.train_and_save(trainer, training_args, script_args)


if __name__ == "__main__":
    import tiny
    from trl import SFTConfig, ScriptArguments

    tiny.run(main, ScriptArguments, SFTConfig)
