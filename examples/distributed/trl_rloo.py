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
    from trl import RLOOTrainer
    from trl_grpo import prompts_and_rewards

    dataset, reward_funcs = prompts_and_rewards(script_args, training_args, model_args, dataset_args, fused_args)
    # hf_fused: the policy RLOOTrainer would load from the name, patched before the trainer sees it (tiny.py)
    trainer = tiny.patched_trainer(RLOOTrainer, dataset, script_args, training_args, model_args, fused_args,
                                   reward_funcs=reward_funcs)
    tiny.train_and_save(trainer, training_args, script_args)


if __name__ == "__main__":
    import tiny
    from trl import RLOOConfig

    tiny.run(main, RLOOScriptArguments, RLOOConfig)
