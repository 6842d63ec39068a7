"""The current CUDA device around the ops' kernel launches: Triton launches a kernel on the current device, not on
its tensors' (cuBLAS and PyTorch's own kernels follow the tensors), so a call whose tensors sit on another GPU than
the current one (lm_head of a model dispatched over several GPUs) makes their GPU current first."""

from __future__ import annotations

import contextlib

import torch


def kernel_device(t: torch.Tensor):
    """A context manager making ``t``'s GPU the current device (nothing for a tensor off CUDA)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


__all__ = ["kernel_device"]
