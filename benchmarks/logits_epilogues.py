"""The gradient pass's fused epilogue vs cuBLAS tiles: ``python -m benchmarks.logits_epilogues --device cuda``.

A developer's tool for :mod:`hf_fused.ops.backends.logits_epilogues`. Per shape ``M×N×K`` (token rows × vocabulary
columns × hidden size, bf16, logits with standard deviation ~4 as a trained head's), median ms
(:func:`benchmarks.measure.median_ms`) of ``torch.mm`` into the ``[M, N]`` tile alone (cuBLAS's matmul, the
floor), ``torch.mm`` + ``triton_kernels.grad_kernel`` (``dz`` in place: the two passes' gradient tile before), and
:func:`~hf_fused.ops.backends.logits_epilogues.logits_grad_` (``dz`` from the matmul's epilogue) at each of
``--stages``. Sanity: the share of ``dz`` elements that differ between the two (a logit one bf16 step apart where
the two matmuls' fp32 sums round differently). ``--quick`` runs a tiny shape on CPU under ``TRITON_INTERPRET=1``
(correctness only).
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch

from .measure import free_memory, median_ms, short_error
from .report import text_table

# The lean plan's tiles: 8448-row blocks at 32768×2048×151936 in a 256 MiB tile's chunk, a whole-vocabulary row
# block, H = 4096, and all 29,491 kept rows of the 32k problem in one block of a narrow chunk.
SHAPES = [(8448, 11008, 2048), (8448, 151936, 2048), (4224, 11264, 4096), (29491, 3456, 2048)]
QUICK_SHAPES = [(70, 600, 64)]


def _operands(m: int, n: int, k: int, device: torch.device):
    gen = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen, device=device) * 4 / k**0.5).to(torch.bfloat16)  # logits' std ~4
    labels = torch.randint(0, n, (m,), generator=gen, device=device)
    return h, w, labels


def parse_config(name: str):
    """A :class:`~hf_fused.ops.backends.compensated.GemmConfig` from its ``name`` (``128x256x64/g8/w8/s4/e4``; the
    kernel is always the TMA one)."""
    from hf_fused.ops.backends.compensated import GemmConfig

    blocks, *fields = name.strip().split("/")
    block_m, block_n, block_k = (int(x) for x in blocks.split("x"))
    keys = {"g": "group_m", "w": "num_warps", "s": "num_stages", "e": "epilogue_split"}
    values = {keys[f[0]]: int(f[1:]) for f in fields if f and f[0] in keys}
    return GemmConfig(block_m, block_n, block_k, tma=True, **values)


def bench_shape(m: int, n: int, k: int, device: torch.device, repeats: int, stages: tuple[int, ...],
                configs: tuple = ()) -> list:
    from hf_fused.ops.backends import logits_epilogues as L
    from hf_fused.ops.backends import triton_kernels as TK
    from hf_fused.ops.backends.triton_cublas import _GRAD_BLOCK_V, _GRAD_WARPS

    h, w, labels = _operands(m, n, k, device)
    scalars = dict(logit_scale=1.0, softcap=1.0, inv_temperature=1.0, HAS_BIAS=False, SOFTCAP=False, SCALED=False)
    f32 = dict(dtype=torch.float32, device=device)
    tile = torch.empty((m, n), dtype=torch.bfloat16, device=device)
    torch.mm(h, w.t(), out=tile)
    lse = torch.logsumexp(tile.float(), dim=1)
    g_lp = torch.randn(m, **f32)
    zeros = torch.zeros(m, **f32)

    def cublas_grad():
        torch.mm(h, w.t(), out=tile)
        TK.grad_kernel[(m,)](tile, tile.stride(0), tile, tile.stride(0), n, 0, lse, labels, lse, zeros, g_lp,
                             zeros, lse, HAS_G_LP=True, HAS_G_ENT=False, SUM_PZ=False, BLOCK_V=_GRAD_BLOCK_V,
                             num_warps=_GRAD_WARPS, **scalars)

    def fused_grad(out, config):
        L.logits_grad_(h, w, out, labels, lse, zeros, g_lp, zeros, has_g_lp=True, has_g_ent=False, col_offset=0,
                       bias=None, scalars=scalars, config=config)

    cublas_grad()
    dz_ref = tile.clone()
    dz = torch.empty_like(tile)
    fused_grad(dz, L.CONFIG)
    note = f"dz differs on {(dz != dz_ref).float().mean().item():.2e} of the elements"
    del dz_ref
    shape, flops = f"{m}×{n}×{k}", 2 * m * n * k
    variants = [("cuBLAS mm (tile)", lambda: torch.mm(h, w.t(), out=tile)), ("cuBLAS mm + grad kernel", cublas_grad)]
    variants += [(f"fused grad s{s}", lambda s=s: fused_grad(dz, dataclasses.replace(L.CONFIG, num_stages=s)))
                 for s in stages]
    variants += [(f"fused grad {c.name}", lambda c=c: fused_grad(dz, c)) for c in configs]
    rows = []
    for name, fn in variants:
        try:
            ms, _ = median_ms(fn, device, repeats)
            rows.append(dict(shape=shape, variant=name, ms=ms, tflops=flops / ms / 1e9))
        except Exception as e:  # a config that does not fit this GPU's shared memory
            rows.append(dict(shape=shape, variant=name, ms=float("nan"), tflops=float("nan"), note=short_error(e, 120)))
    rows[0]["note"] = note
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.logits_epilogues", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=None)
    parser.add_argument("--quick", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--stages", default="4,3", help="comma-separated stage counts of the fused kernels")
    parser.add_argument("--shapes", default=None, help="comma-separated M:N:K (default: the lean plan's tiles)")
    parser.add_argument("--configs", default="", help="comma-separated launch shapes of the fused kernel to time "
                        "besides --stages, named as GemmConfig.name: 128x256x64/g8/w8/s4/e4 (the epilogue split must "
                        "be 4)")
    args = parser.parse_args(argv)
    if args.quick:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.quick else "cpu"))
    rows = []
    shapes = [tuple(int(x) for x in s.split(":")) for s in args.shapes.split(",")] if args.shapes else (
        QUICK_SHAPES if args.quick else SHAPES)
    configs = tuple(parse_config(c) for c in args.configs.split(",") if c)
    for m, n, k in shapes:
        rows += bench_shape(m, n, k, device, args.repeats, tuple(int(s) for s in args.stages.split(",")), configs)
        free_memory(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}")
    cells = [[r["shape"], r["variant"], f"{r['ms']:.3f}", f"{r['tflops']:.1f}", r.get("note", "")] for r in rows]
    print("\n".join(text_table(["shape", "variant", "ms", "TFLOP/s", "note"], cells, align_left=2)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
