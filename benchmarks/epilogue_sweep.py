"""Launch shapes of the two Triton epilogues: ``python -m benchmarks.epilogue_sweep --device cuda``.

A developer's tool. Times :data:`~hf_fused.ops.backends.triton_kernels.stats_kernel` (online log-sum-exp,
label logit, entropy sum) and ``grad_kernel`` (``dz`` in place) on one one-pass tile: ``--rows`` token rows of
whole ``--vocab`` rows of bf16 logits with standard deviation 4 (a trained head's, see DESIGN.md), for each
``BLOCK_V × num_warps`` in the sweep, and prints median ms and the bandwidth each reaches (bytes the kernel must
move: the tile read once for the statistics, read and written once for ``dz``). The backend's launch
constants (``_STATS_BLOCK_V``/``_STATS_WARPS``, ``_GRAD_BLOCK_V``/``_GRAD_WARPS`` in
:mod:`hf_fused.ops.backends.triton_cublas`) are marked ``*``. Also checks every configuration's outputs
against the backend's own (the same math; must agree to fp32 summation order).
"""

from __future__ import annotations

import argparse

import torch

from .measure import median_ms
from .report import text_table

STATS_SWEEP = [(b, w) for b in (256, 512, 1024, 2048, 4096) for w in (1, 2, 4, 8)]
GRAD_SWEEP = [(b, w) for b in (512, 1024, 2048, 4096) for w in (4, 8, 16)]


def _configs(text):
    return [tuple(int(x) for x in item.split(":")) for item in text.split(",")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-entropy", action="store_true",
                        help="statistics without the entropy sum (as cross-entropy's two passes run them)")
    parser.add_argument("--stats-only", action="store_true", help="skip the gradient kernel's sweep")
    parser.add_argument("--stats-configs", type=_configs, default=STATS_SWEEP, metavar="BLOCK_V:WARPS,...",
                        help="the statistics kernel's launch shapes to time (default: the whole sweep)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)

    from hf_fused.ops.backends import triton_cublas as tc
    from hf_fused.ops.backends import triton_kernels as tk

    gen = torch.Generator(device=device).manual_seed(0)
    n, v = args.rows, args.vocab
    logits = (torch.randn(n, v, generator=gen, device=device) * 4).to(torch.bfloat16)
    labels = torch.randint(0, v, (n,), generator=gen, device=device)
    g_lp = torch.randn(n, generator=gen, device=device)
    scalars = dict(logit_scale=1.0, softcap=1.0, inv_temperature=1.0, HAS_BIAS=False, SOFTCAP=False, SCALED=False)

    def new_stats():
        f32 = dict(dtype=torch.float32, device=device)
        return [torch.full((n,), float("-inf"), **f32), torch.zeros(n, **f32), torch.zeros(n, **f32),
                torch.zeros(n, **f32)]

    def stats(block, warps, out):
        m, s, t, zy = out
        tk.stats_kernel[(n,)](logits, logits.stride(0), v, 0, labels, labels, m, s, t, zy, m, labels, m,
                              ENTROPY=not args.no_entropy, SUM_Z=False, ARGMAX=False, SUM_SQ=False, BLOCK_V=block,
                              num_warps=warps, **scalars)

    ref = new_stats()
    stats(tc._STATS_BLOCK_V, tc._STATS_WARPS, ref)
    lse = ref[0] + ref[1].log()
    ent = lse - ref[2] / ref[1] if not args.no_entropy else torch.zeros_like(lse)
    dz = torch.empty_like(logits)

    def grad(block, warps):
        tk.grad_kernel[(n,)](logits, logits.stride(0), dz, dz.stride(0), v, 0, lse, labels, lse, ent, g_lp, g_lp,
                             lse, HAS_G_LP=True, HAS_G_ENT=False, SUM_PZ=False, BLOCK_V=block, num_warps=warps,
                             **scalars)

    grad(tc._GRAD_BLOCK_V, tc._GRAD_WARPS)
    dz_ref = dz.clone()
    tile_bytes = logits.numel() * logits.element_size()
    rows = []
    for block, warps in args.stats_configs:
        out = new_stats()
        stats(block, warps, out)
        ok = torch.allclose(out[0] + out[1].log(), lse, rtol=1e-5, atol=1e-5)
        ms = median_ms(lambda: stats(block, warps, new_stats()), device, args.repeats)[0]
        star = "*" if (block, warps) == (tc._STATS_BLOCK_V, tc._STATS_WARPS) else ""
        rows.append(["stats", f"{block}{star}", warps, f"{ms:.3f}", f"{tile_bytes / ms / 1e9:.2f}",
                     "ok" if ok else "DIFF"])
    for block, warps in () if args.stats_only else GRAD_SWEEP:
        grad(block, warps)
        ok = torch.allclose(dz.float(), dz_ref.float(), rtol=1e-2, atol=1e-6)
        ms = median_ms(lambda: grad(block, warps), device, args.repeats)[0]
        star = "*" if (block, warps) == (tc._GRAD_BLOCK_V, tc._GRAD_WARPS) else ""
        rows.append(["grad", f"{block}{star}", warps, f"{ms:.3f}", f"{2 * tile_bytes / ms / 1e9:.2f}",
                     "ok" if ok else "DIFF"])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    print(f"{name}: one tile of {n} × {v} bf16 logits (std 4); '*' = the backend's launch constants")
    print("\n".join(text_table(["kernel", "BLOCK_V", "warps", "ms", "TB/s", "check"], rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
