"""Run an example script exactly as ``accelerate launch`` would (``runpy``, as ``__main__``), counting
hf_fused's head computations, so a test can tell that the script's fused loss really ran (a parity test
alone cannot: a script that silently kept TRL's head would match its unpatched reference exactly).

    accelerate launch ... tests/distributed/script_runner.py COUNT_FILE SCRIPT [script arguments...]

Each rank writes ``{"rank", "head_calls", "partitioned_head_calls"}`` as JSON to ``COUNT_FILE.<rank>``.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_worker import count_fused_head_calls  # noqa: E402


def main() -> None:
    count_file, script, *args = sys.argv[1:]
    calls = count_fused_head_calls()
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as ``python SCRIPT`` sets it: the script's imports
    runpy.run_path(script, run_name="__main__")
    rank = int(os.environ.get("RANK", "0"))
    with open(f"{count_file}.{rank}", "w") as f:
        json.dump({"rank": rank, "head_calls": calls["all"], "partitioned_head_calls": calls["partitioned"]}, f)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown, where gloo's threads have aborted a rank before
