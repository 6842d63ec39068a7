"""Part A: SFT steps with ``transformers.Trainer`` (unpatched vs Liger vs ``apply_fused_loss``) and with TRL's
``SFTTrainer`` (its own fused LM head vs ``apply_fused_loss``), on the same model and token rows."""

from __future__ import annotations

import contextlib
import importlib
import statistics
import tempfile
import time
import traceback
from typing import Optional

import torch

from ..measure import GIB, allocated_gib, free_memory, is_oom, peak_gib, reset_peak, short_error, synchronize
from .models import (
    RandomTokens, attn_implementation, build_model, checkpointing_on, is_gemma2, make_step_timer, model_config, n_params,
    quiet_run_kwargs,
)
from .report import describe_sft

#: ``Trainer`` variants, then ``SFTTrainer`` ones: ``trl_sft`` (TRL 1.16's own chunked fused LM head, installed by
#: ``SFTTrainer``) and ``hf_fused_trl_sft`` (``apply_fused_loss(model)`` first: hf_fused answers TRL's fused call).
#: Also: ``liger_flce`` (Liger's fused linear cross-entropy alone) and ``hf_fused_liger`` (``apply_fused_loss`` +
#: ``Trainer(use_liger_kernel=True)``: Liger's RoPE/RMSNorm/SwiGLU kernels with hf_fused's loss).
SFT_VARIANTS = ("plain", "liger", "hf_fused", "trl_sft", "hf_fused_trl_sft")
ALL_SFT_VARIANTS = SFT_VARIANTS + ("liger_flce", "hf_fused_liger")
TRL_SFT_VARIANTS = ("trl_sft", "hf_fused_trl_sft")
LIGER_VARIANTS = ("liger", "liger_flce", "hf_fused_liger")

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
        **quiet_run_kwargs(args, device, TrainingArguments),
    )
    if variant in LIGER_VARIANTS:
        kwargs["use_liger_kernel"] = True
    if variant == "liger_flce":
        kwargs["liger_kernel_config"] = dict(rope=False, rms_norm=False, swiglu=False,
                                             fused_linear_cross_entropy=True)
    return TrainingArguments(**kwargs)


def sft_trl_config(out_dir: str, seq_len: int, args, device: torch.device):
    """``SFTConfig`` with the ``Trainer`` variants' settings; ``max_length`` the row length (no truncation),
    no packing, ``loss_type="nll"`` (TRL's default: mean negative log-likelihood over the label tokens)."""
    from trl import SFTConfig

    return SFTConfig(
        output_dir=out_dir, max_steps=args.warmup + args.steps, per_device_train_batch_size=1,
        gradient_accumulation_steps=1, learning_rate=1e-5, optim=args.optim, max_length=seq_len, packing=False,
        loss_type="nll", **quiet_run_kwargs(args, device, SFTConfig),
    )


def _training_args(variant: str, tmp: str, seq_len: int, args, device):
    if variant in TRL_SFT_VARIANTS:
        return sft_trl_config(tmp, seq_len, args, device)
    return sft_training_args(variant, tmp, args, device)


def _make_trainer(variant: str, model, dataset: RandomTokens, training_args, timer):
    if variant in TRL_SFT_VARIANTS:
        from trl import SFTTrainer

        from .grpo import word_tokenizer

        # The rows are pre-tokenized ids; the tokenizer only supplies the pad / eos ids SFTTrainer asks for.
        return SFTTrainer(model=model, args=training_args, train_dataset=dataset.as_hf_dataset(),
                          processing_class=word_tokenizer(), callbacks=[timer])
    from transformers import Trainer

    return Trainer(model=model, args=training_args, train_dataset=dataset, callbacks=[timer])


def _sft_once(variant: str, seq_len: int, args, device: torch.device) -> dict:
    from transformers.trainer_callback import PrinterCallback

    with tempfile.TemporaryDirectory() as tmp:
        # The arguments before the model, as users write it: under accelerate's ZeRO-3 config (zero3_init_flag)
        # they make transformers build the model partitioned (deepspeed.zero.Init), for every variant alike.
        training_args = _training_args(variant, tmp, seq_len, args, device)
        t_build = time.perf_counter()
        config = model_config(args.sft_shape, max(args.max_positions, seq_len))
        model = build_model(config, device, args.dtype, args.seed, attn_implementation(args.sft_shape))
        if variant in ("hf_fused", "hf_fused_trl_sft", "hf_fused_liger"):
            from hf_fused import apply_fused_loss

            apply_fused_loss(model)
        synchronize(device)
        build_s = time.perf_counter() - t_build
        weights = allocated_gib(device)
        timer = make_step_timer(device)
        dataset = RandomTokens(args.warmup + args.steps, seq_len, config.vocab_size, args.seed, args.position_ids)
        trainer = _make_trainer(variant, model, dataset, training_args, timer)
        trainer.remove_callback(PrinterCallback)  # no per-step log dicts on stdout
        reset_peak(device)
        t_train = time.perf_counter()
        trainer.train()
        synchronize(device)
        train_s = time.perf_counter() - t_train
    peak = peak_gib(device)
    checkpointing = checkpointing_on(model)
    forward = getattr(model.forward, "__func__", model.forward)
    forward = f"{getattr(forward, '__module__', '?')}.{getattr(forward, '__qualname__', '?')}"
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    wrapper = engine_description(trainer)
    trainer.accelerator.free_memory()
    timed = timer.times[args.warmup:]
    if not timed:
        raise RuntimeError(f"no timed steps (callback saw {len(timer.times)} steps)")
    return {
        "status": "ok",
        "tokens_per_s": seq_len / statistics.median(timed),  # median: see the package docstring
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
        "wrapper": wrapper,
    }


def engine_description(trainer) -> str:
    """What trained the model: the class that wrapped it (``DistributedDataParallel``, ``DeepSpeedEngine``,
    ``FullyShardedDataParallel``, ``FSDP<Model>`` of FSDP2, the model's own class in one process), and ``cp<N>`` /
    ``sp<N>`` when ``N`` ranks shared each sequence (context / Ulysses sequence parallelism). A run is only as good as this: accelerate runs an FSDP config as DDP on
    CPU ranks without a word, and a context-parallel config whose ranks each trained the whole row would report
    twice the tokens."""
    name = type(trainer.model_wrapped).__name__
    config = getattr(trainer.accelerator, "parallelism_config", None)
    for kind in ("cp", "sp"):  # torch's context parallelism, DeepSpeed's Ulysses sequence parallelism
        if config is not None and getattr(config, f"{kind}_enabled", False):
            return f"{name} {kind}{getattr(config, f'{kind}_size')}"
    return name


def run_sft(variant: str, seq_len: int, args, device: torch.device) -> dict:
    """One (variant, sequence length) run; OOM and other errors become a status, never an exception."""
    leftover = free_memory(device)
    t0 = time.perf_counter()
    family = "gemma2" if is_gemma2(args.sft_shape) else "qwen3"
    ctx = (restored_module_globals(f"transformers.models.{family}.modeling_{family}") if variant in LIGER_VARIANTS
           else contextlib.nullcontext())
    try:
        with ctx:
            result = _sft_once(variant, seq_len, args, device)
    except Exception as e:  # noqa: BLE001 - record and go on with the next run
        result = {"status": "OOM" if is_oom(e) else "error", "error": short_error(e)}
        if result["status"] == "error":
            result["traceback"] = traceback.format_exc()[-3000:]
        result["peak_gib"] = peak_gib(device)
    result.update(variant=variant, seq_len=seq_len, wall_s=time.perf_counter() - t0, allocated_before_gib=None if leftover is None else leftover / GIB)
    free_memory(device)
    return result


def sft_part(args, device: torch.device, doc: dict, save, deadline: float, bar) -> None:
    """Run part A's runs into ``doc``, saving after each and advancing ``bar`` (:func:`benchmarks.measure.progress`)."""
    runs = doc["sft"]["runs"]
    for variant in args.sft_variants:
        skip_reason = liger_unavailable(device) if variant in LIGER_VARIANTS else None
        failed_at = None
        for seq_len in sorted(args.seq_lens):
            if skip_reason:
                res = {"status": "skipped", "note": skip_reason}
            elif failed_at is not None:
                res = {"status": "skipped", "note": f"{failed_at[0]} at {failed_at[1]} tokens"}
            elif time.perf_counter() > deadline:
                res = {"status": "skipped", "note": "time budget"}
            else:
                bar.write(f"SFT {variant:10s} seq {seq_len:6d} ...")
                res = run_sft(variant, seq_len, args, device)
                bar.write(f"    -> {describe_sft(res)}  ({res['wall_s']:.1f} s)")
                if res["status"] in ("OOM", "error"):  # longer sequences would fail the same way
                    failed_at = (res["status"], seq_len)
            res.setdefault("variant", variant)
            res.setdefault("seq_len", seq_len)
            runs.append(res)
            save()
            bar.update(1)
