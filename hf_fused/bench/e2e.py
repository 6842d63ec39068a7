"""End-to-end training benchmark: whole training steps of real-shaped models, not the loss alone.

``python -m hf_fused.bench.e2e [--parts sft,grpo] [--seq-lens 4096,16384,32768] [--steps 3] --out DIR``

Part A, SFT: a Qwen3-1.7B-shaped model (random init from ``transformers.Qwen3Config``, bf16 weights,
tied embeddings, SDPA attention, gradient checkpointing, batch size 1, random token ids) trained by
``transformers.Trainer`` for ``--warmup`` + ``--steps`` optimizer steps at each sequence length, in
three variants:

* ``plain``: the unpatched model (full ``[tokens, vocab]`` logits, upcast to fp32 by transformers' loss);
* ``liger``: ``TrainingArguments(use_liger_kernel=True)``, i.e. Liger's fused linear cross-entropy
  **and** its RoPE / RMSNorm / SwiGLU kernels (transformers' default Liger config; ``liger_flce``, not run
  by default, applies the fused linear cross-entropy alone);
* ``hf_fused``: ``hf_fused.apply_fused_loss(model)``, then the same ``Trainer``.

Each run records tokens/s over the timed steps (a ``TrainerCallback`` synchronizes the GPU at step
begin/end), ``torch.cuda.max_memory_allocated()`` over the whole ``train()`` (weights, gradients,
optimizer states, activations and loss; the counter is reset after the model is built) and the logged
losses (step 1 is the same model and batch for every variant, so the first losses should agree to bf16
precision). ``torch.cuda.OutOfMemoryError`` is recorded as ``OOM`` (any other exception as ``error``,
with its traceback in the JSON); a variant that failed at one length is not run at longer ones. Runs go variant by variant, shortest length first, and
everything is freed between runs. Liger patches ``transformers.models.qwen3.modeling_qwen3`` globals
(RoPE function, RMSNorm and MLP classes); they are restored after each Liger run.

Optimizer: ``adamw_torch`` by default (``--optim``). With bf16 weights its two states are bf16, so
weights + gradients + states take 4 × 2 bytes × 1.72 G params ≈ 13.8 GB for the 1.7B shape, the same
for every variant.

Part B, GRPO: ``hf_fused.FusedGRPOTrainer`` vs ``trl.GRPOTrainer`` (TRL 1.16, whose own chunked fused
LM head is the baseline) on a Qwen3-0.6B-shaped model. No generation: both trainers are built offline
(word-level tokenizer, no reward model, no vLLM) and each step calls ``trainer._compute_loss(model,
inputs)`` + ``backward()`` on a synthetic batch with the keys ``_generate_and_score_completions``
returns (``prompt_ids``, ``prompt_mask``, ``completion_ids``, ``completion_mask``, ``advantages``,
``num_items_in_batch``): ``--grpo-completions`` completions of ``--grpo-prompt-len`` prompt tokens and
``--grpo-completion-len`` completion tokens, every token valid, loss ``dapo``, beta 0, one iteration
per generation (so, as in TRL, there is no ``old_per_token_logps``: the loss uses the detached current
log-probs). Reports the median fwd+bwd time of the timed steps (no optimizer step) and the peak memory.
Variants: ``trl``, ``hf_fused`` (default budget) and ``hf_fused_one_pass`` (``fused_options`` with a
``tile_budget_bytes`` holding the fp32 ``[V, H]`` accumulator + 2048 vocabulary rows, so the on-policy
``grad_hint`` gives the head's gradients in the forward pass).

Writes ``DIR/e2e.json`` after every run (a command cut short keeps what it measured) and
``DIR/e2e.txt`` (the table printed last). ``--time-budget`` (seconds since start) skips the runs that
would start after it. ``--tiny`` shrinks everything for a CPU smoke test:
``python -m hf_fused.bench.e2e --tiny --device cpu --out /tmp/e2e``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import json
import math
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

SFT_VARIANTS = ("plain", "liger", "hf_fused")
ALL_SFT_VARIANTS = SFT_VARIANTS + ("liger_flce",)
GRPO_VARIANTS = ("trl", "hf_fused", "hf_fused_one_pass")
GIB = 2**30

# Qwen3-1.7B and Qwen3-0.6B shapes (random init; only the shapes matter here).
SHAPES = {
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=4096),
}


# ----------------------------------------------------------------------------------------------------
# Models, memory, timing.


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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> Optional[float]:
    """Collect garbage, empty the CUDA cache and reset the peak counter; returns GiB still allocated."""
    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device) / GIB


def allocated_gib(device: torch.device) -> Optional[float]:
    return torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else None


def peak_gib(device: torch.device) -> Optional[float]:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def short_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def checkpointing_kwargs(cls) -> dict:
    """Gradient checkpointing arguments under whichever name this transformers spells them
    (``activation_checkpointing`` in newer 5.x, ``gradient_checkpointing`` before)."""
    names = {f.name for f in dataclasses.fields(cls)}
    key = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    return {key: True, f"{key}_kwargs": {"use_reentrant": False}}


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
            sync(device)
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync(device)
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


# ----------------------------------------------------------------------------------------------------
# Part A: SFT with transformers.Trainer.


def liger_unavailable(device: torch.device) -> Optional[str]:
    """None when transformers' ``use_liger_kernel`` can run here, else why not."""
    if device.type != "cuda":
        return "Liger's kernels need CUDA (Triton)"
    try:
        importlib.import_module("liger_kernel.transformers")
    except Exception as e:  # noqa: BLE001 - any import failure means "skip"
        return f"liger_kernel not importable ({short_error(e)})"
    from transformers.utils import is_liger_kernel_available

    if not is_liger_kernel_available():
        return "transformers.utils.is_liger_kernel_available() is False"
    return None


@contextlib.contextmanager
def restored_module_globals(module_name: str):
    """Undo the module-level monkey patches Liger applies (it replaces functions and classes of
    ``modeling_qwen3`` for every model built afterwards, not only the instance it patches)."""
    module = importlib.import_module(module_name)
    saved = dict(vars(module))
    try:
        yield
    finally:
        for k in set(vars(module)) - set(saved):
            delattr(module, k)
        for k, v in saved.items():
            if vars(module).get(k) is not v:
                setattr(module, k, v)


def sft_training_args(variant: str, out_dir: str, args, device: torch.device):
    from transformers import TrainingArguments

    kwargs = dict(
        output_dir=out_dir,
        max_steps=args.warmup + args.steps,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=1,
        learning_rate=1e-5,
        optim=args.optim,
        bf16=args.dtype == torch.bfloat16,
        use_cpu=device.type == "cpu",
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=args.seed,
        **checkpointing_kwargs(TrainingArguments),
    )
    if variant in ("liger", "liger_flce"):
        kwargs["use_liger_kernel"] = True
    if variant == "liger_flce":
        kwargs["liger_kernel_config"] = dict(rope=False, rms_norm=False, swiglu=False,
                                             fused_linear_cross_entropy=True)
    return TrainingArguments(**kwargs)


def _sft_once(variant: str, seq_len: int, args, device: torch.device) -> dict:
    from transformers import Trainer
    from transformers.trainer_callback import PrinterCallback

    t_build = time.perf_counter()
    config = qwen3_config(args.sft_shape, max(args.max_positions, seq_len))
    model = build_model(config, device, args.dtype, args.seed)
    if variant == "hf_fused":
        from hf_fused import apply_fused_loss

        apply_fused_loss(model)
    sync(device)
    build_s = time.perf_counter() - t_build
    weights = allocated_gib(device)
    timer = make_step_timer(device)
    dataset = RandomTokens(args.warmup + args.steps, seq_len, config.vocab_size, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(model=model, args=sft_training_args(variant, tmp, args, device), train_dataset=dataset,
                          callbacks=[timer])
        trainer.remove_callback(PrinterCallback)  # no per-step log dicts on stdout
        reset_peak(device)
        t_train = time.perf_counter()
        trainer.train()
        sync(device)
        train_s = time.perf_counter() - t_train
    peak = peak_gib(device)
    checkpointing = checkpointing_on(model)
    forward = getattr(model.forward, "__func__", model.forward)
    forward = f"{getattr(forward, '__module__', '?')}.{getattr(forward, '__qualname__', '?')}"
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    trainer.accelerator.free_memory()
    timed = timer.times[args.warmup:]
    if not timed:
        raise RuntimeError(f"no timed steps (callback saw {len(timer.times)} steps)")
    return {
        "status": "ok",
        "tokens_per_s": seq_len * len(timed) / sum(timed),
        "step_s": timed,
        "step_s_median": statistics.median(timed),
        "warmup_step_s": timer.times[: args.warmup],
        "peak_gib": peak,
        "weights_gib": weights,
        "losses": losses,
        "build_s": build_s,
        "train_s": train_s,
        "params": n_params(model),
        "checkpointing": checkpointing,
        "forward": forward,  # which forward trained: transformers', Liger's lce_forward or hf_fused's
    }


def run_sft(variant: str, seq_len: int, args, device: torch.device) -> dict:
    """One (variant, sequence length) run; OOM and other errors become a status, never an exception."""
    leftover = free_memory(device)
    t0 = time.perf_counter()
    ctx = (restored_module_globals("transformers.models.qwen3.modeling_qwen3") if variant.startswith("liger")
           else contextlib.nullcontext())
    try:
        with ctx:
            result = _sft_once(variant, seq_len, args, device)
    except Exception as e:  # noqa: BLE001 - record and go on with the next run
        result = {"status": "OOM" if is_oom(e) else "error", "error": short_error(e)}
        if result["status"] == "error":
            result["traceback"] = traceback.format_exc()[-3000:]
        result["peak_gib"] = peak_gib(device)
    result.update(variant=variant, seq_len=seq_len, wall_s=time.perf_counter() - t0, allocated_before_gib=leftover)
    free_memory(device)
    return result


def sft_part(args, device: torch.device, doc: dict, save, deadline: float) -> None:
    runs = doc["sft"]["runs"]
    for variant in args.sft_variants:
        skip_reason = liger_unavailable(device) if variant.startswith("liger") else None
        failed_at = None
        for seq_len in sorted(args.seq_lens):
            if skip_reason:
                res = {"status": "skipped", "note": skip_reason}
            elif failed_at is not None:
                res = {"status": "skipped", "note": f"{failed_at[0]} at {failed_at[1]} tokens"}
            elif time.perf_counter() > deadline:
                res = {"status": "skipped", "note": "time budget"}
            else:
                log(f"SFT {variant:10s} seq {seq_len:6d} ...")
                res = run_sft(variant, seq_len, args, device)
                log(f"    -> {describe_sft(res)}  ({res['wall_s']:.1f} s)")
                if res["status"] in ("OOM", "error"):  # longer sequences would fail the same way
                    failed_at = (res["status"], seq_len)
            res.setdefault("variant", variant)
            res.setdefault("seq_len", seq_len)
            runs.append(res)
            save()


# ----------------------------------------------------------------------------------------------------
# Part B: GRPO loss steps, FusedGRPOTrainer vs trl.GRPOTrainer.


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
    cfg = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=g,
        num_generations=g,
        max_completion_length=args.grpo_completion_len,
        loss_type="dapo",
        beta=0.0,
        learning_rate=1e-6,
        bf16=args.dtype == torch.bfloat16,
        use_cpu=device.type == "cpu",
        use_vllm=False,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=args.seed,
        **checkpointing_kwargs(GRPOConfig),
    )
    return cls(model=model, reward_funcs=constant_reward, args=cfg, processing_class=word_tokenizer(),
               train_dataset=Dataset.from_dict({"prompt": ["the red cat"] * g}), **extra)


def grpo_inputs(args, vocab_size: int, device: torch.device) -> dict:
    """What ``_generate_and_score_completions`` returns for one batch (all tokens valid)."""
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
    return {k: v.to(device) for k, v in inputs.items()}


def _grpo_once(variant: str, args, device: torch.device) -> dict:
    t_build = time.perf_counter()
    config = qwen3_config(args.grpo_shape, max(args.max_positions, args.grpo_prompt_len + args.grpo_completion_len))
    model = build_model(config, device, args.dtype, args.seed)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = build_grpo_trainer(variant, model, tmp, args, device)
    model = trainer.model
    if not checkpointing_on(model):  # Trainer enables it in train(), which is never called here
        enable_checkpointing(model)
    model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = grpo_inputs(args, config.vocab_size, device)
    sync(device)
    build_s = time.perf_counter() - t_build
    weights = allocated_gib(device)
    times, losses = [], []
    reset_peak(device)
    for _ in range(args.warmup + args.steps):
        model.zero_grad(set_to_none=True)
        sync(device)
        t0 = time.perf_counter()
        loss = trainer._compute_loss(model, inputs)
        loss.backward()
        sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    peak = peak_gib(device)
    grad_norm = math.sqrt(sum(p.grad.float().pow(2).sum().item() for p in model.parameters() if p.grad is not None))
    model.zero_grad(set_to_none=True)
    trainer.accelerator.free_memory()
    timed = times[args.warmup:]
    tokens = args.grpo_completions * (args.grpo_prompt_len + args.grpo_completion_len)
    return {
        "status": "ok",
        "step_s": timed,
        "step_s_median": statistics.median(timed),
        "warmup_step_s": times[: args.warmup],
        "tokens_per_s": tokens / statistics.median(timed),
        "peak_gib": peak,
        "weights_gib": weights,
        "peak_above_weights_gib": None if peak is None else peak - weights,
        "losses": losses,
        "grad_norm_last": grad_norm,
        "checkpointing": checkpointing_on(model),
        "build_s": build_s,
        "params": n_params(model),
    }


def run_grpo(variant: str, args, device: torch.device) -> dict:
    leftover = free_memory(device)
    t0 = time.perf_counter()
    try:
        result = _grpo_once(variant, args, device)
    except Exception as e:  # noqa: BLE001
        result = {"status": "OOM" if is_oom(e) else "error", "error": short_error(e)}
        if result["status"] == "error":
            result["traceback"] = traceback.format_exc()[-3000:]
        result["peak_gib"] = peak_gib(device)
    result.update(variant=variant, wall_s=time.perf_counter() - t0, allocated_before_gib=leftover)
    free_memory(device)
    return result


def grpo_unavailable() -> Optional[str]:
    try:
        importlib.import_module("trl")
        importlib.import_module("datasets")
    except Exception as e:  # noqa: BLE001
        return f"trl/datasets not importable ({short_error(e)})"
    return None


def grpo_part(args, device: torch.device, doc: dict, save, deadline: float) -> None:
    runs = doc["grpo"]["runs"]
    reason = grpo_unavailable()
    for variant in args.grpo_variants:
        if reason:
            res = {"status": "skipped", "note": reason, "variant": variant}
        elif time.perf_counter() > deadline:
            res = {"status": "skipped", "note": "time budget", "variant": variant}
        else:
            log(f"GRPO {variant:10s} ...")
            res = run_grpo(variant, args, device)
            log(f"    -> {describe_grpo(res)}  ({res['wall_s']:.1f} s)")
        runs.append(res)
        save()


# ----------------------------------------------------------------------------------------------------
# Report.


def fmt_gib(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def describe_sft(r: dict) -> str:
    if r["status"] != "ok":
        return r["status"] + (f" ({r.get('note') or r.get('error')})" if r.get("note") or r.get("error") else "")
    loss = f"{r['losses'][0]:.4f}" if r.get("losses") else "-"
    return f"{r['tokens_per_s']:.0f} tok/s, peak {fmt_gib(r['peak_gib'])} GiB, loss@1 {loss}"


def describe_grpo(r: dict) -> str:
    if r["status"] != "ok":
        return r["status"] + (f" ({r.get('note') or r.get('error')})" if r.get("note") or r.get("error") else "")
    return (f"{r['step_s_median'] * 1e3:.0f} ms/step, {r['tokens_per_s']:.0f} tok/s, peak {fmt_gib(r['peak_gib'])} GiB "
            f"(+{fmt_gib(r['peak_above_weights_gib'])} over weights), loss {r['losses'][0]:.5f}")


def longest_fit(runs: list[dict], variant: str) -> Optional[int]:
    ok = [r["seq_len"] for r in runs if r["variant"] == variant and r["status"] == "ok"]
    return max(ok) if ok else None


def sft_table(doc: dict) -> list[str]:
    sft = doc["sft"]
    runs = sft["runs"]
    lens = sorted({r["seq_len"] for r in runs})
    variants = [v for v in sft["variants"] if any(r["variant"] == v for r in runs)]
    if not lens:
        return []
    lines = [f"SFT  {sft['model']}, {sft['setup']}",
             "  cell: tokens/s | peak GiB (max_memory_allocated over train(): weights+grads+optimizer+activations)"]
    head = f"  {'variant':10s}" + "".join(f"{f'seq {n}':>22s}" for n in lens) + f"{'longest fit':>14s}"
    lines.append(head)
    for v in variants:
        cells = []
        for n in lens:
            r = next((r for r in runs if r["variant"] == v and r["seq_len"] == n), None)
            if r is None:
                cells.append("-")
            elif r["status"] == "ok":
                cells.append(f"{r['tokens_per_s']:.0f} | {fmt_gib(r['peak_gib'])}")
            elif r["status"] == "skipped":
                cells.append("skipped")
            else:
                cells.append(r["status"])
        fit = longest_fit(runs, v)
        lines.append(f"  {v:10s}" + "".join(f"{c:>22s}" for c in cells) + f"{(str(fit) if fit else 'none'):>14s}")
    notes = sorted({f"{r['variant']}: {r['note']}" for r in runs if r.get("note") and r["note"] != "time budget"
                    and not r["note"].startswith(("OOM at", "error at"))})
    notes += sorted({f"{r['variant']} @ {r['seq_len']}: {r['error']}" for r in runs if r["status"] == "error"})
    if "liger" in variants:
        notes.insert(0, "liger = use_liger_kernel=True: fused linear CE plus Liger's RoPE/RMSNorm/SwiGLU kernels")
    lines += [f"  note: {n}" for n in notes]
    firsts = {f"{r['variant']}@{r['seq_len']}": r["losses"][0] for r in runs if r["status"] == "ok" and r.get("losses")}
    if firsts:
        lines.append("  step-1 loss: " + ", ".join(f"{k} {v:.4f}" for k, v in firsts.items()))
    return lines


def grpo_table(doc: dict) -> list[str]:
    grpo = doc["grpo"]
    if not grpo["runs"]:
        return []
    lines = [f"GRPO {grpo['model']}, {grpo['setup']}",
             f"  {'variant':10s}{'ms/step':>10s}{'tok/s':>10s}{'peak GiB':>10s}{'+weights':>10s}{'loss':>12s}"
             f"{'|grad|':>10s}"]
    for r in grpo["runs"]:
        if r["status"] == "ok":
            lines.append(f"  {r['variant']:10s}{r['step_s_median'] * 1e3:>10.0f}{r['tokens_per_s']:>10.0f}"
                         f"{fmt_gib(r['peak_gib']):>10s}{fmt_gib(r['peak_above_weights_gib']):>10s}"
                         f"{r['losses'][0]:>12.5f}{r['grad_norm_last']:>10.4f}")
        else:
            lines.append(f"  {r['variant']:10s}  {describe_grpo(r)}")
    return lines


def table(doc: dict) -> str:
    lines = [f"hf_fused e2e on {doc['env']['device_name']} ({doc['env']['device']}), torch {doc['env']['torch']}, "
             f"transformers {doc['env']['transformers']}, trl {doc['env'].get('trl')}, "
             f"liger {doc['env'].get('liger_kernel')}; total {doc.get('total_s', 0):.0f} s"]
    for part in (sft_table(doc), grpo_table(doc)):
        if part:
            lines += [""] + part
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# Command line.


def version_of(dist: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict:
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": version_of("transformers"),
        "trl": version_of("trl"),
        "liger_kernel": version_of("liger_kernel") or version_of("liger-kernel"),
        "triton": version_of("triton"),
        "hf_fused_backend": "triton" if device.type == "cuda" else "torch",
    }


def parse_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse_list(s: str, allowed: tuple, what: str) -> list[str]:
    items = [x.strip() for x in s.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {what}: {', '.join(bad)} (choose from {', '.join(allowed)})")
    return items


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hf_fused.bench.e2e", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("e2e_out"), help="output directory (default e2e_out)")
    p.add_argument("--parts", type=lambda s: parse_list(s, ("sft", "grpo"), "part"), default=["sft", "grpo"],
                   help="comma-separated, run in this order (default sft,grpo)")
    p.add_argument("--seq-lens", type=parse_ints, default=None,
                   help="SFT sequence lengths (default 4096,16384,32768; --tiny: 64,128,256)")
    p.add_argument("--sft-variants", type=lambda s: parse_list(s, ALL_SFT_VARIANTS, "SFT variant"),
                   default=list(SFT_VARIANTS), help=f"default {','.join(SFT_VARIANTS)}; also liger_flce")
    p.add_argument("--grpo-variants", type=lambda s: parse_list(s, GRPO_VARIANTS, "GRPO variant"),
                   default=list(GRPO_VARIANTS), help=f"default {','.join(GRPO_VARIANTS)}")
    p.add_argument("--steps", type=int, default=3, help="timed steps per run (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up steps per run (default 1)")
    p.add_argument("--optim", default="adamw_torch", help="SFT optimizer (TrainingArguments.optim; default adamw_torch)")
    p.add_argument("--grpo-completions", type=int, default=None, help="completions per step (default 8; --tiny 4)")
    p.add_argument("--grpo-prompt-len", type=int, default=None, help="prompt tokens (default 512; --tiny 16)")
    p.add_argument("--grpo-completion-len", type=int, default=None, help="completion tokens (default 2048; --tiny 32)")
    p.add_argument("--device", default=None, help="cuda or cpu (default cuda if available)")
    p.add_argument("--tiny", action="store_true", help="tiny model and lengths (CPU smoke test)")
    p.add_argument("--time-budget", type=float, default=450.0,
                   help="seconds after start past which no new run starts (default 450)")
    p.add_argument("--seed", type=int, default=0)
    return p


def resolve_args(args, parser) -> argparse.Namespace:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False (use --tiny --device cpu)")
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    args.device = device
    # bf16 weights on CUDA; fp32 on CPU, where bf16 matmuls are very slow and only the plumbing is tested.
    args.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tiny = args.tiny
    args.sft_shape = "tiny" if tiny else "qwen3-1.7b"
    args.grpo_shape = "tiny" if tiny else "qwen3-0.6b"
    args.max_positions = 512 if tiny else 40960
    args.seq_lens = args.seq_lens or ([64, 128, 256] if tiny else [4096, 16384, 32768])
    args.grpo_completions = args.grpo_completions or (4 if tiny else 8)
    args.grpo_prompt_len = args.grpo_prompt_len or (16 if tiny else 512)
    args.grpo_completion_len = args.grpo_completion_len or (32 if tiny else 2048)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    return args


def log(msg: str) -> None:
    print(msg, flush=True)


def new_doc(args, argv) -> dict:
    dt = str(args.dtype).replace("torch.", "")
    return {
        "argv": argv,
        "env": environment(args.device),
        "sft": {
            "model": f"{args.sft_shape}-shaped Qwen3 (random init, tied, {dt}, sdpa)",
            "setup": (f"Trainer, batch 1, grad checkpointing, {args.optim}, {args.warmup} warm-up + {args.steps} "
                      f"timed steps"),
            "shape": SHAPES[args.sft_shape],
            "variants": args.sft_variants,
            "runs": [],
        },
        "grpo": {
            "model": f"{args.grpo_shape}-shaped Qwen3 (random init, tied, {dt}, sdpa)",
            "setup": (f"_compute_loss + backward, {args.grpo_completions} x ({args.grpo_prompt_len} prompt + "
                      f"{args.grpo_completion_len} completion) tokens, dapo, beta 0, grad checkpointing, "
                      f"median of {args.steps} after {args.warmup} warm-up"),
            "shape": SHAPES[args.grpo_shape],
            "runs": [],
        },
    }


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = resolve_args(parser.parse_args(argv), parser)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    deadline = start + args.time_budget
    doc = new_doc(args, argv)

    def save():
        doc["total_s"] = time.perf_counter() - start
        (args.out / "e2e.json").write_text(json.dumps(doc, indent=1, default=str))

    log(f"e2e: {doc['env']}")
    threads = torch.get_num_threads()
    if args.tiny and args.device.type == "cpu":
        torch.set_num_threads(1)  # tiny matmuls: extra threads only add contention on a shared CPU
    try:
        for part in args.parts:
            (sft_part if part == "sft" else grpo_part)(args, args.device, doc, save, deadline)
    finally:
        torch.set_num_threads(threads)
    save()
    text = table(doc)
    (args.out / "e2e.txt").write_text(text + "\n")
    print("\n" + text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
