"""Run an example script exactly as ``python SCRIPT`` / ``accelerate launch SCRIPT`` would (``runpy``, as
``__main__``, the script's folder first on ``sys.path``), recording what a parity test needs from outside
the script:

* hf_fused's head computations on each rank, so a test can tell that the script's fused loss really ran (a
  parity test alone cannot: a script that silently kept TRL's head would match its unpatched reference);
* every parameter, whole, when ``Trainer.train`` starts and when it returns (gathered from ZeRO-3 partitions
  or FSDP2 DTensors, PEFT adapters included), as ``train_worker.full_parameters`` reads them.

    accelerate launch ... tests/distributed/script_runner.py OUT SCRIPT [script arguments...]

Each rank writes ``{"rank", "head_calls", "partitioned_head_calls", "head_positions"}`` (the most positions of a
row its fused head received) as JSON to ``OUT.<rank>.json``; rank 0
writes ``torch.save({"initial", "params"})`` to ``OUT.params.pt``.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import exit_rank  # noqa: E402
from train_worker import count_fused_head_calls, full_parameters  # noqa: E402


def record_parameters(out: str) -> None:
    import torch
    import transformers

    train = transformers.Trainer.train

    def recorded(self, *args, **kwargs):
        initial = full_parameters(self.model)  # collective under ZeRO-3: every rank calls it
        result = train(self, *args, **kwargs)
        params = full_parameters(self.model)
        if self.accelerator.is_main_process:
            torch.save({"initial": initial, "params": params, "wrapper": type(self.model_wrapped).__name__},
                       f"{out}.params.pt")
        return result

    transformers.Trainer.train = recorded


def main() -> None:
    out, script, *args = sys.argv[1:]
    calls = count_fused_head_calls()
    record_parameters(out)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as ``python SCRIPT`` sets it: the script's imports
    runpy.run_path(script, run_name="__main__")
    rank = int(os.environ.get("RANK", "0"))
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"rank": rank, "head_calls": calls["all"], "partitioned_head_calls": calls["partitioned"],
                   "head_positions": calls["max_positions"]}, f)


if __name__ == "__main__":
    main()
    exit_rank()
