"""Run example scripts exactly as ``python SCRIPT`` / ``accelerate launch SCRIPT`` would (``runpy``, as
``__main__``, the script's folder first on ``sys.path``), recording what a parity test needs from outside
the script:

* hf_fused's head computations on each rank, so a test can tell that the script's fused loss really ran (a
  parity test alone cannot: a script that silently kept TRL's head would match its unpatched reference);
* every parameter, whole, when ``Trainer.train`` starts and when it returns (gathered from ZeRO-3 partitions
  or FSDP2 DTensors, PEFT adapters included), as ``train_worker.full_parameters`` reads them.

    accelerate launch ... tests/distributed/script_runner.py RUNS.json

``RUNS.json`` lists the runs of this launch, ``[{"case": {"script", "args"}, "dir"}, ...]``; each runs ``script``
with ``args`` and ``--output_dir <dir>``, one after the other in this process (a launch costs far more than a tiny
script's run; the environment is restored after each). For each run, each rank writes ``{"rank", "head_calls",
"partitioned_head_calls", "head_positions", "teacher"}`` (the most positions of a row its fused head received; a
distillation trainer's teacher as training starts, :func:`teacher_record`) as JSON to ``<dir>/run.<rank>.json``;
rank 0 writes ``torch.save({"initial", "params", "wrapper"})`` to ``<dir>/run.params.pt``.
A run that raised writes its traceback to ``<dir>/error.txt``, and the next one runs.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

from ranks import exit_rank, run_each
from train_worker import count_fused_head_calls, full_parameters

#: Where the run in progress records its parameters (``<dir>/run``).
_current = {"out": None}


def record_parameters() -> None:
    import torch
    import transformers

    train = transformers.Trainer.train

    def recorded(self, *args, **kwargs):
        _current["teacher"] = teacher_record(getattr(self, "teacher_model", None))
        initial = full_parameters(self.model)  # collective under ZeRO-3: every rank calls it
        result = train(self, *args, **kwargs)
        params = full_parameters(self.model)
        if self.accelerator.is_main_process:
            torch.save({"initial": initial, "params": params, "wrapper": type(self.model_wrapped).__name__},
                       f"{_current['out']}.params.pt")
        return result

    transformers.Trainer.train = recorded


def teacher_record(teacher) -> dict | None:
    """A distillation trainer's teacher as training starts: its wrapper's class, whether FSDP (1 or 2) wraps it,
    and whether its lm_head weight is a DTensor (FSDP2's shard); ``None`` without a teacher."""
    if teacher is None:
        return None
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    head = getattr(teacher, "module", teacher).get_output_embeddings()
    return {"wrapper": type(teacher).__name__, "fsdp": isinstance(teacher, (FSDPModule, FullyShardedDataParallel)),
            "dtensor_head": isinstance(head.weight, DTensor)}


def keep_the_process_group() -> None:
    """The scripts end as TRL's do, ``trainer.end()`` destroying the process group; the next run of this launch would
    build a new one while DeepSpeed keeps its groups from the first (``Group ... is not registered``). One process
    group serves every run, and is left by ``ranks.exit_rank`` after a barrier. (The script launched as users
    launch it, without this runner, ends as it does for them: test_trl_scripts.py.)"""
    from accelerate.state import PartialState

    PartialState.destroy_process_group = lambda self, group=None: None


def share_the_tiny_text() -> None:
    """The ``--tiny`` scripts make their text and tokenizer from Python's documentation split into words
    (``tiny._words``: 0.1 s, two or three times a run on each rank); the runs of a launch split it once."""
    import functools

    import tiny

    tiny._words = functools.cache(tiny._words)


def run_script(script: str, args: list[str], directory: str) -> None:
    out = os.path.join(directory, "run")
    _current.update(out=out, teacher=None)
    calls = count_fused_head_calls()
    sys.argv = [script, *args, "--output_dir", directory]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as ``python SCRIPT`` sets it: the script's imports
    runpy.run_path(script, run_name="__main__")
    rank = int(os.environ.get("RANK", "0"))
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"rank": rank, "head_calls": calls["all"], "partitioned_head_calls": calls["partitioned"],
                   "head_positions": calls["max_positions"], "teacher": _current["teacher"]}, f)


def main(batch_file: str) -> None:
    record_parameters()
    keep_the_process_group()
    share_the_tiny_text()

    def run(case: dict, directory: str) -> None:
        path = list(sys.path)
        try:
            run_script(case["script"], case["args"], directory)
        finally:
            sys.path[:] = path

    run_each(batch_file, run)


if __name__ == "__main__":
    main(sys.argv[1])
    exit_rank()
