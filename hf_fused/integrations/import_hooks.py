"""Post-import hooks: run a function on a module right after it is first imported.

An integration with an optional library (TRL) must adjust that library's classes before the user builds
anything with them, but importing the library to do so costs seconds in processes that never use it.
:func:`when_imported` runs the adjustment at once if the module is loaded, and otherwise right after the module
finishes executing, before the ``import`` statement that loaded it returns (so a module that imports a name from
it gets the adjusted object). :func:`cancel` withdraws a hook that has not run yet.

How: a finder first on ``sys.meta_path`` answers only for the watched names; it asks the other finders for the
module's spec and wraps the loader's ``exec_module`` (as ``wrapt``'s import hooks do). The finder is on
``sys.meta_path`` only while some hook is pending (:func:`finder_installed`). The module's ``__loader__`` and
``__spec__.loader`` stay the original loader. A hook that raises is reported as a warning: importing the library
never fails because of it.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
import warnings
from types import ModuleType
from typing import Callable

Hook = Callable[[ModuleType], None]

_PENDING: dict[str, list[Hook]] = {}  # module name -> hooks to run once it is imported
_LOCK = threading.RLock()


def when_imported(name: str, hook: Hook) -> None:
    """Run ``hook(module)`` on module ``name`` once it is imported: now if it is in ``sys.modules``, else right
    after its import executes it. Registering the same hook twice for a name before the import runs it once."""
    with _LOCK:
        module = sys.modules.get(name)
        if module is None:
            hooks = _PENDING.setdefault(name, [])
            if hook not in hooks:
                hooks.append(hook)
            if _FINDER not in sys.meta_path:
                sys.meta_path.insert(0, _FINDER)
            return
    _run(hook, module)


def cancel(name: str, hook: Hook) -> None:
    """Withdraw ``hook`` from module ``name`` if it has not run yet; the finder leaves ``sys.meta_path`` once no
    hook is pending."""
    with _LOCK:
        hooks = _PENDING.get(name)
        if hooks is not None and hook in hooks:
            hooks.remove(hook)
            if not hooks:
                del _PENDING[name]
        if not _PENDING and _FINDER in sys.meta_path:
            sys.meta_path.remove(_FINDER)


def finder_installed() -> bool:
    """Whether hf_fused's import finder is on ``sys.meta_path`` (some hook is waiting for its module)."""
    return _FINDER in sys.meta_path


def _run(hook: Hook, module: ModuleType) -> None:
    try:
        hook(module)
    except Exception as error:  # the user's import must not fail because of an integration
        warnings.warn(
            f"hf_fused: its hook on {module.__name__} failed ({type(error).__name__}: {error}); "
            "that integration is not installed.",
            stacklevel=2,
        )


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _PENDING:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _HookedLoader(spec.loader)
        return spec


class _HookedLoader(importlib.abc.Loader):
    """The module's own loader, then the pending hooks."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # The module keeps its real loader (resources, source, reload).
        if getattr(module, "__loader__", None) in (None, self):
            module.__loader__ = self.loader
        if getattr(module.__spec__, "loader", None) is self:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        with _LOCK:
            hooks = _PENDING.pop(module.__name__, [])
            if not _PENDING and _FINDER in sys.meta_path:
                sys.meta_path.remove(_FINDER)
        for hook in hooks:
            _run(hook, module)

    def __getattr__(self, name):
        return getattr(self.loader, name)


_FINDER = _PostImportFinder()
