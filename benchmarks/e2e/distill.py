"""Part C: distillation loss steps, TRL's ``DistillationTrainer`` on an hf_fused student (``apply_fused_loss``) vs
stock (TRL's ``ChunkedDivergenceFunction``), no generation: each step is ``trainer.compute_loss(model, inputs)`` +
``backward()`` on a synthetic batch with the keys TRL's generation step returns, as part B does for GRPO."""

from __future__ import annotations

import importlib
import os
import tempfile
import time
import warnings
from typing import Optional

import torch

from ..measure import allocated_gib, short_error, synchronize
from .grpo import word_tokenizer
from .runs import guarded_run, run_variants, step_record, timed_steps
from .models import SHAPES, build_model, checkpointing_on, enable_checkpointing, n_params, quiet_run_kwargs

DISTILL_VARIANTS = ("trl", "hf_fused")
#: Teacher shapes: Qwen3-8B's (hidden 4096, untied head) over the student's vocabulary; a tiny one for ``--tiny``.
TEACHER_SHAPES = {
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "tiny": dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=24, vocab_size=4096),
}


def distill_setting(args) -> str:
    return (f"compute_loss + backward, {args.distill_completions} x ({args.grpo_prompt_len} prompt + "
            f"{args.grpo_completion_len} completion) tokens, beta {args.distill_beta:g}, temperature 1, student grad "
            f"checkpointing, median of {args.steps} after {args.warmup} warm-up")


def _config(shape: dict, max_positions: int, tied: bool):
    from transformers import Qwen3Config

    return Qwen3Config(**shape, tie_word_embeddings=tied, max_position_embeddings=max_positions, use_cache=False,
                       pad_token_id=0, eos_token_id=1, bos_token_id=None)


def distill_inputs(args, vocab_size: int, device: torch.device) -> dict:
    """What ``DistillationTrainer``'s generation step returns for one batch (every completion token valid)."""
    g = torch.Generator().manual_seed(args.seed + 2)
    n, p, c = args.distill_completions, args.grpo_prompt_len, args.grpo_completion_len
    completion_mask = torch.ones(n, c, dtype=torch.long)
    inputs = {
        "prompt_ids": torch.randint(2, vocab_size, (n, p), generator=g),
        "prompt_mask": torch.ones(n, p, dtype=torch.long),
        "completion_ids": torch.randint(2, vocab_size, (n, c), generator=g),
        "completion_mask": completion_mask,
        "num_items_in_batch": completion_mask.sum(),
    }
    return {k: v.to(device) for k, v in inputs.items()}


def build_distill_trainer(variant: str, student, teacher, out_dir: str, args, device: torch.device):
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    if variant == "hf_fused":
        import hf_fused

        hf_fused.apply_fused_loss(student)
    cfg = DistillationConfig(output_dir=out_dir, per_device_train_batch_size=args.distill_completions,
                             max_completion_length=args.grpo_completion_len, beta=args.distill_beta,
                             learning_rate=1e-6, use_vllm=False, **quiet_run_kwargs(args, device, DistillationConfig))
    return DistillationTrainer(model=student, teacher_model=teacher, args=cfg, processing_class=word_tokenizer(),
                               train_dataset=Dataset.from_dict({"prompt": ["the red cat"] * args.distill_completions}))


class _OpCalls:
    """Counts the calls of hf_fused's op from TRL's trainer (the record says the head went through it), while
    active."""

    def __enter__(self):
        self.count, self.module = 0, None
        try:
            import hf_fused.integrations.trl.divergence as module
        except Exception:  # noqa: BLE001 - no hf_fused integration: nothing to count
            return self
        self.module, self.original = module, module.linear_distillation_loss

        def counted(*a, **k):
            self.count += 1
            return self.original(*a, **k)

        module.linear_distillation_loss = counted
        return self

    def __exit__(self, *exc):
        if self.module is not None:
            self.module.linear_distillation_loss = self.original


def _distill_once(variant: str, args, device: torch.device) -> dict:
    t_build = time.perf_counter()
    positions = max(args.max_positions, args.grpo_prompt_len + args.grpo_completion_len)
    student = build_model(_config(SHAPES[args.distill_student], positions, True), device, args.dtype, args.seed)
    teacher = build_model(_config(TEACHER_SHAPES[args.distill_teacher], positions, False), device, args.dtype,
                          args.seed + 1)
    teacher.requires_grad_(False)
    inputs = distill_inputs(args, student.config.vocab_size, device)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        trainer = build_distill_trainer(variant, student, teacher, tmp, args, device)
    model = trainer.model
    if not checkpointing_on(model):  # Trainer enables it in train(), which is never called here
        enable_checkpointing(model)
    model.train()
    synchronize(device)
    build_s = time.perf_counter() - t_build
    weights = allocated_gib(device)
    with _OpCalls() as calls:
        times, losses, peak, grad_norm = timed_steps(model, lambda: trainer.compute_loss(model, inputs), device,
                                                     args.warmup + args.steps)
    entropy = trainer._metrics["train"]["entropy"][-1] if trainer._metrics["train"].get("entropy") else None
    model.zero_grad(set_to_none=True)
    trainer.accelerator.free_memory()
    tokens = args.distill_completions * (args.grpo_prompt_len + args.grpo_completion_len)
    return step_record(times, args.warmup, tokens, peak, weights, losses, grad_norm, model, build_s,
                       entropy_last=entropy, teacher_params=n_params(teacher), hf_fused_op_calls=calls.count)


def run_distill(variant: str, args, device: torch.device) -> dict:
    return guarded_run(lambda: _distill_once(variant, args, device), device, variant=variant)


def distill_unavailable() -> Optional[str]:
    try:
        importlib.import_module("trl.trainer.distillation_trainer")
        importlib.import_module("datasets")
    except Exception as e:  # noqa: BLE001
        return f"trl's DistillationTrainer/datasets not importable ({short_error(e)})"
    return None


def distill_part(args, device: torch.device, doc: dict, save, deadline: float, bar) -> None:
    """Run part C's runs into ``doc``, saving after each and advancing ``bar``."""
    run_variants("distill", args.distill_variants, doc["distill"]["runs"], distill_unavailable(), deadline, bar,
                 save, lambda variant: run_distill(variant, args, device), describe_distill)


def describe_distill(r: dict) -> str:
    if r["status"] != "ok":
        return r["status"] + (f" ({r.get('note') or r.get('error')})" if r.get("note") or r.get("error") else "")
    peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
    return (f"{r['step_s_median'] * 1e3:.0f} ms/step, {r['tokens_per_s']:.0f} tok/s, peak {peak} GiB, "
            f"loss {r['losses'][0]:.5f}, hf_fused op calls {r.get('hf_fused_op_calls')}")


def distill_table(doc: dict) -> list[str]:
    part = doc.get("distill")
    if not part or not part["runs"]:
        return []
    lines = [f"Distillation {part['model']}, {part['setup']}",
             f"  {'variant':10s}{'ms/step':>10s}{'tok/s':>10s}{'peak GiB':>10s}{'+weights':>10s}{'loss':>12s}"
             f"{'entropy':>10s}{'|grad|':>10s}{'op calls':>10s}"]
    for r in part["runs"]:
        if r["status"] == "ok":
            gib = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
            ent = "-" if r.get("entropy_last") is None else f"{r['entropy_last']:.4f}"
            lines.append(f"  {r['variant']:10s}{r['step_s_median'] * 1e3:>10.0f}{r['tokens_per_s']:>10.0f}"
                         f"{gib(r['peak_gib']):>10s}{gib(r['peak_above_weights_gib']):>10s}{r['losses'][0]:>12.5f}"
                         f"{ent:>10s}{r['grad_norm_last']:>10.4f}{r.get('hf_fused_op_calls', '-'):>10}")
        else:
            lines.append(f"  {r['variant']:10s}  {describe_distill(r)}")
    return lines
