"""TRL's RLOO script (``trl/scripts/rloo.py`` of TRL 1.16, which is its GRPO script with ``RLOOTrainer``) with
hf_fused's loss: the policy that ``RLOOTrainer`` would load from ``--model_name_or_path`` is loaded here the same
way and passed through ``apply_fused_loss`` before the trainer sees it, after which ``RLOOTrainer``'s fused-head
calls for the policy (the completions' log-probabilities and entropies) are computed from the hidden states and
lm_head tile by tile; TRL's loss code is unchanged. Launch it under any engine with the configs beside it:

```bash
accelerate launch --config_file examples/distributed/zero3.yaml examples/distributed/trl_rloo.py \\
    --model_name_or_path Qwen/Qwen2-0.5B-Instruct \\
    --dataset_name trl-lib/DeepMath-103K \\
    --reward_funcs accuracy_reward \\
    --per_device_train_batch_size 8 --num_generations 8 \\
    --output_dir Qwen2-0.5B-RLOO
```

Every option of TRL's script is accepted, plus ``--no_fused_loss`` (TRL's stock head: the reference for the same
command) and ``--tiny`` (offline, no Hub: as ``trl_grpo.py --tiny``). Run from the repository root (the DeepSpeed
configs name their JSON files relative to it). Besides TRL's ``save_model`` the script writes
``trainer_state.json`` (every logged step) to ``--output_dir``.
"""

from trl_grpo import GRPOScriptArguments as RLOOScriptArguments  # TRL's two dataclasses have the same fields


def main(script_args, training_args, model_args, dataset_args, fused_args):
    import tiny
    from hf_fused import apply_fused_loss
    from trl import RLOOTrainer, get_peft_config, get_quantization_config
    from trl_grpo import prompts_and_rewards

    dataset, reward_funcs = prompts_and_rewards(script_args, training_args, model_args, dataset_args, fused_args)

    # hf_fused: the policy RLOOTrainer would load from the name, patched before the trainer sees it
    quantization_config = get_quantization_config(model_args)
    model = model_args.model_name_or_path
    if fused_args.fused_loss:
        model = apply_fused_loss(tiny.load_like_trl_trainer(model, training_args, quantization_config))

    trainer = RLOOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        quantization_config=quantization_config,
        peft_config=get_peft_config(model_args),
    )

    tiny.train_and_save(trainer, training_args, script_args)


def make_parser(prog: str | None = None):
    from tiny import FusedArguments
    from trl import DatasetMixtureConfig, ModelConfig, RLOOConfig, TrlParser

    dataclass_types = (RLOOScriptArguments, RLOOConfig, ModelConfig, DatasetMixtureConfig, FusedArguments)
    return TrlParser(dataclass_types, prog=prog)


if __name__ == "__main__":
    parser = make_parser()
    script_args, training_args, model_args, dataset_args, fused_args = parser.parse_args_and_config(
        fail_with_unknown_args=False
    )
    main(script_args, training_args, model_args, dataset_args, fused_args)
