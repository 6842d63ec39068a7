"""The notebooks: each opens with a markdown cell saying what it shows and ends with a plot, is saved executed, imports
only hf_fused and public libraries, and runs top to bottom again here (its own asserts included) through nbclient, as
``python notebooks/run.py`` does. On CPU the outputs of the cells tagged ``stable-output`` (memory figures, counted
tensor by tensor) must be what the re-run prints, so saved figures cannot go stale."""

import ast
from pathlib import Path

import pytest
import torch

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
REPO_PACKAGES = {"examples", "benchmarks", "tests", "notebooks"}  # the clone's own code: not for notebooks


def test_the_three_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == ["01_ops_tour.ipynb", "02_fine_tuning.ipynb", "03_grpo.ipynb"]


def _tagged(nb, tag: str) -> list:
    return [c for c in nb.cells if tag in c.get("metadata", {}).get("tags", [])]


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_opens_with_what_it_shows_and_ends_with_a_plot(path):
    nb = nbformat.read(path, as_version=4)
    first, last = nb.cells[0], nb.cells[-1]
    assert first.cell_type == "markdown" and first.source.startswith("# "), "open with a title and what it shows"
    assert "shows" in first.source
    assert last.cell_type == "code" and "plt.show()" in last.source
    assert any("image/png" in o.get("data", {}) for o in last.outputs), "the last cell's plot is not saved"
    assert len(_tagged(nb, "versions")) == 1 and _tagged(nb, "stable-output")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_saved_with_outputs_and_imports_only_libraries(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code), "run `make notebooks` and commit the result"
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    for cell in code:
        for node in ast.walk(ast.parse(cell.source)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                for name in names:
                    assert name.split(".")[0] not in REPO_PACKAGES, f"{path.name} imports {name}"
    assert "sys.path" not in "\n".join(c.source for c in code)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    # The kernel is a process of its own, outside conftest's one-thread rule: without this, its OpenMP workers
    # spin-wait for cores that the other pytest worker and the distributed tests' ranks hold (a notebook then took
    # 2-3x its CPU time of wall time in CI). The saved figures do not depend on the thread count.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    saved = nbformat.read(path, as_version=4)
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError at the first failing cell; ipykernel's python3 is this Python
    # The saved memory figures are checked where they were made: on CPU, with the same library versions.
    if torch.cuda.is_available() or _text(_tagged(nb, "versions")[0]) != _text(_tagged(saved, "versions")[0]):
        return
    for now, then in zip(_tagged(nb, "stable-output"), _tagged(saved, "stable-output")):
        assert _text(now) == _text(then), (
            f"{path.name}: the saved output of a stable-output cell is not what a re-run prints; run "
            f"`python notebooks/run.py {path.stem}` and commit the notebook\nsaved:\n{_text(then)}\nnow:\n{_text(now)}")
