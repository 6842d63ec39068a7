"""The logits matmul's fused epilogues vs cuBLAS tiles: ``python -m benchmarks.logits_epilogues --device cuda``.

A developer's tool for :mod:`hf_fused.ops.backends.logits_epilogues`. Per shape ``M×N×K`` (token rows × vocabulary
columns × hidden size, bf16, logits with standard deviation ~4 as a trained head's), median ms
(:func:`benchmarks.measure.median_ms`) of:

* statistics: ``torch.mm`` into a ``[M, N]`` tile + ``triton_kernels.stats_kernel`` (the two passes' first pass
  before) against :func:`~hf_fused.ops.backends.logits_epilogues.logits_statistics_` (no tile written), each with
  the entropy's Σexp·z;
* gradient: ``torch.mm`` + ``triton_kernels.grad_kernel`` (``dz`` in place) against
  :func:`~hf_fused.ops.backends.logits_epilogues.logits_grad_` (``dz`` stored from the epilogue);
* the bare ``torch.mm`` into the tile (cuBLAS's matmul alone, the floor of both).

Sanity columns: the largest log-sum-exp difference between the two statistics (fp32 summation order, and a
logit one bf16 step apart where the two matmuls' fp32 sums round differently), and the share of ``dz`` elements
that differ. ``--configs`` adds the fused kernels at other stage counts. ``--quick`` runs tiny shapes on CPU
under ``TRITON_INTERPRET=1`` (correctness only).
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch

from .measure import free_memory, median_ms, short_error
from .report import text_table

# The lean plan's row blocks at 32768×2048×151936 (8448 rows; the statistics pass over the whole vocabulary, the
# gradient pass in its 256 MiB tile's chunk), and H = 4096.
SHAPES = [(8448, 151936, 2048), (8448, 11008, 2048), (4224, 151936, 4096), (4224, 11264, 4096)]
QUICK_SHAPES = [(70, 600, 64)]


def _operands(m: int, n: int, k: int, device: torch.device):
    gen = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen, device=device) * 4 / k**0.5).to(torch.bfloat16)  # logits' std ~4
    labels = torch.randint(0, n, (m,), generator=gen, device=device)
    return h, w, labels


def bench_shape(m: int, n: int, k: int, device: torch.device, repeats: int, stages: tuple[int, ...]) -> list:
    from hf_fused.ops.backends import logits_epilogues as L
    from hf_fused.ops.backends import triton_kernels as TK
    from hf_fused.ops.backends.triton_cublas import _GRAD_BLOCK_V, _GRAD_WARPS, _STATS_BLOCK_V, _STATS_WARPS

    h, w, labels = _operands(m, n, k, device)
    scalars = dict(logit_scale=1.0, softcap=1.0, inv_temperature=1.0, HAS_BIAS=False, SOFTCAP=False, SCALED=False)
    f32 = dict(dtype=torch.float32, device=device)
    tile = torch.empty((m, n), dtype=torch.bfloat16, device=device)

    def new_stats():
        return torch.full((m,), float("-inf"), **f32), torch.zeros(m, **f32), torch.zeros(m, **f32), torch.zeros(m, **f32)

    def cublas_stats(stats):
        torch.mm(h, w.t(), out=tile)
        TK.stats_kernel[(m,)](tile, tile.stride(0), n, 0, labels, labels, *stats, stats[0], labels, stats[0],
                              ENTROPY=True, SUM_Z=False, ARGMAX=False, SUM_SQ=False, BLOCK_V=_STATS_BLOCK_V,
                              num_warps=_STATS_WARPS, **scalars)

    def fused_stats(stats, config):
        L.logits_statistics_(h, w, labels, *stats[:3], stats[3], col_offset=0, bias=None, scalars=scalars,
                             config=config)

    ref, fused = new_stats(), new_stats()
    cublas_stats(ref)
    fused_stats(fused, L.CONFIG)
    lse_ref, lse = ref[0] + ref[1].log(), fused[0] + fused[1].log()
    g_lp = torch.randn(m, **f32)
    zeros = torch.zeros(m, **f32)

    def cublas_grad():
        torch.mm(h, w.t(), out=tile)
        TK.grad_kernel[(m,)](tile, tile.stride(0), tile, tile.stride(0), n, 0, lse_ref, labels, lse_ref, zeros, g_lp,
                             zeros, lse_ref, HAS_G_LP=True, HAS_G_ENT=False, SUM_PZ=False, BLOCK_V=_GRAD_BLOCK_V,
                             num_warps=_GRAD_WARPS, **scalars)

    def fused_grad(out, config):
        L.logits_grad_(h, w, out, labels, lse_ref, zeros, g_lp, zeros, has_g_lp=True, has_g_ent=False, col_offset=0,
                       bias=None, scalars=scalars, config=config)

    cublas_grad()
    dz_ref = tile.clone()
    dz = torch.empty_like(tile)
    fused_grad(dz, L.CONFIG)
    differ = (dz != dz_ref).float().mean().item()
    del dz_ref
    rows = []
    flops = 2 * m * n * k
    mm_ms, _ = median_ms(lambda: torch.mm(h, w.t(), out=tile), device, repeats)
    rows.append(dict(shape=f"{m}×{n}×{k}", variant="cuBLAS mm (tile)", ms=mm_ms, tflops=flops / mm_ms / 1e9))
    for name, fn in (("cuBLAS mm + stats kernel", lambda: cublas_stats(new_stats())),
                     ("cuBLAS mm + grad kernel", cublas_grad)):
        ms, _ = median_ms(fn, device, repeats)
        rows.append(dict(shape=f"{m}×{n}×{k}", variant=name, ms=ms, tflops=flops / ms / 1e9))
    note = (f"max |Δlse| {(lse - lse_ref).abs().max().item():.2e}, max |Δzp| "
                       f"{(fused[2] / fused[1] - ref[2] / ref[1]).abs().max().item():.2e}, "
                       f"label logits equal {bool((fused[3] == ref[3]).all())}, dz differs on {differ:.2e}")
    part = torch.empty((3, L.column_tiles(n), m), **f32)
    scratch = torch.empty(m, **f32)
    stats_args = dict(PART_M=part[0], PART_S=part[1], PART_T=part[2], ZY=scratch, stride_part=m, DZ=scratch,
                      stride_dz=0, LSE=scratch, ENT=scratch, G_LP=scratch, G_ENT=scratch, GRAD=0, HAS_G_LP=False,
                      HAS_G_ENT=False)
    variants = []
    for s in stages:
        config = dataclasses.replace(L.CONFIG, num_stages=s)
        variants += [
            (f"fused statistics s{s}", lambda config=config: fused_stats(new_stats(), config)),
            (f"fused grad s{s}", lambda config=config: fused_grad(dz, config)),
        ]
    config = L.CONFIG
    launch = lambda **kw: L._launch(h, w, 0, None, labels, scalars, config, **{**stats_args, **kw})  # noqa: E731
    variants += [
        ("  epilogue: bit-pattern rounding", lambda: launch(ENTROPY=True, LABEL=True, ROUND=1)),
        ("  epilogue: no label logit", lambda: launch(ENTROPY=True, LABEL=False)),
        ("  epilogue: no label, no entropy", lambda: launch(ENTROPY=False, LABEL=False)),
        ("  epilogue: none (a row max)", lambda: launch(ENTROPY=False, LABEL=False, GRAD=2)),
    ]
    for name, fn in variants:
        try:
            ms, _ = median_ms(fn, device, repeats)
            rows.append(dict(shape=f"{m}×{n}×{k}", variant=name, ms=ms, tflops=flops / ms / 1e9))
        except Exception as e:  # a config that does not fit this GPU's shared memory
            rows.append(dict(shape=f"{m}×{n}×{k}", variant=name, ms=float("nan"), tflops=float("nan"),
                             note=short_error(e, 120)))
    rows[0]["note"] = note
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.logits_epilogues", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=None)
    parser.add_argument("--quick", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--stages", default="4,3", help="comma-separated stage counts of the fused kernels")
    args = parser.parse_args(argv)
    if args.quick:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.quick else "cpu"))
    rows = []
    for m, n, k in QUICK_SHAPES if args.quick else SHAPES:
        rows += bench_shape(m, n, k, device, args.repeats, tuple(int(s) for s in args.stages.split(",")))
        free_memory(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}")
    cells = [[r["shape"], r["variant"], f"{r['ms']:.3f}", f"{r['tflops']:.1f}", r.get("note", "")] for r in rows]
    print("\n".join(text_table(["shape", "variant", "ms", "TFLOP/s", "note"], cells, align_left=2)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
