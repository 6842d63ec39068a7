"""The GPU backend's log-prob statistics from the logits matmul's fp32 accumulator against cuBLAS's bf16 tiles:
``python -m benchmarks.fp32_logits [--device cuda] [--shapes 8192x2048x151936,32768x2048x151936,16384x4096x128256]
[--repeats 10] [--error-rows 2048] [--gradient-shape 4096x2048x151936]``.

Per ``N×H×V`` shape (bf16, logits of standard deviation ~4, 10% of labels ignored), median milliseconds
(:func:`benchmarks.measure.median_ms`) of:

* ``mm``: cuBLAS's bf16 ``[M, V]`` matmul of the kept rows alone (the statistics' floor);
* ``stats``, ``stats+ent``: the fused statistics kernel and its merge alone
  (:func:`hf_fused.ops.backends.triton_cublas.fused_matmul.logits_statistics_`);
* ``fwd``, ``fwd+ent``: ``linear_logprobs`` without gradient (the statistics pass), fp32 statistics off / on;
* ``ce``: ``linear_cross_entropy`` forward + backward (the one pass), off / on (stored tile) / ``rec`` (``dz``
  recomputed from the accumulator);
* ``lp2``: ``linear_logprobs`` with the entropy, forward + backward (the two passes), off / on;

and the per-token log-probs' largest and RMS distance in nats to float64 on the first ``--error-rows`` kept rows,
for eager bf16 logits (TRL's head without ``cast_lm_head_to_fp32``), off and on. Then the cross-entropy's loss and
gradients against float64 at ``--gradient-shape`` (relative errors), off / on / rec. "Off" and "on" are
:func:`hf_fused.ops.backends.triton_cublas.fp32_logits_rule.forced` blocks, whatever the defaults.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

import torch

from hf_fused.ops import linear_cross_entropy, linear_logprobs
from hf_fused.ops.backends.triton_cublas import fp32_logits_rule, fused_matmul
from hf_fused.ops.backends.triton_cublas.tiles import kernel_scalars, new_row_stats
from hf_fused.ops.logit_transform import LogitTransform

from .measure import median_ms, text_table

SHAPES = "8192x2048x151936,32768x2048x151936,16384x4096x128256"
#: (column, fp32 statistics on, the one pass's dz) of the timed calls through the ops.
MODES = (("off", False, None), ("on", True, "tile"), ("rec", True, "recompute"))


def parse_shape(text: str) -> tuple[int, int, int]:
    n, h, v = (int(x) for x in text.lower().split("x"))
    return n, h, v


def inputs(device: torch.device, n: int, h: int, v: int, seed: int = 0):
    """bf16 ``hidden [n, h]``, ``weight [v, h]`` (logits of standard deviation ~4) and labels, 10% ignored."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(device, torch.bfloat16)
    weight = (torch.randn(v, h, generator=g) * (4 / h**0.5)).to(device, torch.bfloat16)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.1] = -100
    return hidden, weight, labels.to(device)


def _distance(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = (a.double() - b.double()).abs()
    return d.max().item(), d.square().mean().sqrt().item()


def logprob_errors(hidden, weight, labels, rows: int) -> dict:
    """``{name: (max, rms)}`` nats from float64 of the first ``rows`` kept rows' log-probs: eager bf16 logits, the
    backend with the fp32 statistics off and on."""
    kept = (labels != -100).nonzero()[:, 0][:rows]
    h, y = hidden.index_select(0, kept), labels.index_select(0, kept)
    w64 = weight.double()
    ref = torch.cat([torch.log_softmax(h[c:c + 512].double() @ w64.t(), -1).gather(1, y[c:c + 512, None])[:, 0]
                     for c in range(0, h.shape[0], 512)])
    del w64
    with torch.no_grad():
        out = {"eager": _distance(torch.log_softmax((h @ weight.t()).float(), -1).gather(1, y[:, None])[:, 0], ref)}
        for name, on, _ in MODES[:2]:
            with fp32_logits_rule.forced(on):
                out[name] = _distance(linear_logprobs(h, weight, y, backend="triton")[0], ref)
    return out


def measure(device: torch.device, shape: tuple[int, int, int], repeats: int, error_rows: int) -> dict:
    """One shape's row: milliseconds per column and the log-prob errors."""
    hidden, weight, labels = inputs(device, *shape)
    kept = (labels != -100).nonzero()[:, 0]
    h, y = hidden.index_select(0, kept).contiguous(), labels.index_select(0, kept)
    row = {"shape": "x".join(map(str, shape)), "ms": {}}

    def timed(name, fn):
        fn()  # warm-up: compilation, autotuning
        row["ms"][name] = median_ms(fn, device, repeats)[0]

    out = torch.empty(h.shape[0], weight.shape[0], dtype=torch.bfloat16, device=device)
    timed("mm", lambda: torch.mm(h, weight.t(), out=out))
    out = None  # the [M, V] product's memory back before the backend's calls
    scalars = kernel_scalars(LogitTransform(), None)
    for name, entropy in (("stats", False), ("stats+ent", True)):
        timed(name, lambda entropy=entropy: fused_matmul.logits_statistics_(
            h, weight, y, new_row_stats(h.shape[0], device), scalars, return_entropy=entropy))
    with torch.no_grad():
        for name, on, _ in MODES[:2]:
            with fp32_logits_rule.forced(on):
                timed(f"fwd {name}", lambda: linear_logprobs(hidden, weight, labels, backend="triton"))
                timed(f"fwd+ent {name}", lambda: linear_logprobs(hidden, weight, labels, backend="triton",
                                                                 return_entropy=True))
    hg, wg = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

    def ce():
        hg.grad = wg.grad = None
        linear_cross_entropy(hg, wg, labels, backend="triton").backward()

    def lp2():
        hg.grad = wg.grad = None
        lp, ent = linear_logprobs(hg, wg, labels, backend="triton", return_entropy=True)
        (lp.sum() + 0.1 * ent.sum()).backward()

    for name, on, dz in MODES:
        with fp32_logits_rule.forced(on, dz):
            timed(f"ce {name}", ce)
            if dz != "recompute":  # the two passes do not take the one pass's dz
                timed(f"lp2 {name}", lp2)
    row["errors"] = logprob_errors(hidden, weight, labels, error_rows)
    return row


def gradient_errors(device: torch.device, shape: tuple[int, int, int]) -> dict:
    """``{mode: (loss, hidden gradient, weight gradient)}`` relative errors of ``linear_cross_entropy`` against
    float64 (the float64 gradients formed 1024 rows at a time)."""
    hidden, weight, labels = inputs(device, *shape, seed=1)
    kept = labels != -100
    count = int(kept.sum())
    h64, w64 = hidden.double(), weight.double()
    d_h, d_w, loss64 = torch.zeros_like(h64), torch.zeros_like(w64), 0.0
    for c in range(0, shape[0], 1024):
        z = h64[c:c + 1024] @ w64.t()
        lse, y, k = torch.logsumexp(z, -1), labels[c:c + 1024].clamp_min(0), kept[c:c + 1024]
        loss64 += (lse - z.gather(1, y[:, None])[:, 0])[k].sum().item()
        p = z.sub_(lse[:, None]).exp_()
        p[torch.arange(p.shape[0], device=device), y] -= 1
        p *= k[:, None].double() / count
        d_h[c:c + 1024] = p @ w64
        d_w += p.t() @ h64[c:c + 1024]
        del z, p
    loss64 /= count
    del h64, w64
    out = {}
    for name, on, dz in MODES:
        hg, wg = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with fp32_logits_rule.forced(on, dz):
            loss = linear_cross_entropy(hg, wg, labels, backend="triton")
            loss.backward()
        rel = [((g.double() - ref).norm() / ref.norm()).item() for g, ref in ((hg.grad, d_h), (wg.grad, d_w))]
        out[name] = (abs(loss.item() - loss64) / abs(loss64), *rel)
    return out


COLUMNS = ("mm", "stats", "stats+ent", "fwd off", "fwd on", "fwd+ent off", "fwd+ent on", "ce off", "ce on", "ce rec",
           "lp2 off", "lp2 on")


def report(rows: list[dict], gradients: Optional[dict], gradient_shape: str) -> list[str]:
    lines = ["median ms (bf16, logits of std ~4, 10% of labels ignored); fp32 statistics off / on, ce rec: the one "
             "pass's dz from the accumulator"]
    lines += text_table(["shape", *COLUMNS], [[r["shape"], *(f"{r['ms'][c]:.2f}" for c in COLUMNS)] for r in rows])
    lines += ["", "per-token log-probs, nats from float64 (max / rms)"]
    lines += text_table(["shape", "eager bf16", "off", "on"], [
        [r["shape"], *(f"{r['errors'][k][0]:.1e} / {r['errors'][k][1]:.1e}" for k in ("eager", "off", "on"))]
        for r in rows])
    if gradients:
        lines += ["", f"cross-entropy at {gradient_shape} against float64 (relative): loss / hidden grad / weight grad"]
        lines += [f"  {name}: {a:.1e} / {b:.2e} / {c:.2e}" for name, (a, b, c) in gradients.items()]
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fp32_logits", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", default=SHAPES, help="comma-separated NxHxV")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--error-rows", type=int, default=2048)
    parser.add_argument("--gradient-shape", default="4096x2048x151936", help="NxHxV, or 'none'")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = []
    for text in args.shapes.split(","):
        rows.append(measure(device, parse_shape(text), args.repeats, args.error_rows))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    gradients = None
    if args.gradient_shape != "none":
        gradients = gradient_errors(device, parse_shape(args.gradient_shape))
    print("\n".join(report(rows, gradients, args.gradient_shape)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
