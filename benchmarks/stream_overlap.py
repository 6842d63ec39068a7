"""Does the one pass gain from running its memory-bound epilogues beside its matmuls?
``python -m benchmarks.stream_overlap --device cuda``.

A developer's probe. One one-pass tile (``--rows`` token rows × the whole ``--vocab``, bf16, logits of standard
deviation 4): the logits matmul, the statistics and gradient kernels (:mod:`hf_fused.ops.backends.triton_kernels`),
the hidden-gradient matmul into fp32 and the weight-gradient matmul into an fp32 ``[V, H]`` accumulator (cuBLAS),
as the GPU backend's one pass runs them, in order on one stream; then with the tile's rows cut into ``--slices``
slices whose statistics and gradient kernels run on a second stream, so that slice ``i``'s epilogues overlap slice
``i + 1``'s logits matmul and slice ``i − 1``'s hidden-gradient matmul (the weight gradient still takes the whole
tile at once). Prints median ms per tile for each, the components alone, and checks that the overlapped tile's
``dh`` and ``dW`` equal the sequential ones (to fp32 summation order: cuBLAS may pick another algorithm for a
slice's rows).
"""

from __future__ import annotations

import argparse

import torch

from .measure import median_ms
from .report import text_table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--slices", default="2,4,8", help="row slices per tile to try (comma-separated)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    device = torch.device(args.device)

    from hf_fused.ops.backends import triton_cublas as tc
    from hf_fused.ops.logit_transform import LogitTransform

    n, h_size, v = args.rows, args.hidden, args.vocab
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, h_size, generator=gen, device=device).to(torch.bfloat16)
    weight = (torch.randn(v, h_size, generator=gen, device=device) * (4 / h_size**0.5)).to(torch.bfloat16)
    labels = torch.randint(0, v, (n,), generator=gen, device=device)
    f32 = dict(dtype=torch.float32, device=device)
    tile = torch.empty(n, v, dtype=torch.bfloat16, device=device)
    d_hidden = torch.empty(n, h_size, **f32)
    d_weight = torch.zeros(v, h_size, **f32)
    g_lp = torch.full((n,), 1.0 / n, **f32)
    # the backend's own launches (as benchmarks.plan_sweep times them)
    backend = tc.TritonCublasBackend()
    scalars = backend._scalars(LogitTransform(), None)
    stats = backend._new_stats(n, device)

    def logits(a, b):
        torch.mm(hidden[a:b], weight.t(), out=tile[a:b])

    def epilogues(a, b):
        row_stats = tc._row_slice(stats, a, b)
        row_stats[0].fill_(float("-inf"))
        row_stats[1].zero_()
        row_stats[2].zero_()
        backend._stats(tile[a:b], 0, None, labels[a:b], row_stats, scalars, True)
        lse = row_stats[0] + row_stats[1].log()
        backend._grad(tile[a:b], 0, None, labels[a:b], lse, lse, g_lp[a:b], lse, scalars, True, False)

    def hidden_grad(a, b):
        tc._mm_f32_(d_hidden[a:b], tile[a:b], weight)

    def weight_grad():
        tc._addmm_f32_(d_weight, tile.t(), hidden)

    def sequential():
        logits(0, n)
        epilogues(0, n)
        hidden_grad(0, n)
        weight_grad()

    def overlapped(k):
        bounds = [round(i * n / k) for i in range(k + 1)]
        slices = list(zip(bounds, bounds[1:]))
        if device.type != "cuda":  # the same slices in order (for the CPU smoke test)
            for a, b in slices:
                logits(a, b)
                epilogues(a, b)
            for a, b in slices:
                hidden_grad(a, b)
            weight_grad()
            return
        main = torch.cuda.current_stream(device)
        side.wait_stream(main)  # the previous tile's weight gradient has read the tile
        ready = []
        for a, b in slices:
            logits(a, b)
            produced = torch.cuda.Event()
            produced.record(main)
            with torch.cuda.stream(side):
                side.wait_event(produced)
                epilogues(a, b)
                done = torch.cuda.Event()
                done.record(side)
            ready.append(done)
        for (a, b), done in zip(slices, ready):
            main.wait_event(done)
            hidden_grad(a, b)
        weight_grad()

    side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def run_parts():
        parts = {"logits": lambda: logits(0, n), "statistics + gradient kernels": lambda: epilogues(0, n),
                 "hidden gradient": lambda: hidden_grad(0, n), "weight gradient": weight_grad}
        return [(name, median_ms(fn, device, args.repeats)[0]) for name, fn in parts.items()]

    rows = []
    sequential()
    parts = run_parts()
    for name, ms in parts:
        rows.append([name, "", f"{ms:.3f}", ""])
    rows.append(["sum of the parts", "", f"{sum(ms for _, ms in parts):.3f}", ""])
    d_weight.zero_()
    sequential()
    ref_dh, ref_dw = d_hidden.clone(), d_weight.clone()
    seq_ms = median_ms(sequential, device, args.repeats)[0]
    rows.append(["sequential (the backend's order)", 1, f"{seq_ms:.3f}", "1.000"])
    for k in (int(x) for x in args.slices.split(",")):
        d_weight.zero_()
        overlapped(k)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        # cuBLAS may pick another algorithm for a slice's rows: fp32 sums in another order
        same = torch.allclose(d_hidden, ref_dh, rtol=1e-5, atol=1e-7) and torch.allclose(d_weight, ref_dw,
                                                                                          rtol=1e-5, atol=1e-7)
        ms = median_ms(lambda: overlapped(k), device, args.repeats)[0]
        rows.append([f"epilogues on a second stream{'' if same else ' (DIFFERENT RESULT)'}", k, f"{ms:.3f}",
                     f"{ms / seq_ms:.3f}"])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    print(f"{name}: one one-pass tile, {n} rows × H {h_size} × V {v}, bf16")
    print("\n".join(text_table(["schedule", "slices", "ms per tile", "vs sequential"], rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
