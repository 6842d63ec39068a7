"""What the TRL scripts here share: their two extra options (:class:`FusedArguments`), ``--tiny`` (an offline
model, tokenizer and text, with no Hub access), loading the model a TRL trainer would load from a name
(:func:`load_like_trl_trainer`), and the setup and ending steps of TRL 1.16's own scripts
(:func:`model_kwargs_and_dataset`, :func:`train_and_save`).

A 2-layer Llama built from a config with seeded initial weights and a word-level tokenizer learned from
Python's own documentation (``pydoc_data.topics``, shipped with CPython), saved with ``save_pretrained`` so
that TRL's trainers load them by path as they would a Hub model; and fixed-length lines of the same text.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

#: The tokenizer's vocabulary (3 special tokens and the most frequent words; the rest are ``[UNK]``).
VOCAB = 256


@dataclass
class FusedArguments:
    fused_loss: bool = field(
        default=True,
        metadata={"help": "Train with hf_fused's loss (--no_fused_loss: TRL's stock trainer and head, the reference "
                          "run of the same command)."},
    )
    tiny: bool = field(
        default=False,
        metadata={"help": "Offline: a tiny model, tokenizer and dataset built locally (ignores "
                          "--model_name_or_path and --dataset_name)."},
    )


def load_like_trl_trainer(model_id: str, training_args, quantization_config):
    """The model a TRL 1.16 trainer (``SFTTrainer``, ``DPOTrainer``) would load given ``model=model_id``, with the
    same helper and keyword arguments. Under ZeRO-3 (``zero3_init_flag``) it is built partitioned: the trainer's
    config already exists. ``training_args.model_init_kwargs`` is consumed here, as the trainer would."""
    from trl.trainer.utils import create_model_from_path

    kwargs = dict(training_args.model_init_kwargs or {})
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    if training_args.distributed_state.distributed_type in ["MULTI_GPU", "DEEPSPEED"]:
        kwargs["device_map"] = None  # distributed training requires device_map=None ("auto" fails)
    kwargs.setdefault("trust_remote_code", training_args.trust_remote_code)
    training_args.model_init_kwargs = None  # used: the trainer would warn that an instantiated model ignores them
    return create_model_from_path(model_id, **kwargs)


def _words() -> list[str]:
    import pydoc_data.topics
    from tokenizers import pre_tokenizers

    splitter = pre_tokenizers.Whitespace()
    topics = pydoc_data.topics.topics
    return [w for key in sorted(topics) for w, _ in splitter.pre_tokenize_str(topics[key])]


def lines(count: int, words_per_line: int) -> list[str]:
    """``count`` lines of ``words_per_line`` consecutive words of the documentation. Each word is one token
    (a known word or ``[UNK]``), so every line tokenizes to the same length: no rank pads its batch
    differently from a single process."""
    words = _words()
    return [" ".join(words[i:i + words_per_line]) for i in range(0, words_per_line * count, words_per_line)]


def write_model(directory: str) -> None:
    """Save the tiny model and its tokenizer to ``directory`` (nothing if it already holds a model)."""
    if os.path.exists(os.path.join(directory, "config.json")):
        return
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(lines(2048, 16),
                            trainers.WordLevelTrainer(vocab_size=VOCAB, special_tokens=["[PAD]", "[EOS]", "[UNK]"]))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]",
                                                      unk_token="[UNK]")
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def run(main, script_arguments, config, fused_arguments=FusedArguments) -> None:
    """Parse the command line as TRL 1.16's scripts do (``TrlParser`` over ``script_arguments``, the trainer's
    ``config`` class, ``ModelConfig``, ``DatasetMixtureConfig``) plus ``fused_arguments`` (:class:`FusedArguments`
    or a script's subclass of it), and call ``main`` with the five."""
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser

    parser = TrlParser((script_arguments, config, ModelConfig, DatasetMixtureConfig, fused_arguments))
    main(*parser.parse_args_and_config(fail_with_unknown_args=False))


def patched_trainer(trainer_cls, dataset, script_args, training_args, model_args, fused_args, **trainer_kwargs):
    """What TRL 1.16's SFT, DPO, KTO and RLOO scripts build, with hf_fused's one change: the model ``trainer_cls``
    would load from ``--model_name_or_path`` is loaded the same way (:func:`load_like_trl_trainer`) and passed
    through ``apply_fused_loss`` before the trainer sees it (unless ``--no_fused_loss``), so that every fused-head
    call of the trainer comes from hf_fused's ops, and a LoRA adapter on lm_head passes TRL's check (hf_fused trains
    it). ``trainer_kwargs``: the trainer's other arguments (RLOO's ``reward_funcs``)."""
    from hf_fused import apply_fused_loss
    from trl import get_peft_config, get_quantization_config

    quantization_config = get_quantization_config(model_args)
    model = model_args.model_name_or_path
    if fused_args.fused_loss:
        model = apply_fused_loss(load_like_trl_trainer(model, training_args, quantization_config))
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        # TRL 1.16 builds a reference model after its Accelerator, when the distributed type reads FSDP, which its
        # device_map=None rule omits: device_map="auto" then dispatches it over every GPU the rank sees, and FSDP
        # moves the weights under accelerate's hooks (tensors on two GPUs). The rule as under DDP.
        training_args.model_init_kwargs = {**(training_args.model_init_kwargs or {}), "device_map": None}
    return trainer_cls(
        model=model,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        quantization_config=quantization_config,
        peft_config=get_peft_config(model_args),
        **trainer_kwargs,
    )


def preference_rows(count: int, prompt_words: int, completion_words: int) -> dict[str, list[str]]:
    """``--tiny``'s preference data (DPO): ``count`` rows whose prompt is the first ``prompt_words`` words of a
    line, chosen the next ``completion_words`` of the same line, rejected those of the next line. Every row
    tokenizes to the same lengths."""
    rows = lines(count + 1, prompt_words + completion_words)
    split = [(r.split()[:prompt_words], r.split()[prompt_words:]) for r in rows]
    return {"prompt": [" ".join(p) for p, _ in split[:-1]], "chosen": [" ".join(c) for _, c in split[:-1]],
            "rejected": [" ".join(c) for _, c in split[1:]]}


def unpaired_rows(count: int, prompt_words: int, completion_words: int) -> dict[str, list[str]]:
    """``--tiny``'s unpaired preference data (KTO): each row of :func:`preference_rows` twice, its chosen
    completion labelled desirable and its rejected one undesirable."""
    rows = preference_rows(count, prompt_words, completion_words)
    return {"prompt": [p for p in rows["prompt"] for _ in (0, 1)],
            "completion": [c for pair in zip(rows["chosen"], rows["rejected"]) for c in pair],
            "label": [True, False] * count}


def model_kwargs_and_dataset(script_args, training_args, model_args, dataset_args, fused_args,
                             tiny_columns: dict[str, list[str]]):
    """What TRL 1.16's own scripts (``trl/scripts/sft.py``, ``dpo.py``, ``grpo.py``) do before building the
    trainer, shared by the example scripts: ``training_args.model_init_kwargs`` from the model arguments, and the
    dataset (with ``--tiny``: the local tiny model written to ``<output_dir>/tiny-model`` and ``tiny_columns`` as
    the train split). Returns the dataset."""
    from datasets import Dataset, DatasetDict, load_dataset
    from trl import get_dataset

    model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    if training_args.model_init_kwargs is not None:
        model_init_kwargs.update(training_args.model_init_kwargs)
    training_args.model_init_kwargs = model_init_kwargs

    if fused_args.tiny:
        model_args.model_name_or_path = os.path.join(training_args.output_dir, "tiny-model")
        # The main process writes the model; the others then find it (same seed, same files either way).
        with training_args.main_process_first(desc="tiny model"):
            write_model(model_args.model_name_or_path)
        return DatasetDict(train=Dataset.from_dict(tiny_columns))
    if dataset_args.datasets and script_args.dataset_name:
        from accelerate.logging import get_logger

        get_logger(__name__).warning(
            "Both `datasets` and `dataset_name` are provided. The `datasets` argument will be used to load the "
            "dataset and `dataset_name` will be ignored."
        )
        return get_dataset(dataset_args)
    if dataset_args.datasets:
        return get_dataset(dataset_args)
    if script_args.dataset_name:
        return load_dataset(
            script_args.dataset_name, name=script_args.dataset_config, streaming=script_args.dataset_streaming
        )
    raise ValueError("Either `datasets` or `dataset_name` must be provided.")


def train_and_save(trainer, training_args, script_args) -> None:
    """The end of TRL 1.16's scripts: train, save the model and ``trainer_state.json`` (every logged step), push
    if asked, and close the trackers (transformers ≥ 5.18)."""
    import transformers
    from packaging.version import Version

    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.accelerator.print("✅ Training completed.")
    trainer.save_model(training_args.output_dir)
    trainer.save_state()
    trainer.accelerator.print(f"💾 Model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
        trainer.accelerator.print(f"🤗 Model pushed to the Hub in https://huggingface.co/{trainer.hub_model_id}.")
    if Version(transformers.__version__) >= Version("5.18.0"):
        trainer.end()
