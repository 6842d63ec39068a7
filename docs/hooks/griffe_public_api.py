"""Griffe extension for the API reference: public import paths and the docstrings' reST roles.

* ``hf_fused.FusedTrainer`` and ``hf_fused.FusedGRPOTrainer`` are imported on first use (a module
  ``__getattr__``, so ``import hf_fused`` needs neither trl nor a Trainer), which static analysis cannot
  see: every name in ``hf_fused.__all__`` and ``hf_fused.ops.__all__`` that griffe did not find gets an alias to
  the object that ``getattr`` returns, so the reference names objects by the path users import them from.
* The docstrings are written for Sphinx as much as for ``help()``: ``:func:`name``` roles become a link to
  the name's reference entry when it is public, else inline code; a paragraph ending in ``::`` ends in ``:``
  (the indented block after it is a Markdown code block already); an ``a, b: text`` entry of an ``Args:``
  section documents each parameter it names. Double-backtick literals are Markdown
  code spans as they are; ``#:`` comments right above a constant are its docstring (Sphinx's convention).
"""

from __future__ import annotations

import importlib
import re

import griffe

#: The modules whose ``__all__`` is the public API, in the order a bare name is looked up.
PUBLIC_MODULES = ("hf_fused", "hf_fused.ops")

#: ``a, b: text`` and the lines indented deeper that continue it.
_GROUPED_PARAMS = re.compile(r"^([ \t]+)([A-Za-z_]\w*(?:,[ \t]*[A-Za-z_]\w*)+):([ \t].*(?:\n\1[ \t]+\S.*)*)$", re.M)
_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):`~?([^`]+)`")


def public_names() -> dict[str, str]:
    """``{bare name: public path}`` for every name in the public modules' ``__all__`` (the first module wins)."""
    names: dict[str, str] = {}
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            names.setdefault(name, f"{module_name}.{name}")
    return names


def _role_to_markdown(match: re.Match, public: dict[str, str]) -> str:
    target = match.group(1).strip()
    shown = target.rsplit(".", 1)[-1] if match.group(0).split("`")[1].startswith("~") else target
    path = target if target in public.values() else public.get(target)
    return f"[`{shown}`][{path}]" if path else f"`{shown}`"


def markdown_docstring(text: str, public: dict[str, str]) -> str:
    """The docstring ``text`` with reST roles and ``::`` paragraph ends turned into Markdown."""
    text = _ROLE.sub(lambda m: _role_to_markdown(m, public), text)
    text = _GROUPED_PARAMS.sub(_split_grouped_params, text)
    return re.sub(r"(?<=\S)::$", ":", text, flags=re.M)


def _split_grouped_params(match: re.Match) -> str:
    """``a, b: text`` (one entry for several parameters, its continuation lines included) as one entry per
    parameter, as Google style wants."""
    indent, names, text = match.groups()
    return "\n".join(f"{indent}{name.strip()}:{text}" for name in names.split(","))


class PublicApi(griffe.Extension):
    """Aliases for lazily exported public names; Markdown for reST roles in every docstring of the package."""

    def __init__(self) -> None:
        super().__init__()
        self._public: dict[str, str] | None = None

    def _names(self) -> dict[str, str]:
        if self._public is None:
            self._public = public_names()
        return self._public

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs) -> None:
        if pkg.name != "hf_fused":
            return
        for module_name in PUBLIC_MODULES:
            module = importlib.import_module(module_name)
            target_module = pkg if module_name == "hf_fused" else pkg[module_name.split(".", 1)[1]]
            for name in module.__all__:
                if name in target_module.members:
                    continue
                obj = getattr(module, name)  # the lazy import runs here, as it does for users
                path = f"{obj.__module__}.{obj.__qualname__}"
                target_module.set_member(name, griffe.Alias(name, path, parent=target_module))
        public = self._names()
        for obj in _walk(pkg):
            if obj.docstring is None and obj.is_attribute:
                _comment_docstring(obj)
            if obj.docstring is not None:
                obj.docstring.value = markdown_docstring(obj.docstring.value, public)


def _comment_docstring(attribute: griffe.Attribute) -> None:
    """The Sphinx convention the code uses for constants: ``#:`` comment lines right above the assignment."""
    lines = attribute.module.lines
    comment = []
    row = (attribute.lineno or 1) - 2
    while row >= 0 and lines[row].lstrip().startswith("#:"):
        comment.insert(0, lines[row].lstrip()[2:].strip())
        row -= 1
    if comment:
        attribute.docstring = griffe.Docstring(" ".join(comment), parent=attribute)


def _walk(obj: griffe.Object):
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)
