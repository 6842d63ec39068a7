"""The end-to-end benchmark's models and data: Qwen3 shapes (random init), gradient checkpointing under
either transformers spelling, a step timer and random token rows."""

from __future__ import annotations

import dataclasses
import time

import torch

from ..measure import synchronize

SHAPES = {
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=4096),
}


def qwen3_config(shape: str, max_positions: int):
    from transformers import Qwen3Config

    return Qwen3Config(**SHAPES[shape], tie_word_embeddings=True, max_position_embeddings=max_positions,
                       use_cache=False, pad_token_id=0, eos_token_id=1, bos_token_id=None)


def build_model(config, device: torch.device, dtype: torch.dtype, seed: int):
    """A fresh random-init causal LM built directly on ``device`` (same weights for the same seed)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    return model


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() deduplicates the tied head


def checkpointing_kwargs(cls) -> dict:
    """Gradient checkpointing arguments under whichever name this transformers spells them
    (``activation_checkpointing`` in newer 5.x, ``gradient_checkpointing`` before)."""
    names = {f.name for f in dataclasses.fields(cls)}
    key = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    return {key: True, f"{key}_kwargs": {"use_reentrant": False}}


def quiet_run_kwargs(args, device: torch.device, config_cls) -> dict:
    """The ``TrainingArguments`` / ``GRPOConfig`` fields both parts share: dtype and device from the run, no
    reporting, saving, workers or progress bar, a log every step, the run's seed, gradient checkpointing."""
    return dict(bf16=args.dtype == torch.bfloat16, use_cpu=device.type == "cpu", report_to=[], save_strategy="no",
                logging_steps=1, dataloader_num_workers=0, disable_tqdm=True, seed=args.seed,
                **checkpointing_kwargs(config_cls))


def checkpointing_on(model) -> bool:
    new = hasattr(type(model), "is_activation_checkpointing")  # the old name warns on newer transformers
    flag = "is_activation_checkpointing" if new else "is_gradient_checkpointing"
    return bool(getattr(model, flag, False))


def enable_checkpointing(model) -> None:
    """What ``Trainer.train()`` does with ``use_reentrant=False``, for the GRPO part that never calls ``train()``."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def make_step_timer(device: torch.device):
    """A TrainerCallback timing every optimizer step (GPU synchronized at step begin and end)."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []
            self._t0 = None

        def on_step_begin(self, args, state, control, **kwargs):
            synchronize(device)
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            synchronize(device)
            self.times.append(time.perf_counter() - self._t0)

    return StepTimer()


class RandomTokens(torch.utils.data.Dataset):
    """``n`` rows of ``seq_len`` random token ids (labels = input ids; the model shifts them)."""

    def __init__(self, n: int, seq_len: int, vocab_size: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(2, vocab_size, (n, seq_len), generator=g)

    def __len__(self):
        return self.ids.size(0)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}
