"""Smoke test of ``python -m benchmarks.tensor_parallel`` on CPU (a one-rank gloo group on an in-process store):
every variant and op runs, the one-rank call is the unsharded op bit for bit and the tensor-parallel path at
``tp = 1``'s work agrees with it."""

from __future__ import annotations

import torch.distributed as dist

from benchmarks.tensor_parallel import OPS, VARIANTS, main, run


def test_every_variant_runs_and_agrees_with_the_unsharded_op(capsys):
    import torch

    try:
        rows = run(torch.device("cpu"), tokens=48, hidden=16, vocab=131, repeats=1)
        assert [(r["op"], r["variant"]) for r in rows] == [(op, v) for op in OPS for v in VARIANTS]
        for row in rows:
            assert row["ms"] > 0
            if row["variant"] == "unsharded":
                assert row["errors"] is None
            elif row["variant"] == "one-rank":
                assert row["errors"] == [0.0, 0.0, 0.0]
            else:  # bf16 weight gradients: one rounding of sums taken in another order
                value, d_hidden, d_weight = row["errors"]
                assert value <= 1e-6 and d_hidden <= 1e-6 and d_weight <= 2.0**-8, row
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert main(["--device", "cpu", "--tokens", "16", "--hidden", "8", "--vocab", "37", "--repeats", "1",
                 "--ops", "cross_entropy", "--variants", "unsharded,tp-path"]) == 0
    printed = capsys.readouterr().out
    assert "tp-path" in printed and "error value / dX / dW" in printed
