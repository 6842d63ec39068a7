"""TRL's GRPO script (``trl/scripts/grpo.py`` of TRL 1.16) on hf_fused: the one changed line is the trainer,
``FusedGRPOTrainer`` (a ``trl.GRPOTrainer`` whose per-token log-probabilities and entropies, and where TRL's
loss allows it the head's gradients, come from hf_fused's tiled ops; TRL's loss code is unchanged). Launch it
under any engine with the configs beside it:

```bash
accelerate launch --config_file examples/distributed/zero3.yaml examples/distributed/trl_grpo.py \\
    --model_name_or_path Qwen/Qwen2-0.5B-Instruct \\
    --dataset_name trl-lib/DeepMath-103K \\
    --reward_funcs accuracy_reward \\
    --per_device_train_batch_size 8 --num_generations 8 \\
    --output_dir Qwen2-0.5B-GRPO
```

Every option of TRL's script is accepted (``GRPOScriptArguments``, ``GRPOConfig``, ``ModelConfig``,
``DatasetMixtureConfig``), plus two:

* ``--no_fused_loss``: TRL's ``GRPOTrainer`` instead (the stock reference for the same command).
* ``--tiny``: offline, no Hub (``tiny.py``): a 2-layer Llama and a word-level tokenizer written to
  ``<output_dir>/tiny-model`` before training (so that directory holds the initial weights), 256 prompts of 6
  words of Python's documentation, and, unless ``--reward_funcs`` names some, the reward ``characters``
  below; any ``--model_name_or_path`` / ``--dataset_name`` is ignored.

Run from the repository root (the DeepSpeed configs name their JSON files relative to it). Besides TRL's
``save_model`` the script writes ``trainer_state.json`` (every logged step) to ``--output_dir``.
"""

import importlib
import os
import sys
from dataclasses import dataclass, field

from trl import ScriptArguments


@dataclass
class GRPOScriptArguments(ScriptArguments):
    """
    Script arguments for the GRPO training script.

    Args:
        reward_model_name_or_path (`str`, *optional*):
            Reward model id of a pretrained model hosted inside a model repo on huggingface.co or local path to a
            directory containing model weights saved using [`~transformers.PreTrainedModel.save_pretrained`].
        reward_funcs (`list[str]`, *optional*):
            Reward functions to use. Supported values are:
                - `"accuracy_reward"`
                - `"reasoning_accuracy_reward"`
                - `"think_format_reward"`
                - `"get_soft_overlong_punishment"` (used values are `max_completion_len=1280`, `soft_punish_cache=256`)
                - any dotted import path (e.g., `'my_lib.rewards.custom_reward'`).
    """

    reward_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Reward model id of a pretrained model hosted inside a model repo on huggingface.co or "
            "local path to a directory containing model weights saved using `PreTrainedModel.save_pretrained`."
        },
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions to use. Supported values are: `accuracy_reward`, `reasoning_accuracy_reward`, `think_format_reward`, "
            "`get_soft_overlong_punishment` (used values are `max_completion_len=1280`, `soft_punish_cache=256`), or "
            "any dotted import path (e.g., `'my_lib.rewards.custom_reward'`)."
        },
    )


def characters(completions, **kwargs):
    """``--tiny``'s reward: the length of each completion in characters (it varies within a group of
    generations, so the advantages are not all zero and the policy gets a gradient)."""
    return [float(len(completion)) for completion in completions]


def prompts_and_rewards(script_args, training_args, model_args, dataset_args, fused_args):
    """What TRL 1.16's GRPO and RLOO scripts do before building their trainer (the two scripts are the same
    but for the trainer): the reward functions ``--reward_funcs`` / ``--reward_model_name_or_path`` name
    (``--tiny``: :func:`characters` unless some are named) and the prompts. Returns ``(dataset, reward_funcs)``."""
    import tiny
    from trl.rewards import (
        accuracy_reward,
        get_soft_overlong_punishment,
        reasoning_accuracy_reward,
        think_format_reward,
    )

    reward_funcs_registry = {
        "accuracy_reward": accuracy_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
        "think_format_reward": think_format_reward,
        "get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256),
    }

    # Get the reward models and functions
    reward_funcs = []
    if script_args.reward_model_name_or_path:
        reward_funcs.append(script_args.reward_model_name_or_path)

    if script_args.reward_funcs:
        for func_name in script_args.reward_funcs:
            if func_name in reward_funcs_registry:
                reward_funcs.append(reward_funcs_registry[func_name])
            elif "." in func_name:
                module_path, func_name = func_name.rsplit(".", 1)
                sys.path.insert(0, os.getcwd())
                module = importlib.import_module(module_path)
                reward_func = getattr(module, func_name)
                reward_funcs.append(reward_func)
            else:
                raise ValueError(
                    f"Could not load reward function '{func_name}'. Expected one of "
                    f"{list(reward_funcs_registry.keys())} or a valid import path."
                )
    if fused_args.tiny and not reward_funcs:
        reward_funcs.append(characters)

    dataset = tiny.model_kwargs_and_dataset(script_args, training_args, model_args, dataset_args, fused_args,
                                            {"prompt": tiny.lines(256, 6)})
    return dataset, reward_funcs


def main(script_args, training_args, model_args, dataset_args, fused_args):
    import tiny
    from hf_fused import FusedGRPOTrainer
    from trl import GRPOTrainer, get_peft_config, get_quantization_config

    dataset, reward_funcs = prompts_and_rewards(script_args, training_args, model_args, dataset_args, fused_args)

    # Initialize the GRPO trainer (hf_fused: FusedGRPOTrainer in place of GRPOTrainer)
    trainer_cls = FusedGRPOTrainer if fused_args.fused_loss else GRPOTrainer
    trainer = trainer_cls(
        model=model_args.model_name_or_path,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )

    tiny.train_and_save(trainer, training_args, script_args)


if __name__ == "__main__":
    import tiny
    from trl import GRPOConfig

    tiny.run(main, GRPOScriptArguments, GRPOConfig)
