"""Where the ranks of tests/distributed run: 2 CPU processes over gloo (CI), or, with
``HF_FUSED_TEST_DEVICE=cuda`` on a machine with 2 GPUs, one GPU per rank over NCCL (the same tests, the same
references and tolerances; the single-process references then run on the first GPU)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import traceback
from typing import Callable

import torch
import torch.distributed as dist

#: The variable tests/grpo_harness.py reads too: "cpu" (default) or "cuda".
CUDA = os.environ.get("HF_FUSED_TEST_DEVICE", "cpu") == "cuda"


def rank_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` (made current) under ``HF_FUSED_TEST_DEVICE=cuda``, else CPU."""
    if not CUDA:
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def init_process_group() -> torch.device:
    """``torch.distributed`` over NCCL (GPU ranks) or gloo (CPU ranks); returns this rank's device."""
    device = rank_device()
    if CUDA:
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    return device


def exit_rank() -> None:
    """End this rank's process once every rank has reached this point, without interpreter teardown (where gloo's
    threads have aborted a rank, "terminate called without an active exception").

    The barrier first: NCCL collectives are queued on the GPU, and a rank that exits while its last ones are
    still queued leaves its peers waiting for them forever. Rank 0 of TRL's scripts under FSDP2 hung so on 2 H200s
    in ``save_model``'s full-state-dict gather (it copies each gathered tensor to the CPU, falling behind rank 1,
    which has nothing to copy and had exited)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    os._exit(0)


@contextlib.contextmanager
def sequence_parallelism_undone_after():
    """Undo, when the run inside ends, what DeepSpeed's Ulysses sequence parallelism set up process-wide, so that the
    next run of this process can set it up again, or run without it.

    ``UlyssesSPAttentionHF.register_with_transformers`` (called by ``accelerator.prepare``) does two things once per
    process: it builds the sequence-parallel groups, asserting they are not built yet ("sequence parallel group is
    already initialized"; DeepSpeed drops them itself only when the world's process group is destroyed, by the same
    ``_release_sequence_parallel_groups``), and it replaces the core attention function in transformers'
    ``ALL_ATTENTION_FUNCTIONS`` (``sdpa``) by its wrapper, which a second run would wrap again (an all-to-all twice:
    "query input tensor does not match the required shape"). The groups of the run before stay valid process
    groups; the next run's ``accelerator.prepare`` builds its own."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attention = dict(ALL_ATTENTION_FUNCTIONS)
    groups = sys.modules.get("deepspeed.utils.groups")
    mpu = None if groups is None else groups.mpu
    try:
        yield
    finally:
        groups = sys.modules.get("deepspeed.utils.groups")
        if groups is not None:  # the engine of a Ulysses run hands DeepSpeed its sequence-parallel mpu, process-wide
            groups.mpu = mpu
        for name, function in attention.items():
            if ALL_ATTENTION_FUNCTIONS[name] is not function:
                ALL_ATTENTION_FUNCTIONS[name] = function
        sequence_parallel = sys.modules.get("deepspeed.runtime.sequence_parallel.parallel_state_sp")
        if sequence_parallel is not None:
            sequence_parallel._release_sequence_parallel_groups()


def run_each(batch_file: str, body: Callable[[dict, str], None], barrier: bool = False) -> None:
    """Run each entry ``{"case", "dir", "environment"}`` of a launch's batch file (launch.run_cases) in turn in this
    process: ``body(case, dir)`` under the run's own accelerate configuration (:func:`launched_under`), with DeepSpeed's
    Ulysses set-up undone after it (:func:`sequence_parallelism_undone_after`); a run that raises writes its traceback
    to ``<dir>/error.txt`` and the next one runs; the environment (which ``TrainingArguments`` and the scripts extend)
    is restored after each. ``barrier``: the ranks wait for each other after each run (so that a run one rank left
    early cannot meet the next run's collectives on another).

    What is alive before each run (torch, transformers, TRL, DeepSpeed, the state runs before it left) is frozen out
    of the cyclic garbage collector's traversals (``gc.freeze``, after a collection of what the run before left):
    every run makes full collections (``Trainer.train``'s ``free_memory``, DeepSpeed's ``defragment``), which
    otherwise traverse all of it, 0.35 s each on a 2-core machine."""
    with open(batch_file) as f:
        runs = json.load(f)
    for entry in runs:
        gc.collect()
        gc.freeze()
        environ = dict(os.environ)
        try:
            with launched_under(entry.get("environment")), sequence_parallelism_undone_after():
                body(entry["case"], entry["dir"])
        except (Exception, SystemExit):
            with open(os.path.join(entry["dir"], "error.txt"), "a") as f:
                f.write(f"rank {os.environ.get('RANK', '0')}:\n{traceback.format_exc()}\n")
        finally:
            os.environ.clear()
            os.environ.update(environ)
            if barrier and dist.is_initialized():
                dist.barrier()


@contextlib.contextmanager
def launched_under(environment: dict | None):
    """Within the block this rank sees what ``accelerate launch --config_file <the run's config>`` would have given it
    (``environment``: ``{"set": {...}, "unset": [...]}``, launch.accelerate_environment's variables of that config, and
    those of the launch's other configs to drop), and accelerate's per-configuration state (the engine plugins, mixed
    precision, gradient accumulation) is built anew from it; the process group stays. So one launch serves runs of
    several configurations of one rank count: a launch costs each rank 10-20 s of imports, a tiny run a few seconds.
    The environment itself is restored by :func:`run_each`."""
    if environment is None:
        yield
        return
    from accelerate.state import AcceleratorState, GradientState

    def fresh_state():
        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()
        deepspeed = sys.modules.get("transformers.integrations.deepspeed")
        if deepspeed is not None:  # is_deepspeed_zero3_enabled() reads a process-wide reference to the last config
            deepspeed.unset_hf_deepspeed_config()

    for key in environment["unset"]:
        os.environ.pop(key, None)
    os.environ.update(environment["set"])
    fresh_state()
    try:
        yield
    finally:
        fresh_state()
