"""TRL's rollout trainers under tensor parallelism: each tensor-parallel group trains as ONE data-parallel replica
(:func:`serve_tensor_parallel_rollouts`, called when a ``GRPOTrainer`` or ``RLOOTrainer`` — TRL's, or a subclass such
as ``hf_fused.FusedGRPOTrainer`` — has been built around a patched model).

Under accelerate's ``ParallelismConfig(tp_size=n)`` the ``n`` ranks of a tensor-parallel group hold one model replica,
and accelerate's data loader (``prepare_data_loader`` with the device mesh) hands them the same prompts. TRL 1.16's
``GRPOTrainer`` and ``RLOOTrainer`` take every process for a data-parallel replica instead. What that changes, in
TRL 1.16's ``grpo_trainer.py`` and ``rloo_trainer.py``, and what answers each:

* ``GRPOConfig.__post_init__`` (``RLOOConfig``'s alike) sets ``generation_batch_size = per_device_train_batch_size ×
  world_size × steps_per_generation``, and the ``RepeatSampler`` takes ``generation_batch_size / num_generations``
  prompts per generation, ``n`` times what a replica's loader yields per generation: with ``steps_per_generation`` or
  ``num_iterations`` above 1 a generation's prompts arrive over several of the loader's batches, of which the trainer
  generates from the first only (prompts skipped, others trained twice). Here: the trainer's ``args`` become a copy with
  ``generation_batch_size = per_device_train_batch_size × replicas × steps_per_generation`` (``steps_per_generation``
  and the per-device batch, which set what each replica's loader yields, are kept).
* ``__init__`` ends with ``set_seed(args.seed, device_specific=True)`` (the seed plus the process index).
  transformers' ``generate`` samples from the global generator and ``_prepare_inputs`` shuffles the generation batch
  with it: the ranks of a group would sample different completions of the same prompts and shuffle them differently,
  while every forward of the tensor-parallel model is a collective over them. Here: re-seeded with the seed plus the
  replica's index, so the ranks of a group draw the same numbers (replica 0 draws what one process would).
* ``_calculate_rewards`` gathers the rewards of every process (``gather``, the name ``accelerate.utils.gather`` in the
  trainer's module; RLOO also ``gather(kl)``) and ``_generate_and_score_completions`` slices its advantages back by
  ``accelerator.process_index``: each group's rows ``n`` times over (batch-level standard deviations change), and
  ranks of one replica would take different slices. ``gather_object`` (prompts, completions, user log columns),
  ``accelerator.gather`` (``num_items_in_batch``, lengths, token counts, clip ratios), ``accelerator.reduce`` (entropy,
  KL) and ``accelerator.gather_for_metrics`` (the router loss) count each replica ``n`` times; GRPO's ``cispo``,
  ``dapo`` and ``vespo`` losses divide ``num_items_in_batch`` by ``accelerator.num_processes``. Here: during each call
  of ``_generate_and_score_completions`` and ``_compute_loss`` (:func:`data_parallel_view`) ``trainer.accelerator`` is
  a :class:`DataParallelAccelerator` — the replica's index and the replica count for ``process_index`` and
  ``num_processes``, gathers and reductions that keep one process per replica — and the trainer module's ``gather``
  and ``gather_object`` names are bound to the same views. The gathers are TRL's own (accelerate's, over every
  process); the rows of each replica's first process are kept (:class:`DataParallelLayout`). The ranks of a replica
  hold the same rollouts, and hf_fused's vocabulary-parallel head gives each of them the same merged log-probs.

Refused under tensor parallelism, each saying why (:func:`serve_tensor_parallel_rollouts`): vLLM generation (its
weight sync and colocated engines split prompts by process) and transformers' continuous batching (not verified),
context or sequence parallelism beside it (a replica's ranks then hold different tokens), and a generation batch per
replica that is not a whole number of groups.

Verified (tests/distributed/test_tensor_parallel.py): ``FusedGRPOTrainer`` and TRL's ``RLOOTrainer`` on a patched
model under ``ParallelismConfig(tp_size=2)``, and ``FusedGRPOTrainer`` under ``ParallelismConfig(dp_shard_size=2,
tp_size=2)`` (FSDP2 over 2 replicas), completions sampled by transformers' ``generate`` on the tensor-parallel model,
against TRL's single-process unpatched run on the same global batch (under FSDP2 × TP sampling each replica's prompts
from that replica's seed); the replica layout of ``(dp_shard, tp)`` and ``(dp_replicate, dp_shard, tp)`` meshes on
stand-ins (tests/integrations/test_trl_tensor_parallel.py).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

#: TRL trainers (class names along the MRO) whose rollouts are scored, normalized and split by process.
ROLLOUT_TRAINERS = ("GRPOTrainer", "RLOOTrainer")

#: The trainer methods that gather, reduce or slice by process (TRL 1.16): run inside :func:`data_parallel_view`.
VIEWED_METHODS = ("_generate_and_score_completions", "_compute_loss")

#: The names of the trainer's TRL module that gather over processes (imported from ``accelerate.utils``).
VIEWED_MODULE_FUNCTIONS = ("gather", "gather_object")

_SERVED = "_hf_fused_data_parallel_layout"


@dataclass(frozen=True)
class DataParallelLayout:
    """Which processes form each data-parallel replica, read from accelerate's device mesh.

    Attributes:
        world: the number of processes.
        index: this process's replica (the data loader's index: ranks of one replica get the same batch).
        size: the number of replicas (the product of the enabled ``dp_replicate`` and ``dp_shard`` sizes).
        leaders: each replica's first process (global rank), in replica order: whose rows a gather keeps.
    """

    world: int
    index: int
    size: int
    leaders: tuple

    @classmethod
    def of(cls, accelerator) -> "DataParallelLayout":
        """The layout of ``accelerator.torch_device_mesh``: the data-parallel dimensions (``parallelism_config
        .dp_dim_names``) index the replicas in row-major order, the others (``tp``) the ranks of a replica."""
        mesh, config = accelerator.torch_device_mesh, accelerator.parallelism_config
        names = list(mesh.mesh_dim_names)
        data = [names.index(name) for name in config.dp_dim_names]
        model = [i for i in range(len(names)) if i not in data]
        table = mesh.mesh.permute(*data, *model).reshape(-1, config.non_data_parallel_size)  # [replicas, ranks]
        rank = torch.distributed.get_rank()
        index = int((table == rank).any(dim=1).nonzero()[0, 0])
        return cls(world=torch.distributed.get_world_size(), index=index, size=table.size(0),
                   leaders=tuple(int(r) for r in table[:, 0]))

    def replica_rows(self, gathered: torch.Tensor) -> torch.Tensor:
        """``gathered`` (every process's equal-sized rows, in rank order, as accelerate's ``gather`` returns them)
        reduced to the rows of each replica's first process, in replica order."""
        return gathered.unflatten(0, (self.world, -1))[list(self.leaders)].flatten(0, 1)

    def replica_objects(self, per_process: list) -> list:
        """One entry of ``per_process`` (one per process, in rank order) per replica."""
        return [per_process[rank] for rank in self.leaders]


class DataParallelAccelerator:
    """Stands in for a rollout trainer's ``accelerator`` inside :func:`data_parallel_view`: ``process_index`` and
    ``num_processes`` are the replica's index and the replica count; ``gather``, ``gather_for_metrics`` and ``reduce``
    keep one process per replica (:class:`DataParallelLayout`). Everything else is the accelerator's own
    (``pad_across_processes`` too: padding to the longest of all processes equals the longest of the replicas, whose
    ranks hold the same rows)."""

    def __init__(self, accelerator, layout: DataParallelLayout):
        object.__setattr__(self, "_accelerator", accelerator)
        object.__setattr__(self, "_layout", layout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._accelerator, name, value)

    @property
    def process_index(self) -> int:
        return self._layout.index

    @property
    def num_processes(self) -> int:
        return self._layout.size

    def gather(self, tensor):
        """accelerate's ``Accelerator.gather`` over the replicas (nested structures of tensors too)."""
        return replica_gather(self._accelerator.gather, self._layout)(tensor)

    def gather_for_metrics(self, input_data, use_gather_object: bool = False):
        """Tensors as :meth:`gather`, anything else as ``gather_object`` over the replicas. (TRL's rollout trainers
        call it on one router loss per process.)"""
        from accelerate.utils import gather_object, recursively_apply

        if not use_gather_object:
            try:  # accelerate's own test: only tensors, at any depth
                recursively_apply(lambda t: t, input_data, error_on_other_type=True)
            except TypeError:
                use_gather_object = True
        if use_gather_object:
            return replica_gather_object(gather_object, self._layout)(input_data)
        return self.gather(input_data)

    def reduce(self, tensor, reduction: str = "sum", scale: float = 1.0):
        """accelerate's ``Accelerator.reduce`` over the replicas: ``"sum"`` (and accelerate's ``"none"``, also a
        sum), ``"mean"`` (the sum over the replica count) or ``"max"``."""
        from accelerate.utils import recursively_apply

        if reduction not in ("sum", "mean", "max", "none"):
            raise ValueError(f"hf_fused: reduce(reduction={reduction!r}): expected 'sum', 'mean', 'max' or 'none'")

        def one(t: torch.Tensor) -> torch.Tensor:
            per_replica = self._layout.replica_rows(self._accelerator.gather(t.unsqueeze(0)))
            if reduction == "max":
                return per_replica.amax(dim=0)
            out = per_replica.sum(dim=0)
            return out / self._layout.size if reduction == "mean" else out

        return recursively_apply(one, tensor, error_on_other_type=True)


def replica_gather(gather: Callable, layout: DataParallelLayout) -> Callable:
    """``gather`` (accelerate's ``gather``: every process's rows, concatenated) keeping each replica's first
    process's rows."""
    from accelerate.utils import recursively_apply

    @functools.wraps(gather)
    def gather_replicas(tensor):
        return recursively_apply(layout.replica_rows, gather(tensor))

    return gather_replicas


def replica_gather_object(gather_object: Callable, layout: DataParallelLayout) -> Callable:
    """``gather_object`` (accelerate's: every process's list, concatenated) over the replicas: each process's
    object is gathered whole (``gather_object([obj])``), one per replica kept, and those concatenated."""

    @functools.wraps(gather_object)
    def gather_object_replicas(obj):
        return [item for kept in layout.replica_objects(gather_object([obj])) for item in kept]

    return gather_object_replicas


@contextlib.contextmanager
def data_parallel_view(trainer, layout: DataParallelLayout, module):
    """While open: ``trainer.accelerator`` is a :class:`DataParallelAccelerator` and ``module``'s (the TRL module
    defining the trainer's rollout code) ``gather`` and ``gather_object`` keep one process per replica; all put back
    on exit. Re-entrant (an open view is kept as it is)."""
    accelerator = trainer.accelerator
    if isinstance(accelerator, DataParallelAccelerator):
        yield
        return
    saved = {name: vars(module)[name] for name in VIEWED_MODULE_FUNCTIONS if name in vars(module)}
    views = {"gather": replica_gather, "gather_object": replica_gather_object}
    trainer.accelerator = DataParallelAccelerator(accelerator, layout)
    for name, function in saved.items():
        setattr(module, name, views[name](function, layout))
    try:
        yield
    finally:
        trainer.accelerator = accelerator
        for name, function in saved.items():
            setattr(module, name, function)


def rollout_trainer_class(trainer) -> Optional[type]:
    """The TRL class of :data:`ROLLOUT_TRAINERS` along ``trainer``'s MRO (``None`` if it is none of them)."""
    return next((cls for cls in type(trainer).__mro__ if cls.__name__ in ROLLOUT_TRAINERS
                 and cls.__module__.startswith("trl.")), None)


def serve_tensor_parallel_rollouts(trainer) -> Optional[DataParallelLayout]:
    """Make a GRPO or RLOO trainer (TRL's, or a subclass) built under tensor parallelism (its accelerator's
    ``parallelism_config.tp_enabled``) train each tensor-parallel group as one data-parallel replica (module
    docstring): ``trainer.args`` copied with the generation batch of the replicas, the global generators re-seeded
    with ``args.seed`` plus the replica's index, and :data:`VIEWED_METHODS` wrapped on the instance in
    :func:`data_parallel_view`. Call it once ``__init__`` has returned. Idempotent; any other trainer or layout
    passes untouched (``None``).

    Returns:
        The :class:`DataParallelLayout` served, or ``None``.

    Raises:
        NotImplementedError: vLLM or continuous-batching generation, or context or sequence parallelism beside
            tensor parallelism (the message says what to do instead).
        ValueError: the generation batch of a replica is not a whole number of ``num_generations`` groups.
    """
    rollout = rollout_trainer_class(trainer)
    accelerator = getattr(trainer, "accelerator", None)
    config = getattr(accelerator, "parallelism_config", None)
    if rollout is None or config is None or not getattr(config, "tp_enabled", False):
        return None
    if _SERVED in vars(trainer):
        return vars(trainer)[_SERVED]
    _refuse_unverified(trainer, rollout.__name__, config)
    from accelerate.utils import set_seed

    layout = DataParallelLayout.of(accelerator)
    trainer.args = _args_per_replica(trainer.args, layout.size, type(trainer).__name__)
    set_seed(trainer.args.seed + layout.index)
    module = sys.modules[rollout.__module__]
    for name in VIEWED_METHODS:
        setattr(trainer, name, _viewed(getattr(trainer, name), trainer, layout, module))
    vars(trainer)[_SERVED] = layout
    return layout


def _viewed(method: Callable, trainer, layout: DataParallelLayout, module) -> Callable:
    @functools.wraps(method)
    def in_data_parallel_view(*args, **kwargs):
        with data_parallel_view(trainer, layout, module):
            return method(*args, **kwargs)

    return in_data_parallel_view


def _args_per_replica(args, replicas: int, trainer_name: str):
    """A copy of ``args`` whose ``generation_batch_size`` counts the data-parallel replicas, not the processes."""
    per_replica = args.per_device_train_batch_size * args.steps_per_generation
    if per_replica % args.num_generations:
        raise ValueError(
            f"hf_fused: {trainer_name} under tensor parallelism generates per_device_train_batch_size × "
            f"steps_per_generation = {args.per_device_train_batch_size} × {args.steps_per_generation} = {per_replica} "
            f"completions per data-parallel replica (the ranks of a tensor-parallel group share them), not a whole "
            f"number of groups of num_generations = {args.num_generations}: raise per_device_train_batch_size or "
            "steps_per_generation (not generation_batch_size, which TRL derived from the process count)"
        )
    generation_batch_size = per_replica * replicas
    if args.generation_batch_size == generation_batch_size:
        return args
    args = copy.copy(args)
    args.generation_batch_size = generation_batch_size
    return args


def _refuse_unverified(trainer, rollout: str, config) -> None:
    name = type(trainer).__name__
    prefix = f"hf_fused: {name} under tensor parallelism (tp_size={config.tp_size}) "
    if getattr(config, "cp_enabled", False) or getattr(config, "sp_enabled", False):
        raise NotImplementedError(
            prefix + f"with context or sequence parallelism (cp_size={config.cp_size}, sp_size="
            f"{getattr(config, 'sp_size', 1)}) is not supported: the ranks of a replica would hold different tokens "
            f"of its rollouts, and {rollout}'s scoring is served per tensor-parallel group only. Drop cp_size/sp_size, "
            "or train with data parallelism, FSDP2 or DeepSpeed ZeRO (docs/tensor_parallel.md)"
        )
    if getattr(trainer, "use_vllm", False):
        raise NotImplementedError(
            prefix + "with use_vllm=True is not supported: TRL's vLLM generation splits prompts and syncs weights "
            "by process, not by tensor-parallel group. Generate with transformers (use_vllm=False), or train with "
            "data parallelism, FSDP2 or DeepSpeed ZeRO (docs/tensor_parallel.md)"
        )
    if getattr(trainer, "use_transformers_continuous_batching", False):
        raise NotImplementedError(
            prefix + "with use_transformers_continuous_batching=True is not supported (not verified on a "
            "tensor-parallel model): generate with transformers' generate (the default), or train with data "
            "parallelism, FSDP2 or DeepSpeed ZeRO (docs/tensor_parallel.md)"
        )
