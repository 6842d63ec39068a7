# Two commands for a fresh clone: `make demo` (fine-tune on real text) and `make test`.
# Each creates .venv on first use. torch is installed first (beside uv), so that the CPU build is taken
# and nothing later pulls the multi-GB CUDA build (pip and uv keep an installed torch that satisfies >=2.6);
# on a GPU machine run `make TORCH=torch demo` or install into your own environment (README).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# uv installs the package and its dependencies (a minute faster than pip on 2 cores); pip installs torch (uv does not
# look where the CPU build lies) and DeepSpeed (its build reads the installed torch)
UV := $(VENV)/bin/uv pip install -q --python $(PY)
TORCH ?= torch==2.13.0

.PHONY: venv demo demo-grpo test notebooks docs wheel clean

$(VENV)/.installed: setup.cfg setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" uv
	$(UV) -e ".[test,examples]"
	# DeepSpeed for tests/distributed (ZeRO-2/3 on CPU ranks); after torch, no compiled ops, keeps torch
	DS_BUILD_OPS=0 $(PY) -m pip install -q "deepspeed>=0.19"
	# ...except the shared-memory op its CPU ranks build on first use (a minute or two of C++): built once here, not
	# by the first test launch while later ones wait on its lock under their timeouts; in this environment's folder, where
	# tests/conftest.py points torch (the shared default, ~/.cache/torch_extensions, is rebuilt for each environment)
	DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(abspath $(VENV))/torch_extensions $(PY) -c \
		"from deepspeed.comm.torch import build_shm_op; build_shm_op()"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) -m examples sft

demo-grpo: venv
	$(PY) -m examples grpo

# The whole suite on 2 workers (each module of tests/distributed on one, sharing its launches: tests/conftest.py),
# and the 20 slowest tests listed at the end so that growth shows.
test: venv
	$(PY) -m pytest -q -n 2 --durations=20

# Execute every notebook in place, saving outputs and plots (what CI re-runs in tests/examples/test_notebooks.py).
notebooks: venv
	$(PY) notebooks/run.py

# The documentation site (mkdocs.yml) into site/, every warning an error: a broken link or anchor, an unresolved
# reference, a public name without a docstring or missing from docs/reference/ (docs/hooks/api_check.py).
docs: venv
	$(UV) -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# The wheel, and a check that it holds the library only.
wheel: venv
	$(PY) -m pip wheel -q --no-deps -w dist .
	$(PY) -m zipfile -l dist/hf_fused-*.whl | awk 'NR > 1 {print $$1}' | grep -v -e '^hf_fused/' -e '^hf_fused-.*\.dist-info/' \
		&& { echo "wheel holds files outside hf_fused/"; exit 1; } || echo "wheel: hf_fused/ only"

clean:
	rm -rf $(VENV) outputs dist build site *.egg-info
