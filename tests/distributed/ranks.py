"""Where the ranks of tests/distributed run: 2 CPU processes over gloo (CI), or, with
``HF_FUSED_TEST_DEVICE=cuda`` on a machine with 2 GPUs, one GPU per rank over NCCL (the same tests, the same
references and tolerances; the single-process references then run on the first GPU)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

#: The variable tests/grpo_helpers.py reads too: "cpu" (default) or "cuda".
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
