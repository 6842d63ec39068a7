"""MkDocs hook: the API reference covers the public API, and every public name has a docstring.

Run by ``mkdocs build`` (``hooks:`` in mkdocs.yml). Each finding is a warning, which ``mkdocs build --strict``
(``make docs``, tests/docs/test_site.py) turns into a failed build:

* a name in ``hf_fused.__all__`` or ``hf_fused.ops.__all__`` without a docstring of its own;
* a public name that no ``::: path`` directive under ``docs/reference/`` documents (by its public path, or by the
  path of the same object in the other public module: ``hf_fused.linear_logprobs`` is ``hf_fused.ops.linear_logprobs``);
* a directive that names something that is not public (a stale or internal path).

Broken links and unresolved references are MkDocs' and mkdocstrings' own warnings.
"""

from __future__ import annotations

import importlib
import logging
import re
import sys
from pathlib import Path

import griffe

sys.path.insert(0, str(Path(__file__).resolve().parent))  # MkDocs loads a hook by its file, not as a package
from griffe_public_api import PUBLIC_MODULES, PublicApi  # noqa: E402

log = logging.getLogger("mkdocs.hooks.api_check")

_DIRECTIVE = re.compile(r"^:::\s+(\S+)", re.M)


def _documented_paths(docs_dir: Path) -> set[str]:
    return {m.group(1) for page in sorted((docs_dir / "reference").glob("*.md"))
            for m in _DIRECTIVE.finditer(page.read_text())}


def check_public_api(docs_dir: Path) -> list[str]:
    """The findings (one sentence each) for the public API against ``docs_dir/reference``."""
    findings = []
    package = griffe.load("hf_fused", extensions=griffe.load_extensions(PublicApi), resolve_aliases=True,
                          resolve_external=False)
    documented = _documented_paths(docs_dir)
    same_object: dict[int, set[str]] = {}
    public = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            path = f"{module_name}.{name}"
            public.append(path)
            same_object.setdefault(id(getattr(module, name)), set()).add(path)
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            path = f"{module_name}.{name}"
            obj = package[path.split(".", 1)[1]]
            target = obj.final_target if obj.is_alias else obj
            if target.docstring is None or not target.docstring.value.strip():
                findings.append(f"public name {path} has no docstring (write one where it is defined: {target.path})")
            if not documented & same_object[id(getattr(module, name))]:
                findings.append(f"public name {path} is not in the API reference (add '::: {path}' to a page "
                                "under docs/reference/)")
    for path in sorted(documented - set(public)):
        findings.append(f"docs/reference names {path}, which is not in hf_fused.__all__ or hf_fused.ops.__all__")
    return findings


def on_pre_build(config, **kwargs) -> None:
    for finding in check_public_api(Path(config["docs_dir"])):
        log.warning(finding)
