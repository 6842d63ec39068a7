"""Part B: GRPO loss steps, ``FusedGRPOTrainer`` vs ``trl.GRPOTrainer`` (no generation): on-policy (β = 0, no old
log-probs) or, with ``--grpo-off-policy-kl``, off-policy with TRL's k3 KL term (old and reference log-probs in the
inputs, as ``_generate_and_score_completions`` returns them for ``num_iterations > 1`` and ``beta > 0``)."""

from __future__ import annotations

import importlib
import tempfile
import time
import warnings
from typing import Optional

import torch

from ..measure import allocated_gib, short_error, synchronize
from ..problems import BETA, OLD_LOGP_NOISE, REF_LOGP_NOISE
from .models import build_model, checkpointing_on, enable_checkpointing, quiet_run_kwargs, qwen3_config
from .report import describe_grpo
from .runs import guarded_run, run_variants, step_record, timed_steps

GRPO_VARIANTS = ("trl", "hf_fused", "hf_fused_one_pass")
GRPO_MODELS = ("qwen3-0.6b", "qwen3-1.7b")


def grpo_setting(args) -> str:
    if args.grpo_off_policy_kl:
        return (f"off-policy (old = current log-probs + N(0, {OLD_LOGP_NOISE}²)), k3 KL beta {BETA} "
                f"(ref = current + N(0, {REF_LOGP_NOISE}²))")
    return "on-policy, beta 0"

def word_tokenizer():
    """A small word-level tokenizer (no hub access); the benchmark feeds token ids directly."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[PAD]", "[EOS]", "[UNK]"] + "the a one two three red green blue cat dog is and not yes no".split()
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]")
    fast.padding_side = "left"
    return fast


def constant_reward(completions, **kwargs):
    return [0.0 for _ in completions]


def build_grpo_trainer(variant: str, model, out_dir: str, args, device: torch.device):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    extra = {}
    if variant.startswith("hf_fused"):
        from hf_fused import FusedGRPOTrainer as cls

        if variant == "hf_fused_one_pass":  # room for the fp32 [V, H] accumulator + 2048 vocabulary rows
            v, h = model.get_output_embeddings().weight.shape
            extra["fused_options"] = {"tile_budget_bytes": v * h * 4 + 2048 * v * 2}
    else:
        cls = GRPOTrainer
    g = args.grpo_completions
    run_kwargs = quiet_run_kwargs(args, device, GRPOConfig)
    if args.grpo_autocast:  # float32 weights trained with bf16=True, TRL's default
        run_kwargs["bf16"] = True
    cfg = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=g,
        num_generations=g,
        max_completion_length=args.grpo_completion_len,
        loss_type="dapo",
        beta=0.0,
        learning_rate=1e-6,
        use_vllm=False,
        **run_kwargs,
    )
    trainer = cls(model=model, reward_funcs=constant_reward, args=cfg, processing_class=word_tokenizer(),
                  train_dataset=Dataset.from_dict({"prompt": ["the red cat"] * g}), **extra)
    if args.grpo_off_policy_kl:
        # Set after __init__: with beta > 0 it would load a reference model from the hub (unreachable here);
        # _compute_loss reads only self.beta and the inputs' ref_per_token_logps, which grpo_inputs provides.
        trainer.beta = BETA
    return trainer


@torch.no_grad()
def current_logprobs(model, prompt_completion_ids: torch.Tensor, completion_len: int) -> torch.Tensor:
    """``[B, k]`` fp32 log-probs of the completion tokens under ``model`` (unpatched: its own logits), one sequence
    at a time so that only one ``[k, V]`` fp32 block exists."""
    rows = []
    for ids in prompt_completion_ids.split(1):
        logits = model(input_ids=ids, logits_to_keep=completion_len + 1).logits[:, :-1].float()
        rows.append(logits.log_softmax(-1).gather(-1, ids[:, -completion_len:, None]).squeeze(-1))
        del logits
    return torch.cat(rows)


def grpo_inputs(args, vocab_size: int, device: torch.device, model=None) -> dict:
    """What ``_generate_and_score_completions`` returns for one batch (all tokens valid); off-policy with KL, also
    the old and reference log-probs: ``model``'s own (computed before any patch, so every variant gets the same)
    plus seeded Gaussian noise (``benchmarks.problems``' off-policy problem)."""
    g = torch.Generator().manual_seed(args.seed + 1)
    n, p, c = args.grpo_completions, args.grpo_prompt_len, args.grpo_completion_len
    completion_mask = torch.ones(n, c, dtype=torch.long)
    inputs = {
        "prompt_ids": torch.randint(2, vocab_size, (n, p), generator=g),
        "prompt_mask": torch.ones(n, p, dtype=torch.long),
        "completion_ids": torch.randint(2, vocab_size, (n, c), generator=g),
        "completion_mask": completion_mask,
        "advantages": torch.randn(n, generator=g),
        "num_items_in_batch": completion_mask.sum(),
    }
    inputs = {k: v.to(device) for k, v in inputs.items()}
    if args.grpo_off_policy_kl:
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        current = current_logprobs(model, ids, c)
        noise = torch.randn(2, n, c, generator=g).to(device)
        inputs["old_per_token_logps"] = current + OLD_LOGP_NOISE * noise[0]
        inputs["ref_per_token_logps"] = current + REF_LOGP_NOISE * noise[1]
    return inputs


def _grpo_once(variant: str, args, device: torch.device) -> dict:
    t_build = time.perf_counter()
    config = qwen3_config(args.grpo_shape, max(args.max_positions, args.grpo_prompt_len + args.grpo_completion_len))
    model = build_model(config, device, args.grpo_dtype, args.seed)
    model.eval()  # for the old / reference log-probs, as TRL computes them (train() again below)
    inputs = grpo_inputs(args, config.vocab_size, device, model)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = build_grpo_trainer(variant, model, tmp, args, device)
    model = trainer.model
    if not checkpointing_on(model):  # Trainer enables it in train(), which is never called here
        enable_checkpointing(model)
    model.train()
    trainer.current_gradient_accumulation_steps = 1
    synchronize(device)
    build_s = time.perf_counter() - t_build
    weights = allocated_gib(device)

    def step():
        # Trainer.train() runs the forward under the autocast accelerate wraps the prepared model in; this loop
        # calls _compute_loss on the unprepared model, so it opens the same autocast itself.
        with torch.autocast(device.type, dtype=args.grpo_autocast, enabled=args.grpo_autocast is not None):
            return trainer._compute_loss(model, inputs)

    times, losses, peak, grad_norm = timed_steps(model, step, device, args.warmup + args.steps)
    model.zero_grad(set_to_none=True)
    trainer.accelerator.free_memory()
    tokens = args.grpo_completions * (args.grpo_prompt_len + args.grpo_completion_len)
    return step_record(times, args.warmup, tokens, peak, weights, losses, grad_norm, model, build_s)


def run_grpo(variant: str, args, device: torch.device) -> dict:
    return guarded_run(lambda: _grpo_once(variant, args, device), device, variant=variant)


def grpo_unavailable() -> Optional[str]:
    try:
        importlib.import_module("trl")
        importlib.import_module("datasets")
    except Exception as e:  # noqa: BLE001
        return f"trl/datasets not importable ({short_error(e)})"
    return None


def grpo_part(args, device: torch.device, doc: dict, save, deadline: float, bar) -> None:
    """Run part B's runs into ``doc``, saving after each and advancing ``bar`` (:func:`benchmarks.measure.progress`)."""
    run_variants("GRPO", args.grpo_variants, doc["grpo"]["runs"], grpo_unavailable(), deadline, bar, save,
                 lambda variant: run_grpo(variant, args, device), describe_grpo)
