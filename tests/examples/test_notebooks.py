"""The notebooks: saved executed (outputs and a plot in each), import only hf_fused and public libraries, and run
top to bottom again here (their own asserts included) through nbclient, as ``python notebooks/run.py`` does."""

import ast
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
REPO_PACKAGES = {"examples", "benchmarks", "tests", "notebooks"}  # the clone's own code: not for notebooks


def test_the_three_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == ["01_ops_tour.ipynb", "02_fine_tuning.ipynb", "03_grpo.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_saved_with_outputs_and_imports_only_libraries(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code), "run `make notebooks` and commit the result"
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs), "no plot saved"
    for cell in code:
        for node in ast.walk(ast.parse(cell.source)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                for name in names:
                    assert name.split(".")[0] not in REPO_PACKAGES, f"{path.name} imports {name}"
    assert "sys.path" not in "\n".join(c.source for c in code)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError at the first failing cell; ipykernel's python3 is this Python
