"""The GPU backend is one package of small files, each with one job: none over ~400 lines, and no file borrows a
private name from another (what is shared, the matmul toolkit, the tile kernels' helpers, the planning rules, has
public names)."""

from __future__ import annotations

import ast
from pathlib import Path

import hf_fused.ops.backends as backends

BACKENDS = Path(backends.__file__).parent
PACKAGE = BACKENDS / "triton_cublas"


def test_every_file_of_the_gpu_backend_is_small():
    sizes = {path.name: len(path.read_text().splitlines()) for path in PACKAGE.glob("*.py")}
    assert {"backend.py", "plan.py", "one_pass.py", "two_passes.py", "compensated.py", "matmul.py"} <= set(sizes)
    assert max(sizes.values()) <= 400, sizes


def test_no_private_name_is_imported_from_another_module():
    found = []
    for path in sorted(BACKENDS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("hf_fused")):
                found += [f"{path.relative_to(BACKENDS)}:{node.lineno} {alias.name}" for alias in node.names
                          if alias.name.startswith("_")]
    assert found == []
