"""TRL's DPO script (``trl/scripts/dpo.py`` of TRL 1.16) with hf_fused's loss: the policy that ``DPOTrainer``
would load from ``--model_name_or_path`` is loaded here the same way and passed through ``apply_fused_loss``
before the trainer sees it, after which the policy's fused-head calls of ``DPOTrainer`` (the chosen and rejected
log-probabilities, and the mean logits it logs) are computed from the hidden states and lm_head tile by tile,
never as ``[tokens, vocab]`` logits. The reference model ``DPOTrainer`` builds from the same name is patched
alongside (docs/trl.md), and under ``--use_peft`` the reference is the patched policy with its adapter disabled.
Launch it under any engine with the configs beside it:

```bash
accelerate launch --config_file examples/distributed/zero3.yaml examples/distributed/trl_dpo.py \\
    --model_name_or_path Qwen/Qwen2-0.5B-Instruct \\
    --dataset_name trl-lib/ultrafeedback_binarized \\
    --learning_rate 5.0e-7 \\
    --per_device_train_batch_size 2 \\
    --gradient_accumulation_steps 8 \\
    --output_dir Qwen2-0.5B-DPO
```

Every option of TRL's script is accepted (``ScriptArguments``, ``DPOConfig``, ``ModelConfig``,
``DatasetMixtureConfig``), plus ``--no_fused_loss`` (TRL's stock head: the reference for the same command) and
``--tiny`` (offline, no Hub, ``tiny.py``: the 2-layer Llama and word-level tokenizer written to
``<output_dir>/tiny-model``, and 256 preference rows from Python's documentation, each a 6-word prompt, its next
10 words as chosen and the next line's as rejected; any ``--model_name_or_path`` / ``--dataset_name`` is ignored).

Run from the repository root (the DeepSpeed configs name their JSON files relative to it). Besides TRL's
``save_model`` the script writes ``trainer_state.json`` (every logged step) to ``--output_dir``.
"""


def main(script_args, training_args, model_args, dataset_args, fused_args):
    import torch

    import tiny
    from trl import DPOTrainer

    dataset = tiny.model_kwargs_and_dataset(script_args, training_args, model_args, dataset_args, fused_args,
                                            tiny.preference_rows(256, 6, 10))
    # hf_fused: the policy DPOTrainer would load from the name, patched before the trainer sees it (tiny.py)
    trainer = tiny.patched_trainer(DPOTrainer, dataset, script_args, training_args, model_args, fused_args)

    if script_args.ignore_bias_buffers:
        # torch distributed hack (TRL's script)
        trainer.model._ddp_params_and_buffers_to_ignore = [
            name for name, buffer in trainer.model.named_buffers() if buffer.dtype == torch.bool
        ]

    tiny.train_and_save(trainer, training_args, script_args)


if __name__ == "__main__":
    import tiny
    from trl import DPOConfig, ScriptArguments

    tiny.run(main, ScriptArguments, DPOConfig)
