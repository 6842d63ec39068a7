"""TRL's trainers under tensor parallelism: the ones whose batching counts tensor-parallel ranks as data-parallel
processes are refused on a patched model (:func:`refuse_tensor_parallel_rollouts`).

TRL 1.16's ``GRPOTrainer`` and ``RLOOTrainer`` (and ``hf_fused.FusedGRPOTrainer``, a ``GRPOTrainer``) gather the
rewards of every process and take each process's slice by ``accelerator.process_index``; ``GRPOTrainer`` also
divides its loss's token normalizer by ``accelerator.num_processes``. Under accelerate's
``ParallelismConfig(tp_size=n)`` the ``n`` ranks of one model replica are ``n`` processes holding the same prompts:
each group's rewards are gathered ``n`` times (its standard deviation, so the advantages, change) and GRPO's loss is
divided by ``n``. Measured on 2 CPU ranks
over gloo (GRPO, 3 SGD steps, the tiny model of tests/distributed/test_tensor_parallel.py): the parameters ended 0.74
of the update away from the single-process run, whatever computes the head. ``SFTTrainer`` and ``DPOTrainer``
count tokens per batch and train exactly under tensor parallelism (tests/distributed/test_tensor_parallel.py).
"""

from __future__ import annotations

#: TRL trainers (class names along the MRO) whose rollouts are split by process index.
ROLLOUT_TRAINERS = ("GRPOTrainer", "RLOOTrainer")


def refuse_tensor_parallel_rollouts(trainer) -> None:
    """Raise for a GRPO or RLOO trainer (TRL's, or a subclass) built under tensor parallelism (its accelerator's
    ``parallelism_config.tp_enabled``); any other trainer or layout passes.

    Raises:
        NotImplementedError: naming the trainer and what to do instead.
    """
    names = {cls.__name__ for cls in type(trainer).__mro__}
    rollout = next((name for name in ROLLOUT_TRAINERS if name in names), None)
    config = getattr(getattr(trainer, "accelerator", None), "parallelism_config", None)
    if rollout is None or config is None or not getattr(config, "tp_enabled", False):
        return
    normalizer = ", and divides its loss by the number of processes" if rollout == "GRPOTrainer" else ""
    raise NotImplementedError(
        f"hf_fused: {type(trainer).__name__} under tensor parallelism (tp_size={config.tp_size}) is not supported: "
        f"TRL's {rollout} counts each tensor-parallel rank as a data-parallel process (it gathers every process's "
        f"rewards, each group tp_size times over, and slices them by process index{normalizer}), so it would not "
        "train its objective. Train it with data parallelism, FSDP2 or DeepSpeed ZeRO (no tp_size); SFTTrainer and "
        "DPOTrainer run under tensor parallelism (docs/tensor_parallel.md)"
    )
