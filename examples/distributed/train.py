"""Fine-tune a causal LM with hf_fused's fused loss on several GPUs, under whichever engine the accelerate
config picks (DeepSpeed ZeRO-2/3, FSDP2, DDP, tensor parallelism):

    accelerate launch --config_file examples/distributed/zero3.yaml examples/distributed/train.py \\
        --model Qwen/Qwen3-0.6B --text-file corpus.txt --seq-len 2048 --batch 4 --steps 100 --bf16

Run from the repository root (the DeepSpeed configs name their JSON files relative to it). The model is
loaded after the training arguments exist, so under ZeRO-3 ``from_pretrained`` builds it partitioned; the
``hf_fused.FusedTrainer`` then computes the loss from hidden states without ``[tokens, vocab]`` logits.
``--model tiny`` trains a 2-layer model from a config on random tokens: an offline smoke test.
Under a config with a ``parallelism_config`` tensor-parallel size (tp2.yaml, fsdp2_tp2.yaml) the model is loaded
sharded by transformers' tensor-parallel plan (``DistributedConfig``), which a saved model's path or Hub id needs.
"""

from __future__ import annotations

import argparse
import os

import torch
import transformers
from torch.utils.data import Dataset

from hf_fused import FusedTrainer


class TokenBlocks(Dataset):
    """Consecutive ``seq_len`` blocks of a token stream, each its own labels (plain causal-LM training)."""

    def __init__(self, ids: torch.Tensor, seq_len: int):
        usable = (ids.numel() // seq_len) * seq_len
        if usable == 0:
            raise ValueError(f"the text has {ids.numel()} tokens, fewer than one block of --seq-len {seq_len}")
        self.blocks = ids[:usable].view(-1, seq_len)

    def __len__(self):
        return self.blocks.shape[0]

    def __getitem__(self, i):
        block = self.blocks[i]
        return {"input_ids": block, "attention_mask": torch.ones_like(block), "labels": block.clone()}


def tiny_model() -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(config)


def tensor_parallel() -> dict:
    """``from_pretrained`` keywords for the accelerate config's tensor-parallel size (``accelerate launch`` exports
    a ``parallelism_config`` as ``PARALLELISM_CONFIG_*``): transformers shards the model over ``tp_size`` ranks (FSDP2
    over ``dp_shard_size``); none without one."""
    tp_size = int(os.environ.get("PARALLELISM_CONFIG_TP_SIZE", "1"))
    if tp_size == 1:
        return {}
    from transformers.distributed import DistributedConfig

    fsdp_size = int(os.environ.get("PARALLELISM_CONFIG_DP_SHARD_SIZE", "1"))
    return {"distributed_config": DistributedConfig(tp_size=tp_size, fsdp_size=fsdp_size)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="Hub id or local path of a causal LM, or 'tiny'")
    parser.add_argument("--text-file", help="UTF-8 text to train on (not needed with --model tiny)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1, help="sequences per device per micro-batch")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--output-dir", default="outputs/distributed")
    args = parser.parse_args()

    training_args = transformers.TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.grad_accum, max_steps=args.steps, learning_rate=args.lr,
        bf16=args.bf16, gradient_checkpointing=args.gradient_checkpointing, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
    )
    if args.model == "tiny":
        if tensor_parallel():
            parser.error("tensor parallelism shards a model in from_pretrained: pass a saved model, not --model tiny")
        model = tiny_model()
        ids = torch.randint(0, model.config.vocab_size, (64 * args.seq_len,), generator=torch.Generator().manual_seed(0))
    else:
        if not args.text_file:
            parser.error("--text-file is required unless --model tiny")
        # After TrainingArguments: under ZeRO-3 (zero3_init_flag) the model is built partitioned.
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype="auto", **tensor_parallel())
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
        with open(args.text_file, encoding="utf-8") as f:
            ids = torch.tensor(tokenizer(f.read())["input_ids"])
    trainer = FusedTrainer(model=model, args=training_args, train_dataset=TokenBlocks(ids, args.seq_len),
                           data_collator=transformers.default_data_collator)
    trainer.train()
    if trainer.accelerator.is_main_process:
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        print(f"hf_fused distributed example: {trainer.accelerator.num_processes} processes, "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")
    # Every rank past its last collective, then the process group shut down before the interpreter's: left to
    # interpreter exit, gloo's threads have aborted a CPU rank ("terminate called without an active exception").
    trainer.accelerator.wait_for_everyone()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
