"""The end-to-end benchmark's models and data: Qwen3 and Gemma-2 shapes (random init), gradient checkpointing
under either transformers spelling, a step timer and random token rows (as a torch dataset for ``Trainer`` and
as pre-tokenized ``input_ids`` for TRL's ``SFTTrainer``)."""

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
    # google/gemma-2-2b's config.json: 256,000-token vocabulary, final logits soft-capped at 30 (attention at 50).
    "gemma2-2b": dict(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=256, vocab_size=256000, final_logit_softcapping=30.0,
                      attn_logit_softcapping=50.0, query_pre_attn_scalar=256, sliding_window=4096),
    # The tiny shape's random-init logits stay below 1 in magnitude: a cap of 0.5 bends them, so the smoke test's
    # loss agreement covers the soft-capping (30 would leave them untouched).
    "tiny-gemma2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=4096, final_logit_softcapping=0.5,
                        attn_logit_softcapping=50.0, query_pre_attn_scalar=16, sliding_window=32),
}
#: ``--model`` → (full shape, ``--tiny`` shape). Default: Qwen3-1.7B.
SFT_MODELS = {"qwen3-1.7b": ("qwen3-1.7b", "tiny"), "gemma2-2b": ("gemma2-2b", "tiny-gemma2")}


def is_gemma2(shape: str) -> bool:
    return "gemma2" in shape


def attn_implementation(shape: str) -> str:
    """SDPA, except for Gemma-2, which transformers refuses to run under SDPA (no attention-logit soft-capping
    there): ``eager``, its reference implementation."""
    return "eager" if is_gemma2(shape) else "sdpa"


def model_config(shape: str, max_positions: int):
    """The transformers config of a named shape (tied embeddings, no KV cache)."""
    if not is_gemma2(shape):
        return qwen3_config(shape, max_positions)
    from transformers import Gemma2Config

    return Gemma2Config(**SHAPES[shape], tie_word_embeddings=True, max_position_embeddings=max_positions,
                        use_cache=False, pad_token_id=0, eos_token_id=1, bos_token_id=None)


def qwen3_config(shape: str, max_positions: int):
    from transformers import Qwen3Config

    return Qwen3Config(**SHAPES[shape], tie_word_embeddings=True, max_position_embeddings=max_positions,
                       use_cache=False, pad_token_id=0, eos_token_id=1, bos_token_id=None)


def build_model(config, device: torch.device, dtype: torch.dtype, seed: int, attn: str = "sdpa"):
    """A fresh random-init causal LM built directly on ``device`` (same weights for the same seed)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
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
    """``n`` rows of ``seq_len`` random token ids (labels = input ids; the model shifts them), with
    ``position_ids`` when asked (DeepSpeed's Ulysses dataloader adapter requires them)."""

    def __init__(self, n: int, seq_len: int, vocab_size: int, seed: int, position_ids: bool = False):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(2, vocab_size, (n, seq_len), generator=g)
        self.position_ids = position_ids

    def __len__(self):
        return self.ids.size(0)

    def __getitem__(self, i):
        row = {"input_ids": self.ids[i], "labels": self.ids[i].clone()}
        if self.position_ids:
            row["position_ids"] = torch.arange(self.ids.size(1))
        return row

    def as_hf_dataset(self):
        """The same rows as a ``datasets.Dataset`` of pre-tokenized ``input_ids`` (what ``SFTTrainer`` takes
        without tokenizing; its collator makes the labels from them)."""
        from datasets import Dataset

        return Dataset.from_dict({"input_ids": self.ids.tolist()})
