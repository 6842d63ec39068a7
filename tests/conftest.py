"""Shared pytest setup for the whole suite.

* CPU threads: every test runs on one intra-op thread (:func:`single_thread`).
* GPU tests (``gpu`` marker) are skipped without CUDA, ``multigpu`` ones without 2 GPUs; under
  ``HF_FUSED_TEST_DEVICE=cuda`` the multi-process tests of tests/distributed (one GPU per rank) without 2 GPUs.
* On CPU, Triton's kernels run in its interpreter, without its repeated scans of ``triton.language``
  (``triton_interpreter``).
* What is alive when a module starts is frozen out of the cyclic garbage collector's traversals
  (:func:`pytest_runtest_setup`).
* Under pytest-xdist (``make test``: ``-n 2``) each module of tests/distributed runs on one worker, where its tests
  share their launches (distributed/launch.py); every other test goes to whichever worker is free
  (:func:`pytest_xdist_make_scheduler`).

Shared helpers live in modules beside this file, on pytest's ``pythonpath`` (setup.cfg): ``references`` (float64
references, relative errors, tolerances), ``models`` (tiny models and tokenizers), ``sm90`` (compiling kernels for an H100 without one), ``grpo_harness`` (the GRPO
parity harness); the multi-process launcher and its workers in ``distributed/``.
"""

import gc
import os
import sys
from pathlib import Path

import pytest
import torch

#: The repository's root and this folder.
ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"

# The C++ op DeepSpeed's CPU ranks load (deepspeed_shm_comm) is built by torch under TORCH_EXTENSIONS_DIR, by default
# ~/.cache/torch_extensions, one folder for every environment on the machine; its build is keyed by the source and
# include paths, so a second clone's environment rebuilt it at each alternation (30-160 s of C++, ranks waiting on its
# lock). Kept in this environment, where `make venv` builds it (Makefile); the ranks inherit the variable.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

if not torch.cuda.is_available():
    # Triton kernels run in its interpreter on CPU tensors; must be set before triton_kernels is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] == "1":
        from triton_interpreter import skip_scans_of_patched_packages

        skip_scans_of_patched_packages()


_frozen_at = {"module": None}


def pytest_runtest_setup(item):
    """At the first test of each module, everything alive (torch, transformers, TRL, DeepSpeed, the test modules,
    what earlier modules imported lazily or cached: half a million objects) is moved out of the cyclic garbage
    collector's reach (``gc.freeze``) after a collection: every ``Trainer.train`` starts with a full ``gc.collect()``
    (accelerate's ``free_memory``), which traversed all of it, 0.3-1 s each time, half the time of the trainer
    tests. Garbage the tests make is collected as before (the previous module's fixtures are torn down by now)."""
    if item.path != _frozen_at["module"]:
        _frozen_at["module"] = item.path
        gc.collect()
        gc.freeze()


def pytest_unconfigure(config):
    # the frozen objects go back to the collector, so that interpreter shutdown finalizes them as it would have
    # (nanobind, in Triton, reports those it finds left at exit as leaks)
    gc.unfreeze()


@pytest.fixture(autouse=True, scope="session")
def single_thread():
    """One intra-op thread for every test: the tests' tensors are tiny (V ≤ 300, H ≤ 32) and gain nothing from
    intra-op parallelism, while on a shared 2-core machine OpenMP's workers spin-wait for busy cores (the op tests
    ran ~5× slower, tiny models ~10×, with the default thread count under load; ``pytest -n 2`` runs two workers)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def saved_models(tmp_path_factory):
    """``saved_models(name)``: the directory where ``models.SAVED_MODELS[name]`` is saved, once per test session
    (per pytest-xdist worker), for processes that load it with ``from_pretrained``."""
    from models import SAVED_MODELS

    root = tmp_path_factory.mktemp("saved_models")
    saved = {}

    def get(name: str) -> str:
        if name not in saved:
            SAVED_MODELS[name]().save_pretrained(root / name)
            saved[name] = str(root / name)
        return saved[name]

    return get


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's default ``--dist load``, except that the tests of one module of tests/distributed go to one
    worker together: the first of them launches every run the module's tests ask of an engine (distributed/launch.py),
    which a second worker would launch again. (``--dist loadgroup`` cannot express it with pytest 9: xdist 3.8 groups
    by rewriting ``item._nodeid``, which pytest 9 no longer reads.) Another ``--dist`` is left to xdist."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class DistributedModulesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path.startswith("tests/distributed/") else nodeid

    return DistributedModulesTogether(config, log)


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (python -m pytest -m gpu on a GPU machine)")
    skip_multigpu = pytest.mark.skip(reason=f"needs 2 CUDA GPUs, found {gpus} (docs/distributed.md)")
    # HF_FUSED_TEST_DEVICE=cuda runs each rank of tests/distributed on its own GPU (distributed/ranks.py)
    ranks_on_gpus = os.environ.get("HF_FUSED_TEST_DEVICE", "cpu") == "cuda"
    skip_ranks = pytest.mark.skip(reason=f"HF_FUSED_TEST_DEVICE=cuda runs each rank on its own GPU: needs 2, found "
                                         f"{gpus}")
    distributed = TESTS / "distributed"
    for item in items:
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(skip_multigpu)
        elif "gpu" in item.keywords and gpus < 1:
            item.add_marker(skip_gpu)
        elif (ranks_on_gpus and gpus < 2 and item.path.is_relative_to(distributed)
              and item.path.name != "test_zero3_single_gpu.py"):
            item.add_marker(skip_ranks)
