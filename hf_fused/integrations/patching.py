"""One process-wide patch of a third-party library: what it replaces, when, why, and how it is undone.

A :class:`ThirdPartyPatch` describes one rebind of a transformers or TRL attribute (the inventory of them all is
:mod:`hf_fused.integrations.inventory`). :meth:`~ThirdPartyPatch.install` runs its ``apply`` on the watched module
once that module is imported (at once if it is loaded; :func:`~hf_fused.integrations.import_hooks.when_imported`),
never importing it, and does nothing when the library is not installed. ``apply(module, patch)`` makes each
replacement with :meth:`~ThirdPartyPatch.rebind`, which records the original.

:meth:`~ThirdPartyPatch.uninstall` cancels a pending import hook and puts every original back where the attribute
still holds hf_fused's replacement (and in every loaded module of ``aliases_in`` that imported the replacement by
name). A replacement that someone else has wrapped since cannot be taken out of their chain: the wrappers check
:meth:`~ThirdPartyPatch.liveness` and pass every call straight through once their installation is undone.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Optional

from .import_hooks import cancel, when_imported

_MISSING = object()


@dataclass
class Rebind:
    """``owner.name`` (a module or class attribute) replaced by ``replacement``; ``original`` is what it held
    (``_MISSING`` when the attribute was not in ``owner``'s own ``__dict__``)."""

    owner: Any
    name: str
    original: Any
    replacement: Any

    def in_place(self) -> bool:
        return vars(self.owner).get(self.name, _MISSING) is self.replacement

    def restore(self) -> None:
        """Put the original back if the attribute still holds the replacement."""
        if not self.in_place():
            return
        if self.original is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.original)


@dataclass(eq=False)
class ThirdPartyPatch:
    """One entry of the inventory (see the module docstring).

    Attributes:
        name: short name (the inventory's key).
        module: the module whose import triggers ``apply`` (e.g. ``"trl.trainer.utils"``).
        target: what is rebound (``"transformers.Trainer.prediction_step"``).
        trigger: when it is installed.
        versions: the library versions whose shape it was written against and is checked with.
        why: what hf_fused needs it for.
        passes_through: what every other call gets (unchanged behaviour).
        apply: ``apply(module, patch)``: makes the replacements with ``patch.rebind``.
        aliases_in: a package whose loaded modules may hold the replacement under the same name (imported by
            name after it was installed); uninstalling restores those too.
    """

    name: str
    module: str
    target: str
    trigger: str
    versions: str
    why: str
    passes_through: str
    apply: Callable[[ModuleType, "ThirdPartyPatch"], None]
    aliases_in: Optional[str] = None
    rebinds: list = field(default_factory=list, repr=False)
    #: What ``apply`` learned about the installed library (e.g. ``"refused"``: why a protocol is not served).
    state: dict = field(default_factory=dict, repr=False)
    installed: bool = False
    _generation: int = 0

    def install(self) -> None:
        """Have ``apply`` run on :attr:`module` once it is imported (now if it is loaded). Idempotent; an
        installation whose replacements someone has put back since (a test's monkeypatch) is made again. No-op
        when the library is not installed."""
        if self.installed:
            if all(r.in_place() for r in self.rebinds):
                return
            self.uninstall()
        if importlib.util.find_spec(self.module.split(".")[0]) is None:
            return
        self.installed = True
        self._generation += 1
        when_imported(self.module, self._on_import)

    def uninstall(self) -> None:
        """Undo :meth:`install` (see the module docstring). Idempotent."""
        cancel(self.module, self._on_import)
        self.installed = False
        self._generation += 1  # wrappers left in someone else's chain pass through from now on
        replacements = {id(r.replacement): r for r in self.rebinds}
        for rebind in reversed(self.rebinds):
            rebind.restore()
        if self.aliases_in is not None:
            for module in list(sys.modules.values()):
                name = getattr(module, "__name__", None)
                if not isinstance(name, str) or not (name == self.aliases_in or name.startswith(self.aliases_in + ".")):
                    continue
                for rebind in replacements.values():
                    # vars(), not getattr: a lazy module would import its optional submodules on attribute access.
                    if vars(module).get(rebind.name) is rebind.replacement:
                        setattr(module, rebind.name, rebind.original)
        self.rebinds.clear()
        self.state.clear()

    def rebind(self, owner: Any, name: str, replacement: Any) -> None:
        """Set ``owner.name = replacement``, remembering the original for :meth:`uninstall`."""
        self.rebinds.append(Rebind(owner, name, vars(owner).get(name, _MISSING), replacement))
        setattr(owner, name, replacement)

    def refuse(self, why: str, consequence: str) -> None:
        """For ``apply``: the installed library is not the shape this entry serves (``why``): record it in
        :attr:`state` (``"refused"``) and warn once, saying what follows (``consequence``), instead of rebinding."""
        self.state["refused"] = why
        warnings.warn(f"hf_fused: {why}. {consequence}", stacklevel=4)

    def liveness(self) -> Callable[[], bool]:
        """A check for the wrappers made now: true while this installation is in place."""
        generation = self._generation
        return lambda: self.installed and self._generation == generation

    def _on_import(self, module: ModuleType) -> None:
        if self.installed:
            self.apply(module, self)
