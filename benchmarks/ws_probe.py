"""Does Triton's warp specialization (``tl.range(..., warp_specialize=True)``) help on Hopper at the two passes'
matmul shapes? A probe, GPU only: a persistent TMA matmul (device-side tensor descriptors, which Hopper's
warp-specialized pipeline needs) with either a plain bf16 store or a cross-entropy ``dz`` epilogue, timed with and
without warp specialization against cuBLAS (``torch.mm``) and the library's fused-``dz`` kernel.

    python -m benchmarks.ws_probe [--shapes M:N:K:nt|nn,...]     # on a CUDA device of compute capability 9.x
    python -m benchmarks.ws_probe --quick                        # tiny shapes on CPU (TRITON_INTERPRET=1)

Measured on an H200 (docs/gpu_results.md, twelfth session): with Triton 3.6 warp specialization gave nothing at
these shapes (the best warp-specialized config within ±3 % of the best plain one, most configs slower).
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

import torch
import triton
import triton.language as tl
from triton.testing import do_bench


@triton.jit
def _pid(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    in_group = GROUP_M * num_pid_n
    first_m = (tile // in_group) * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % size_m), (tile % in_group) // size_m


@triton.jit
def _probe_kernel(A, B, C, Labels, LSE, M, N, K, B_T: tl.constexpr, EPI: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
                  WS: tl.constexpr, FLATTEN: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(A, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    if B_T:
        b_desc = tl.make_tensor_descriptor(B, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(B, shape=[K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N])
    c_desc = tl.make_tensor_descriptor(C, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    tile_c = start - NUM_SMS
    for tile in tl.range(start, num_pid_m * num_pid_n, NUM_SMS, flatten=FLATTEN, warp_specialize=WS):
        pid_m, pid_n = _pid(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_tiles):
            a = a_desc.load([off_m, k * BLOCK_K])
            if B_T:
                b = b_desc.load([off_n, k * BLOCK_K]).T
            else:
                b = b_desc.load([k * BLOCK_K, off_n])
            acc = tl.dot(a, b, acc)
        tile_c += NUM_SMS
        pid_m_c, pid_n_c = _pid(tile_c, num_pid_m, num_pid_n, GROUP_M)
        if EPI == 0:
            c_desc.store([pid_m_c * BLOCK_M, pid_n_c * BLOCK_N], acc.to(tl.bfloat16))
        else:
            rm = pid_m_c * BLOCK_M + tl.arange(0, BLOCK_M)
            rn = pid_n_c * BLOCK_N + tl.arange(0, BLOCK_N)
            labels = tl.load(Labels + rm, mask=rm < M, other=-1)
            lse = tl.load(LSE + rm, mask=rm < M, other=0.0)
            z = acc.to(tl.bfloat16).to(tl.float32)
            p = tl.exp(z - lse[:, None])
            dz = tl.where(rn[None, :] == labels[:, None], p - 1.0, p)
            c_desc.store([pid_m_c * BLOCK_M, pid_n_c * BLOCK_N], dz.to(tl.bfloat16))


def _alloc(size: int, alignment: int, stream, device: str = "cuda"):
    return torch.empty(size, device=device, dtype=torch.int8)


def probe(m, n, k, b_t, epi, config, ws, device="cuda"):
    """``(median ms, max |error|)`` of one launch shape of :func:`_probe_kernel` (bf16 on CUDA; fp32 under the
    interpreter, timed once) against ``torch.mm`` and the same epilogue in PyTorch."""
    block_m, block_n, block_k, warps, stages = config
    cuda = device != "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device=device).manual_seed(m + n + k)
    a = torch.randn(m, k, device=device, generator=g).to(dtype)
    b = (torch.randn((n, k) if b_t else (k, n), device=device, generator=g) * 0.05).to(dtype)
    c = torch.empty(m, n, device=device, dtype=dtype)
    labels = torch.randint(0, n, (m,), device=device, generator=g)
    lse = torch.full((m,), 12.0, device=device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 4

    def run():
        _probe_kernel[(sms,)](a, b, c, labels, lse, m, n, k, B_T=b_t, EPI=epi, BLOCK_M=block_m, BLOCK_N=block_n,
                              BLOCK_K=block_k, GROUP_M=8, NUM_SMS=sms, WS=ws, FLATTEN=not ws,
                              num_warps=warps, num_stages=stages)

    run()
    # the kernel stores bf16 values (rounded on the GPU; truncated by the interpreter, whose fp32 → bf16
    # conversion truncates): compare in fp32 against the fp32 result
    z = (a.float() @ (b.T if b_t else b).float())
    if epi == 1:
        z = torch.exp(z.bfloat16().float() - lse[:, None])
        z[torch.arange(m, device=device), labels] -= 1
    err = (c.float() - z).abs().max().item()
    if not cuda:
        start = time.perf_counter()
        run()
        return (time.perf_counter() - start) * 1e3, err
    return do_bench(run, warmup=50, rep=300, return_mode="median"), err


def main(argv=None) -> list[tuple]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8448:10112:2048:nt,2048:151936:2048:nt,8448:2048:10112:nn",
                        help="comma-separated M:N:K:layout, layout nt (b is [N, K]) or nn (b is [K, N])")
    parser.add_argument("--quick", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    args = parser.parse_args(argv)
    if args.quick:
        if os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--quick runs the kernel under Triton's interpreter: set TRITON_INTERPRET=1")
        device, shapes, configs = "cpu", "96:160:64:nt,96:64:160:nn", [(32, 32, 32, 4, 2)]
    else:
        device, shapes = "cuda", args.shapes
        configs = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4),
                   (128, 256, 64, 4, 3), (256, 128, 64, 8, 3)]
    triton.set_allocator(lambda size, alignment, stream: _alloc(size, alignment, stream, device))
    rows = []
    for spec in shapes.split(","):
        m, n, k, layout = spec.split(":")
        m, n, k, b_t = int(m), int(n), int(k), layout == "nt"
        cublas = float("nan")
        if device != "cpu":
            a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            b = torch.randn((n, k) if b_t else (k, n), device=device, dtype=torch.bfloat16)
            cublas = do_bench(lambda: torch.mm(a, b.T if b_t else b), warmup=50, rep=300, return_mode="median")
        rows.append((spec, "cublas mm", "-", "-", f"{cublas:.3f}", "", ""))
        for epi, config, ws in itertools.product((0, 1) if b_t else (0,), configs, (False, True)):
            try:
                ms, err = probe(m, n, k, b_t, epi, config, ws, device)
                rows.append((spec, "store" if epi == 0 else "dz", config, ws, f"{ms:.3f}", f"{cublas / ms:.2f}",
                             f"{err:.2e}"))
            except Exception as exc:  # a config Triton cannot build (shared memory, say): say so and go on
                rows.append((spec, "store" if epi == 0 else "dz", config, ws, "error",
                             type(exc).__name__, str(exc).splitlines()[0][:80] if str(exc) else ""))
            print(rows[-1], flush=True)
    print("\nshape | epilogue | (bm, bn, bk, warps, stages) | ws | ms | cuBLAS/this | max err")
    for row in rows:
        print(" | ".join(str(x) for x in row))
    return rows


if __name__ == "__main__":
    main()
