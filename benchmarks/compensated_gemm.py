"""Compensated-accumulation GEMM vs cuBLAS: ``python -m benchmarks.compensated_gemm --device cuda``.

A developer's tool for the memory-lean gradient loop. Times one hidden-state accumulation step
``dh += dz @ W_c`` (``dz [M, K]`` row-major, ``W_c [K, N]`` a row slice of a row-major weight, K the vocabulary
chunk, N the hidden size) three ways:

* ``cuBLAS addmm → fp32``: ``torch.addmm(acc32, dz, W_c, out_dtype=float32, out=acc32)``, today's lean path
  (an fp32 ``[M, N]`` accumulator);
* ``cuBLAS addmm → bf16``: ``torch.addmm(c, dz, W_c, out=c)`` into the bf16 gradient (no extra memory, one
  rounding per chunk: the accuracy we do not accept, timed as the floor);
* ``compensated``: :func:`hf_fused.ops.backends.compensated.compensated_addmm_` into a ``(hi, lo)`` pair (bf16
  ``hi``, int8 residual ``lo``: ``RESIDUAL_DTYPE``), with its default launch configuration and with each of
  ``SWEEP_CONFIGS``: names ending ``/ptr`` run the pointer-load kernel, ``/tma`` the Hopper one (TMA loads,
  persistent programs; sm_90 and later); the default is labelled with the kernel it ran.

Per shape: median ms (:func:`benchmarks.measure.median_ms`: ``triton.testing.do_bench``, CUDA events, L2
flushed, about ``--repeats`` timed calls after warm-up), TFLOP/s (``2·M·K·N``), time relative to
``cuBLAS addmm → fp32``, and as a sanity check the share of elements where one compensated step from zero
differs from the fp32 product rounded once (fp32 summation order only: expect ≲ 0.1 %). The best
configuration per shape is printed last. Estimated at about two minutes on an H100 (mostly Triton compiling
the fifteen configurations once; 136 timings of at most ~30 calls of ≤ 15 ms each). Only the ``/tma`` ones:
``--tma-only``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Optional

import torch

from .measure import free_memory, median_ms, short_error
from .report import text_table

SHAPES = [(m, k, n) for m in (8192, 32768) for k in (8192, 16384) for n in (2048, 4096)]
# CPU smoke test under TRITON_INTERPRET=1; ragged against its 32×32×16 tiles, with K and N multiples of 8 (the
# 16-byte strides TMA descriptors need).
QUICK_SHAPES = [(64, 128, 96), (70, 56, 88)]


def _addmm_fp32(acc32: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    if a.is_cuda:
        torch.addmm(acc32, a, b, out_dtype=torch.float32, out=acc32)
    else:  # CPU has no out_dtype matmul for bf16 operands
        acc32.addmm_(a.float(), b.float())


def _operands(m: int, k: int, n: int, device: torch.device):
    gen = torch.Generator(device=device).manual_seed(0)
    # dz-like rows (one −1 per row would not change the GEMM's speed; magnitudes only keep values finite over
    # hundreds of timed accumulations); a weight ~ N(0, 0.02²) sliced from a taller one, as W[v0:v1] is.
    a = (torch.randn(m, k, generator=gen, device=device) / k).to(torch.bfloat16)
    weight = (torch.randn(k + 64, n, generator=gen, device=device) * 0.02).to(torch.bfloat16)
    return a, weight[64:]


def _bench_shape(m: int, k: int, n: int, device: torch.device, repeats: int, configs) -> tuple[list, float]:
    from hf_fused.ops.backends.compensated import RESIDUAL_DTYPE, _uses_tma, compensated_addmm_, default_config

    a, b = _operands(m, k, n, device)
    acc32 = torch.zeros(m, n, dtype=torch.float32, device=device)
    c16 = torch.zeros(m, n, dtype=torch.bfloat16, device=device)
    hi, lo = torch.zeros_like(c16), torch.zeros(m, n, dtype=RESIDUAL_DTYPE, device=device)

    _addmm_fp32(acc32, a, b)
    compensated_addmm_(hi, lo, a, b)
    differs = (hi != acc32.to(torch.bfloat16)).float().mean().item()

    default = default_config(m, n, device)
    variants = [("cuBLAS addmm → fp32", lambda: _addmm_fp32(acc32, a, b)),
                ("cuBLAS addmm → bf16", lambda: torch.addmm(c16, a, b, out=c16))]
    default_kernel = "tma" if _uses_tma(hi, a, b, default) else "ptr"
    variants += [(f"compensated {c.name}" + (f" (default, {default_kernel})" if c == default else ""),
                  lambda c=c: compensated_addmm_(hi, lo, a, b, config=c))
                 for c in ([default] if default not in configs else []) + list(configs)]
    results = []
    for label, fn in variants:
        try:
            fn()  # compile / warm up
            results.append((label, median_ms(fn, device, repeats)[0]))
        except Exception as exc:  # one configuration out of resources on this GPU should not end the sweep
            print(f"{m}×{k}×{n} {label}: {short_error(exc)}", flush=True)
            results.append((label, float("nan")))
    del a, b, acc32, c16, hi, lo
    free_memory(device)
    return results, differs


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compensated_gemm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (the Triton interpreter; use --quick)")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per variant (default 20)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and two configurations (CPU smoke test)")
    parser.add_argument("--tma-only", action="store_true", help="of SWEEP_CONFIGS, only the TMA kernel's")
    parser.add_argument("--shapes", default=None, help="comma-separated M:K:N (default: M ∈ {8192, 32768}, "
                        "K ∈ {8192, 16384}, N ∈ {2048, 4096})")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel module is first imported
    from hf_fused.ops.backends.compensated import SMALL, SWEEP_CONFIGS, GemmConfig

    if args.shapes:
        shapes = [tuple(int(x) for x in s.split(":")) for s in args.shapes.split(",")]
    else:
        shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.quick:
        tiny = GemmConfig(32, 32, 16, group_m=2, num_warps=4, num_stages=2, tma=False)
        configs = (tiny, dataclasses.replace(tiny, tma=True), SMALL)
    else:
        configs = SWEEP_CONFIGS
    if args.tma_only:
        configs = tuple(c for c in configs if c.tma)

    header = ["M×K×N", "variant", "ms", "TFLOP/s", "× fp32 cuBLAS"]
    rows, best = [], []
    for m, k, n in shapes:
        results, differs = _bench_shape(m, k, n, device, args.repeats, configs)
        base = results[0][1]
        flops = 2 * m * k * n
        shape = f"{m}×{k}×{n}"
        for label, ms in results:
            rows.append([shape, label, f"{ms:.3f}", f"{flops / ms / 1e9:.1f}", f"{ms / base:.2f}"])
        label, ms = min(results[2:], key=lambda r: (r[1] != r[1], r[1]))  # NaN (failed) last
        best.append([shape, label.removeprefix("compensated ").split(" (default")[0], f"{ms:.3f}",
                     f"{flops / ms / 1e9:.1f}", f"{ms / base:.2f}", f"{100 * differs:.3f}"])
        print("\n".join(text_table(header, rows[-len(results):], align_left=2)) + "\n", flush=True)
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu (Triton interpreter)'}, "
          f"torch {torch.__version__}, bf16 operands\n")
    print("best per shape (compensated; '% differs': one step from zero vs the fp32 product rounded once)")
    print("\n".join(text_table(["M×K×N", "config", "ms", "TFLOP/s", "× fp32 cuBLAS", "% differs"], best, 2)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
