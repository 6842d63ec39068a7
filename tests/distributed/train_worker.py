"""Training runs for tests/distributed: a tiny causal LM trained for a few optimizer steps with
``transformers.Trainer`` (optionally patched by ``hf_fused.apply_fused_loss``) or ``hf_fused.FusedTrainer``.

Run it under ``accelerate launch --config_file <engine>.yaml`` (the engine's ranks) or as a plain process
(the single-process reference), with one argument: a JSON file listing the runs of this launch,
``[{"case": {...}, "dir": ...}, ...]``. The runs train one after the other in this process (the launch, not the
steps, is what costs; each run's ``TrainingArguments`` sets accelerate's state up afresh, and the environment is
restored after each run); a run that raises leaves its traceback in ``<dir>/error.txt`` and the next one starts.
A case:

    model_dir   a tiny model saved with ``save_pretrained`` (loaded with ``from_pretrained`` after
                TrainingArguments exist, so under ZeRO-3 it is built partitioned inside ``deepspeed.zero.Init``)
    <dir>/result.pt   where rank 0 writes ``torch.save({"losses", "params", "initial", "world", "lm_head_numel",
                "head_calls", "model_positions", "n_gpu", ...})``: logged losses, whole parameters after and before
                training, ranks, lm_head.weight.numel() outside its forward (0 when ZeRO-3 partitioned it), hf_fused's
                head computations in this process during training, the most positions of a row the model embedded
                (half the row when two ranks share it), and the Trainer's ``n_gpu`` (2: DataParallel)
    trainer     "Trainer" | "FusedTrainer"
    fused       with "Trainer": patch the model with ``apply_fused_loss`` first
    batch       per-device batch size (the reference uses ranks × batch)
    ga, steps, grad_ckpt, lora ("" | "lm_head": LoRA on attention and lm_head), bf16
    tile_budget_bytes   FusedTrainer's tile bound (small: many tiles per loss call)
    trainer_fsdp        1 | 2: ``TrainingArguments(fsdp="full_shard auto_wrap")``, FSDP1 (``fsdp_config={"version": 1}``)
                        or FSDP2 (transformers 5's default) set up by transformers itself
    attn, no_padding    attention implementation (default "eager"); rows without padding (context parallelism)
    position_ids        rows carry ``position_ids`` (what DeepSpeed's Ulysses sequence parallelism requires)
    count_head_events   ZeRO-3: count lm_head.weight's gathers and gradient reductions during training
    gpus                GPUs a plain process sees (launch.py; with 2 the Trainer runs ``nn.DataParallel``)
    track_vocab_tensors record the most rows of any vocabulary-wide tensor made in training
    cuda        train on the GPU (default: CPU)

Optimizer: plain SGD at a constant learning rate, so the parameter update is ``−lr·Σ gradients``: an
error in any gradient shows in the updated parameters in proportion (Adam would normalize it away).
"""

from __future__ import annotations

import os
import sys

import torch
import transformers
from torch.utils.data import Dataset

from models import make_batch
from ranks import exit_rank, run_each

#: Samples in the training set: enough for ``steps × ga × ranks × batch``, each with its own labels.
SAMPLES = 64


class TinyDataset(Dataset):
    """Fixed-length rows from :func:`models.make_batch` (prompt prefix and padding ignored)."""

    def __init__(self, samples: int = SAMPLES, seq: int = 12, padding: bool = True, position_ids: bool = False):
        ids, mask, labels = make_batch(samples, seq, seed=7)
        if padding:
            self.rows = [dict(input_ids=i, attention_mask=m, labels=y) for i, m, y in zip(ids, mask, labels)]
        else:  # context parallelism shards causal sequences only: no attention mask, prompt prefixes still ignored
            labels[mask == 0] = ids[mask == 0]
            self.rows = [dict(input_ids=i, labels=y) for i, y in zip(ids, labels)]
        if position_ids:  # DeepSpeed's Ulysses dataloader adapter requires them (each shard keeps its positions)
            for row in self.rows:
                row["position_ids"] = torch.arange(seq)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a whole fp32 CPU tensor: gathered from ZeRO-3 partitions, FSDP1 flat shards or FSDP2
    DTensors (collective: every rank must call it). Under DeepSpeed's bf16/fp16, once its optimizer exists, the
    fp32 master weights it updates rather than the model's low-precision copies of them: a copy only moves where an
    update crosses the spacing of the weight's value (2^-8 for a LayerNorm weight near 1), so two runs whose
    gradients agree within bf16's rounding stand a whole spacing apart wherever one rounding fell the other way
    (TRL's SFT script under TRL's ZeRO-3 config, patched against unpatched: the bf16 copies of a LayerNorm weight
    whose updates were 0, ±2^-8 and ±2^-7 were 0.25 of that update apart)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            return {_canonical(n): p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    out = {}
    for name, p in model.named_parameters():
        master = _deepspeed_master(p)
        if master is not None:
            out[name] = master.detach().float().cpu().clone()
        elif hasattr(p, "ds_status"):
            import deepspeed

            with deepspeed.zero.GatheredParameters([p]):
                out[name] = p.detach().float().cpu().clone()
        elif hasattr(p, "full_tensor"):
            out[name] = p.full_tensor().detach().float().cpu().clone()
        else:
            out[name] = p.detach().float().cpu().clone()
    return {_canonical(n): t for n, t in out.items()}


def _deepspeed_master(p: torch.nn.Parameter) -> torch.Tensor | None:
    """``p``'s whole fp32 master weight when DeepSpeed's optimizer keeps one for a bf16/fp16 ``p`` (ZeRO-3:
    ``_z3_optimizer``; ZeRO-1/2: ``_hp_mapping``, set on every rank, None where another rank holds the fragment;
    collective), else None (fp32 training, or no optimizer yet: the masters start as the low-precision weights'
    exact values)."""
    if p.dtype == torch.float32 or not p.requires_grad:
        return None
    if not hasattr(p, "_z3_optimizer") and not hasattr(p, "_hp_mapping"):
        return None
    from deepspeed.utils import safe_get_full_fp32_param

    return safe_get_full_fp32_param(p)


def _canonical(name: str) -> str:
    # One name per parameter whatever wraps the model (DDP/DeepSpeed ``module.``, FSDP, compile).
    for prefix in ("module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(prefix, "")
    return name


#: ZeRO-3's lm_head events by kind and parameter ``ds_id`` (:func:`count_head_events`), and hf_fused's head
#: computations (:func:`count_fused_head_calls`), counted by wrappers installed once per process.
HEAD_EVENTS: dict = {}
HEAD_CALLS = {"all": 0, "partitioned": 0, "max_positions": 0}
_installed: set = set()


def load_tiny_model(model_dir: str):
    """``(model, its lm_head's local numel, every parameter as a whole fp32 tensor)``: the saved tiny model in fp32
    with eager attention, loaded under whatever engine config is active (ZeRO-3: partitioned, numel 0)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager",
                                                              dtype=torch.float32)
    return model, model.get_output_embeddings().weight.numel(), full_parameters(model)


def run_trl_worker(train) -> None:
    """A TRL worker's entry point: ``train(case, <dir>/result.pt)`` for each run of the batch file named on the
    command line, one thread per rank."""
    from pathlib import Path

    torch.set_num_threads(1)
    run_each(sys.argv[1], lambda case, directory: train(case, Path(directory) / "result.pt"))
    exit_rank()


def save_trl_run(trainer, out, initial: dict, lm_head_numel: int, fused_calls: dict) -> None:
    """After ``trainer.train()`` (every rank calls it: the parameters are gathered): rank 0 saves
    ``{"losses", "logs", "fused_calls", "params", "initial", "lm_head_numel", "world", "wrapper"}`` to ``out``, every
    logged entry with a loss per step (grpo_worker.py, preference_worker.py)."""
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    params = full_parameters(trainer.model)
    if trainer.accelerator.is_main_process:
        torch.save({"losses": [entry["loss"] for entry in logs], "logs": logs, "fused_calls": dict(fused_calls),
                    "params": params, "initial": initial, "lm_head_numel": lm_head_numel,
                    "world": trainer.accelerator.num_processes, "wrapper": type(trainer.model_wrapped).__name__},
                   out)
    trainer.accelerator.wait_for_everyone()


def count_head_events() -> dict:
    """ZeRO-3 only: count, per lm_head parameter ``ds_id``, DeepSpeed's fetches of a module's parameters in
    forward, hf_fused's own all-gathers (:mod:`hf_fused.model.distributed`) and DeepSpeed's gradient
    reductions (its reduce hook), into :data:`HEAD_EVENTS` (cleared). Class-level wrappers, installed before the
    first engine exists and once per process."""
    HEAD_EVENTS.clear()
    if "head_events" in _installed:
        return HEAD_EVENTS
    _installed.add("head_events")
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    from hf_fused.model import distributed

    def tally(kind, params):
        for p in params:
            HEAD_EVENTS.setdefault(kind, {}).setdefault(p.ds_id, 0)
            HEAD_EVENTS[kind][p.ds_id] += 1

    fetch = PartitionedParameterCoordinator.fetch_sub_module
    reduce = DeepSpeedZeroOptimizer_Stage3.reduce_ready_partitions_and_remove_grads
    add = distributed._Gather.add

    def counted_fetch(self, module, forward):
        if forward:
            tally("deepspeed_forward_fetches", module.parameters(recurse=False))
        return fetch(self, module, forward)

    def counted_reduce(self, param):
        tally("reductions", [param])
        return reduce(self, param)

    def counted_add(self, params):
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        tally("hf_fused_gathers", [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE])
        return add(self, params)

    PartitionedParameterCoordinator.fetch_sub_module = counted_fetch
    DeepSpeedZeroOptimizer_Stage3.reduce_ready_partitions_and_remove_grads = counted_reduce
    distributed._Gather.add = counted_add
    return HEAD_EVENTS


def count_fused_head_calls() -> dict:
    """Count, from now on (:data:`HEAD_CALLS`, zeroed), hf_fused's head computations, how many found lm_head
    partitioned by ZeRO-3 (so they went through the gather-for-backward node of hf_fused.model.distributed), and
    the most sequence positions one call received (context parallelism gives each rank its share)."""
    HEAD_CALLS.update(all=0, partitioned=0, max_positions=0)
    if "head_calls" in _installed:
        return HEAD_CALLS
    _installed.add("head_calls")
    from hf_fused.model import distributed, forward

    run_head = forward.run_head

    def counted(lm_head, hidden, compute):
        HEAD_CALLS["all"] += 1
        HEAD_CALLS["max_positions"] = max(HEAD_CALLS["max_positions"], hidden.shape[-2])  # [B, T, H]: this rank's T
        HEAD_CALLS["partitioned"] += bool(distributed.partitioned_head_params(lm_head))
        return run_head(lm_head, hidden, compute)

    forward.run_head = counted
    return HEAD_CALLS


class VocabWidthTracker:
    """A dispatch mode that records the most rows of any tensor an op produces with the vocabulary as its
    last dimension (logits or a tile of them): ``[N, V]`` logits would show N rows. Tensors of the weight's
    size (``V·H`` elements: lm_head's weight, its gradient, their transposes) are not logits and are skipped."""

    def __init__(self, vocab: int, hidden: int):
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self
        self.vocab, self.weight_numel, self.max_rows = vocab, vocab * hidden, 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if (isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == tracker.vocab
                            and t.numel() != tracker.weight_numel):
                        tracker.max_rows = max(tracker.max_rows, t.numel() // tracker.vocab)
                return out

        self.mode = Mode()


def train(case: dict, out: str) -> None:
    """Train ``case``; rank 0 saves the result to ``out``."""
    counts = count_head_events() if case.get("count_head_events") else {}
    args = transformers.TrainingArguments(
        output_dir=os.path.join(os.path.dirname(out), "trainer"),
        per_device_train_batch_size=case["batch"],
        gradient_accumulation_steps=case.get("ga", 1),
        max_steps=case.get("steps", 3),
        learning_rate=case.get("lr", 0.5),
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,  # no clipping: the update stays −lr·gradient
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        data_seed=0,
        gradient_checkpointing=case.get("grad_ckpt", False),
        bf16=case.get("bf16", False),
        # transformers' own FSDP switch (decoder layers from the model's _no_split_modules), no FSDP launch config:
        # FSDP2 by default in transformers 5, FSDP1 with fsdp_config={"version": 1} (whose default
        # sync_module_states broadcasts through a GPU: off on CPU ranks)
        **(dict(fsdp="full_shard auto_wrap", fsdp_config=None if case["trainer_fsdp"] == 2 else
                {"version": 1, "sync_module_states": bool(case.get("cuda"))}) if case.get("trainer_fsdp") else {}),
        use_cpu=not case.get("cuda", False),
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        case["model_dir"], attn_implementation=case.get("attn", "eager"), dtype=torch.float32
    )
    if case.get("lora"):
        import peft

        transformers.set_seed(0)  # the adapter's initial values: the same in every process
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "lm_head"],
            init_lora_weights=False,  # B ≠ 0: the adapter changes lm_head's output from the first step
        ))
    trainer_cls = transformers.Trainer
    if case["trainer"] == "FusedTrainer":
        from hf_fused import FusedTrainer as trainer_cls
    elif case.get("fused"):
        from hf_fused import apply_fused_loss

        apply_fused_loss(model)
    head = model.get_output_embeddings()
    head_weight = getattr(head, "weight", None)
    if head_weight is None:  # PEFT LoRA layer: the base layer holds the weight
        head_weight = head.base_layer.weight
    lm_head_numel = head_weight.numel()
    initial = full_parameters(model)
    extra = {}
    if case["trainer"] == "FusedTrainer" and case.get("tile_budget_bytes"):
        extra["fused_options"] = {"tile_budget_bytes": case["tile_budget_bytes"]}
    dataset = TinyDataset(padding=not case.get("no_padding"), position_ids=case.get("position_ids", False))
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset,
                          data_collator=transformers.default_data_collator, **extra)
    counts.clear()  # from here on: training only (not the patch-time probe)
    head_calls = count_fused_head_calls()
    model_positions = [0]  # the most positions of a row this rank's model embedded (sequence/context parallelism)
    model.get_input_embeddings().register_forward_hook(
        lambda module, inputs, output: model_positions.__setitem__(0, max(model_positions[0], inputs[0].shape[-1])))
    tracker = VocabWidthTracker(model.config.vocab_size, model.config.hidden_size)
    if case.get("track_vocab_tensors"):
        with tracker.mode:
            trainer.train()
    else:
        trainer.train()
    head_counts = {kind: by_id.get(getattr(head_weight, "ds_id", None), 0) for kind, by_id in counts.items()}
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    params = full_parameters(trainer.model)
    if trainer.accelerator.is_main_process:
        torch.save({"losses": losses, "params": params, "initial": initial, "world": trainer.accelerator.num_processes,
                    "head_counts": head_counts, "max_vocab_rows": tracker.max_rows,
                    "lm_head_numel": lm_head_numel, "head_calls": head_calls["all"],
                    "head_positions": head_calls["max_positions"], "model_positions": model_positions[0],
                    "n_gpu": trainer.args.n_gpu,
                    "wrapper": type(trainer.model_wrapped).__name__},
                   out)
    trainer.accelerator.wait_for_everyone()


def main(batch_file: str) -> None:
    torch.set_num_threads(1)
    run_each(batch_file, lambda case, directory: train(case, os.path.join(directory, "result.pt")))


if __name__ == "__main__":
    main(sys.argv[1])
    exit_rank()
