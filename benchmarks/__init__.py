"""Benchmarks a user can run (README.md in this folder says how, and what to install: ``pip install -e .[bench]``).

Entry points: ``python -m benchmarks`` (the ops side by side with every peer), ``python -m benchmarks.e2e``
(training steps end to end), ``python -m benchmarks.e2e.distributed`` (end to end under each distributed engine).

Modules of the ops benchmark, each importing only the ones before it: :mod:`.measure` (time, memory, error against
float64, JSON / table / plot / progress: shared by every entry point), :mod:`.losses` (the objectives: TRL's GRPO
loss types and distillation divergences), :mod:`.reference` (the float64 ground truth), :mod:`.problems` (shapes
and inputs), :mod:`.peers` (one adapter per implementation), :mod:`.runner` (the loop, JSON), :mod:`.report`
(table, plot).
"""
