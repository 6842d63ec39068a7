"""The compensated matmul's fold written as a QuACK GEMM epilogue, against hf_fused's Triton kernel and cuBLAS.

``python -m benchmarks.quack_fold`` (a Hopper GPU, quack-kernels 0.6.4 with nvidia-cutlass-dsl 4.6.2): checks that
the fold of :mod:`hf_fused.ops.backends.compensated` (``hi + lo·ulp(hi)/254 += a @ b``, bf16 ``hi``, int8 ``lo``)
computed in the epilogue of QuACK's warp-specialized SM90 GEMM gives the Triton kernel's pair bit for bit, then
times both beside cuBLAS's fp32-output ``addmm`` (the same product into an fp32 accumulator) on the shapes the
lean path and a one pass with the pair as its weight-gradient accumulator would run, and prints one table.

Why it exists: the lean path's hidden-gradient matmul costs 1.2-1.3× cuBLAS's time (docs/gpu_results.md); this
asks whether that is Triton's doing or the fold's (a second implementation on the fastest public GEMM framework).
Not used by the library. QuACK 0.6.4's host layer has no int8 entry in ``torch2cute_dtype_map``; the tool adds
one (``cutlass.Int8``) for the residual's TMA load and store.

``--add-only`` times instead the plain fp32 accumulation ``acc += a @ b`` on QuACK's GEMM with its output added
by a TMA reduce-add store (``gemm_add_inplace``: QuACK's default configuration, and the configurations above)
against cuBLAS's ``beta = 1`` addmm, at the one pass's weight-gradient shapes (each half of the split accumulator,
H = 2048 and 4096) and the lean path's chunk. Measured on an H100 (docs/gpu_results.md, fourteenth session): QuACK
0.6.4 1.00–1.17× cuBLAS's time at every shape, so the library keeps cuBLAS there.
"""

from __future__ import annotations

import argparse
import sys

import torch

from .measure import free_memory, median_ms, short_error
from .report import text_table


def _build():
    """The fold as a QuACK epilogue (imports QuACK and the CuTe DSL)."""
    import cutlass
    import quack.cute_dsl_utils
    from cutlass import Float32, Uint32
    from cutlass._mlir.dialects import arith
    from cutlass.cutlass_dsl import dsl_user_op
    from quack.epilogue.frontend import gemm_epilogue
    from quack.rounding import _bits_f32, _f32_bits

    quack.cute_dsl_utils.torch2cute_dtype_map.setdefault(torch.int8, cutlass.Int8)

    def _ir(x, kind, loc, ip):
        return kind(x).ir_value(loc=loc, ip=ip)

    @dsl_user_op
    def umax(a, b, *, loc=None, ip=None):
        return Uint32(arith.maxui(_ir(a, Uint32, loc, ip), _ir(b, Uint32, loc, ip), loc=loc, ip=ip))

    @dsl_user_op
    def umin(a, b, *, loc=None, ip=None):
        return Uint32(arith.minui(_ir(a, Uint32, loc, ip), _ir(b, Uint32, loc, ip), loc=loc, ip=ip))

    @dsl_user_op
    def clamp127(q, *, loc=None, ip=None):
        q = arith.maxnumf(_ir(q, Float32, loc, ip), _ir(-127.0, Float32, loc, ip), loc=loc, ip=ip)
        return Float32(arith.minnumf(q, _ir(127.0, Float32, loc, ip), loc=loc, ip=ip))

    @dsl_user_op
    def zero_at_inf_nan(exponent, q, *, loc=None, ip=None):
        finite = arith.cmpi(arith.CmpIPredicate.ne, _ir(exponent, Uint32, loc, ip), _ir(0xFF, Uint32, loc, ip),
                            loc=loc, ip=ip)
        return Float32(arith.select(finite, _ir(q, Float32, loc, ip), _ir(0.0, Float32, loc, ip), loc=loc, ip=ip))

    # compensated.py's _decode / _encode, operation for operation
    def decode(q, h):
        binade = umin(umax(_f32_bits(h) & Uint32(0x7F800000), Uint32(0x00800000)), Uint32(0x7F000000))
        return (q * (2.0**-7 / 254)) * _bits_f32(binade)

    def encode(r, hi32):
        exponent = (_f32_bits(hi32) >> Uint32(23)) & Uint32(0xFF)
        scale = _bits_f32((Uint32(255) - umax(exponent, Uint32(1))) << Uint32(23))
        q = (r * scale * 16256.0 + 12582912.0) - 12582912.0
        return zero_at_inf_nan(exponent, clamp127(q))

    @gemm_epilogue(outputs=("lo_out",))
    def compensated_fold(acc, c, lo):
        t = (c + decode(lo, c)) + acc
        hi32 = Float32(cutlass.BFloat16(t))
        return {"D": hi32, "lo_out": encode(t - hi32, hi32)}

    return compensated_fold


def _configs():
    from quack.gemm_config import GemmConfig

    def config(m, n, pingpong, cm, cn):
        return GemmConfig(tile_m=m, tile_n=n, pingpong=pingpong, cluster_m=cm, cluster_n=cn,
                          is_dynamic_persistent=False)

    return {"coop 128x256": config(128, 256, False, 2, 1), "pingpong 128x128": config(128, 128, True, 2, 1),
            "pingpong 128x192": config(128, 192, True, 2, 1)}


def _time_shape(m, k, n, transposed, device, repeats, quack_fold_, configs) -> list[list[str]]:
    """Table rows for one ``[M, K] @ [K, N]`` product: cuBLAS's fp32-output addmm, the Triton kernel, QuACK's fold
    per config (a config QuACK cannot build for the shape is said and skipped)."""
    from hf_fused.ops.backends.compensated import RESIDUAL_DTYPE, compensated_addmm_

    a = torch.randn(k, m, device=device).bfloat16().t() if transposed else torch.randn(m, k, device=device).bfloat16()
    b = torch.randn(k, n, device=device).bfloat16() * 0.02
    acc = torch.zeros(m, n, device=device)
    hi = torch.zeros(m, n, dtype=torch.bfloat16, device=device)
    lo = torch.zeros(m, n, dtype=RESIDUAL_DTYPE, device=device)
    variants = {"cuBLAS addmm → fp32": lambda: torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc),
                "Triton compensated": lambda: compensated_addmm_(hi, lo, a, b)}
    variants.update({f"QuACK fold, {name}": (lambda c=config: quack_fold_(hi, lo, a, b, c))
                     for name, config in configs.items()})
    rows = []
    for name, fn in variants.items():
        try:
            fn()  # compile / warm up
            ms = median_ms(fn, device, repeats)[0]
            rows.append([f"{m}×{k}×{n}", name, f"{ms:.3f}", f"{2 * m * n * k / ms / 1e9:.1f}"])
        except Exception as exc:  # noqa: BLE001 - a config QuACK cannot build for this shape: say so, go on
            print(f"{m}×{k}×{n} {name}: {short_error(exc)}", flush=True)
    return rows


def _time_add(m, k, n, device, repeats, configs) -> list[list[str]]:
    """Table rows for ``acc += a @ b`` (``a = [K, M]ᵀ``, the one pass's ``dz.T``): cuBLAS's addmm, QuACK's with
    its default configuration and per config; the largest difference from cuBLAS's result after one call,
    relative."""
    from quack.gemm_interface import gemm_add_inplace, gemm_tuned

    a = (torch.randn(k, m, device=device) * 1e-3).bfloat16().t()
    b = torch.randn(k, n, device=device).bfloat16()
    acc = torch.zeros(m, n, device=device)
    ref = torch.addmm(acc, a, b, out_dtype=torch.float32)
    variants = {"cuBLAS addmm → fp32": lambda: torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc),
                "QuACK add → fp32, default": lambda: gemm_add_inplace(a, b, acc, tuned=False)}
    variants.update({f"QuACK add → fp32, {name}": (
        lambda c=config: gemm_tuned.fn(a, b, acc, None, add_to_output=True, config=c)) for name, config in configs.items()})
    rows = []
    for name, fn in variants.items():
        try:
            acc.zero_()
            fn()  # compile / warm up, and the check
            err = ((acc - ref).abs().max() / ref.abs().max()).item()
            ms = median_ms(fn, device, repeats)[0]
            rows.append([f"{m}×{k}×{n}", name, f"{ms:.3f}", f"{2 * m * n * k / ms / 1e9:.1f}", f"{err:.1e}"])
        except Exception as exc:  # noqa: BLE001 - a config QuACK cannot build for this shape: say so, go on
            print(f"{m}×{k}×{n} {name}: {short_error(exc)}", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quack_fold", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--add-only", action="store_true",
                        help="time only the fp32 accumulation with QuACK's TMA reduce-add against cuBLAS's addmm")
    args = parser.parse_args(argv)
    if args.add_only:
        device, rows, configs = torch.device("cuda"), [], _configs()
        for m, k, n in [(75968, 2048, 2048), (151936, 2048, 2048), (75968, 2048, 4096), (10112, 8448, 2048)]:
            rows += _time_add(m, k, n, device, args.repeats, configs)
            free_memory(device)
        print("\n" + "\n".join(text_table(["M×K×N", "variant", "ms", "TFLOP/s", "max rel. diff"], rows, align_left=2)))
        return 0
    from hf_fused.ops.backends.compensated import RESIDUAL_DTYPE, compensated_addmm_

    device = torch.device("cuda")
    fold, configs = _build(), _configs()

    def quack_fold_(hi, lo, a, b, config):
        fold(a, b, hi, out={"D": hi, "lo_out": lo}, lo=lo, config=config, tuned=False)

    # 1. bit for bit: eight folds of random products into one pair (dims multiples of 16: int8 TMA rows)
    torch.manual_seed(0)
    m, k, n, chunks = 2048, 4096, 2048, 8
    pairs = [(torch.randn(m, k, device=device).bfloat16(), torch.randn(k, n, device=device).bfloat16())
             for _ in range(chunks)]
    hi_t = torch.zeros(m, n, dtype=torch.bfloat16, device=device)
    lo_t = torch.zeros(m, n, dtype=RESIDUAL_DTYPE, device=device)
    for a, b in pairs:
        compensated_addmm_(hi_t, lo_t, a, b)
    for name, config in configs.items():
        hi, lo = torch.zeros_like(hi_t), torch.zeros_like(lo_t)
        for a, b in pairs:
            quack_fold_(hi, lo, a, b, config)
        print(f"{m}x{k}x{n}, {chunks} folds, QuACK {name}: hi equal to Triton's {(hi == hi_t).float().mean():.6f}, "
              f"lo {(lo == lo_t).float().mean():.6f}")

    # 2. times: (M, K, N) of the product, transposed A for the weight-gradient shapes (M = V)
    shapes = [(7373, 7680, 2048, False), (8448, 7680, 2048, False), (4224, 7680, 2048, False),
              (29491, 1920, 2048, False), (151936, 1792, 2048, True), (151936, 2048, 2048, True),
              (151936, 2048, 4096, True)]
    rows = []
    for m, k, n, transposed in shapes:
        rows += _time_shape(m, k, n, transposed, device, args.repeats, quack_fold_, configs)
        free_memory(device)
    print("\n" + "\n".join(text_table(["M×K×N", "variant", "ms", "TFLOP/s"], rows, align_left=2)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
