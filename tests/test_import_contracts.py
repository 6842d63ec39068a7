"""The package's import structure is a checked contract: ``lint-imports`` (import-linter) keeps every contract of
``.importlinter`` (the layers trainers → integrations → model → ops, each importing only downward; the layers
inside ops; no import cycle at any depth; ops free of model and training libraries; model free of TRL), and no
module imports a private name from another layer."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("ops", "model", "integrations", "trainers")


def test_lint_imports_keeps_every_contract():
    lint_imports = Path(sys.executable).parent / "lint-imports"
    assert lint_imports.exists(), f"{lint_imports} not found: install the test extra (pip install -e '.[test]')"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([str(lint_imports), "--no-cache", "--config", str(ROOT / ".importlinter")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else ""


def _private_imports_across_layers() -> list[str]:
    found = []
    for path in sorted((ROOT / "hf_fused").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")
                source = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not source.startswith("hf_fused") or _layer(source) in ("", _layer(module)):
                continue
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"{module} (line {node.lineno}): from {source} import {alias.name}")
    return found


def test_no_private_name_crosses_a_layer():
    assert _private_imports_across_layers() == []
