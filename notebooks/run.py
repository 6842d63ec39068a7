"""Execute the notebooks in place and save them with their outputs and plots: ``python notebooks/run.py [NAME ...]``.

Every ``notebooks/*.ipynb`` by default, or those named. Each runs top to bottom in a fresh ``python3`` kernel
(nbclient), in this directory, with its own asserts; a failing cell stops that notebook, which is then not
saved, and the exit status is 1. ``tests/examples/test_notebooks.py`` runs the same notebooks in CI without
saving, and checks that the saved outputs of the cells tagged ``stable-output`` are what the re-run prints.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbclient
import nbformat

HERE = Path(__file__).resolve().parent


def execute(path: Path, timeout: int = 600) -> nbformat.NotebookNode:
    """The notebook at ``path``, executed (raises ``nbclient.exceptions.CellExecutionError`` on a failing cell)."""
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    return nb


def main(argv: list[str]) -> int:
    paths = [HERE / (a if a.endswith(".ipynb") else a + ".ipynb") for a in argv] or sorted(HERE.glob("*.ipynb"))
    failed = []
    for path in paths:
        start = time.perf_counter()
        try:
            nb = execute(path)
        except nbclient.exceptions.CellExecutionError as e:
            print(f"{path.name}: FAILED\n{e}", file=sys.stderr)
            failed.append(path.name)
            continue
        nbformat.write(nb, path)
        print(f"{path.name}: executed and saved in {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
