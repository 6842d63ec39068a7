"""SFT demo: the same training run with ``hf_fused.FusedTrainer`` and with ``transformers.Trainer``.

``python -m examples sft [--model PATH] [--steps N] [--seq-len L] [--batch-size B]
[--device cpu|cuda] [--lr LR] [--seed S] [--rtol R]``

1. Model: a small random Qwen3 (real Qwen vocabulary of 151,936 rows, tied embeddings as in
   Qwen3-0.6B) with the real Qwen tokenizer, or a local HF checkpoint given by ``--model``.
2. Data: the pydoc help topics as prompt/completion SFT blocks (``examples.text``).
3. Trains twice in fp32 from the same initial weights, seed and batch order, and prints the
   per-step losses of both and their relative difference.
4. Measures, on one batch, the peak memory of the lm_head loss alone (hidden states -> loss ->
   backward), once as transformers computes it (full ``[tokens, vocab]`` logits) and once with
   ``hf_fused.ops.linear_cross_entropy``.

Exit status: 0 when every step's relative loss difference is within ``--rtol`` (1e-4), else 1.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import transformers
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.trainer_callback import ProgressCallback

from hf_fused import FusedTrainer
from hf_fused.ops import linear_cross_entropy

from benchmarks.measure import track_peak_memory
from .text import IGNORE_INDEX, TokenBlocks, build_sft_blocks
from .model import tiny_qwen3_config
from .tokenizer import build_qwen_tokenizer

__all__ = ["parse_args", "train_step_losses", "head_loss_peak_memory", "main"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m examples sft",
        description="Train with hf_fused.FusedTrainer and transformers.Trainer; compare losses and memory.",
    )
    p.add_argument("--model", metavar="PATH", help="local HF checkpoint dir (default: a small random Qwen3)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run (default 20)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per example (default 128)")
    p.add_argument("--batch-size", type=int, default=4, help="examples per step (default 4)")
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu",
        help="default: cuda if available",
    )
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rtol", type=float, default=1e-4, help="max relative loss difference per step")
    args = p.parse_args(argv)
    for name in ("steps", "seq_len", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    return args


def _model_factory(args: argparse.Namespace) -> tuple[Callable[[], torch.nn.Module], object]:
    """``(make_model, tokenizer)``; each ``make_model()`` returns identical fresh fp32 weights."""
    if args.model:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)

        def make_model():
            model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
            model.config.use_cache = False
            return model
    else:
        tokenizer = build_qwen_tokenizer()
        config = tiny_qwen3_config(tokenizer, use_cache=False)

        def make_model():
            transformers.set_seed(args.seed)  # same seed -> same random init for both runs
            return transformers.Qwen3ForCausalLM(config)

    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer of {args.model} has no eos token; it is needed to separate documents")
    return make_model, tokenizer


class _QuietProgress(ProgressCallback):
    """Trainer's tqdm bar, with the loss in the bar instead of a printed dict per step; keeps each step's seconds."""

    def __init__(self):
        super().__init__()
        self.step_seconds: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_seconds.append(time.perf_counter() - self._t0)
        super().on_step_end(args, state, control, **kwargs)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and logs and "loss" in logs:
            self.training_bar.set_postfix(loss=f"{logs['loss']:.4f}")


def train_step_losses(
    trainer_cls: type[transformers.Trainer],
    model: torch.nn.Module,
    dataset: TokenBlocks,
    args: argparse.Namespace,
    step_seconds: list[float] | None = None,
) -> list[float]:
    """Train ``model`` with ``trainer_cls`` for ``args.steps`` steps; returns the loss of each step, and appends
    each step's wall seconds to ``step_seconds`` when given.

    fp32, AdamW, linear decay, no checkpoints, no reporting; the output dir is temporary.
    """
    with tempfile.TemporaryDirectory(prefix="hf_fused_sft_") as out:
        targs = transformers.TrainingArguments(
            output_dir=out,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch_size,
            learning_rate=args.lr,
            seed=args.seed,
            data_seed=args.seed,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=args.device == "cpu",
            dataloader_num_workers=0,
        )
        trainer = trainer_cls(
            model=model, args=targs, train_dataset=dataset, data_collator=transformers.default_data_collator
        )
        trainer.remove_callback(ProgressCallback)
        progress = _QuietProgress()
        trainer.add_callback(progress)
        trainer.train()
        if step_seconds is not None:
            step_seconds.extend(progress.step_seconds)
        # log_history holds the un-rounded fp32 mean loss of each step (logging_steps=1).
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    if len(losses) != args.steps:
        raise RuntimeError(f"expected {args.steps} logged losses, got {len(losses)}")
    return losses


def _unfused_head_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What transformers' causal-LM models do: full logits, upcast to fp32, shifted cross-entropy."""
    logits = F.linear(hidden, weight)  # [B, L, V]
    return ForCausalLMLoss(logits, labels, vocab_size=weight.shape[0])


def _fused_head_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]  # the op takes aligned labels
    return linear_cross_entropy(hidden, weight, shifted)


def head_loss_peak_memory(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device
) -> dict[str, dict[str, float]]:
    """Peak bytes of the lm_head loss (forward + backward) alone, unfused vs fused, on one batch.

    The decoder runs once without grad; its output ``[B, L, H]`` and a copy of the lm_head weight
    ``[V, H]`` become leaf tensors, so the measured region holds exactly the head's work: logits
    (unfused only), loss, and the gradients of hidden states and weight.

    Returns:
        ``{"unfused": {...}, "fused": {...}}``, each with ``peak_bytes``, ``loss`` and the
        gradients' max abs difference from the unfused ones (``max_grad_diff``).
    """
    with torch.no_grad():
        hidden = model.get_decoder()(
            input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)
        ).last_hidden_state
    weight = model.get_output_embeddings().weight.detach()
    labels = batch["labels"].to(device)

    results: dict[str, dict[str, float]] = {}
    grads = {}
    for name, loss_fn in (("unfused", _unfused_head_loss), ("fused", _fused_head_loss)):
        h = hidden.detach().clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        with track_peak_memory(device) as mem:
            loss = loss_fn(h, w, labels)
            loss.backward()
        grads[name] = (h.grad, w.grad)
        results[name] = {"peak_bytes": mem.peak_bytes, "loss": loss.item()}
        del h, w, loss
    for name in results:
        results[name]["max_grad_diff"] = max(
            (a - b).abs().max().item() for a, b in zip(grads[name], grads["unfused"])
        )
    return results


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2] if xs else float("nan")


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the process exit status (0 = losses agree within ``--rtol``)."""
    args = parse_args(argv)
    device = torch.device(args.device)
    make_model, tokenizer = _model_factory(args)

    blocks = build_sft_blocks(tokenizer, args.seq_len)
    n = min(len(blocks), args.steps * args.batch_size)  # one pass if there is enough text
    dataset = TokenBlocks(blocks.input_ids[:n], blocks.labels[:n])
    print(f"data: {n} blocks of {args.seq_len} tokens from the pydoc help topics")

    model = make_model().to(device)
    vocab = model.get_output_embeddings().weight.shape[0]
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.model or 'random Qwen3 (2 layers, hidden 128)'}, {n_params / 1e6:.1f}M params, vocab {vocab}")
    batch = transformers.default_data_collator([dataset[i] for i in range(min(args.batch_size, n))])
    memory = head_loss_peak_memory(model, batch, device)
    del model

    runs = {}
    for label, trainer_cls in (("fused", FusedTrainer), ("unfused", transformers.Trainer)):
        print(f"\ntraining with {trainer_cls.__module__}.{trainer_cls.__name__} ({label})")
        seconds: list[float] = []
        runs[label] = (train_step_losses(trainer_cls, make_model(), dataset, args, seconds), _median(seconds[1:] or seconds))

    (fused, t_fused), (unfused, t_unfused) = runs["fused"], runs["unfused"]
    rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(fused, unfused)]
    print(f"\n{'step':>4}  {'fused loss':>12}  {'unfused loss':>12}  {'rel diff':>9}")
    for step, (a, b, r) in enumerate(zip(fused, unfused, rel), start=1):
        print(f"{step:>4}  {a:>12.6f}  {b:>12.6f}  {r:>9.2e}{'  <-- above rtol' if r > args.rtol else ''}")
    print(f"median step time: fused {t_fused:.2f} s, unfused {t_unfused:.2f} s (the first step, which pays one-time "
          f"set-up, left out; on a CPU it depends on the machine and its load)")

    tokens = batch["input_ids"].numel()
    print(
        f"\nlm_head loss + backward on one batch ({tokens} tokens x {vocab} vocab; "
        f"fp32 logits alone would be {_mib(tokens * vocab * 4)}), peak memory on {device.type}:"
    )
    for label in ("unfused", "fused"):
        m = memory[label]
        print(f"  {label:>7}: {_mib(m['peak_bytes']):>12}   loss {m['loss']:.6f}   max |grad diff| {m['max_grad_diff']:.1e}")
    if memory["fused"]["peak_bytes"]:
        print(f"  ratio unfused/fused: {memory['unfused']['peak_bytes'] / memory['fused']['peak_bytes']:.1f}x")

    worst = max(rel)
    if worst > args.rtol:
        print(f"\nFAIL: max relative loss difference {worst:.2e} > rtol {args.rtol:.0e}")
        return 1
    print(f"\nOK: max relative loss difference {worst:.2e} <= rtol {args.rtol:.0e}")
    return 0
