"""The current CUDA device around the ops' kernel launches: Triton launches a kernel on the current device, not on
its tensors' (cuBLAS and PyTorch's own kernels follow the tensors), so a call whose tensors sit on another GPU than
the current one (lm_head of a model dispatched over several GPUs) makes their GPU current first. And a GPU's compute
capability, read once per process: the kernel choices of every call ask for it after the call's host sync, while
the GPU waits, and ``torch.cuda.get_device_capability`` reads the whole property struct at each call; its
multiprocessor count likewise (the Triton kernels' persistent grids)."""

from __future__ import annotations

import contextlib
import functools

import torch


def kernel_device(t: torch.Tensor):
    """A context manager making ``t``'s GPU the current device (nothing for a tensor off CUDA)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def capability(device: torch.device) -> tuple[int, int]:
    """The compute capability ``(major, minor)`` of a CUDA ``device`` (``cuda`` alone: the current one)."""
    properties = _properties(device)
    return properties.major, properties.minor


def multiprocessors(device: torch.device) -> int:
    """The multiprocessor count of a CUDA ``device`` (``cuda`` alone: the current one); 1 elsewhere (Triton's
    interpreter: the fewest, largest programs are fastest)."""
    return _properties(device).multi_processor_count if device.type == "cuda" else 1


def _properties(device: torch.device):
    return _properties_of(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _properties_of(index: int):
    """The device's property struct, read once per process and GPU index."""
    return torch.cuda.get_device_properties(index)


__all__ = ["capability", "kernel_device", "multiprocessors"]
