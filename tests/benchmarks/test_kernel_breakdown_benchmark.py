"""``python -m benchmarks.kernel_breakdown``: kernels sorted into categories by name (names as an H200's profiler
gives them), the idle time between a step's kernels from their spans, and a CPU smoke run of the whole tool."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks.kernel_breakdown import HF_FUSED_TRITON, category, hf_fused_kernel_names, kernel_times, main


@pytest.mark.parametrize("name, expected", [
    ("kernel_cutlass_kernel_quackepiloguefrontendGemmMod_identity_epi_f05b54c28d71a101__none_sm9_ao_object_at_",
     "QuACK GEMM"),
    ("nvjet_sm90_tss_256x128_64x4_1x2_h_bz_coopA_NNT", "cuBLAS GEMM"),
    ("_exp_tile_grad_kernel", HF_FUSED_TRITON),
    ("_compensated_addmm_tma_kernel", HF_FUSED_TRITON),
    ("Memcpy DtoD (Device -> Device)", "copies"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float>>",
     "PyTorch elementwise"),
    ("some_other_kernel", "other"),
])
def test_kernels_are_sorted_by_name(name, expected):
    pytest.importorskip("triton")
    assert category(name, hf_fused_kernel_names()) == expected


def test_idle_is_the_time_no_kernel_ran():
    cuda = torch.autograd.DeviceType.CUDA

    def event(name, start, end):  # microseconds, as the profiler's time ranges
        return SimpleNamespace(name=name, device_type=cuda, time_range=SimpleNamespace(start=start, end=end))

    events = [event("a", 0, 10), event("b", 12, 20), event("c", 15, 18), event("a", 25, 30)]
    kernels, idle = kernel_times(events, torch.device("cuda"))
    assert kernels == {"a": (2, 0.015), "b": (1, 0.008), "c": (1, 0.003)}
    assert idle == pytest.approx(0.007)  # 10 → 12 and 20 → 25; c runs inside b


def test_cpu_smoke_run(capsys):
    assert main(["--device", "cpu", "--quick", "--shapes", "ce-128-h64-v1k", "--peers", "hf_fused,eager",
                 "--repeats", "1", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "ce-128-h64-v1k · hf_fused: step" in out and "by category" in out
    summary = out.strip().splitlines()
    assert summary[-4].split()[:3] == ["problem", "peer", "step"] and len(summary[-2:]) == 2
