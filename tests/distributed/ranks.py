"""Where the ranks of tests/distributed run: 2 CPU processes over gloo (CI), or, with
``HF_FUSED_TEST_DEVICE=cuda`` on a machine with 2 GPUs, one GPU per rank over NCCL (the same tests, the same
references and tolerances; the single-process references then run on the first GPU)."""

from __future__ import annotations

import contextlib
import os
import sys

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
    next run of this process can set it up again.

    ``UlyssesSPAttentionHF.register_with_transformers`` (called by ``accelerator.prepare``) does two things once per
    process: it builds the sequence-parallel groups, asserting they are not built yet ("sequence parallel group is
    already initialized"; DeepSpeed drops them itself only when the world's process group is destroyed, by the same
    ``_release_sequence_parallel_groups``), and it replaces the core attention function in transformers'
    ``ALL_ATTENTION_FUNCTIONS`` (``sdpa``) by its wrapper, which a second run would wrap again (an all-to-all twice:
    "query input tensor does not match the required shape"). The groups of the run before stay valid process
    groups; the next run's ``accelerator.prepare`` builds its own."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attention = dict(ALL_ATTENTION_FUNCTIONS)
    try:
        yield
    finally:
        for name, function in attention.items():
            if ALL_ATTENTION_FUNCTIONS[name] is not function:
                ALL_ATTENTION_FUNCTIONS[name] = function
        sequence_parallel = sys.modules.get("deepspeed.runtime.sequence_parallel.parallel_state_sp")
        if sequence_parallel is not None:
            sequence_parallel._release_sequence_parallel_groups()
