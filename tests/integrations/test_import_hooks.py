"""``hf_fused.integrations.import_hooks.when_imported``: a hook runs on a module once, right after its first import
(before the importing statement gets the module) or at once if it is loaded; the module keeps its own loader; a hook
that raises warns and the import still succeeds; a cancelled hook never runs, and the finder leaves ``sys.meta_path``
with the last pending hook."""

from __future__ import annotations

import sys

import pytest

from hf_fused.integrations import import_hooks
from hf_fused.integrations.import_hooks import cancel, finder_installed, when_imported


@pytest.fixture
def make_module(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    names = []

    def make(name: str, source: str = "VALUE = 1\n") -> str:
        (tmp_path / f"{name}.py").write_text(source)
        names.append(name)
        return name

    yield make
    for name in names:
        sys.modules.pop(name, None)


def test_hook_runs_once_right_after_the_first_import(make_module):
    name = make_module("_hf_fused_hooked_a")
    seen = []

    def hook(module):
        seen.append(module.VALUE)
        module.VALUE = 2

    when_imported(name, hook)
    when_imported(name, hook)  # registered twice: runs once
    assert seen == [] and name not in sys.modules
    from _hf_fused_hooked_a import VALUE  # the importing statement sees what the hook left

    module = sys.modules[name]
    assert seen == [1] and VALUE == 2
    assert type(module.__loader__).__name__ == "SourceFileLoader" and module.__spec__.loader is module.__loader__
    import importlib

    importlib.reload(module)
    assert seen == [1] and module.VALUE == 1  # a reload does not run the hook again


def test_hook_on_a_loaded_module_runs_at_once(make_module):
    name = make_module("_hf_fused_hooked_b")
    module = __import__(name)
    seen = []
    when_imported(name, seen.append)
    assert seen == [module]


def test_hook_that_raises_warns_and_the_import_succeeds(make_module):
    name = make_module("_hf_fused_hooked_c")

    def hook(module):
        raise KeyError("boom")

    when_imported(name, hook)
    with pytest.warns(UserWarning, match="hook on _hf_fused_hooked_c failed"):
        module = __import__(name)
    assert module.VALUE == 1


def test_cancelled_hook_does_not_run_and_the_finder_leaves(make_module):
    name = make_module("_hf_fused_hooked_d")
    seen = []
    when_imported(name, seen.append)
    assert finder_installed()
    cancel(name, seen.append)
    assert finder_installed() == bool(import_hooks._PENDING)  # only while another hook waits (the inventory's)
    __import__(name)
    assert seen == [] and name not in import_hooks._PENDING
