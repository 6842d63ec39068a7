"""``python -m benchmarks``: fused lm_head losses, side by side, on one device.

Modules (one job each): :mod:`.problems` (shapes, inputs, the DAPO loss), :mod:`.peers` (one adapter per
implementation), :mod:`.reference` (float64 ground truth), :mod:`.measure` (time, memory, matmul
ceiling), :mod:`.runner` (the loop, JSON), :mod:`.report` (table, plot). See ``DEVICE.md`` for running it
on the GPU machine.
"""
