"""TRL's SFT script (``trl/scripts/sft.py`` of TRL 1.16) with hf_fused's loss: the one added line is
``apply_fused_loss(trainer.model)``, after which every fused-head call of ``SFTTrainer`` (its loss, entropy
and token accuracy) is computed from the hidden states and lm_head tile by tile, never as
``[tokens, vocab]`` logits. Launch it under any engine with the configs beside it:

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
* ``--tiny``: offline, no Hub: a 2-layer Llama built from a config, a word-level tokenizer and a dataset of
  fixed-length lines of Python's own documentation (``pydoc_data.topics``), all written to
  ``<output_dir>/tiny-model`` before training (so that directory holds the initial weights); any
  ``--model_name_or_path`` / ``--dataset_name`` is ignored.

Run from the repository root (the DeepSpeed configs name their JSON files relative to it). Besides TRL's
``save_model`` the script writes ``trainer_state.json`` (every logged step) to ``--output_dir``.
"""

import os
from dataclasses import dataclass, field

#: ``--tiny``: lines of this many words (each word one token, unknown words ``[UNK]``), so that every
#: sample has the same length and no rank pads differently from a single process.
TINY_WORDS_PER_LINE = 15
TINY_LINES = 512
TINY_VOCAB = 256


@dataclass
class FusedArguments:
    fused_loss: bool = field(
        default=True,
        metadata={"help": "Compute SFTTrainer's losses with hf_fused (--no_fused_loss: TRL's own head)."},
    )
    tiny: bool = field(
        default=False,
        metadata={"help": "Offline: a tiny model, tokenizer and dataset built locally (ignores "
                          "--model_name_or_path and --dataset_name)."},
    )


def build_tiny(directory: str):
    """Write a 2-layer Llama (seeded initial weights) and a word-level tokenizer to ``directory``, and return
    a ``DatasetDict`` with a ``train`` split of fixed-length text lines from ``pydoc_data.topics``."""
    import pydoc_data.topics
    import torch
    import transformers
    from datasets import Dataset, DatasetDict
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    specials = ["[PAD]", "[EOS]", "[UNK]"]
    splitter = pre_tokenizers.Whitespace()
    words = [w for key in sorted(pydoc_data.topics.topics)
             for w, _ in splitter.pre_tokenize_str(pydoc_data.topics.topics[key])]
    n = TINY_WORDS_PER_LINE
    lines = [" ".join(words[i:i + n]) for i in range(0, n * TINY_LINES, n)]
    if not os.path.exists(os.path.join(directory, "config.json")):
        tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
        tok.pre_tokenizer = splitter
        tok.train_from_iterator(lines, trainers.WordLevelTrainer(vocab_size=TINY_VOCAB, special_tokens=specials))
        tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]",
                                                          eos_token="[EOS]", unk_token="[UNK]")
        config = transformers.LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        )
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    return DatasetDict(train=Dataset.from_dict({"text": lines}))


def main(script_args, training_args, model_args, dataset_args, fused_args):
    import transformers
    from accelerate.logging import get_logger
    from datasets import load_dataset
    from packaging.version import Version

    from hf_fused import apply_fused_loss
    from trl import SFTTrainer, get_dataset, get_peft_config, get_quantization_config

    logger = get_logger(__name__)

    model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    if training_args.model_init_kwargs is not None:
        model_init_kwargs.update(training_args.model_init_kwargs)
    training_args.model_init_kwargs = model_init_kwargs

    # Load the dataset
    if fused_args.tiny:
        model_args.model_name_or_path = os.path.join(training_args.output_dir, "tiny-model")
        # The main process writes the model; the others then find it (same seed, same files either way).
        with training_args.main_process_first(desc="tiny model"):
            dataset = build_tiny(model_args.model_name_or_path)
    elif dataset_args.datasets and script_args.dataset_name:
        logger.warning(
            "Both `datasets` and `dataset_name` are provided. The `datasets` argument will be used to load the "
            "dataset and `dataset_name` will be ignored."
        )
        dataset = get_dataset(dataset_args)
    elif dataset_args.datasets and not script_args.dataset_name:
        dataset = get_dataset(dataset_args)
    elif not dataset_args.datasets and script_args.dataset_name:
        dataset = load_dataset(
            script_args.dataset_name, name=script_args.dataset_config, streaming=script_args.dataset_streaming
        )
    else:
        raise ValueError("Either `datasets` or `dataset_name` must be provided.")

    # Initialize the SFT trainer
    trainer = SFTTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    # hf_fused: the trainer's fused-head calls (loss, entropy, token accuracy) come from hf_fused's ops.
    # After the trainer is built because TRL's script hands it a model name; under ZeRO-3 the model is
    # already partitioned here, and the engine wraps it later in train().
    if fused_args.fused_loss:
        apply_fused_loss(trainer.model)

    # Train the model
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)

    # Log training complete
    trainer.accelerator.print("✅ Training completed.")

    # Save and push to Hub
    trainer.save_model(training_args.output_dir)
    trainer.save_state()  # trainer_state.json: the log history of every step
    trainer.accelerator.print(f"💾 Model saved to {training_args.output_dir}.")

    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
        trainer.accelerator.print(f"🤗 Model pushed to the Hub in https://huggingface.co/{trainer.hub_model_id}.")

    # Finish the trackers and destroy the process group
    if Version(transformers.__version__) >= Version("5.18.0"):
        trainer.end()


def make_parser(prog: str | None = None):
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, SFTConfig, TrlParser

    dataclass_types = (ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig, FusedArguments)
    return TrlParser(dataclass_types, prog=prog)


if __name__ == "__main__":
    parser = make_parser()
    script_args, training_args, model_args, dataset_args, fused_args = parser.parse_args_and_config(
        fail_with_unknown_args=False
    )
    main(script_args, training_args, model_args, dataset_args, fused_args)
